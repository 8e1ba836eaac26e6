"""sparse_mla_decode / sparse_mla_prefill on the GPU against the float32 reference: random data
per case (seeded from the case's own parameters, so no case depends on which ran before it),
NaN-poisoned caller-owned out and lse before every call and every graph replay, NaN in
every cache slot no index names (NaN bytes in the fp8_ds_mla cache), random and clustered
indices with duplicates, -1 padding and out-of-range slots, all-invalid rows, topk larger
than the context, ragged topk_length (0, short, past topk), every head count and s_q
claimed, topk 16384 on both caches, prefill at H 1/16/32/64/128, strided cache views, CUDA
graphs.

Every comparison is tests.helpers.assert_attention_close, per row: each query token's out
([H, 512]; a (request, query token) of decode, a token of prefill) within a relative L2 of
the reference's row; lse per element. Tolerances (docs/kernels/sparse_decode.md): as dense
decode — the kernel's own roundings are P to bf16 before PV and the output to bf16: each
row's rel L2(out) < 8e-3, lse within 2e-3 absolute, against the reference on the keys the
kernel multiplies. For fp8_ds_mla those are e4m3 * tile scale rounded once to bf16 (the
format's defined dequantization, then the MMA input type): the reference gets the same bf16
keys; out is also checked per row against the float32 dequantization, where the budget adds
the one bf16 rounding of every key and value that the reference above shares with the kernel
(each row's rel L2 < 8e-3 + 8e-3, the whole output's < 8e-3; a one-head row of the prefill,
512 values, was measured at 9.2e-3 on the H100, its whole output at 3.6e-3; lse there differs
by up to ~1e-2, seen on the H200, and is not compared). Heads with no valid index: out exactly
0, lse -inf.
tests/gpu/test_negative_controls.py shows that this comparison fails on wrong variants.
"""

from itertools import pairwise

import pytest
import torch

from mla_backend import ops
from mla_backend import reference as ref
from tests.helpers import (
    PAGE,
    SPARSE_OUT_TOL,
    assert_attention_close,
    assert_lse_close,
    assert_rows_close,
    block_tables,
    capture_graph,
    case_gen,
    e4m3_codes,
    nan_outputs,
    rel_l2,
    sparse_cache,
    sparse_case,
    sparse_kernel_keys,
    sparse_row_keys,
)

pytestmark = pytest.mark.gpu


def _slots(cache: torch.Tensor) -> int:
    return cache.shape[0] * cache.shape[1] if cache.dim() == 3 else cache.shape[0]


def _run_decode(q, cache, idx, plan, scale, length=None, fill=float("nan")):
    """sparse_mla_decode into poisoned caller-owned out and lse (returned as they are)."""
    out, lse = nan_outputs(q, fill=fill)
    got, got_lse = ops.sparse_mla_decode(q, cache, idx, plan, scale, topk_length=length, out=out,
                                         lse=lse)
    assert got.data_ptr() == out.data_ptr() and got_lse.data_ptr() == lse.data_ptr()
    return got, got_lse


def _compare(got, lse, q, cache, idx, scale, length, what, exact=False):
    """Against the reference on the kernel's keys; with exact (fp8_ds_mla), out also against
    the float32 dequantization."""
    keys = sparse_row_keys(idx, _slots(cache), length)
    want, want_lse = ref.sparse_mla_decode(q, sparse_kernel_keys(cache), idx, None, scale, length)
    assert_attention_close(got, lse, want, want_lse, SPARSE_OUT_TOL, what, keys=keys)
    if exact and cache.dtype == torch.uint8:  # the format end to end
        exact_out, _ = ref.sparse_mla_decode(q, cache, idx, None, scale, length)
        _assert_close_to_dequantization(got, exact_out, what, keys)


def _check_decode(batch, s_q, heads, topk, fmt, min_units_per_cta=None, g=None, **kw):
    g = g or case_gen("decode", batch, s_q, heads, topk, fmt, min_units_per_cta,
                      sorted(kw.items()))
    q, cache, idx, length = sparse_case(batch, s_q, heads, topk, fmt, g=g, **kw)
    scale = 576 ** -0.5
    plan = ops.plan_sparse_decode(batch, s_q, heads, topk, topk_length=length, device="cuda",
                                  kv_cache_dtype=cache.dtype, _min_units_per_cta=min_units_per_cta)
    got, lse = _run_decode(q, cache, idx, plan, scale, length)
    _compare(got, lse, q, cache, idx, scale, length,
             f"sparse_mla_decode {fmt} batch {batch} s_q {s_q} H {heads} topk {topk}"
             f"{f' min_units {min_units_per_cta}' if min_units_per_cta else ''}", exact=True)
    return got, lse


