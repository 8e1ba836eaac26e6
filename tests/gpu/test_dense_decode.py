"""mla_decode on the GPU against the float32 reference: random data per case (seeded from the
case's own parameters, so no case depends on which ran before it), NaN-poisoned caller-owned
out and lse before every call and every graph replay, NaN in unused pages, permuted block
tables with garbage in unused entries, ragged and zero lengths, strided cache views, every
s_q from 1 to 8 at H 1/16/64/128 in bf16 and fp16, the head counts claimed, CUDA graphs in
both dtypes, the per-tensor fp8 cache at every s_q.

Every comparison is tests.helpers.assert_attention_close, per row: each (request, query
token) row of out, its [H, 512], within a relative L2 of the reference's row, so an error in
one long request is not hidden by the norm of short ones; lse per element. Tolerances
(docs/kernels/dense_decode.md): the kernel reads the same bf16/fp16 inputs as the reference;
its only roundings are P to the input dtype before PV and the output to the input dtype. So
each row's rel L2(out) < 8e-3 for bf16 (8 mantissa bits: 2^-9 per rounding) and < 2e-3 for
fp16; lse (fp32 throughout) within 2e-3 absolute; heads with no key exactly 0 and -inf.
tests/gpu/test_negative_controls.py shows that this comparison fails on wrong variants.
"""

from itertools import pairwise
from unittest import mock

import pytest
import torch

from mla_backend import formats, ops
from mla_backend import reference as ref
from tests.helpers import (
    DENSE_OUT_TOL,
    assert_attention_close,
    capture_graph,
    case_gen,
    case_seed,
    dense_row_keys,
    e4m3_codes,
    nan_outputs,
    paged_case,
)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("few_rows_kernel")]
SCALE = 576 ** -0.5


def _name(lens, s_q, heads, dtype, **extra) -> str:
    """A short description of a case for failure messages."""
    lens = list(lens)
    shown = lens if len(lens) <= 8 else f"{len(lens)} requests up to {max(lens)}"
    more = "".join(f" {k} {v}" for k, v in extra.items() if v is not None)
    return f"mla_decode lens {shown} s_q {s_q} H {heads} {str(dtype).split('.')[-1]}{more}"


def _run(q, cache, table, seq, plan, scale, **kw):
    """mla_decode into NaN-poisoned caller-owned out and lse (returned as they are)."""
    out, lse = nan_outputs(q)
    got, got_lse = ops.mla_decode(q, cache, table, seq, plan, scale, out=out, lse=lse, **kw)
    assert got.data_ptr() == out.data_ptr() and got_lse.data_ptr() == lse.data_ptr()
    return got, got_lse


def _compare(got, lse, q, cache, table, seq, scale, what, causal=True, kv_scale=None):
    want, want_lse = ref.mla_decode(q, cache, table, seq, None, scale, causal=causal,
                                    kv_scale=kv_scale)
    assert_attention_close(got, lse, want, want_lse, DENSE_OUT_TOL[q.dtype], what,
                           keys=dense_row_keys(seq, q.shape[1], causal))


def _check(lens, s_q, heads, dtype=torch.bfloat16, causal=True, strided=False, scale=None):
    q, cache, table, seq = paged_case(lens, s_q, heads, dtype=dtype, device="cuda",
                                      seed=case_seed(lens, s_q, heads, dtype, causal, strided,
                                                     scale))
    if strided:  # the layer's slice of a cross-layer buffer [blocks, layers, 64, 576]
        big = torch.full((cache.shape[0], 3, 64, 576), float("nan"), dtype=dtype, device="cuda")
        big[:, 2] = cache
        cache = big[:, 2]
    scale = scale if scale is not None else SCALE
    plan = ops.plan_decode(seq, s_q, heads)
    got, lse = _run(q, cache, table, seq, plan, scale, causal=causal)
    _compare(got, lse, q, cache, table, seq, scale,
             _name(lens, s_q, heads, dtype, causal=causal, strided=strided or None),
             causal=causal)
    return plan


HEADS = [1, 2, 5, 8, 16, 20, 32, 48, 64, 100, 128]


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("s_q", [1, 2, 4])
def test_heads_and_query_lengths(heads, s_q):
    _check([1, 37, 700, 64, 2049, 128], s_q, heads)


