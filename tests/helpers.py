"""What the tests share: paged inputs (dense and sparse), the naive float64 decode, e4m3 code
populations, the tolerances of the gpu tier and its one comparison (per-row relative L2 of
out, per-element lse), NaN-poisoned outputs, and (from bench/common.py, which the benches
use too) the block-table builder, the whole-tensor rel L2 and the CUDA-graph capture."""

from __future__ import annotations

import zlib

import torch

from bench.common import block_tables, capture_graph, rel_l2
from mla_backend import formats

__all__ = ["D_QK", "D_V", "PAGE", "E4M3_POPULATIONS", "DENSE_OUT_TOL", "SPARSE_OUT_TOL",
           "LSE_ATOL", "assert_attention_close", "assert_lse_close", "assert_rows_close",
           "block_tables", "capture_graph", "case_gen", "case_seed", "dense_row_keys",
           "e4m3_codes", "naive_dense_decode", "nan_outputs", "paged_case", "rel_l2",
           "row_errors", "sparse_cache", "sparse_case", "sparse_kernel_keys", "sparse_row_keys"]

D_QK, D_V, PAGE = 576, 512, 64

# The gpu tier's tolerances (docs/kernels/dense_decode.md, sparse_decode.md), per row of out
# (one query token: [H, 512]) and per element of lse. The kernels' own roundings are P to
# the input dtype before PV and out to the input dtype (2^-9 relative for bf16, 2^-12 for
# fp16); lse stays in float32.
DENSE_OUT_TOL = {torch.bfloat16: 8e-3, torch.float16: 2e-3}
SPARSE_OUT_TOL = 8e-3
LSE_ATOL = 2e-3


def case_seed(*parts: object) -> int:
    """A seed from a case's own parameters: the same data whichever tests run before it."""
    return zlib.crc32(repr(parts).encode())


def case_gen(*parts: object) -> torch.Generator:
    return torch.Generator().manual_seed(case_seed(*parts))