# the float32 dequantization differs from the keys the kernel multiplies by one bf16 rounding
# of each key and value (2^-9 relative), the same budget as the kernel's own roundings
KEY_ROUNDING_TOL = 8e-3


def _assert_close_to_dequantization(got, exact, what, keys):
    """out against the float32 dequantization: each row within the kernel's budget plus the
    keys' rounding, and the whole output within the kernel's budget alone (as before rows were
    checked one by one)."""
    assert_rows_close(got, exact, SPARSE_OUT_TOL + KEY_ROUNDING_TOL,
                      f"{what}: out vs the float32 dequantization", keys)
    whole = rel_l2(got, exact)
    assert whole < SPARSE_OUT_TOL, f"{what}: whole-output rel L2 vs the dequantization {whole:.3e}"


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
    q, cache, idx, _ = sparse_case(4, 2, heads, 256, fmt, num_blocks=3, invalid_frac=0.0,
                                   g=case_gen("all invalid", fmt, heads))
    idx[0] = -1                          # every index of entry 0 invalid
    idx[1, 1] = cache.shape[0] * PAGE    # one query row: all out of range
    idx[2, :, 40:] = -1                  # topk 256 over a 40-token context: -1 padded
    plan = ops.plan_sparse_decode(4, 2, heads, 256, device="cuda")
    got, lse = _run_decode(q, cache, idx, plan, 0.1)
    _compare(got, lse, q, cache, idx, 0.1, None, f"all-invalid rows {fmt} H {heads}")
    assert torch.isinf(lse[0]).all() and torch.isinf(lse[1, 1]).all()
    assert torch.isfinite(lse[1, 0]).all() and torch.isfinite(lse[2]).all()


# every e4m3 code, subnormals alone, the largest binades alone, with random tile scales:
# the producer's conversion (convert_e4m3x16, plain and paired) must give the same bf16
# keys as the format's float32 dequantization rounded once
@pytest.mark.parametrize("population", ["every", "subnormal", "largest"])
@pytest.mark.parametrize("heads", [16, 128])
def test_decode_fp8_ds_mla_every_e4m3_code(population, heads):
    g = case_gen("codes", population, heads)
    q, cache, idx, length = sparse_case(4, 2, heads, 256, "fp8_ds_mla", num_blocks=20,
                                        lengths=[256, 100, 3, 256], g=g)
    used = ~(cache == 0xFF).all(-1)
    n = int(used.sum())
    cache[used, :512] = e4m3_codes(population, (n, 512), g).cuda()
    scales = 10 ** (torch.rand(n, 4, generator=g) * 2 - 3)  # 1e-3 .. 1e-1
    cache[used, 512:528] = scales.contiguous().view(torch.uint8).cuda()
    plan = ops.plan_sparse_decode(4, 2, heads, 256, topk_length=length, device="cuda")
    got, lse = _run_decode(q, cache, idx, plan, 0.05, length)
    _compare(got, lse, q, cache, idx, 0.05, length, f"e4m3 codes {population} H {heads}")