# every s_q the kernels take, at few head counts (rows <= 16: both kernels, by the fixture) and
# many, both dtypes; requests of 4 and 1 keys have causal rows that see no key
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [1, 16, 64, 128])
@pytest.mark.parametrize("s_q", range(1, 9))
def test_every_query_length(s_q, heads, dtype):
    _check([9, 300, 4, 1000, 1, 2049], s_q, heads, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [16, 128])
def test_dtypes(dtype, heads):
    _check([555, 1, 0, 3000], 2, heads, dtype=dtype)


@pytest.mark.parametrize("causal", [True, False])
def test_non_causal_and_causal(causal):
    _check([5, 64, 65, 1000], 4, 16, causal=causal)


def test_zero_lengths_everywhere_and_mixed():
    _check([0, 0, 0], 1, 16)
    _check([0, 7, 0, 0, 3000, 0], 2, 64)


def test_strided_cache_view():
    _check([100, 2000, 3], 1, 16, strided=True)


def test_large_batch_and_long_context():
    lens = torch.randint(1, 9000, (64,), generator=torch.Generator().manual_seed(5)).tolist()
    _check(lens, 1, 16)
    _check(lens[:16], 2, 128)


def _knobs(plan) -> dict[str, int]:
    """The planner's arguments that ops.plan_decode passed for `plan` (the twin's keywords)."""
    ordered = plan.metadata.numel() == 2 * plan.batch + 2
    return ops.dense._planner_knobs(plan.rows, plan.rows_per_cta, plan.unit_tokens, plan.kv_fp8,
                                    ordered)


def _plan_parts(plan) -> tuple[list[int], int, list[int] | None]:
    """A plan's P[0..B], U and order of the requests (None: a plan without one)."""
    meta, batch = plan.metadata.cpu().tolist(), plan.batch
    return meta[:batch + 1], meta[batch + 1], meta[batch + 2:] if len(meta) > batch + 2 else None


