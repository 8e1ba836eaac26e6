"""sparse_mla_decode / sparse_mla_prefill on the GPU against the float32 reference: fresh
random data each case, poisoned outputs, NaN in every cache slot no index names (NaN bytes
in the fp8_ds_mla cache), random and clustered indices with duplicates, -1 padding and
out-of-range slots, all-invalid rows, topk larger than the context, ragged topk_length
(0, short, past topk), every head count and s_q claimed, strided cache views, CUDA graphs.

Tolerances (docs/kernels/sparse_decode.md): as dense decode — the kernel's own roundings
are P to bf16 before PV and the output to bf16: rel L2(out) < 8e-3, lse within 2e-3
absolute, against the reference on the keys the kernel multiplies. For fp8_ds_mla those are
e4m3 * tile scale rounded once to bf16 (the format's defined dequantization, then the MMA
input type): the reference gets the same bf16 keys; the output is also checked against the
float32 dequantization (rel L2 < 8e-3; lse there differs by up to ~1e-2, the bf16 rounding
of the keys, seen on the H200). Rows with no valid index: out exactly 0, lse -inf.
"""

from itertools import pairwise

import pytest
import torch

from mla_backend import formats, ops
from mla_backend import reference as ref
from tests.helpers import block_tables, capture_graph, e4m3_codes, rel_l2

pytestmark = pytest.mark.gpu
TOL_OUT, TOL_LSE = 8e-3, 2e-3
PAGE = 64
_seed = [5000]


def _gen():
    _seed[0] += 1
    return torch.Generator().manual_seed(_seed[0])


def _cache(num_blocks: int, used: torch.Tensor, fmt: str, g) -> torch.Tensor:
    """A paged cache [num_blocks, 64, 576] bf16 or [.., 656] uint8 whose unused slots are NaN
    (bf16) or 0xFF bytes (NaN e4m3 values, NaN scales, NaN rope)."""
    kv = (torch.randn(num_blocks, PAGE, 576, generator=g) * 2).to(torch.bfloat16)
    if fmt == "bf16":
        kv[~used] = float("nan")
        return kv
    packed = formats.quantize_fp8_ds_mla(kv[..., :512].contiguous(), kv[..., 512:].contiguous())
    packed[~used] = 0xFF
    return packed


def _case(batch, s_q, heads, topk, fmt, *, num_blocks=40, clustered=False, lengths=None,
          invalid_frac=0.1, g=None):
    """q, cache, indices [B, s_q, topk] over a random set of used slots, topk_length."""
    g = g or _gen()
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
    cache = _cache(num_blocks, used.view(num_blocks, PAGE), fmt, g)
    q = torch.randn(batch, s_q, heads, 576, generator=g).to(torch.bfloat16)
    length = None if lengths is None else torch.tensor(lengths, dtype=torch.int32).cuda()
    return q.cuda(), cache.cuda(), idx.cuda(), length


def _kernel_keys(cache):
    """The keys the kernel multiplies: an fp8_ds_mla cache dequantized (e4m3 * tile scale in
    float32) and rounded once to bf16, as the kernel does before its MMAs; a bf16 cache as is."""
    if cache.dtype != torch.uint8:
        return cache
    return formats.dequantize_fp8_ds_mla(cache).to(torch.bfloat16)


def _compare(got, lse, want, want_lse):
    assert not got.isnan().any(), "unwritten or NaN output"
    empty = torch.isinf(want_lse)
    assert torch.equal(torch.isinf(lse), empty) and bool((lse[empty] < 0).all())
    assert torch.all(got[empty] == 0)
    if (~empty).any():
        assert rel_l2(got[~empty], want[~empty]) < TOL_OUT, rel_l2(got[~empty], want[~empty])
        assert torch.allclose(lse[~empty], want_lse[~empty], atol=TOL_LSE)