def test_decode_fp8_ds_mla_nan_code_reaches_the_output():
    """An e4m3 NaN in a listed token makes every query row that lists it NaN, as in the
    reference; the other rows are unaffected. out and lse are poisoned with +inf here, so a
    row left unwritten is not mistaken for a NaN row."""
    q, cache, idx, _ = sparse_case(3, 1, 64, 128, "fp8_ds_mla", num_blocks=10, invalid_frac=0.0,
                                   g=case_gen("nan code"))
    slot = int(idx[1, 0, 5])
    cache.view(-1, 656)[slot, 300] = 0x7F
    plan = ops.plan_sparse_decode(3, 1, 64, 128, device="cuda")
    got, lse = _run_decode(q, cache, idx, plan, 0.05, fill=float("inf"))
    want, want_lse = ref.sparse_mla_decode(q, sparse_kernel_keys(cache), idx, None, 0.05)
    nan_rows = want.isnan().any(-1)
    assert nan_rows[1, 0].all() and torch.equal(want[nan_rows].isnan().all(-1), nan_rows[nan_rows])
    assert torch.equal(got.isnan().all(-1), nan_rows) and torch.equal(got.isnan().any(-1), nan_rows)
    assert not (lse == float("inf")).any(), "lse unwritten"
    ok = ~nan_rows.any(-1)  # query rows with no NaN head
    assert ok.any()
    assert_attention_close(got[ok], lse[ok], want[ok], want_lse[ok], SPARSE_OUT_TOL,
                           "rows beside a NaN key",
                           keys=sparse_row_keys(idx, _slots(cache))[ok.cpu()])


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("heads", [16, 128])
def test_decode_more_groups_than_ctas_split_and_empty(fmt, heads):
    """More query groups than CTAs: the combine takes split groups by the CTA they start in;
    empty groups (topk_length 0) get out 0, lse -inf."""
    g = case_gen("more groups", fmt, heads)
    lengths = torch.randint(0, 700, (100,), generator=g)
    lengths[::9] = 0
    _check_decode(100, 2, heads, 640, fmt, num_blocks=80, lengths=lengths.tolist(), g=g)
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
    _check_decode(8, 2, heads, 512, fmt, min_units_per_cta=min_units, num_blocks=40,
                  g=case_gen("schedules", fmt, heads))  # the same inputs for every schedule


# topk 16384 (the kernels' limit) on both caches, at a small and at the largest H
@pytest.mark.parametrize("fmt, heads", [("fp8_ds_mla", 16), ("bf16", 128)])
def test_decode_topk_16384(fmt, heads):
    _check_decode(2, 1, heads, 16384, fmt, num_blocks=300, lengths=[16384, 9000])


def test_decode_large_batch():
    _check_decode(128, 1, 64, 2048, "bf16", num_blocks=200)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("heads", [16, 64, 128])
def test_decode_strided_cache_and_strided_q_and_indices(fmt, heads):
    g = case_gen("strided", fmt, heads)
    q, cache, idx, length = sparse_case(3, 2, heads, 128, fmt, lengths=[128, 40, 1], g=g)
    big = torch.full((cache.shape[0], 3) + tuple(cache.shape[1:]), 0xFF if fmt != "bf16"
                     else float("nan"), dtype=cache.dtype, device="cuda")
    big[:, 1] = cache
    view = big[:, 1]                                     # a layer's slice: stride(0) = 3 pages
    q_big = torch.randn(3, 2, heads, 640, generator=g).to(torch.bfloat16).cuda()
    q_big[..., :576] = q
    idx_big = torch.full((3, 4, 136), -1, dtype=torch.int32, device="cuda")
    idx_big[:, ::2, :128] = idx
    qv, iv = q_big[..., :576], idx_big[:, ::2, :128]
    plan = ops.plan_sparse_decode(3, 2, heads, 128, topk_length=length)
    got, lse = _run_decode(qv, view, iv, plan, 0.07, length)
    _compare(got, lse, q, cache, idx, 0.07, length, f"strided views {fmt} H {heads}")


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("heads", [20, 100, 128])
def test_decode_q_views(fmt, heads):
    """q is read through its strides (a tensor map): heads-major storage, a size-1 s_q with
    an odd stride, a batch expanded from one row (stride 0)."""
    g = case_gen("q views", fmt, heads)
    q, cache, idx, length = sparse_case(3, 2, heads, 192, fmt, lengths=[192, 70, 0], g=g)
    scale = 0.06
    heads_major = q.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    assert heads_major.stride(2) == 3 * 2 * 576
    one_token = torch.empty(3, 5, heads, 576, dtype=q.dtype, device="cuda")[:, 2:3]
    one_token.copy_(q[:, :1])
    expanded = q[:1].expand(3, -1, -1, -1)
    for name, qv, idx_v in (("heads-major", heads_major, idx), ("one token", one_token, idx[:, :1]),
                            ("expanded", expanded, idx)):
        plan = ops.plan_sparse_decode(3, qv.shape[1], heads, 192, topk_length=length)
        got, lse = _run_decode(qv, cache, idx_v.contiguous(), plan, scale, length)
        _compare(got, lse, qv.contiguous(), cache, idx_v, scale, length,
                 f"q {name} {fmt} H {heads}")


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("heads", [1, 16, 32, 64, 128])
def test_prefill_flat_and_paged(fmt, heads):
    g = case_gen("prefill", fmt, heads)
    tokens, topk = 300, 2048
    q, cache, idx, _ = sparse_case(tokens, 1, heads, topk, fmt, num_blocks=60, g=g)
    length = torch.randint(0, topk + 50, (tokens,), generator=g, dtype=torch.int32).cuda()
    flat = cache.reshape(-1, cache.shape[-1])           # [S, 576] or [S, 656]
    q2, idx2 = q[:, 0], idx[:, 0]
    keys = sparse_row_keys(idx2, flat.shape[0], length)
    want, want_lse = ref.sparse_mla_prefill(q2, sparse_kernel_keys(flat), idx2, 0.05, length)
    exact = ref.sparse_mla_prefill(q2, flat, idx2, 0.05, length)[0]
    for name, kv in (("flat", flat), ("paged", cache)):
        out, lse = nan_outputs(q2)
        got, got_lse = ops.sparse_mla_prefill(q2, kv, idx2, 0.05, length, out=out, lse=lse)
        assert got.data_ptr() == out.data_ptr() and got_lse.data_ptr() == lse.data_ptr()
        assert got.shape == (tokens, heads, 512) and got_lse.shape == (tokens, heads)
        what = f"sparse_mla_prefill {name} {fmt} H {heads}"
        assert_attention_close(got, got_lse, want, want_lse, SPARSE_OUT_TOL, what, keys=keys)
        _assert_close_to_dequantization(got, exact, what, keys)