def _split_and_empty(plan) -> tuple[int, int]:
    """(requests split across CTAs, empty requests) of a plan."""
    P, U, _ = _plan_parts(plan)
    split = sum(1 for a, b in pairwise(P) if b > a and a // U != (b - 1) // U)
    return split, sum(1 for a, b in pairwise(P) if a == b)


@pytest.mark.parametrize("heads", [16, 128])
def test_more_requests_than_ctas_split_and_empty(heads, monkeypatch):
    """More requests than CTAs: the combine takes split requests by the CTA they start in
    (the plan in the requests' order: a longest-first plan would split none)."""
    monkeypatch.setattr(ops.cost_model, "DENSE_LPT_EXTRA_UNITS", -1)
    lens = torch.randint(0, 1500, (300,), generator=case_gen("more requests", heads))
    lens[::7] = 0
    plan = _check(lens.tolist(), 1, heads)
    assert 300 > plan.num_ctas + 3  # the by-CTA combine grid is the smaller one
    split, empty = _split_and_empty(plan)
    assert split > 0 and empty > 0


# more requests than CTAs, lengths in [0.5, 1.5] x 1k: whole requests longest first, none split,
# read and written through the plan's order (empty requests at its end). Batches where the
# twin takes the order (at 300 requests on 132 CTAs, or 40 on 16, it would cost too many units)
@pytest.mark.parametrize("kv_fp8", [False, True])
@pytest.mark.parametrize("heads,s_q,batch", [(128, 1, 128), (64, 2, 130), (16, 1, 264), (128, 4, 48)])
def test_longest_first_plan_whole_requests_in_their_order(kv_fp8, heads, s_q, batch):
    lens = torch.randint(512, 1536, (batch,), generator=case_gen("longest first", heads, s_q, batch))
    lens[::11] = 0
    lens = lens.tolist()
    plan = _check_fp8(lens, s_q, heads) if kv_fp8 else _check(lens, s_q, heads)
    _, _, order = _plan_parts(plan)
    if plan.unit_tokens == 64 and batch > plan.num_ctas:
        assert order is not None and sorted(order) == list(range(batch))
        assert order != list(range(batch)), "the longest-first plan should be taken here"
        assert _split_and_empty(plan)[0] == 0
    else:  # the mma.sync kernel (the few_rows_kernel fixture)
        assert order is None


def test_longest_first_plan_under_cuda_graph_replays_with_new_lengths():
    """The order is part of the plan on the device: graph replays follow it as lengths change
    (128 requests of 0.5-1.5k keys on 66 CTAs: the twin takes the order in every replay)."""
    heads, batch = 128, 128
    ws = ops.decode_workspace(batch, 1, heads, device="cuda")
    q, cache, table, seq = paged_case([1536] * batch, 1, heads, device="cuda",
                                      seed=case_seed("longest first graph"))
    out, lse = nan_outputs(q)

    def step():
        plan = ops.plan_decode(seq, 1, heads, workspace=ws)
        ops.mla_decode(q, cache, table, seq, plan, SCALE, out=out, lse=lse)

    g, _ = capture_graph(step)
    gen = case_gen("longest first replays")
    orders = []
    for _ in range(3):
        lens = torch.randint(512, 1537, (batch,), generator=gen, dtype=torch.int32)
        lens[::13] = 0
        seq.copy_(lens)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        g.replay()
        _compare(out, lse, q, cache, table, seq, SCALE, f"longest-first graph lens {lens.tolist()}")
        plan = ws.plan_view(batch, 1)
        _, _, order = _plan_parts(plan)
        assert order is not None and order != list(range(batch)), "the order should be taken"
        want = ref.plan_decode_metadata(lens, plan.num_ctas, **_knobs(plan))
        assert plan.metadata.cpu().tolist() == want.tolist()
        orders.append(order)
    assert orders[0] != orders[1] != orders[2]  # each replay planned its own lengths


def test_single_long_request_many_splits():
    plan = _check([40000], 1, 16)
    meta = plan.metadata.cpu()
    assert int(meta[-1]) * plan.num_ctas >= int(meta[-2]) > int(meta[-1])  # really split


def _splits(plan) -> int:
    """CTAs holding a piece of the plan's requests (batch 1: the request's splits)."""
    meta = plan.metadata.cpu().tolist()
    return -(-meta[-2] // meta[-1])


# batch 1 at 16k keys: every CTA holds a split, whose partials (q's dtype, or float32 in a
# build with -DMLA_BACKEND_16BIT_PARTIALS=0: torch.ops.mla_backend.dense_partial_bytes())
# the combine merges; the same per-row tolerance in every build
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,s_q", [(16, 1), (64, 1), (64, 2), (128, 1), (128, 2)])
def test_batch_one_long_context_splits_over_many_ctas(heads, s_q, dtype):
    plan = _check([16384], s_q, heads, dtype=dtype)
    # 132 SMs: 86, 86, 64, 64 and 32 splits (one wave of CTAs, at most 88 for one request)
    assert _splits(plan) >= 24


@pytest.mark.parametrize("heads", [16, 64, 128])
def test_fp8_cache_batch_one_long_context_splits(heads):
    _check_fp8([16384], 1, heads)


def test_large_scale_sharp_softmax():
    _check([300, 2000], 1, 32, scale=0.5)


@pytest.mark.parametrize("seq", [
    torch.randint(0, 20000, (300,), generator=torch.Generator().manual_seed(8),
                  dtype=torch.int32).index_fill_(0, torch.arange(0, 300, 7), 0),
    torch.full((64,), 8192, dtype=torch.int32),   # equal lengths: whole requests at H 128
    torch.full((128,), 4096, dtype=torch.int32),
    torch.full((1500,), 1000, dtype=torch.int32),  # more requests than the block's 1024 threads
    torch.tensor([1190, 978, 0, 777, 1151, 5, 0], dtype=torch.int32),  # aligned (U = 2)
    torch.randint(0, 2000, (32,), generator=torch.Generator().manual_seed(3), dtype=torch.int32),
    torch.randint(0, 9000, (128,), generator=torch.Generator().manual_seed(4), dtype=torch.int32),
    torch.randint(0, 9000, (256,), generator=torch.Generator().manual_seed(5), dtype=torch.int32),
    torch.randint(0, 9000, (257,), generator=torch.Generator().manual_seed(6), dtype=torch.int32),
    torch.randint(512, 1536, (128,), generator=torch.Generator().manual_seed(7), dtype=torch.int32),
    torch.randint(0, 1536, (1024,), generator=torch.Generator().manual_seed(9), dtype=torch.int32),
    torch.tensor([1000], dtype=torch.int32),  # small steps: one page a CTA
    torch.tensor([700, 0, 600], dtype=torch.int32),
    torch.tensor([32768], dtype=torch.int32),  # one long request: at most 88 CTAs
    torch.tensor([65536, 1000, 1000, 1000], dtype=torch.int32),
], ids=["ragged", "equal-64x8k", "equal-128x4k", "equal-1500x1k", "aligned-7", "aligned-32",
        "padded-128", "padded-256", "packed-257", "longest-first-128", "longest-first-1024",
        "small-1", "small-3", "capped-1", "capped-4"])
def test_planner_matches_python_twin(seq):
    # fp8 at H 16: one row tile of the wgmma kernel (its own minimum work)
    for heads, kv_dtype in ((16, None), (128, None), (16, torch.float8_e4m3fn)):
        plan = ops.plan_decode(seq.cuda(), 1, heads, kv_cache_dtype=kv_dtype)
        ordered = plan.metadata.numel() == 2 * seq.shape[0] + 2
        assert ordered == ops.dense._ordered(seq.shape[0], plan.unit_tokens, plan.num_ctas)
        want = ref.plan_decode_metadata(seq, plan.num_ctas, **_knobs(plan))
        assert torch.equal(plan.metadata.cpu(), want)


# equal lengths: whole requests per CTA (no split, nothing merged) where the planner takes them
@pytest.mark.parametrize("heads,s_q,lens", [(128, 1, [4096] * 64), (128, 2, [2048] * 33),
                                            (64, 1, [3000] * 130), (16, 1, [1000] * 264)])
def test_equal_lengths_whole_requests(heads, s_q, lens):
    plan = _check(lens, s_q, heads)
    assert _split_and_empty(plan)[0] == 0, "equal lengths should leave no request split"


# request starts inside CTAs' ranges (packed, align -1: such a CTA runs two pieces) and on
# them (aligned: the pieces stop at each request's keys, the padding is computed by no CTA)
@pytest.mark.parametrize("align", [-1, 1])
@pytest.mark.parametrize("kv_fp8", [False, True])
@pytest.mark.parametrize("heads,s_q", [(16, 1), (128, 2)])
def test_request_starts_inside_ctas_and_on_them(align, kv_fp8, heads, s_q, monkeypatch):
    monkeypatch.setattr(ops.cost_model, "DENSE_ALIGN_EXTRA_UNITS", align)
    monkeypatch.setattr(ops.cost_model, "DENSE_RESTART_PAD_UNITS", -1)  # packed, not padded
    # two pages a CTA on every cache (fp8 at one row tile would take one: no start inside a CTA)
    monkeypatch.setattr(ops.cost_model, "MIN_TOKENS_PER_CTA_FP8_ONE_TILE", 128)
    lens = [1190, 978, 0, 777, 1151, 5, 4000, 63]
    plan = _check_fp8(lens, s_q, heads) if kv_fp8 else _check(lens, s_q, heads)
    meta = plan.metadata.cpu().tolist()
    P, U = meta[:-1], meta[-1]
    inside = [p for p in P[:-1] if p % U]
    # the mma.sync kernel (the few_rows_kernel fixture's other case) never takes aligned plans
    aligned = align == 1 and plan.unit_tokens == 64
    assert (inside == []) == aligned, f"starts {P} on U = {U}, align {align}"


# padded plans (no aligned plan fits): a request that ends inside a CTA is followed by padding
# in that CTA, so the next request starts inside it after a gap the kernels skip
@pytest.mark.parametrize("kv_fp8", [False, True])
@pytest.mark.parametrize("heads,s_q", [(16, 2), (128, 1)])
def test_padded_plan_gaps_inside_ctas(kv_fp8, heads, s_q):
    g = torch.Generator().manual_seed(case_seed(f"padded {heads} {s_q}"))
    lens = torch.randint(1500, 6500, (40,), generator=g).tolist()
    plan = _check_fp8(lens, s_q, heads) if kv_fp8 else _check(lens, s_q, heads)
    meta = plan.metadata.cpu().tolist()
    P, U = meta[:-1], meta[-1]
    units = [-(-n // 64) for n in lens]
    gaps = [P[r + 1] - P[r] - units[r] for r in range(len(lens))]
    assert plan.unit_tokens == 64 and max(gaps) > 0, f"no padding in {P} on U = {U}"
    assert all(0 <= gp <= ops.cost_model.DENSE_RESTART_PAD_UNITS for gp in gaps)
    assert any(p % U for p in P[1:-1]), f"no request starts inside a CTA in {P} on U = {U}"
    want = ref.plan_decode_metadata(torch.tensor(lens, dtype=torch.int32), plan.num_ctas,
                                    **_knobs(plan))
    assert meta == want.tolist()


def test_plan_reused_by_several_layers_and_refilled_in_place():
    q, cache, table, seq = paged_case([100, 900, 3000], 1, 16, device="cuda",
                                      seed=case_seed("plan reused"))
    plan = ops.plan_decode(seq, 1, 16)
    for layer in range(3):  # every layer of a step shares the plan and its scratch
        ql = q * (layer + 1)
        got, lse = _run(ql, cache, table, seq, plan, 0.05)
        _compare(got, lse, ql, cache, table, seq, 0.05, f"layer {layer} sharing one plan")
    # new lengths stay within each request's blocks (the caller's contract)
    seq2 = torch.tensor([64, 5, 2999], dtype=torch.int32, device="cuda")
    same = ops.plan_decode(seq2, 1, 16, out=plan)
    assert same is plan
    got, lse = _run(q, cache, table, seq2, plan, 0.05)
    _compare(got, lse, q, cache, table, seq2, 0.05, "plan refilled in place")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_graph_capture_and_replay_with_new_lengths(dtype):
    lens = [2000, 2000, 64, 64]  # block tables sized for the longest replay below
    q, cache, table, seq = paged_case(lens, 2, 16, dtype=dtype, device="cuda",
                                      seed=case_seed("graph", dtype))
    seq_buf = seq.clone()
    plan = ops.plan_decode(seq_buf, 2, 16)
    out, lse = nan_outputs(q)

    def step():
        ops.plan_decode(seq_buf, 2, 16, out=plan)
        ops.mla_decode(q, cache, table, seq_buf, plan, 0.05, out=out, lse=lse)

    graph, _ = capture_graph(step)
    for new in ([400, 1999, 0, 1], [2000, 2, 64, 30], [500, 2000, 64, 1]):
        seq_buf.copy_(torch.tensor(new, dtype=torch.int32))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        _compare(out, lse, q, cache, table, seq_buf, 0.05, f"graph replay lens {new} {dtype}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_fp8", [False, True])
def test_workspace_plans_every_batch_and_s_q_and_graphs_share_it(kv_fp8, dtype):
    """One workspace serves plans of any batch <= max and s_q <= max (vLLM's builder keeps
    one per model); graphs captured at two batch sizes replay, alternating, against plans
    refilled into the same memory."""
    heads = 16
    cache_dtype = torch.float8_e4m3fn if kv_fp8 else None
    ws = ops.decode_workspace(8, 4, heads, device="cuda", kv_cache_dtype=cache_dtype)
    kw = {"kv_scale": 0.5} if kv_fp8 else {}

    def case(lens, s_q):
        q, cache, table, seq = paged_case(lens, s_q, heads, dtype=dtype, device="cuda",
                                          seed=case_seed("workspace", lens, s_q, kv_fp8, dtype))
        if kv_fp8:  # the reference dequantizes the same fp8 bytes with the same scale
            cache = formats.quantize_fp8_per_tensor(cache, 0.5)
        return q, cache, table, seq

    for lens, s_q in (([5, 3000, 0], 1), ([700] * 8, 4), ([1], 2), ([0, 64, 129, 4000], 3)):
        q, cache, table, seq = case(lens, s_q)
        plan = ops.plan_decode(seq, s_q, heads, kv_cache_dtype=cache_dtype, workspace=ws)
        assert plan.metadata.data_ptr() == ws.metadata.data_ptr()
        got, lse = _run(q, cache, table, seq, plan, 0.05, **kw)
        _compare(got, lse, q, cache, table, seq, 0.05, _name(lens, s_q, heads, dtype,
                 workspace=True, fp8=kv_fp8), **kw)
    with pytest.raises(ValueError, match="workspace holds plans of batch <= 8, s_q <= 4"):
        ops.plan_decode(torch.zeros(9, dtype=torch.int32, device="cuda"), 1, heads,
                        kv_cache_dtype=cache_dtype, workspace=ws)

    graphs = {}
    for batch in (2, 6):
        q, cache, table, seq = case([3000] * batch, 1)
        out, lse = nan_outputs(q)

        def step(q=q, cache=cache, table=table, seq=seq, out=out, lse=lse):
            plan = ops.plan_decode(seq, 1, heads, kv_cache_dtype=cache_dtype, workspace=ws)
            ops.mla_decode(q, cache, table, seq, plan, 0.05, out=out, lse=lse, **kw)

        g, _ = capture_graph(step)
        graphs[batch] = (g, q, cache, table, seq, out, lse)
    gen = case_gen("workspace replays", kv_fp8, dtype)
    for batch in (6, 2, 6, 2):
        g, q, cache, table, seq, out, lse = graphs[batch]
        seq.copy_(torch.randint(0, 3001, (batch,), generator=gen, dtype=torch.int32))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        g.replay()
        _compare(out, lse, q, cache, table, seq, 0.05,
                 f"workspace graph batch {batch} lens {seq.tolist()} fp8 {kv_fp8}", **kw)


def test_random_shapes_fuzz():
    """Random batch, H, s_q and lengths from a fixed seed, bf16 and fp16 in turn."""
    g = case_gen("fuzz")
    for i in range(12):
        batch = int(torch.randint(1, 20, (1,), generator=g))
        heads = int(torch.randint(1, 129, (1,), generator=g))
        s_q = int(torch.randint(1, 9, (1,), generator=g))
        lens = torch.randint(0, 5000, (batch,), generator=g).tolist()
        _check(lens, s_q, heads, dtype=(torch.bfloat16, torch.float16)[i % 2])


# ---- per-tensor fp8 cache (576 bytes per token, value = e4m3 * kv_scale)

def _check_fp8(lens, s_q, heads, dtype=torch.bfloat16, scale_as_tensor=False, strided=False,
               population=None):
    key = ("fp8", lens, s_q, heads, dtype, scale_as_tensor, strided, population)
    q, cache16, table, seq = paged_case(lens, s_q, heads, dtype=dtype, device="cuda",
                                        seed=case_seed(*key))
    kv_scale = float(cache16.float().nan_to_num(0).abs().amax() / 448)
    cache = formats.quantize_fp8_per_tensor(cache16, kv_scale)  # NaN in unused slots stays NaN
    if population is not None:  # used tokens' bytes replaced by random codes of the population
        raw = cache.view(torch.uint8)
        used = ~((raw & 0x7F) == 0x7F).all(-1)
        codes = e4m3_codes(population, (int(used.sum()), 576), case_gen("codes", *key))
        raw[used] = codes.cuda()
        # fp16 with e4m3 subnormals: scale 1, so that a long request's output (the mean of
        # many values ~2^-9 * scale) stays above fp16's own subnormals, whose fixed 2^-24
        # spacing would exceed the 2e-3 relative tolerance at scale 0.01 (not the
        # conversion under test)
        kv_scale = 1.0 if (population == "subnormal" and dtype == torch.float16) else 0.01
    if strided:
        big = torch.zeros(cache.shape[0], 2, 64, 576, dtype=torch.float8_e4m3fn, device="cuda")
        big[:, 1] = cache
        cache = big[:, 1]
    scale_arg = torch.tensor([kv_scale], device="cuda") if scale_as_tensor else kv_scale
    plan = ops.plan_decode(seq, s_q, heads, kv_cache_dtype=torch.float8_e4m3fn)
    # the wgmma kernel's two operand types (cost_model.FP8_FP16_OPERANDS_MIN_BATCH picks one
    # by the batch): the pages converted to q's type, and to fp16 with Q converted per piece
    for fp16_from in (None, 1):
        with mock.patch.object(ops.cost_model, "FP8_FP16_OPERANDS_MIN_BATCH", fp16_from):
            got, lse = _run(q, cache, table, seq, plan, SCALE, kv_scale=scale_arg)
        # the reference dequantizes the same fp8 bytes; the kernel converts them exactly (every
        # e4m3 value is a bf16 and an fp16; a bf16 q row scaled by a power of two is an fp16
        # row) and folds kv_scale into S and O in float32, so its roundings are those of a
        # 16-bit cache
        _compare(got, lse, q, cache, table, seq, SCALE,
                 _name(lens, s_q, heads, dtype, fp8_scale=kv_scale, population=population,
                       fp16_operands=fp16_from is not None),
                 kv_scale=kv_scale)
    return plan


# rows = s_q * H <= 16 on each kernel (the few_rows_kernel fixture): at this batch the
# library's rule takes the wgmma kernel for both cache dtypes, one 64-row tile, most of it
# padding rows that are never stored (the Q tensor maps' boxes run past the query tensor and
# read zeros there); the mma.sync kernel, 16-row tiles
@pytest.mark.parametrize("kv_fp8", [False, True])
@pytest.mark.parametrize("heads,s_q", [(1, 1), (1, 8), (2, 3), (2, 8), (8, 1), (8, 2), (16, 1),
                                       (4, 4), (5, 2)])
def test_few_rows_on_each_kernel(few_rows_kernel, heads, s_q, kv_fp8):
    lens = [1, 37, 700, 0, 2049, 64]
    plan = _check_fp8(lens, s_q, heads) if kv_fp8 else _check(lens, s_q, heads)
    assert plan.rows_per_cta == (16 if few_rows_kernel == "mma.sync" else 64)


# rows = s_q * H <= 16: either kernel (the few_rows_kernel fixture); more: the wgmma kernel,
# whose consumers convert each page's raw bytes in place, at 1, 2 (a 2-CTA cluster where the
# pairs fit), 4 and 8 row tiles
@pytest.mark.parametrize("heads", [1, 16, 20, 64, 128])
@pytest.mark.parametrize("s_q", range(1, 9))
def test_fp8_cache_heads_and_query_lengths(heads, s_q):
    _check_fp8([1, 37, 700, 0, 2049], s_q, heads)


# The mma.sync kernel and the wgmma kernel's fp16 tiles multiply fp16 operands over an fp8
# cache: a bf16 query row goes to fp16 scaled by a power of two of its own. Rows up to 1e11 apart and beyond fp16's range
# either way (1e5 and 3e4 * randn overflow fp16 unscaled, 1e-6 * randn is subnormal there),
# on each kernel; the cache is ~1e-5, so the large rows' logits are O(1) and their lse is
# within float32's reach of the 2e-3 tolerance.
@pytest.mark.parametrize("heads,s_q", [(16, 1), (8, 2), (128, 1)])
def test_fp8_cache_query_rows_far_apart_in_magnitude(heads, s_q):
    lens = [700, 37, 2049, 64]
    key = ("fp8 magnitudes", heads, s_q)
    q, cache16, table, seq = paged_case(lens, s_q, heads, device="cuda", seed=case_seed(*key))
    factors = torch.tensor([1e5, 3e4, 1e-6, 1e3], device="cuda")
    rows = q.shape[0] * s_q * heads
    q = (q.float() * factors.repeat(rows // 4 + 1)[:rows].view(*q.shape[:3], 1)).to(q.dtype)
    cache16 = cache16 * 1e-5
    kv_scale = float(cache16.float().nan_to_num(0).abs().amax() / 448)
    cache = formats.quantize_fp8_per_tensor(cache16, kv_scale)
    plan = ops.plan_decode(seq, s_q, heads, kv_cache_dtype=torch.float8_e4m3fn)
    got, lse = _run(q, cache, table, seq, plan, SCALE, kv_scale=kv_scale)
    _compare(got, lse, q, cache, table, seq, SCALE,
             _name(lens, s_q, heads, q.dtype, fp8_scale=kv_scale, rows="1e5/3e4/1e-6/1e3"),
             kv_scale=kv_scale)


@pytest.mark.parametrize("heads", [16, 64])
def test_fp8_cache_fp16_tensor_scale_strided(heads):
    _check_fp8([300, 5, 1500], 2, heads, dtype=torch.float16, scale_as_tensor=True, strided=True)


# every e4m3 code, subnormals alone and the largest binades alone: the kernels' conversion
# (convert_e4m3x16) against the float32 dequantization; a flushed subnormal or a wrong
# exponent is a wrong output, not a rounding
@pytest.mark.parametrize("population", ["every", "subnormal", "largest"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [8, 64, 128])  # few rows (either kernel), one tile, two tiles
def test_fp8_cache_every_e4m3_code(population, dtype, heads):
    _check_fp8([700, 64, 5], 1, heads, dtype=dtype, population=population)


@pytest.mark.parametrize("heads", [8, 64, 128])
def test_fp8_cache_nan_code_reaches_the_output(heads):
    """An e4m3 NaN (0x7F / 0xFF) in a token of request 1 makes request 1's rows NaN, as in
    the reference; request 0 is unaffected. out and lse are poisoned with +inf here, so a
    row left unwritten is not mistaken for a NaN row."""
    q, cache16, table, seq = paged_case([300, 200], 1, heads, device="cuda",
                                        seed=case_seed("fp8 nan", heads))
    cache = formats.quantize_fp8_per_tensor(cache16, 0.02)
    cache.view(torch.uint8)[int(table[1, 1]), 7, 130] = 0xFF  # token 71 of request 1
    plan = ops.plan_decode(seq, 1, heads, kv_cache_dtype=torch.float8_e4m3fn)
    out, lse = nan_outputs(q, fill=float("inf"))
    got, lse = ops.mla_decode(q, cache, table, seq, plan, SCALE, kv_scale=0.02, out=out,
                              lse=lse)
    want, want_lse = ref.mla_decode(q, cache, table, seq, None, SCALE, kv_scale=0.02)
    assert want[1].isnan().all() and got[1].isnan().all()
    assert not (lse[1] == float("inf")).any(), "lse of request 1 unwritten"
    assert_attention_close(got[:1], lse[:1], want[:1], want_lse[:1],
                           DENSE_OUT_TOL[torch.bfloat16], f"request 0 beside a NaN one, H {heads}",
                           keys=dense_row_keys(seq[:1], 1))


@pytest.mark.parametrize("heads", [8, 128])
def test_fp8_cache_one_long_request_many_splits_and_page_tails(heads):
    # one request split over every CTA, plus lengths ending 1 and 63 keys into a page
    _check_fp8([30001, 65, 127], 1, heads)


@pytest.mark.parametrize("fp16_from", [None, 1])  # the wgmma kernel's tiles: q's type, fp16
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [16, 64, 128])
def test_fp8_cache_cuda_graph(heads, dtype, fp16_from, monkeypatch):
    monkeypatch.setattr(ops.cost_model, "FP8_FP16_OPERANDS_MIN_BATCH", fp16_from)
    lens = [2000, 64, 900]
    q, cache16, table, seq = paged_case(lens, 1, heads, dtype=dtype, device="cuda",
                                        seed=case_seed("fp8 graph", heads, dtype))
    cache = formats.quantize_fp8_per_tensor(cache16, 0.02)
    scale = torch.tensor([0.02], device="cuda")
    seq_buf = seq.clone()
    plan = ops.plan_decode(seq_buf, 1, heads, kv_cache_dtype=torch.float8_e4m3fn)
    out, lse = nan_outputs(q)

    def step():
        ops.plan_decode(seq_buf, 1, heads, kv_cache_dtype=torch.float8_e4m3fn, out=plan)
        ops.mla_decode(q, cache, table, seq_buf, plan, 0.05, kv_scale=scale, out=out, lse=lse)

    graph, _ = capture_graph(step)
    for new in ([1999, 3, 900], [10, 64, 0]):
        seq_buf.copy_(torch.tensor(new, dtype=torch.int32))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        _compare(out, lse, q, cache, table, seq_buf, 0.05,
                 f"fp8 graph replay lens {new} H {heads} {dtype}", kv_scale=0.02)