def _check_decode(batch, s_q, heads, topk, fmt, min_units_per_cta=None, **kw):
    q, cache, idx, length = _case(batch, s_q, heads, topk, fmt, **kw)
    scale = 576 ** -0.5
    plan = ops.plan_sparse_decode(batch, s_q, heads, topk, topk_length=length, device="cuda",
                                  kv_cache_dtype=cache.dtype, _min_units_per_cta=min_units_per_cta)
    out = torch.full((batch, s_q, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    got, lse = ops.sparse_mla_decode(q, cache, idx, plan, scale, topk_length=length, out=out)
    assert got.data_ptr() == out.data_ptr()
    want, want_lse = ref.sparse_mla_decode(q, _kernel_keys(cache), idx, None, scale, length)
    _compare(got, lse, want, want_lse)
    if cache.dtype == torch.uint8:  # the format end to end: float32 dequantization
        exact, _ = ref.sparse_mla_decode(q, cache, idx, None, scale, length)
        _compare_out(got, exact, want_lse)
    return got, lse


def _compare_out(got, want, want_lse):
    valid = torch.isfinite(want_lse)
    if valid.any():
        assert rel_l2(got[valid], want[valid]) < TOL_OUT, rel_l2(got[valid], want[valid])


HEADS = [1, 8, 16, 20, 32, 64, 100, 128]


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("s_q", [1, 2, 4])
def test_decode_heads_and_query_lengths(fmt, heads, s_q):
    _check_decode(3, s_q, heads, 512, fmt, lengths=[512, 77, 300])


# 16 heads: one 64-row tile, 48 rows of it padding; 128: two tiles
@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("topk", [64, 100, 2048])
@pytest.mark.parametrize("heads", [16, 128])
def test_decode_clustered_indices_and_ragged_lengths(fmt, topk, heads):
    # lengths 0 (empty), short, not a multiple of the 64-entry unit, past topk (clamped)
    _check_decode(6, 2, heads, topk, fmt, clustered=True,
                  lengths=[0, 5, topk - 3, topk + 100, 33, topk], num_blocks=80)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("heads", [16, 32])  # padded tiles
def test_decode_all_invalid_rows_and_topk_past_context(fmt, heads):
    q, cache, idx, _ = _case(4, 2, heads, 256, fmt, num_blocks=3, invalid_frac=0.0)
    idx[0] = -1                          # every index of entry 0 invalid
    idx[1, 1] = cache.shape[0] * PAGE    # one query row: all out of range
    idx[2, :, 40:] = -1                  # topk 256 over a 40-token context: -1 padded
    plan = ops.plan_sparse_decode(4, 2, heads, 256, device="cuda")
    got, lse = ops.sparse_mla_decode(q, cache, idx, plan, 0.1)
    want, want_lse = ref.sparse_mla_decode(q, _kernel_keys(cache), idx, None, 0.1)
    _compare(got, lse, want, want_lse)
    assert torch.isinf(lse[0]).all() and torch.isinf(lse[1, 1]).all()
    assert torch.isfinite(lse[1, 0]).all() and torch.isfinite(lse[2]).all()


# every e4m3 code, subnormals alone, the largest binades alone, with random tile scales:
# the producer's conversion (convert_e4m3x16, plain and paired) must give the same bf16
# keys as the format's float32 dequantization rounded once
@pytest.mark.parametrize("population", ["every", "subnormal", "largest"])
@pytest.mark.parametrize("heads", [16, 128])
def test_decode_fp8_ds_mla_every_e4m3_code(population, heads):
    g = _gen()
    q, cache, idx, length = _case(4, 2, heads, 256, "fp8_ds_mla", num_blocks=20,
                                  lengths=[256, 100, 3, 256], g=g)
    used = ~(cache == 0xFF).all(-1)
    n = int(used.sum())
    cache[used, :512] = e4m3_codes(population, (n, 512), g).cuda()
    scales = 10 ** (torch.rand(n, 4, generator=g) * 2 - 3)  # 1e-3 .. 1e-1
    cache[used, 512:528] = scales.contiguous().view(torch.uint8).cuda()
    plan = ops.plan_sparse_decode(4, 2, heads, 256, topk_length=length, device="cuda")
    got, lse = ops.sparse_mla_decode(q, cache, idx, plan, 0.05, topk_length=length)
    want, want_lse = ref.sparse_mla_decode(q, _kernel_keys(cache), idx, None, 0.05, length)
    _compare(got, lse, want, want_lse)


def test_decode_fp8_ds_mla_nan_code_reaches_the_output():
    """An e4m3 NaN in a listed token makes every query row that lists it NaN, as in the
    reference; the other rows are unaffected."""
    q, cache, idx, _ = _case(3, 1, 64, 128, "fp8_ds_mla", num_blocks=10, invalid_frac=0.0)
    slot = int(idx[1, 0, 5])
    cache.view(-1, 656)[slot, 300] = 0x7F
    plan = ops.plan_sparse_decode(3, 1, 64, 128, device="cuda")
    got, _ = ops.sparse_mla_decode(q, cache, idx, plan, 0.05)
    want, want_lse = ref.sparse_mla_decode(q, _kernel_keys(cache), idx, None, 0.05)
    nan_rows = want.isnan().any(-1)
    assert nan_rows[1, 0].all() and torch.equal(want[nan_rows].isnan().all(-1), nan_rows[nan_rows])
    assert torch.equal(got.isnan().all(-1), nan_rows) and torch.equal(got.isnan().any(-1), nan_rows)
    ok = ~nan_rows
    assert rel_l2(got[ok], want[ok]) < TOL_OUT


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("heads", [16, 128])
def test_decode_more_groups_than_ctas_split_and_empty(fmt, heads):
    """More query groups than CTAs: the combine takes split groups by the CTA they start in;
    empty groups (topk_length 0) get out 0, lse -inf."""
    g = _gen()
    lengths = torch.randint(0, 700, (100,), generator=g)
    lengths[::9] = 0
    got, _ = _check_decode(100, 2, heads, 640, fmt, num_blocks=80, lengths=lengths.tolist(), g=g)
    plan = ops.plan_sparse_decode(100, 2, heads, 640, topk_length=torch.tensor(
        lengths.tolist(), dtype=torch.int32, device="cuda"), device="cuda")
    meta = plan.metadata.cpu().tolist()
    P, U = meta[:-1], meta[-1]
    assert 200 > plan.num_ctas + 2  # the by-CTA combine grid is the smaller one
    assert any(b > a and a // U != (b - 1) // U for a, b in pairwise(P))  # split groups
    assert any(a == b for a, b in pairwise(P))                              # empty groups


def _planner_schedule(batch, s_q, topk, num_ctas, min_units):
    """(P, U) from the planner kernel, as for a plan with lengths on the GPU."""
    meta = torch.full((batch * s_q + 2,), -7, dtype=torch.int32, device="cuda")
    torch.ops.mla_backend.plan_sparse_decode(None, meta, s_q, topk, num_ctas, min_units, 64)
    meta = meta.cpu().tolist()
    return meta[:-1], meta[-1]


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("heads", [16, 128])
def test_decode_uniform_plan_more_groups_than_ctas_split(fmt, heads):
    """A uniform plan (no topk_length) whose CTAs split groups, with more groups than CTAs:
    the kernels and the by-CTA merge take the schedule from its closed form."""
    plan = ops.plan_sparse_decode(100, 2, heads, 640, device="cuda", _min_units_per_cta=16)
    assert plan.uniform_units == 10 and plan.needs_combine
    assert plan.units_per_cta % 10 != 0 and 200 > plan.num_ctas + 2
    _check_decode(100, 2, heads, 640, fmt, min_units_per_cta=16, num_blocks=80)


def test_plan_needs_combine_matches_the_device_plan():
    """A uniform plan (no topk_length) is the planner kernel's schedule in closed form, and
    the host's needs_combine is False exactly when that schedule has no group that spans
    CTAs and no empty group (then the merge kernel is not launched)."""
    seen = set()
    for batch, s_q, heads, topk in [(32, 2, 128, 512), (128, 2, 128, 512), (128, 2, 128, 2048),
                                    (3, 2, 16, 128), (1, 1, 128, 16384), (100, 1, 64, 640),
                                    (7, 3, 20, 64), (128, 1, 16, 2048), (64, 1, 16, 512)]:
        for kv_dtype in (torch.bfloat16, torch.uint8):
            plan = ops.plan_sparse_decode(batch, s_q, heads, topk, device="cuda",
                                          kv_cache_dtype=kv_dtype)
            upr, U = plan.uniform_units, plan.units_per_cta
            assert upr == -(-topk // 64) and U >= 1
            P = [r * upr for r in range(batch * s_q + 1)]
            # the planner kernel, given the floor that yields U, computes the same schedule
            assert _planner_schedule(batch, s_q, topk, plan.num_ctas, U) == (P, U)
            spans = any(b > a and a // U != (b - 1) // U for a, b in pairwise(P))
            empty = any(a == b for a, b in pairwise(P))
            assert plan.needs_combine == (spans or empty), (batch, s_q, heads, topk, kv_dtype)
            seen.add(plan.needs_combine)
    assert seen == {True, False}
    length = torch.full((4,), 64, dtype=torch.int32, device="cuda")
    assert ops.plan_sparse_decode(4, 1, 16, 64, topk_length=length).needs_combine


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("min_units", [8, 3, 16])
def test_decode_whole_request_and_split_schedules(fmt, heads, min_units):
    """The same inputs under a schedule of whole requests per CTA (8 units: no merge), of
    requests split at odd places (3), and of two requests per CTA (16)."""
    plan = ops.plan_sparse_decode(8, 2, heads, 512, device="cuda", _min_units_per_cta=min_units)
    assert plan.needs_combine == (min_units == 3)
    _check_decode(8, 2, heads, 512, fmt, min_units_per_cta=min_units, num_blocks=40)


def test_decode_large_batch_and_topk_16384():
    _check_decode(2, 1, 16, 16384, "fp8_ds_mla", num_blocks=300, lengths=[16384, 9000])
    _check_decode(128, 1, 64, 2048, "bf16", num_blocks=200)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("heads", [16, 64, 128])
def test_decode_strided_cache_and_strided_q_and_indices(fmt, heads):
    g = _gen()
    q, cache, idx, length = _case(3, 2, heads, 128, fmt, lengths=[128, 40, 1], g=g)
    big = torch.full((cache.shape[0], 3) + tuple(cache.shape[1:]), 0xFF if fmt != "bf16"
                     else float("nan"), dtype=cache.dtype, device="cuda")
    big[:, 1] = cache
    view = big[:, 1]                                     # a layer's slice: stride(0) = 3 pages
    q_big = torch.randn(3, 2, heads, 640, device="cuda").to(torch.bfloat16)
    q_big[..., :576] = q
    idx_big = torch.full((3, 4, 136), -1, dtype=torch.int32, device="cuda")
    idx_big[:, ::2, :128] = idx
    qv, iv = q_big[..., :576], idx_big[:, ::2, :128]
    plan = ops.plan_sparse_decode(3, 2, heads, 128, topk_length=length)
    got, lse = ops.sparse_mla_decode(qv, view, iv, plan, 0.07, topk_length=length)
    want, want_lse = ref.sparse_mla_decode(q, _kernel_keys(cache), idx, None, 0.07, length)
    _compare(got, lse, want, want_lse)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("heads", [20, 100, 128])
def test_decode_q_views(fmt, heads):
    """q is read through its strides (a tensor map): heads-major storage, a size-1 s_q with
    an odd stride, a batch expanded from one row (stride 0)."""
    g = _gen()
    q, cache, idx, length = _case(3, 2, heads, 192, fmt, lengths=[192, 70, 0], g=g)
    scale = 0.06
    heads_major = q.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    assert heads_major.stride(2) == 3 * 2 * 576
    one_token = torch.empty(3, 5, heads, 576, dtype=q.dtype, device="cuda")[:, 2:3]
    one_token.copy_(q[:, :1])
    expanded = q[:1].expand(3, -1, -1, -1)
    for qv, idx_v in ((heads_major, idx), (one_token, idx[:, :1]), (expanded, idx)):
        plan = ops.plan_sparse_decode(3, qv.shape[1], heads, 192, topk_length=length)
        got, lse = ops.sparse_mla_decode(qv, cache, idx_v.contiguous(), plan, scale, topk_length=length)
        want, want_lse = ref.sparse_mla_decode(qv.contiguous(), _kernel_keys(cache), idx_v, None,
                                               scale, length)
        _compare(got, lse, want, want_lse)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("heads", [16, 64, 128])
def test_prefill_flat_and_paged(fmt, heads):
    g = _gen()
    tokens, topk = 300, 2048
    q, cache, idx, _ = _case(tokens, 1, heads, topk, fmt, num_blocks=60, g=g)
    length = torch.randint(0, topk + 50, (tokens,), generator=g, dtype=torch.int32).cuda()
    flat = cache.reshape(-1, cache.shape[-1])           # [S, 576] or [S, 656]
    want, want_lse = ref.sparse_mla_prefill(q[:, 0], _kernel_keys(flat), idx[:, 0], 0.05,
                                            length)
    exact = ref.sparse_mla_prefill(q[:, 0], flat, idx[:, 0], 0.05, length)[0]
    for kv in (flat, cache):
        got, lse = ops.sparse_mla_prefill(q[:, 0], kv, idx[:, 0], 0.05, length)
        assert got.shape == (tokens, heads, 512) and lse.shape == (tokens, heads)
        _compare(got, lse, want, want_lse)
        _compare_out(got, exact, want_lse)


@pytest.mark.parametrize("heads", [32, 64, 128])
def test_bf16_cache_larger_than_l2(heads):
    """A bf16 cache of 70400 slots, above the 65536 from which the bf16 producer prefetches
    each fill's rows to L2 (kPrefetchMinSlots in csrc/decode_wgmma.cu; H <= 64 only):
    decode over the paged cache with ragged lengths, then prefill over the same rows as a
    flat kv."""
    g = _gen()
    batch, topk = 48, 2048
    lengths = torch.randint(0, topk + 50, (batch,), generator=g).tolist()
    got, _ = _check_decode(batch, 1, heads, topk, "bf16", num_blocks=1100, lengths=lengths, g=g)
    assert got.shape == (batch, 1, heads, 512)
    q, cache, idx, _ = _case(200, 1, heads, topk, "bf16", num_blocks=1100, g=g)
    flat = cache.reshape(-1, 576)
    assert flat.shape[0] >= 65536
    got, lse = ops.sparse_mla_prefill(q[:, 0], flat, idx[:, 0], 0.05)
    want, want_lse = ref.sparse_mla_prefill(q[:, 0], flat, idx[:, 0], 0.05)
    _compare(got, lse, want, want_lse)


def test_dense_equivalent_matches_mla_decode():
    """Indices naming every cached token of a request give dense non-causal decode."""
    g = _gen()
    lens = [700, 64, 1]
    blocks = [11, 1, 1]
    cache = torch.randn(sum(blocks), PAGE, 576, generator=g).to(torch.bfloat16).cuda()
    table = block_tables(torch.arange(sum(blocks)), blocks, width=11)[0].cuda()  # in order
    topk = 704
    pos = torch.arange(topk)
    idx = (table.cpu()[:, pos // PAGE] * PAGE + pos % PAGE).to(torch.int32)
    idx[pos.unsqueeze(0) >= torch.tensor(lens).unsqueeze(1)] = -1
    q = torch.randn(3, 1, 32, 576, generator=g).to(torch.bfloat16).cuda()
    seq = torch.tensor(lens, dtype=torch.int32).cuda()
    dense, dense_lse = ops.mla_decode(q, cache, table, seq, ops.plan_decode(seq, 1, 32), 0.04)
    plan = ops.plan_sparse_decode(3, 1, 32, topk, device="cuda")
    got, lse = ops.sparse_mla_decode(q, cache, idx.view(3, 1, topk).cuda(), plan, 0.04)
    assert rel_l2(got, dense) < 4e-3 and torch.allclose(lse, dense_lse, atol=1e-3)


# fp8_ds_mla 128: the paired (2-CTA cluster) launch; bf16 16: the kernel with keys as the
# MMA's M dimension; bf16 128: the co-placed seesaw
@pytest.mark.parametrize("fmt, heads", [("fp8_ds_mla", 64), ("fp8_ds_mla", 128), ("bf16", 16),
                                        ("bf16", 128)])
def test_cuda_graph_with_workspace(fmt, heads):
    """Plan + attention captured once over workspace buffers, replayed on new q, indices and
    lengths of two batch sizes in turn."""
    topk, num_blocks = 256, 20
    ws = ops.sparse_workspace(16, heads, device="cuda")
    cache = _cache(num_blocks, torch.ones(num_blocks, PAGE, dtype=torch.bool), fmt,
                   _gen()).cuda()
    graphs = {}
    for batch in (4, 16):
        st = {"q": torch.zeros(batch, 1, heads, 576, dtype=torch.bfloat16, device="cuda"),
              "idx": torch.full((batch, 1, topk), -1, dtype=torch.int32, device="cuda"),
              "len": torch.zeros(batch, dtype=torch.int32, device="cuda")}

        def step(batch=batch, st=st):
            plan = ops.plan_sparse_decode(batch, 1, heads, topk, topk_length=st["len"],
                                          workspace=ws)
            return ops.sparse_mla_decode(st["q"], cache, st["idx"], plan, 0.06)

        graph, (st["out"], st["lse"]) = capture_graph(step)
        graphs[batch] = (graph, st)
    for _ in range(2):
        for batch, (graph, st) in graphs.items():
            g = _gen()
            st["q"].copy_(torch.randn(st["q"].shape, generator=g).to(torch.bfloat16))
            st["idx"].copy_(torch.randint(-1, num_blocks * PAGE, st["idx"].shape, generator=g,
                                          dtype=torch.int32))
            st["len"].copy_(torch.randint(0, topk + 1, (batch,), generator=g, dtype=torch.int32))
            graph.replay()
            want, want_lse = ref.sparse_mla_decode(st["q"], _kernel_keys(cache), st["idx"],
                                                   None, 0.06, st["len"])
            _compare(st["out"], st["lse"], want, want_lse)


def test_gpu_argument_errors():
    q, cache, idx, length = _case(2, 1, 16, 64, "bf16", lengths=[64, 3])
    plan = ops.plan_sparse_decode(2, 1, 16, 64, topk_length=length)
    with pytest.raises(TypeError, match="fp8_ds_mla"):
        ops.sparse_mla_decode(q, cache.view(torch.float8_e4m3fn)[..., :576], idx, plan, 0.1)
    with pytest.raises(ValueError, match="topk_length must be the tensor the plan"):
        ops.sparse_mla_decode(q, cache, idx, plan, 0.1, topk_length=length.clone())
    with pytest.raises(ValueError, match="plan is for batch 2, s_q 1, H 16, topk 64"):
        ops.sparse_mla_decode(q, cache, idx[..., :32], plan, 0.1)
    with pytest.raises(TypeError, match="q must be bfloat16"):
        ops.sparse_mla_decode(q.half(), cache, idx, plan, 0.1)