@pytest.mark.parametrize("heads", [32, 64, 128])
def test_bf16_cache_larger_than_l2(heads):
    """A bf16 cache of 70400 slots, above the 65536 from which the bf16 producer prefetches
    each fill's rows to L2 (kPrefetchMinSlots in the wgmma kernel; H <= 64 only): decode
    over the paged cache with ragged lengths, then prefill over the same rows as a flat kv."""
    g = case_gen("larger than L2", heads)
    batch, topk = 48, 2048
    lengths = torch.randint(0, topk + 50, (batch,), generator=g).tolist()
    got, _ = _check_decode(batch, 1, heads, topk, "bf16", num_blocks=1100, lengths=lengths, g=g)
    assert got.shape == (batch, 1, heads, 512)
    q, cache, idx, _ = sparse_case(200, 1, heads, topk, "bf16", num_blocks=1100, g=g)
    flat = cache.reshape(-1, 576)
    assert flat.shape[0] >= 65536
    out, lse = nan_outputs(q[:, 0])
    got, lse = ops.sparse_mla_prefill(q[:, 0], flat, idx[:, 0], 0.05, out=out, lse=lse)
    want, want_lse = ref.sparse_mla_prefill(q[:, 0], flat, idx[:, 0], 0.05)
    assert_attention_close(got, lse, want, want_lse, SPARSE_OUT_TOL,
                           f"prefill over a cache larger than L2, H {heads}",
                           keys=sparse_row_keys(idx[:, 0], flat.shape[0]))


