"""Inputs and the correctness gate of bench/dense_decode.py: a rotating KV pool per (batch,
mean seq_len) (bf16 or per-tensor fp8 e4m3 cache), q per (H, s_q) as vLLM's MLA layer
produces it, the float32 reference, and the gate every kernel's output must pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench import common

D_QK, D_V, D_ROPE, PAGE = 576, 512, 64, 64
Q_PROJ_DIM = 192                 # DeepSeek qk_nope (128) + qk_rope (64): q_pe is a slice of it
SCALE = Q_PROJ_DIM ** -0.5       # qk_head_dim ** -0.5 (YaRN mscale left out)
BF16, I32, FP8 = torch.bfloat16, torch.int32, torch.float8_e4m3fn
FP8_MAX = 448.0                  # largest finite e4m3: scale = amax / FP8_MAX
QUANT_CHUNK_BLOCKS = 1024        # cache blocks quantized at a time (bounds the float32 temps)
REL_L2_TOL = 1e-2                # correctness gate on the output
LSE_TOL = 1e-2                   # |lse - ref| / max(1, |ref|): a printed warning only
CHECK_REQUESTS = 2               # the gate compares the first requests of input set 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


EQUAL_LENGTHS = False  # bench --equal-lengths: every request exactly the mean (set before drawing)


def draw_seq_lens(batch: int, mean: int, seed: int) -> list[int]:
    """Uniform in [0.5 mean, 1.5 mean], then scaled so that the total is batch * mean
    (batch 1: exactly the mean); with EQUAL_LENGTHS every request is the mean."""
    if EQUAL_LENGTHS:
        return [mean] * batch
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(batch, generator=g, dtype=torch.float64)
    lens = (0.5 + u) * mean
    lens = lens * (batch * mean / lens.sum())
    out = [max(1, round(v)) for v in lens.tolist()]
    out[-1] = max(1, out[-1] + batch * mean - sum(out))
    return out


@dataclass
class KVPool:
    """The KV side of one (batch, mean seq_len): one cache holding every input set's blocks
    (disjoint), one block table per set, shared seq_lens; for an fp8 cache also its
    per-tensor scale (value = fp8 * kv_scale) as a float and a 1-element float32 CUDA tensor."""

    batch: int
    seq_len: int                  # the mean
    lens: list[int]
    nblk: list[int]
    cache: torch.Tensor           # [num_blocks, 64, 576] bf16 or float8_e4m3fn
    tables: list[torch.Tensor]    # per set: [batch, max_blocks] int32
    seq_lens: torch.Tensor        # [batch] int32 (cuda)
    max_len: int
    kv_scale: float | None = None             # fp8 cache only
    kv_scale_t: torch.Tensor | None = None    # fp8 cache only: [1] float32 (cuda)

    @property
    def nsets(self) -> int:
        return len(self.tables)

    @property
    def tokens(self) -> int:
        return sum(self.lens)

    @property
    def fp8(self) -> bool:
        return self.cache.dtype == FP8

    @property
    def dtype_label(self) -> str:
        """config["dtype"] of the rows: "bf16" (q and cache), "fp8" (bf16 q, fp8 e4m3 cache:
        vLLM's kv_cache_dtype name)."""
        return "fp8" if self.fp8 else "bf16"


def kv_pool_plan(batch: int, mean: int, seed: int, fp8: bool = False
                 ) -> tuple[list[int], list[int], int, int]:
    """(lens, blocks per request, sets, GPU bytes to build the pool) without touching the GPU.
    Sets are sized on the cache's own bytes per token; an fp8 pool is drawn in bf16 first,
    so building it needs both (the bf16 draw is freed once quantized)."""
    lens = draw_seq_lens(batch, mean, seed)
    nblk = [cdiv(n, PAGE) for n in lens]
    per_set = sum(nblk)
    elem = 1 if fp8 else 2
    nsets = common.rotating_sets(per_set * PAGE * D_QK * elem)
    pool_bytes = (nsets * per_set + 8) * PAGE * D_QK * (elem + (2 if fp8 else 0))
    return lens, nblk, nsets, pool_bytes


def quantize_cache_fp8(cache: torch.Tensor) -> tuple[torch.Tensor, float, torch.Tensor]:
    """bf16 cache -> (formats.quantize_fp8_per_tensor(cache, kv_scale) as float8_e4m3fn,
    kv_scale, kv_scale as a [1] float32 CUDA tensor), kv_scale = amax|cache| / 448 rounded to
    float32 (the float and the tensor are the same value). Done in chunks of blocks."""
    from mla_backend import formats

    amax = max(float(c.abs().amax()) for c in cache.split(QUANT_CHUNK_BLOCKS))
    scale_t = torch.tensor([amax], device=cache.device, dtype=torch.float32) / FP8_MAX
    kv_scale = float(scale_t)
    out = torch.empty(cache.shape, device=cache.device, dtype=FP8)
    for src, dst in zip(cache.split(QUANT_CHUNK_BLOCKS), out.split(QUANT_CHUNK_BLOCKS),
                        strict=True):
        dst.copy_(formats.quantize_fp8_per_tensor(src, kv_scale))
    return out, kv_scale, scale_t


def make_kv_pool(batch: int, mean: int, seed: int, fp8: bool = False) -> KVPool:
    lens, nblk, nsets, _ = kv_pool_plan(batch, mean, seed, fp8)
    dev = torch.device("cuda")
    total = nsets * sum(nblk) + 8
    g = torch.Generator(device=dev).manual_seed(seed)
    cache = torch.randn(total, PAGE, D_QK, generator=g, device=dev, dtype=BF16)
    kv_scale: float | None = None
    kv_scale_t: torch.Tensor | None = None
    if fp8:
        cache, kv_scale, kv_scale_t = quantize_cache_fp8(cache)   # the bf16 draw is freed
    perm = torch.randperm(total, generator=g, device=dev, dtype=torch.int64)
    # unused entries point at block 0 (a real block): harmless for every kernel
    tables = common.block_tables(perm, nblk, nsets=nsets)
    return KVPool(batch=batch, seq_len=mean, lens=lens, nblk=nblk, cache=cache, tables=tables,
                  seq_lens=torch.tensor(lens, device=dev, dtype=I32), max_len=max(lens),
                  kv_scale=kv_scale, kv_scale_t=kv_scale_t)


@dataclass
class Inputs:
    """One config: the KV pool plus, per input set, q as vLLM's MLA layer produces it:
    q_nope [T, H, 512] (a transposed bmm output), q_pe [T, H, 64] (a slice of the
    [T, H, 192] projection), and their concatenation q [T, H, 576] (contiguous)."""

    pool: KVPool
    H: int
    s_q: int
    q: list[torch.Tensor]
    q_nope: list[torch.Tensor]
    q_pe: list[torch.Tensor]
    cu_q: torch.Tensor            # [batch + 1] int32: s_q query tokens per request

    @property
    def B(self) -> int:
        return self.pool.batch

    @property
    def T(self) -> int:
        return self.pool.batch * self.s_q

    @property
    def nsets(self) -> int:
        return self.pool.nsets

    def q4(self, i: int) -> torch.Tensor:
        return self.q[i].view(self.B, self.s_q, self.H, D_QK)


def make_inputs(pool: KVPool, H: int, s_q: int, seed: int) -> Inputs:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    T = pool.batch * s_q
    qs, nopes, pes = [], [], []
    for _ in range(pool.nsets):
        q_nope = torch.randn(H, T, D_V, generator=g, device=dev, dtype=BF16).transpose(0, 1)
        q_pe = torch.randn(T, H, Q_PROJ_DIM, generator=g, device=dev,
                           dtype=BF16)[..., Q_PROJ_DIM - D_ROPE:]
        qs.append(torch.cat([q_nope, q_pe], dim=-1))
        nopes.append(q_nope)
        pes.append(q_pe)
    cu_q = torch.arange(pool.batch + 1, device=dev, dtype=I32) * s_q
    return Inputs(pool=pool, H=H, s_q=s_q, q=qs, q_nope=nopes, q_pe=pes, cu_q=cu_q)


def reference(x: Inputs, q: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 out [n, s_q, H, 512] and lse [n, s_q, H] of the first n requests of set 0
    (an fp8 cache dequantized with the pool's kv_scale); q: another [B, s_q, H, 576] query
    for set 0 (a peer's own quantized q, dequantized), default set 0's bf16 q."""
    from mla_backend import reference as ref

    n = min(CHECK_REQUESTS, x.B)
    p = x.pool
    q = x.q4(0) if q is None else q
    return ref.mla_decode(q[:n], p.cache, p.tables[0][:n], p.seq_lens[:n], None, SCALE,
                          causal=True, kv_scale=p.kv_scale)



def gate(kernel: common.Kernel, want: tuple[torch.Tensor, torch.Tensor],
         tol: float = REL_L2_TOL) -> tuple[bool, str]:
    """The gate: (rel L2 of the kernel's out against want's < tol, a message with the rel L2
    and, where the kernel gives one, the lse error, which only warns)."""
    out, lse = kernel.check()
    torch.cuda.synchronize()
    ref_out, ref_lse = want
    n = ref_out.shape[0]
    err = common.rel_l2(out[:n], ref_out)
    msg = f"rel L2 {err:.1e}"
    ok = err < tol                                        # False for NaN too
    if lse is not None:
        diff = (lse[:n].float() - ref_lse).abs() / ref_lse.abs().clamp_min(1.0)
        lse_err = float(diff.max())
        msg += f", lse {lse_err:.1e}"
        if not lse_err <= LSE_TOL:
            msg += " (lse off: warning only)"
    return ok, msg
