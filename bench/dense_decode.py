"""Dense paged MLA decode, ours vs the kernels vLLM 0.25 ships, same process, same inputs.

Run on the GPU machine from the repository root (vLLM's kernels come from /opt/vk/site):

    PYTHONPATH=/opt/vk/site python -m bench.dense_decode [--quick] [--out PATH]
                                                         [--no-flashinfer] [--peers ...]
                                                         [--fp8 | --fp8-only]

Kernels (bf16 cache [num_blocks, 64, 576], int32 block table / seq lens, causal, varlen):
  ours            mla_backend.ops.plan_decode + mla_decode
  flashmla        vllm.v1.attention.ops.flashmla.flash_mla_with_kvcache (FLASHMLA)
  fa3_mla         vllm.vllm_flash_attn.flash_attn_varlen_func(fa_version=3, q=q_pe, q_v=q_nope,
                  k/v = rope/latent views of the same cache) + get_scheduler_metadata
                  (FLASH_ATTN_MLA), page 64 like ours (--fa3-page 16: vLLM's default block size)
  flashinfer_mla  flashinfer.mla.BatchMLAPagedAttentionWrapper(backend="fa3"), JIT-compiled on
                  first use (minutes; --no-flashinfer skips it)
  triton_mla      vllm.v1.attention.ops.triton_decode_attention.decode_attention_fwd
                  (TRITON_MLA); s_q = 1 only, as vLLM sends it nothing else
The calls follow /work/shared/reference/peers_probe.py (how vLLM's backends call them).

What is timed, per call (a CUDA graph of many calls, see bench.common.time_graph):
  ours            plan_decode (GPU planner, no host sync) + mla_decode. vLLM plans once per
                  step for all layers; the plan is inside every timed call to be conservative.
  flashmla        a fresh FlashMLASchedMeta per call, so the tile-scheduler metadata kernel
                  that flash_mla_with_kvcache runs on first use of a schedule is timed too
                  (vLLM runs it once per step, in the first layer).
  fa3_mla         get_scheduler_metadata + flash_attn_varlen_func (vLLM: metadata once per step).
  flashinfer_mla  run() only. Its plan() is host-side (CPU scheduling + a synchronous copy to
                  the GPU), cannot be captured in a CUDA graph, and vLLM runs it once per step
                  outside the graph: it is NOT timed.
  triton_mla      decode_attention_fwd only (it has no metadata; num_kv_splits is host math).
If a step with its metadata cannot be captured, the kernel is timed with the metadata built
once outside the graph, and the row says so ('*' in the table).
Every kernel of a config is built and checked first; then the config times them in --rounds
rounds (default: one per kernel), each kernel first in turn (bench.common.round_orders), and a
kernel's time is the median of its rounds (the rounds are in the results file as us_rounds).
Timed once each and ours always first, a kernel after a pause can run above the power cap's
sustained clock.
The per-layer glue vLLM adds around the calls (torch.cat of q, zero-filled outputs) is not
timed for anyone. Every kernel's time counts only if its output passed the correctness gate
(rel L2 < 1e-2 against mla_backend.reference.mla_decode on the first requests of set 0).

Inputs: random bf16 q and cache, lengths uniform in [0.5, 1.5] x mean (seeded, then scaled
so the batch holds exactly batch x mean tokens), blocks handed out by a random permutation;
several input sets (disjoint cache blocks, own q) rotate so that every rotation touches at
least 4x the 50 MB L2 (2 sets when one set alone is far above it).

FLOPs = 2 H s_q tokens (576 + 512); bytes = tokens 576 2 + Q + O bytes; tokens = sum(seq_lens).
Results: bench/results/dense_decode-<gpu-slug>-<date>.json (design.md's shape) and a table.

fp8 block (--fp8: after the bf16 matrix; --fp8-only: instead of it). Per-tensor fp8 e4m3 cache
[num_blocks, 64, 576] float8_e4m3fn = formats.quantize_fp8_per_tensor(random bf16 cache,
kv_scale), kv_scale = amax / 448 (one float32 for the whole pool); q stays bf16 for ours. Same
lengths, paging and rotation as above (sets sized on 576 bytes per token). Matrix H 16,64,128 x
s_q 1,2 x batch 1,32,128 x seq_len 4096 (--H / --s-q / --batch / --seq-len override it).
  ours            plan_decode(..., kv_cache_dtype=float8_e4m3fn) + mla_decode(..., kv_scale=
                  1-element float32 CUDA tensor); plan timed per call as above
  flashmla        get_mla_metadata_dense_fp8(seq_lens, s_q H, 1) + flash_mla_with_kvcache_fp8
                  (FLASHMLA with kv_cache_dtype "fp8"), metadata timed per call. It takes an
                  fp8 q: vLLM's layer quantizes q per tensor to float8_e4m3fn with the layer's
                  q_scale before forward_mqa (here q_scale = amax|q| / 448 per input set, done
                  once outside the timing, like the other per-layer glue).
Gate: ours against mla_backend.reference.mla_decode on the fp8 cache (kv_scale); FlashMLA
against the same reference fed its own dequantized q (q_fp8 * q_scale), so q's quantization
is in the reference, not in a wider tolerance. FlashMLA's fp8 kernel also rounds the softmax
probabilities to e4m3 before its PV product (no reference models that): if it fails the gate
for that reason, its time shows as '!' and --fp8-peer-tol sets the peer's limit (printed).
bytes = tokens 576 + Q + O bytes (Q, O in bf16); FLOPs as above. Results:
bench/results/dense_decode_fp8-<gpu-slug>-<date>.json (job "dense_decode_fp8"), next to the
bf16 file (--out DIR: in DIR; --fp8-only --out FILE: FILE), with its own table and summary.

Exit status: 0; 1 if ours failed the correctness gate in some row; 2 if the run stopped early.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench import common
from bench.common import BenchRow, log

JOB = "dense_decode"
JOB_FP8 = "dense_decode_fp8"
D_QK, D_V, D_ROPE, PAGE = 576, 512, 64, 64
Q_PROJ_DIM = 192                 # DeepSeek qk_nope (128) + qk_rope (64): q_pe is a slice of it
SCALE = Q_PROJ_DIM ** -0.5       # qk_head_dim ** -0.5 (YaRN mscale left out)
BF16, I32, FP8 = torch.bfloat16, torch.int32, torch.float8_e4m3fn
FP8_MAX = 448.0                  # largest finite e4m3: scale = amax / FP8_MAX
QUANT_CHUNK_BLOCKS = 1024        # cache blocks quantized at a time (bounds the float32 temps)
FA3_SPLITS_CG = 32               # vLLM attention_config.flash_attn_max_num_splits_for_cuda_graph
FLASHINFER_WORKSPACE = 256 * 2**20
REL_L2_TOL = 1e-2                # correctness gate on the output
LSE_TOL = 1e-2                   # |lse - ref| / max(1, |ref|): a printed warning only
CHECK_REQUESTS = 2               # the gate compares the first requests of input set 0
KV_LIMIT_BYTES = 40e9            # skip configs whose rotating KV pool would exceed this
SEED = 1234

OURS = "ours"
PEERS = ("flashmla", "fa3_mla", "flashinfer_mla", "triton_mla")
KERNELS = (OURS, *PEERS)

FULL_MATRIX = {"H": (16, 32, 64, 128), "s_q": (1, 2, 4), "batch": (1, 32, 128),
               "seq_len": (1024, 4096, 16384)}
QUICK_MATRIX = {"H": (16, 128), "s_q": (1, 2), "batch": (1, 32, 128), "seq_len": (4096,)}
FP8_MATRIX = {"H": (16, 64, 128), "s_q": (1, 2), "batch": (1, 32, 128), "seq_len": (4096,)}
FP8_PEERS = ("flashmla",)        # peers with a dense per-tensor fp8 path in the fp8 block


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- inputs


def draw_seq_lens(batch: int, mean: int, seed: int) -> list[int]:
    """Uniform in [0.5 mean, 1.5 mean], then scaled so that the total is batch * mean
    (batch 1: exactly the mean)."""
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
    per_set, maxb = sum(nblk), max(nblk)
    total = nsets * per_set + 8
    g = torch.Generator(device=dev).manual_seed(seed)
    cache = torch.randn(total, PAGE, D_QK, generator=g, device=dev, dtype=BF16)
    kv_scale: float | None = None
    kv_scale_t: torch.Tensor | None = None
    if fp8:
        cache, kv_scale, kv_scale_t = quantize_cache_fp8(cache)   # the bf16 draw is freed
    perm = torch.randperm(total, generator=g, device=dev, dtype=torch.int64)
    nblk_t = torch.tensor(nblk, device=dev, dtype=torch.int64)
    start = torch.cumsum(nblk_t, 0) - nblk_t
    col = torch.arange(maxb, device=dev)
    used = col[None, :] < nblk_t[:, None]
    pos = (start[:, None] + col[None, :]).clamp(max=per_set - 1)
    tables = []
    for s in range(nsets):
        chunk = perm[s * per_set:(s + 1) * per_set]
        # unused entries point at block 0 (a real block): harmless for every kernel
        tables.append(torch.where(used, chunk[pos], 0).to(I32).contiguous())
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


# --------------------------------------------------------------------------- kernels


@dataclass
class Kernel:
    """step(i): one timed call on input set i (metadata / plan included, see the module
    docstring); check(): (out [B, s_q, H, 512], lse [B, s_q, H] natural log or None) of set 0;
    step_premeta: the same call with its metadata built once outside (a fallback for when
    the metadata cannot be captured in a CUDA graph), or None; want: the kernel's own
    reference (out, lse) when the config's does not fit it (a peer that quantizes q), or
    None; tol: its rel L2 limit when not REL_L2_TOL (shown as a note on the row)."""

    step: Callable[[int], object]
    check: Callable[[], tuple[torch.Tensor, torch.Tensor | None]]
    step_premeta: Callable[[int], object] | None = None
    want: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None
    tol: float | None = None


class NotApplicable(Exception):
    """The kernel does not serve this config (the reason is the message)."""


def build_ours(x: Inputs, args: argparse.Namespace) -> Kernel:
    """bf16 cache, or (fp8 block) fp8 cache with the pool's kv_scale as a CUDA tensor."""
    from mla_backend import ops

    p = x.pool
    kv_dtype = FP8 if p.fp8 else None
    plan = ops.plan_decode(p.seq_lens, x.s_q, x.H, kv_cache_dtype=kv_dtype)
    out = torch.empty(x.B, x.s_q, x.H, D_V, device="cuda", dtype=BF16)

    def decode(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.mla_decode(x.q4(i), p.cache, p.tables[i], p.seq_lens, plan, SCALE,
                              causal=True, kv_scale=p.kv_scale_t, out=out)

    def step(i: int) -> object:
        # vLLM pays plan_decode once per step for all layers; timed per call (conservative).
        ops.plan_decode(p.seq_lens, x.s_q, x.H, kv_cache_dtype=kv_dtype, out=plan)
        return decode(i)

    return Kernel(step=step, check=lambda: step(0), step_premeta=decode)


def _require_flashmla_dense() -> None:
    from vllm.v1.attention.ops.flashmla import is_flashmla_dense_supported

    ok, why = is_flashmla_dense_supported()
    if not ok:
        raise NotApplicable(f"FlashMLA dense not supported here: {why}")


def build_flashmla(x: Inputs, args: argparse.Namespace) -> Kernel:
    from vllm.v1.attention.ops.flashmla import flash_mla_with_kvcache, get_mla_metadata

    _require_flashmla_dense()
    p = x.pool
    k_cache = p.cache.unsqueeze(-2)                       # [nb, 64, 1, 576]
    qs = [x.q4(i) for i in range(x.nsets)]                # reshape_query_for_spec_decode
    scheds = [get_mla_metadata()[0] for _ in range(x.nsets)]  # filled by their first call

    def call(i: int, sched: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return flash_mla_with_kvcache(q=qs[i], k_cache=k_cache, block_table=p.tables[i],
                                      cache_seqlens=p.seq_lens, head_dim_v=D_V,
                                      tile_scheduler_metadata=sched, softmax_scale=SCALE,
                                      causal=True, is_fp8_kvcache=False)

    def step(i: int) -> object:
        # A fresh (empty) schedule: this call runs FlashMLA's metadata kernel, as the first
        # layer of a vLLM step does; included in the timing like our planner.
        return call(i, get_mla_metadata()[0])

    def check() -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = step(0)                                # lse [B, H, s_q]
        return out, lse.transpose(1, 2)

    return Kernel(step=step, check=check, step_premeta=lambda i: call(i, scheds[i]))


def build_fa3(x: Inputs, args: argparse.Namespace) -> Kernel:
    from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

    page = args.fa3_page
    if PAGE % page:
        raise NotApplicable(f"--fa3-page {page} does not divide the cache's page {PAGE}")
    p = x.pool
    r = PAGE // page
    cache = p.cache.view(-1, page, D_QK)                  # same memory, `page`-token pages
    k = cache[..., D_V:].unsqueeze(-2)                    # k_pe cache [pages, page, 1, 64]
    v = cache[..., :D_V].unsqueeze(-2)                    # latent cache [pages, page, 1, 512]
    if r == 1:
        tables = p.tables
    else:
        sub = torch.arange(r, device="cuda")
        tables = [(t.long()[:, :, None] * r + sub).reshape(x.B, -1).to(I32).contiguous()
                  for t in p.tables]

    def metadata() -> torch.Tensor:
        return get_scheduler_metadata(
            batch_size=x.B, max_seqlen_q=x.s_q, max_seqlen_k=p.max_len, num_heads_q=x.H,
            num_heads_kv=1, headdim=D_ROPE, cache_seqlens=p.seq_lens, qkv_dtype=BF16,
            headdim_v=D_V, page_size=page, cu_seqlens_q=x.cu_q, causal=True,
            num_splits=FA3_SPLITS_CG)

    def call(i: int, meta: torch.Tensor, want_lse: bool = False) -> object:
        return flash_attn_varlen_func(
            q=x.q_pe[i], k=k, v=v, q_v=x.q_nope[i], max_seqlen_q=x.s_q, cu_seqlens_q=x.cu_q,
            max_seqlen_k=p.max_len, seqused_k=p.seq_lens, block_table=tables[i],
            softmax_scale=SCALE, causal=True, return_softmax_lse=want_lse, fa_version=3,
            scheduler_metadata=meta, num_splits=FA3_SPLITS_CG, cp_world_size=1, cp_rank=0,
            cp_tot_seqused_k=None)

    def check() -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = call(0, metadata(), want_lse=True)     # out [T, H, 512], lse [H, T]
        return (out.view(x.B, x.s_q, x.H, D_V),
                lse.transpose(0, 1).reshape(x.B, x.s_q, x.H))

    meta_once = metadata()
    return Kernel(step=lambda i: call(i, metadata()), check=check,
                  step_premeta=lambda i: call(i, meta_once))


_FLASHINFER: dict[str, Any] = {"ok": False, "error": None, "workspace": None}


def build_flashinfer(x: Inputs, args: argparse.Namespace) -> Kernel:
    if _FLASHINFER["error"] is not None:
        raise NotApplicable(f"not retried after an earlier failure: {_FLASHINFER['error']}")
    try:
        kernel = _build_flashinfer(x)
    except Exception as e:
        if not _FLASHINFER["ok"]:   # never worked (import / JIT build): do not retry per row
            _FLASHINFER["error"] = common.short_error(e, 200)
        raise
    _FLASHINFER["ok"] = True
    return kernel


def _build_flashinfer(x: Inputs) -> Kernel:
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    p = x.pool
    if _FLASHINFER["workspace"] is None:
        # One float workspace shared by every wrapper: it only holds split-KV partials
        # during run(), and the calls run one after another on one stream.
        _FLASHINFER["workspace"] = torch.empty(FLASHINFER_WORKSPACE, dtype=torch.uint8,
                                               device="cuda")
    ws = _FLASHINFER["workspace"]
    ckv, kpe = p.cache[..., :D_V], p.cache[..., D_V:]     # [nb, 64, 512], [nb, 64, 64] views
    nblk = torch.tensor(p.nblk, device="cuda", dtype=I32)
    kv_indptr = torch.cat([torch.zeros(1, device="cuda", dtype=I32),
                           torch.cumsum(nblk, 0).to(I32)])
    used = torch.arange(p.tables[0].shape[1], device="cuda")[None, :] < nblk[:, None]
    first = not _FLASHINFER["ok"]
    if first:
        log("    flashinfer_mla: first plan() JIT-compiles the fa3 batch-MLA module "
            "(nvcc; can take minutes; --no-flashinfer skips it)")
    t0 = time.perf_counter()
    wrappers = []
    for i in range(x.nsets):
        kv_indices = p.tables[i][used].contiguous()       # row-major: request by request
        w = BatchMLAPagedAttentionWrapper(ws, backend="fa3")
        w.plan(qo_indptr=x.cu_q, kv_indptr=kv_indptr, kv_indices=kv_indices,
               kv_len_arr=p.seq_lens, num_heads=x.H, head_dim_ckv=D_V, head_dim_kpe=D_ROPE,
               page_size=PAGE, causal=True, sm_scale=SCALE, q_data_type=BF16,
               kv_data_type=BF16)
        wrappers.append(w)
    if first:
        log(f"    flashinfer_mla: plan()s (incl. JIT) took {time.perf_counter() - t0:.1f} s")
    out = torch.empty(x.T, x.H, D_V, device="cuda", dtype=BF16)
    lse = torch.empty(x.T, x.H, device="cuda", dtype=torch.float32)

    def step(i: int) -> object:
        # run() only: plan() is host-side and runs once per step outside vLLM's graph.
        return wrappers[i].run(x.q_nope[i], x.q_pe[i], ckv, kpe, out=out)

    def check() -> tuple[torch.Tensor, torch.Tensor]:
        o, l_ = wrappers[0].run(x.q_nope[0], x.q_pe[0], ckv, kpe, out=out, lse=lse,
                                return_lse=True, return_lse_base_on_e=True)
        return o.view(x.B, x.s_q, x.H, D_V), l_.view(x.B, x.s_q, x.H)

    return Kernel(step=step, check=check)


def triton_num_kv_splits(max_seq_len: int, sm_count: int) -> int:
    """vLLM 0.25 triton_mla._compute_num_kv_splits: next power of two of max_len / 512,
    capped at 2 x SMs."""
    ideal = 1 << (max(1, max_seq_len // 512) - 1).bit_length()
    return min(ideal, 2 * sm_count)


def build_triton(x: Inputs, args: argparse.Namespace) -> Kernel:
    if x.s_q != 1:
        raise NotApplicable("TRITON_MLA decodes s_q = 1 only (vLLM sends it nothing else)")
    from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd

    p = x.pool
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    nsplit = triton_num_kv_splits(p.max_len, sms)
    k_buf = p.cache.unsqueeze(2)                          # [nb, 64, 1, 576]
    v_buf = k_buf[..., :D_V]
    logits = torch.empty(x.B, x.H, nsplit, D_V + 1, device="cuda", dtype=torch.float32)
    out = torch.empty(x.B, x.H, D_V, device="cuda", dtype=BF16)
    lse = torch.empty(x.B, x.H, device="cuda", dtype=BF16)  # q's dtype, as in TritonMLAImpl
    one = torch.tensor(1.0, device="cuda", dtype=torch.float32)   # layer._k_scale

    def step(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        decode_attention_fwd(x.q[i], k_buf, v_buf, out, lse, p.tables[i], p.seq_lens, logits,
                             nsplit, SCALE, PAGE, k_scale=one, v_scale=one, is_mla=True)
        return out, lse

    def check() -> tuple[torch.Tensor, torch.Tensor]:
        o, l_ = step(0)
        return o.view(x.B, 1, x.H, D_V), l_.view(x.B, 1, x.H)

    return Kernel(step=step, check=check)


BUILDERS: dict[str, Callable[[Inputs, argparse.Namespace], Kernel]] = {
    OURS: build_ours,
    "flashmla": build_flashmla,
    "fa3_mla": build_fa3,
    "flashinfer_mla": build_flashinfer,
    "triton_mla": build_triton,
}


def quantize_q_fp8(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q -> (float8_e4m3fn q / q_scale, q_scale [1] float32), q_scale = amax|q| / 448: a
    static per-tensor quantization like vLLM's MLA layer applies to the decode q
    (_DecodeConcatQuantFP8 with layer._q_scale) before FlashMLA's fp8 path."""
    from mla_backend import formats

    q_scale = (q.abs().amax().float() / FP8_MAX).reshape(1)
    return formats.quantize_fp8_per_tensor(q, q_scale).contiguous(), q_scale


def build_flashmla_fp8(x: Inputs, args: argparse.Namespace) -> Kernel:
    """FlashMLA's dense fp8 path as vLLM 0.25's FlashMLAImpl.forward_mqa calls it for
    kv_cache_dtype "fp8": fp8 q and cache, descale_q / descale_k [1] float32, metadata from
    get_mla_metadata_dense_fp8(seq_lens, s_q * H, 1) (FlashMLAMetadataBuilder)."""
    from vllm.v1.attention.ops.flashmla import (
        flash_mla_with_kvcache_fp8,
        get_mla_metadata_dense_fp8,
    )

    _require_flashmla_dense()
    p = x.pool
    k_cache = p.cache.unsqueeze(-2)                       # [nb, 64, 1, 576] e4m3
    if p.kv_scale_t is None:
        raise NotApplicable("FlashMLA's fp8 path needs an fp8 cache")
    descale_k = p.kv_scale_t.reshape(1)
    quant = [quantize_q_fp8(x.q4(i)) for i in range(x.nsets)]   # [B, s_q, H, 576] e4m3

    def metadata() -> tuple[torch.Tensor, torch.Tensor]:
        return get_mla_metadata_dense_fp8(p.seq_lens, x.s_q * x.H, 1)

    def call(i: int, meta: tuple[torch.Tensor, torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        tile_md, num_splits = meta
        q8, q_scale = quant[i]
        return flash_mla_with_kvcache_fp8(
            q=q8, k_cache=k_cache, block_table=p.tables[i], cache_seqlens=p.seq_lens,
            head_dim_v=D_V, tile_scheduler_metadata=tile_md, num_splits=num_splits,
            softmax_scale=SCALE, causal=True, descale_q=q_scale, descale_k=descale_k)

    def check() -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = call(0, metadata())                    # out [B, s_q, H, 512], lse [B, H, s_q]
        return out, lse.transpose(1, 2)

    def want() -> tuple[torch.Tensor, torch.Tensor]:
        q8, q_scale = quant[0]
        return reference(x, q=q8.float() * q_scale)       # its own q quantization included

    meta_once = metadata()
    tol = args.fp8_peer_tol if args.fp8_peer_tol != REL_L2_TOL else None
    # metadata per call: vLLM runs it once per step (FlashMLAMetadataBuilder), timed like ours
    return Kernel(step=lambda i: call(i, metadata()), check=check,
                  step_premeta=lambda i: call(i, meta_once), want=want, tol=tol)


FP8_BUILDERS: dict[str, Callable[[Inputs, argparse.Namespace], Kernel]] = {
    OURS: build_ours,
    "flashmla": build_flashmla_fp8,
}


# --------------------------------------------------------------------------- one config


class CudaBroken(RuntimeError):
    pass


def _check(kernel: Kernel, want: tuple[torch.Tensor, torch.Tensor], tol: float = REL_L2_TOL
           ) -> tuple[bool, str]:
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


def bench_config(x: Inputs, kernels: list[str], args: argparse.Namespace,
                 copy_bw: float | None,
                 builders: dict[str, Callable[[Inputs, argparse.Namespace], Kernel]] = BUILDERS
                 ) -> tuple[BenchRow, bool]:
    """Builds and checks every kernel, then times them in args.rounds rounds, each kernel
    first in turn (common.round_orders); a kernel's time is the median of its rounds.
    Returns the row and whether ours failed the correctness gate."""
    cfg = {"H": x.H, "s_q": x.s_q, "batch": x.B, "seq_len": x.pool.seq_len,
           "dtype": x.pool.dtype_label}
    row = BenchRow(config=cfg)
    lines: dict[str, str] = {}
    try:
        want = reference(x)
    except Exception as e:  # noqa: BLE001
        why = f"reference failed, nothing can be checked: {common.short_error(e)}"
        log(f"    {why}")
        row.skipped.update(dict.fromkeys(kernels, why))
        if not common.cuda_alive():
            raise CudaBroken(why) from e
        return row, False

    def failed(name: str, e: Exception) -> None:
        """A kernel that raised: reported in the row, never a made-up time."""
        row.skipped[name] = common.short_error(e)
        lines[name] = f"    {name:15s} FAILED: {row.skipped[name]}"
        if args.verbose:
            traceback.print_exc()
        if not common.cuda_alive():
            for line in lines.values():
                log(line)
            raise CudaBroken(f"CUDA context broken after {name} failed: "
                             f"{row.skipped[name]}") from e

    # (kernel, gate passed, gate message, limit, note) of every kernel that built
    built: dict[str, tuple[Kernel, bool, str, float, str]] = {}
    for name in kernels:
        try:
            kernel = builders[name](x, args)
            tol = REL_L2_TOL if kernel.tol is None else kernel.tol
            ok, msg = _check(kernel, want if kernel.want is None else kernel.want(), tol)
            note = (f"correctness limit rel L2 {tol:g} (--fp8-peer-tol), not {REL_L2_TOL:g}"
                    if tol != REL_L2_TOL else "")
            built[name] = (kernel, ok, msg, tol, note)
        except NotApplicable as e:
            row.skipped[name] = str(e)
            lines[name] = f"    {name:15s} skipped: {e}"
        except Exception as e:  # noqa: BLE001
            failed(name, e)
    capture_notes: dict[str, str] = {}  # kernels timed with metadata built outside the graph

    def timer(name: str, kernel: Kernel) -> Callable[[], common.Timing]:
        def run() -> common.Timing:
            if name not in capture_notes:
                try:
                    return common.time_graph(kernel.step, x.nsets, budget_ms=args.budget_ms)
                except common.GraphCaptureError as e:
                    if kernel.step_premeta is None:
                        raise
                    capture_notes[name] = (f"metadata/plan built outside the graph (capture "
                                           f"with it failed: {e})")
            return common.time_graph(kernel.step_premeta, x.nsets, budget_ms=args.budget_ms)
        return run

    timings = common.time_in_rounds({name: timer(name, b[0]) for name, b in built.items()},
                                    args.rounds or max(len(built), 1), failed)
    ours_bad = False
    for name, ts in timings.items():
        _, ok, msg, tol, note = built[name]
        note = "; ".join(filter(None, [note, capture_notes.get(name, "")]))
        us_list = [t.us for t in ts]
        us = statistics.median(us_list)
        row.us_rounds[name] = us_list
        if ok:
            row.us[name] = us
            if note:
                row.notes[name] = note
        else:
            row.uncounted_us[name] = us
            row.skipped[name] = (f"correctness gate failed ({msg}; limit {tol:g}); "
                                 f"measured {us:.1f} us, not counted")
            ours_bad |= name == OURS
        t = ts[-1]
        flag = "" if ok else "  <-- CORRECTNESS GATE FAILED"
        lines[name] = (f"    {name:15s} {us:9.1f} us  [{msg}; {t.nsets} sets, {t.ncalls} "
                       f"calls/graph, {t.reps} replays; rounds "
                       + " ".join(f"{v:.1f}" for v in us_list) + f"]{flag}"
                       + (f"  ({note})" if note else ""))
    built.clear()  # the kernels and their buffers go before the next config is built
    if OURS in kernels and OURS not in row.us and OURS not in row.skipped:
        row.skipped[OURS] = "not run"
    tokens = x.pool.tokens
    flops = 2.0 * x.H * x.s_q * tokens * (D_QK + D_V)
    nbytes = tokens * D_QK * x.pool.cache.element_size() + x.T * x.H * (D_QK + D_V) * 2.0
    row.finalize(flops, nbytes, copy_bw)
    for name in kernels:
        if name in lines:
            log(lines[name])
    return row, ours_bad


# --------------------------------------------------------------------------- driver


def run_matrix(matrix: dict[str, tuple[int, ...]], kernels: list[str],
               builders: dict[str, Callable[[Inputs, argparse.Namespace], Kernel]],
               args: argparse.Namespace, copy_bw: float | None, rows: list[BenchRow],
               save: Callable[[], None], *, fp8: bool = False) -> tuple[bool, int]:
    """Every config of `matrix` (pools built per batch x seq_len, inputs per H x s_q), rows
    appended to `rows` and saved after each. Returns (ours failed a gate, status: 0, or 2 if
    it stopped early)."""
    t_start = time.perf_counter()
    ours_bad = False
    status = 0
    live = common.Table(["H", "s_q", "batch", "seq_len", "dtype"], kernels)
    log("\nper-config lines below use these columns:\n    " + live.header())
    try:
        for seq_len in matrix["seq_len"]:
            for batch in matrix["batch"]:
                seed = args.seed + 1009 * batch + seq_len
                _, _, nsets, pool_bytes = kv_pool_plan(batch, seq_len, seed, fp8)
                if pool_bytes > KV_LIMIT_BYTES:
                    why = (f"KV pool of {nsets} sets would take {pool_bytes / 1e9:.1f} GB "
                           f"(> {KV_LIMIT_BYTES / 1e9:.0f} GB)")
                    log(f"\n[batch={batch} seq_len={seq_len}] skipped: {why}")
                    continue
                pool = make_kv_pool(batch, seq_len, seed, fp8)
                for H in matrix["H"]:
                    for s_q in matrix["s_q"]:
                        log(f"\n[H={H} s_q={s_q} batch={batch} seq_len={seq_len}"
                            + (f" fp8 kv_scale={pool.kv_scale:.3g}" if fp8 else "")
                            + f"] tokens {pool.tokens}, {pool.nsets} input sets, "
                            f"{(time.perf_counter() - t_start):.0f} s elapsed")
                        x = make_inputs(pool, H, s_q, seed + 7 * H + s_q)
                        row, bad = bench_config(x, kernels, args, copy_bw, builders)
                        ours_bad |= bad
                        rows.append(row)
                        log("    " + live.line(row))
                        del x
                        save()
                del pool
                torch.cuda.empty_cache()
    except CudaBroken as e:
        log(f"\nstopping early: {e}")
        status = 2
    except KeyboardInterrupt:
        log("\ninterrupted: writing the rows so far")
        status = 2
    return ours_bad, status


def report(rows: list[BenchRow], kernels: list[str], copy_bw: float | None, out_path: Path,
           seconds: float, ours_bad: bool) -> None:
    """The table, where the results went, the gate warning and the summary (worst row and
    geometric mean, printed last)."""
    log("")
    common.print_table(rows, kernels, copy_bw)
    log(f"results written to {out_path} ({len(rows)} rows, {seconds:.0f} s)")
    if ours_bad:
        log("WARNING: ours failed the correctness gate in at least one row (see '!')")
    common.print_summary(rows)


def fp8_results_path(args: argparse.Namespace, gpu: str, date: str) -> Path:
    """--fp8-only: --out as for the bf16 file (a file, a directory, or the default); with the
    bf16 matrix: the default fp8 file name in the bf16 file's directory."""
    if args.fp8_only:
        return common.resolve_out(args.out, JOB_FP8, gpu, date)
    bf16_path = common.resolve_out(args.out, JOB, gpu, date)
    return bf16_path.parent / common.default_results_path(JOB_FP8, gpu, date).name


def fp8_decode_block(args: argparse.Namespace, copy_bw: float | None = None) -> int:
    """The fp8 block (see the module docstring): ours vs FlashMLA's dense fp8 path over a
    per-tensor fp8 e4m3 cache, its own results file (job dense_decode_fp8), table and
    summary. Returns the exit status: 0; 1 if ours failed a gate; 2 if it stopped early."""
    gpu, date, commit = common.gpu_name(), common.today(), common.git_commit()
    out_path = fp8_results_path(args, gpu, date)
    kernels = args.fp8_kernels
    m = args.fp8_matrix
    log(f"\n===== fp8 block: per-tensor fp8 e4m3 cache (576 B/token), bf16 q =====\n"
        f"matrix: H {m['H']} x s_q {m['s_q']} x batch {m['batch']} x seq_len {m['seq_len']}; "
        f"kernels: {', '.join(kernels) or '(none)'}; results -> {out_path}")
    t_start = time.perf_counter()
    rows: list[BenchRow] = []

    def save() -> None:
        common.write_results(out_path, job=JOB_FP8, gpu=gpu, date=date, commit=commit,
                             copy_bw_gbs=copy_bw, rows=rows)

    ours_bad, status = run_matrix(m, kernels, FP8_BUILDERS, args, copy_bw, rows, save,
                                  fp8=True)
    save()
    report(rows, kernels, copy_bw, out_path, time.perf_counter() - t_start, ours_bad)
    if status == 0 and ours_bad:
        status = 1
    return status


def _int_list(s: str) -> tuple[int, ...]:
    return tuple(int(v) for v in s.split(",") if v.strip())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.dense_decode",
        description="Dense MLA decode: ours vs vLLM 0.25's FlashMLA, FA3 MLA, FlashInfer MLA "
                    "and Triton MLA, side by side on the same inputs (CUDA graphs, rotating "
                    "inputs > L2). Writes design.md's results JSON and prints a table. "
                    "--fp8 / --fp8-only: ours vs FlashMLA's dense fp8 path over a per-tensor "
                    "fp8 e4m3 cache, in its own results file (dense_decode_fp8-...).",
        epilog="Run from the repository root: PYTHONPATH=/opt/vk/site python -m "
               "bench.dense_decode --quick; fp8 only: PYTHONPATH=/opt/vk/site:$PWD python -m "
               "bench.dense_decode --fp8-only --out DIR")
    ap.add_argument("--quick", action="store_true",
                    help="small subset (H 16,128 x s_q 1,2 x batch 1,32,128 x seq 4096), ~2 min")
    ap.add_argument("--out", default="",
                    help="results JSON path, or a directory for the default file name "
                         "(default: bench/results/dense_decode-<gpu-slug>-<date>.json); the "
                         "fp8 block writes dense_decode_fp8-<gpu-slug>-<date>.json next to it "
                         "(with --fp8-only a file path here is the fp8 file)")
    ap.add_argument("--no-flashinfer", action="store_true",
                    help="leave FlashInfer out (its first use JIT-compiles for minutes)")
    ap.add_argument("--peers", default=",".join(PEERS),
                    help=f"comma list of peers to run (default: {','.join(PEERS)}; the fp8 "
                         f"block runs those of {','.join(FP8_PEERS)})")
    ap.add_argument("--no-ours", action="store_true", help="peers only")
    ap.add_argument("--H", type=_int_list, default=None, help="override heads, e.g. 16,128")
    ap.add_argument("--s-q", type=_int_list, default=None, help="override s_q, e.g. 1,2")
    ap.add_argument("--batch", type=_int_list, default=None, help="override batch sizes")
    ap.add_argument("--seq-len", type=_int_list, default=None, help="override mean seq lens")
    ap.add_argument("--fa3-page", type=int, default=PAGE, choices=(16, 32, 64),
                    help="page size FA3 sees the cache with (64: like ours; 16: vLLM's "
                         "default FLASH_ATTN_MLA block size)")
    ap.add_argument("--budget-ms", type=float, default=None,
                    help="GPU time per kernel timing (default 60, --quick 40)")
    ap.add_argument("--rounds", type=int, default=0,
                    help="timing rounds per config, each kernel first in turn; the median "
                         "counts (default: one per kernel, so each is first once)")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--fp8", action="store_true",
                    help="after the bf16 matrix, the fp8 block: per-tensor fp8 e4m3 cache, ours "
                         "vs FlashMLA dense fp8 (H 16,64,128 x s_q 1,2 x batch 1,32,128 x "
                         "seq 4096 unless --H/--s-q/--batch/--seq-len), ~2 min")
    ap.add_argument("--fp8-only", action="store_true",
                    help="the fp8 block only (skips the bf16 matrix)")
    ap.add_argument("--fp8-peer-tol", type=float, default=REL_L2_TOL,
                    help=f"rel L2 limit for FlashMLA's fp8 output (default {REL_L2_TOL:g}, the "
                         "same gate as everyone; its kernel also rounds the softmax "
                         "probabilities to e4m3, which no reference models)")
    ap.add_argument("--verbose", action="store_true", help="tracebacks for failures")
    args = ap.parse_args(argv)
    if args.rounds < 0:
        ap.error(f"--rounds must be >= 1 (or 0: one per kernel); got {args.rounds}")
    peers = [p for p in args.peers.split(",") if p]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        ap.error(f"unknown peers {unknown}; choose from {list(PEERS)}")
    if args.no_flashinfer:
        peers = [p for p in peers if p != "flashinfer_mla"]
    ours = [] if args.no_ours else [OURS]
    args.kernels = ours + [p for p in PEERS if p in peers]
    args.fp8_kernels = ours + [p for p in FP8_PEERS if p in peers]
    args.fp8 = args.fp8 or args.fp8_only
    matrix = dict(QUICK_MATRIX if args.quick else FULL_MATRIX)
    fp8_matrix = dict(FP8_MATRIX)
    for key, attr in (("H", "H"), ("s_q", "s_q"), ("batch", "batch"), ("seq_len", "seq_len")):
        if getattr(args, attr):
            matrix[key] = getattr(args, attr)
            fp8_matrix[key] = getattr(args, attr)
    args.matrix = matrix
    args.fp8_matrix = fp8_matrix
    if args.budget_ms is None:
        args.budget_ms = 40.0 if args.quick else 60.0
    return args


def environment_report(kernels: list[str]) -> None:
    import importlib

    log(f"torch {torch.__version__}, {common.gpu_name()}, "
        f"{torch.cuda.get_device_properties(0).multi_processor_count} SMs, "
        f"capability {torch.cuda.get_device_capability()}")
    probes: list[tuple[str, Callable[[], object]]] = [
        ("vllm", lambda: importlib.import_module("vllm").__version__)]
    if "flashinfer_mla" in kernels:
        probes.append(("flashinfer", lambda: importlib.import_module("flashinfer").__version__))
    if OURS in kernels:
        def extension() -> str:
            ext = importlib.import_module("mla_backend._extension")
            return "loaded" if ext.load() else f"NOT available: {ext._state['error']}"
        probes.append(("mla_backend extension", extension))
    for what, fn in probes:
        try:
            log(f"{what}: {fn()}")
        except Exception as e:  # noqa: BLE001
            log(f"{what}: unavailable ({common.short_error(e, 200)})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        log("no CUDA device: this benchmark runs on the GPU machine")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False       # the float32 reference stays float32
    torch.backends.cudnn.allow_tf32 = False
    gpu, date, commit = common.gpu_name(), common.today(), common.git_commit()
    out_path = common.resolve_out(args.out, JOB, gpu, date)
    environment_report(args.fp8_kernels if args.fp8_only else args.kernels)
    m = args.matrix
    if not args.fp8_only:
        log(f"matrix: H {m['H']} x s_q {m['s_q']} x batch {m['batch']} x seq_len "
            f"{m['seq_len']}; kernels: {', '.join(args.kernels)}; results -> {out_path}")
    t_start = time.perf_counter()
    copy_bw: float | None = None
    try:
        copy_bw = common.copy_bandwidth_gbs()
        log(f"device copy bandwidth (read + write): {copy_bw:.0f} GB/s")
    except Exception as e:  # noqa: BLE001
        log(f"copy bandwidth measurement failed: {common.short_error(e)}")

    status = 0
    if not args.fp8_only:
        rows: list[BenchRow] = []

        def save() -> None:
            common.write_results(out_path, job=JOB, gpu=gpu, date=date, commit=commit,
                                 copy_bw_gbs=copy_bw, rows=rows)

        ours_bad, status = run_matrix(m, args.kernels, BUILDERS, args, copy_bw, rows, save)
        save()
        report(rows, args.kernels, copy_bw, out_path, time.perf_counter() - t_start, ours_bad)
        if status == 0 and ours_bad:
            status = 1

    if args.fp8:
        if status == 2:
            log("\nfp8 block: not run (the bf16 matrix stopped early)")
        else:
            status = max(status, fp8_decode_block(args, copy_bw))
    return status


if __name__ == "__main__":
    sys.exit(main())