def test_dense_equivalent_matches_mla_decode():
    """Indices naming every cached token of a request give dense non-causal decode: the two
    kernels agree per row within 4e-3 (lse 1e-3), and each matches the reference."""
    g = case_gen("dense equivalent")
    lens = [700, 64, 1]
    blocks = [11, 1, 1]
    cache = torch.randn(sum(blocks), PAGE, 576, generator=g).to(torch.bfloat16).cuda()
    table = block_tables(torch.arange(sum(blocks)), blocks, width=11)[0].cuda()  # in order
    topk = 704
    pos = torch.arange(topk)
    idx = (table.cpu()[:, pos // PAGE] * PAGE + pos % PAGE).to(torch.int32)
    idx[pos.unsqueeze(0) >= torch.tensor(lens).unsqueeze(1)] = -1
    idx = idx.view(3, 1, topk).cuda()
    q = torch.randn(3, 1, 32, 576, generator=g).to(torch.bfloat16).cuda()
    seq = torch.tensor(lens, dtype=torch.int32).cuda()
    out, lse = nan_outputs(q)
    dense, dense_lse = ops.mla_decode(q, cache, table, seq, ops.plan_decode(seq, 1, 32), 0.04,
                                      out=out, lse=lse)
    plan = ops.plan_sparse_decode(3, 1, 32, topk, device="cuda")
    got, lse = _run_decode(q, cache, idx, plan, 0.04)
    keys = torch.tensor(lens).view(3, 1)
    assert_rows_close(got, dense, 4e-3, "sparse vs dense kernel out", keys)
    assert_lse_close(lse, dense_lse, 1e-3, "sparse vs dense kernel lse", keys)
    _compare(got, lse, q, cache, idx, 0.04, None, "dense-equivalent indices")


# fp8_ds_mla 128: the paired (2-CTA cluster) launch; bf16 16: the kernel with keys as the
# MMA's M dimension; bf16 128: the co-placed seesaw
@pytest.mark.parametrize("fmt, heads", [("fp8_ds_mla", 64), ("fp8_ds_mla", 128), ("bf16", 16),
                                        ("bf16", 128)])
def test_cuda_graph_with_workspace(fmt, heads):
    """Plan + attention captured once over workspace buffers, replayed on new q, indices and
    lengths of two batch sizes in turn."""
    topk, num_blocks = 256, 20
    ws = ops.sparse_workspace(16, heads, device="cuda")
    cache = sparse_cache(num_blocks, torch.ones(num_blocks, PAGE, dtype=torch.bool), fmt,
                         case_gen("graph cache", fmt, heads)).cuda()
    graphs = {}
    for batch in (4, 16):
        st = {"q": torch.zeros(batch, 1, heads, 576, dtype=torch.bfloat16, device="cuda"),
              "idx": torch.full((batch, 1, topk), -1, dtype=torch.int32, device="cuda"),
              "len": torch.zeros(batch, dtype=torch.int32, device="cuda")}
        st["out"], st["lse"] = nan_outputs(st["q"])

        def step(batch=batch, st=st):
            plan = ops.plan_sparse_decode(batch, 1, heads, topk, topk_length=st["len"],
                                          workspace=ws)
            ops.sparse_mla_decode(st["q"], cache, st["idx"], plan, 0.06, out=st["out"],
                                  lse=st["lse"])

        graph, _ = capture_graph(step)
        graphs[batch] = (graph, st)
    for rnd in range(2):
        for batch, (graph, st) in graphs.items():
            g = case_gen("graph replay", fmt, heads, rnd, batch)
            st["q"].copy_(torch.randn(st["q"].shape, generator=g).to(torch.bfloat16))
            st["idx"].copy_(torch.randint(-1, num_blocks * PAGE, st["idx"].shape, generator=g,
                                          dtype=torch.int32))
            st["len"].copy_(torch.randint(0, topk + 1, (batch,), generator=g, dtype=torch.int32))
            st["out"].fill_(float("nan"))
            st["lse"].fill_(float("nan"))
            graph.replay()
            _compare(st["out"], st["lse"], st["q"], cache, st["idx"], 0.06, st["len"],
                     f"graph replay {rnd} batch {batch} {fmt} H {heads}")


def test_gpu_argument_errors():
    q, cache, idx, length = sparse_case(2, 1, 16, 64, "bf16", lengths=[64, 3],
                                        g=case_gen("argument errors"))
    plan = ops.plan_sparse_decode(2, 1, 16, 64, topk_length=length)
    with pytest.raises(TypeError, match="fp8_ds_mla"):
        ops.sparse_mla_decode(q, cache.view(torch.float8_e4m3fn)[..., :576], idx, plan, 0.1)
    with pytest.raises(ValueError, match="topk_length must be the tensor the plan"):
        ops.sparse_mla_decode(q, cache, idx, plan, 0.1, topk_length=length.clone())
    with pytest.raises(ValueError, match="plan is for batch 2, s_q 1, H 16, topk 64"):
        ops.sparse_mla_decode(q, cache, idx[..., :32], plan, 0.1)
    with pytest.raises(TypeError, match="q must be bfloat16"):
        ops.sparse_mla_decode(q.half(), cache, idx, plan, 0.1)
    with pytest.raises(ValueError, match="lse must be on a CUDA device"):
        ops.sparse_mla_decode(q, cache, idx, plan, 0.1, lse=torch.empty(2, 1, 16))