def paged_case(seq_lens: list[int], s_q: int, heads: int, *, dtype=torch.bfloat16,
               device="cpu", spare_blocks: int = 3, seed: int = 0, nan_unused: bool = True):
    """Random q, a paged cache whose blocks are handed out in a random order, a block table
    whose unused entries hold out-of-range garbage, and NaN in every slot no request uses."""
    g = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    blocks_per_req = [-(-n // PAGE) for n in seq_lens]
    max_blocks = max(blocks_per_req + [1]) + 1
    num_blocks = sum(blocks_per_req) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g)
    cache = torch.randn(num_blocks, PAGE, D_QK, generator=g).to(dtype)
    used = torch.zeros(num_blocks, PAGE, dtype=torch.bool)
    garbage = torch.randint(num_blocks + 1000, 2**30, (batch, max_blocks), generator=g,
                            dtype=torch.int32)
    table = block_tables(perm, blocks_per_req, width=max_blocks, unused=garbage)[0]
    for b, n in enumerate(seq_lens):
        for j in range(blocks_per_req[b]):
            used[int(table[b, j]), : min(PAGE, n - j * PAGE)] = True
    if nan_unused:
        cache[~used] = float("nan")
    q = torch.randn(batch, s_q, heads, D_QK, generator=g).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return (q.to(device), cache.to(device), table.to(device), lens.to(device))


def sparse_cache(num_blocks: int, used: torch.Tensor, fmt: str, g: torch.Generator
                 ) -> torch.Tensor:
    """A paged cache [num_blocks, 64, 576] bf16 or [.., 656] uint8 fp8_ds_mla whose unused
    slots (used: bool [num_blocks, 64]) are NaN (bf16) or 0xFF bytes (NaN e4m3 values, NaN
    scales, NaN rope)."""
    kv = (torch.randn(num_blocks, PAGE, D_QK, generator=g) * 2).to(torch.bfloat16)
    if fmt == "bf16":
        kv[~used] = float("nan")
        return kv
    packed = formats.quantize_fp8_ds_mla(kv[..., :D_V].contiguous(), kv[..., D_V:].contiguous())
    packed[~used] = 0xFF
    return packed


def sparse_case(batch: int, s_q: int, heads: int, topk: int, fmt: str, *, g: torch.Generator,
                num_blocks: int = 40, clustered: bool = False, lengths: list[int] | None = None,
                invalid_frac: float = 0.1, device: str = "cuda"):
    """q [B, s_q, H, 576] bf16, a sparse_cache over a random half of its slots, indices
    [B, s_q, topk] int32 into the used slots (random with duplicates, or runs of 16
    consecutive slots) with -1 and out-of-range entries, and topk_length (lengths) or None."""
    num_slots = num_blocks * PAGE
    used_slots = torch.randperm(num_slots, generator=g)[: num_slots // 2]
    used = torch.zeros(num_slots, dtype=torch.bool)
    used[used_slots] = True
    if clustered:  # runs of consecutive used slots starting at random used slots
        starts = used_slots[torch.randint(0, used_slots.numel(), (batch, s_q, topk // 16 + 1),
                                          generator=g)]
        runs = (starts.unsqueeze(-1) + torch.arange(16)).clamp_max(num_slots - 1)
        idx = runs.reshape(batch, s_q, -1)[..., :topk]
        used[idx.reshape(-1)] = True
    else:  # random used slots, duplicates included
        idx = used_slots[torch.randint(0, used_slots.numel(), (batch, s_q, topk), generator=g)]
    idx = idx.to(torch.int32)
    r = torch.rand(idx.shape, generator=g)
    idx[r < invalid_frac] = -1
    idx[(r >= invalid_frac) & (r < invalid_frac * 1.2)] = num_slots + 7   # out of range
    idx[(r >= invalid_frac * 1.2) & (r < invalid_frac * 1.3)] = -5        # out of range
    cache = sparse_cache(num_blocks, used.view(num_blocks, PAGE), fmt, g)
    q = torch.randn(batch, s_q, heads, D_QK, generator=g).to(torch.bfloat16)
    length = None if lengths is None else torch.tensor(lengths, dtype=torch.int32).to(device)
    return q.to(device), cache.to(device), idx.to(device), length


def sparse_kernel_keys(cache: torch.Tensor) -> torch.Tensor:
    """The keys the sparse kernels multiply: an fp8_ds_mla cache dequantized (e4m3 * tile
    scale in float32) and rounded once to bf16, as the kernels do before their MMAs; a bf16
    cache as is."""
    if cache.dtype != torch.uint8:
        return cache
    return formats.dequantize_fp8_ds_mla(cache).to(torch.bfloat16)


def naive_dense_decode(q, cache, table, lens, scale, causal=True):
    """Explicit per-(request, query, head) softmax in float64, one loop iteration each."""
    batch, s_q, heads, _ = q.shape
    out = torch.zeros(batch, s_q, heads, D_V, dtype=torch.float64)
    lse = torch.full((batch, s_q, heads), float("-inf"), dtype=torch.float64)
    for b in range(batch):
        n = int(lens[b])
        keys = torch.stack([cache[int(table[b, t // PAGE]), t % PAGE] for t in range(n)]) \
            if n else torch.zeros(0, D_QK)
        keys = keys.double()
        for i in range(s_q):
            limit = n - s_q + i + 1 if causal else n
            if limit <= 0:
                continue
            kk = keys[:limit]
            for h in range(heads):
                s = (kk @ q[b, i, h].double()) * scale
                w = torch.softmax(s, 0)
                out[b, i, h] = w @ kk[:, :D_V]
                lse[b, i, h] = torch.logsumexp(s, 0)
    return out, lse


# ---------------------------------------------------------------------- poisoned outputs

def force_dense_kernel(monkeypatch, kernel: str) -> None:
    """Dense decode's steps of <= 16 query rows (s_q * H) on one kernel for this test:
    "rule" leaves the library's choice (cost_model: the wgmma kernel on a 16-bit cache, and on
    fp8 above MMA_MAX_ROWS_FP8 rows or below MMA_MIN_BATCH_FP8 requests), "mma.sync" takes the
    mma.sync kernel at every batch and up to 16 rows on either cache,
    "wgmma" the wgmma kernel at every batch. Steps of more rows run on wgmma either way."""
    from mla_backend.ops import cost_model

    if kernel == "mma.sync":
        monkeypatch.setattr(cost_model, "MMA_MAX_ROWS_FP8", 16)
        monkeypatch.setattr(cost_model, "MMA_MIN_BATCH_16BIT", 1)
        monkeypatch.setattr(cost_model, "MMA_MIN_BATCH_FP8", 1)
    elif kernel == "wgmma":
        monkeypatch.setattr(cost_model, "MMA_MAX_ROWS", 0)
    elif kernel != "rule":
        raise ValueError(f"kernel must be 'rule', 'mma.sync' or 'wgmma'; got {kernel!r}")


def nan_outputs(q: torch.Tensor, dtype: torch.dtype | None = None, fill: float = float("nan")
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Caller-owned out and lse for q ([B, s_q, H, 576] -> out [B, s_q, H, 512] and lse
    [B, s_q, H]; prefill [T, H, 576] -> [T, H, 512] and [T, H]) filled with `fill` (NaN:
    an element the kernel does not write stays NaN). Refill before every call or replay."""
    lead = tuple(q.shape[:-1])
    out = torch.full(lead + (D_V,), fill, dtype=dtype or q.dtype, device=q.device)
    lse = torch.full(lead, fill, dtype=torch.float32, device=q.device)
    return out, lse


# ---------------------------------------------------------------------- keys per row

def dense_row_keys(seq_lens: torch.Tensor, s_q: int, causal: bool = True) -> torch.Tensor:
    """Keys each (request, query token) row of a dense decode attends: [B, s_q]."""
    seq = seq_lens.detach().to("cpu", torch.int64).view(-1, 1)
    if not causal:
        return seq.expand(-1, s_q).clone()
    return (seq - s_q + 1 + torch.arange(s_q).view(1, -1)).clamp_min(0)


def sparse_row_keys(indices: torch.Tensor, num_slots: int,
                    topk_length: torch.Tensor | None = None) -> torch.Tensor:
    """Valid entries of each sparse row (indices [..., topk] -> [...]): in [0, num_slots)
    and, with topk_length ([B], one per leading entry), among the first topk_length[b]."""
    idx = indices.detach().to("cpu", torch.int64)
    valid = (idx >= 0) & (idx < num_slots)
    if topk_length is not None:
        j = torch.arange(idx.shape[-1])
        n = topk_length.detach().to("cpu", torch.int64)
        valid &= j < n.view((-1,) + (1,) * (idx.dim() - 1))
    return valid.sum(-1)


# ---------------------------------------------------------------------- the comparison

def _at(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        out.append(flat % n)
        flat //= n
    return tuple(reversed(out))


def _keys_at(keys: torch.Tensor | None, row: tuple[int, ...]) -> str:
    return "" if keys is None else f" ({int(keys[row])} keys)"


def row_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Relative L2 of each row, float64 on the CPU: out [..., H, 512] -> [...], the norm over
    one row's [H, 512]. A row whose reference is all zero (no key) scores ||got|| / 1e-30:
    0 only when the kernel wrote exactly 0. NaN anywhere in a row gives NaN."""
    g, w = got.detach().double(), want.detach().double()
    err = torch.linalg.vector_norm(g - w, dim=(-2, -1))
    ref = torch.linalg.vector_norm(w, dim=(-2, -1)).clamp_min(1e-30)
    return (err / ref).cpu()


def assert_rows_close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str = "out",
                      keys: torch.Tensor | None = None) -> None:
    """Every row of out (one query token, [H, 512]; got / want [..., H, 512]) within `tol`
    relative L2 of the reference's row. keys (the rows' shape, optional) is what each row
    attends, for the message, which names the worst row, its error, its keys, how many rows
    fail and the whole-output rel L2 (what a single global number would have said)."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dim() < 3 or got[..., 0, 0].numel() == 0:
        return
    err = row_errors(got, want)
    bad = ~(err <= tol)  # NaN fails
    if not bad.any():
        return
    worst = _at(int(torch.where(err.isnan(), float("inf"), err).argmax()), tuple(err.shape))
    nan_rows = int(err.isnan().sum())
    raise AssertionError(
        f"{what}: {int(bad.sum())} of {err.numel()} rows over rel L2 {tol:g}"
        f"{f' ({nan_rows} with NaN)' if nan_rows else ''}; worst row {worst}"
        f"{_keys_at(keys, worst)}: rel L2 {float(err[worst]):.3e} "
        f"(whole-output rel L2 {rel_l2(got, want):.3e})")


def assert_lse_close(lse: torch.Tensor, want_lse: torch.Tensor, atol: float = LSE_ATOL,
                     what: str = "lse", keys: torch.Tensor | None = None) -> None:
    """lse per element: -inf exactly where the reference's is (rows with no key), within
    atol elsewhere; NaN (an unwritten, poisoned element) fails. keys: as assert_rows_close
    (lse's shape minus the head dim)."""
    assert lse.shape == want_lse.shape, \
        f"{what}: shape {tuple(lse.shape)} != {tuple(want_lse.shape)}"
    got, want = lse.detach().double().cpu(), want_lse.detach().double().cpu()
    assert not want.isnan().any(), f"{what}: the reference has NaN; compare the finite rows"
    empty = want == float("-inf")
    diff = torch.where(empty, torch.where(got == float("-inf"), 0.0, float("inf")),
                       (got - want).abs())
    diff = torch.where(got.isnan(), float("inf"), diff)
    bad = ~(diff <= atol)
    if not bad.any():
        return
    worst = _at(int(diff.argmax()), tuple(diff.shape))
    row = worst[:-1]
    raise AssertionError(
        f"{what}: {int(bad.sum())} of {diff.numel()} elements off by more than {atol:g} "
        f"(NaN: {int(got.isnan().sum())}, -inf mismatches: "
        f"{int((empty != (got == float('-inf'))).sum())}); worst (row, head) {worst}"
        f"{_keys_at(keys, row)}: got {float(got[worst]):.6g}, want {float(want[worst]):.6g}")


def assert_attention_close(got: torch.Tensor, lse: torch.Tensor, want: torch.Tensor,
                           want_lse: torch.Tensor, tol: float, what: str = "",
                           *, lse_atol: float = LSE_ATOL,
                           keys: torch.Tensor | None = None) -> None:
    """The gpu tier's comparison of one kernel call with its reference: out and lse written
    everywhere (no NaN left from the poison), out exactly 0 where a head has no key,
    assert_rows_close(out, tol) and assert_lse_close(lse, lse_atol)."""
    prefix = f"{what}: " if what else ""
    nan_out = got.isnan().any(-1)
    if nan_out.any():
        first = tuple(int(i) for i in nan_out.nonzero()[0].cpu())
        raise AssertionError(f"{prefix}out has NaN (unwritten, or computed) in "
                             f"{int(nan_out.sum())} of {nan_out.numel()} (row, head) vectors; "
                             f"first {first}{_keys_at(keys, first[:-1])}")
    empty = torch.isinf(want_lse) & (want_lse < 0)
    nonzero = (got != 0).any(-1) & empty
    if nonzero.any():
        first = tuple(int(i) for i in nonzero.nonzero()[0].cpu())
        raise AssertionError(f"{prefix}out is not exactly 0 at (row, head) {first}, which "
                             f"attends no key")
    assert_rows_close(got, want, tol, f"{prefix}out", keys)
    assert_lse_close(lse, want_lse, lse_atol, f"{prefix}lse", keys)


# ---------------------------------------------------------------------- fp8 codes

# e4m3 byte populations for the fp8 conversion tests: every code but the two NaNs, only the
# subnormals (and zeros), only the two largest binades
E4M3_POPULATIONS = {
    "every": [c for c in range(256) if c & 0x7F != 0x7F],
    "subnormal": list(range(0x00, 0x08)) + list(range(0x80, 0x88)),
    "largest": list(range(0x70, 0x7F)) + list(range(0xF0, 0xFF)),
}


def e4m3_codes(population: str, shape, g: torch.Generator) -> torch.Tensor:
    """Random uint8 e4m3 codes drawn uniformly from one of E4M3_POPULATIONS."""
    pool = torch.tensor(E4M3_POPULATIONS[population], dtype=torch.uint8)
    return pool[torch.randint(0, pool.numel(), tuple(shape), generator=g)]
