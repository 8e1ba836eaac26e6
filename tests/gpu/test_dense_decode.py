"""mla_decode on the GPU against the float32 reference: fresh random data each case,
poisoned outputs, NaN in unused pages, permuted block tables with garbage in unused
entries, ragged and zero lengths, strided cache views, every head count and s_q claimed.

Tolerances (stated in docs/kernels/dense_decode.md): the kernel reads the same bf16/fp16
inputs as the reference; its only roundings are P to the input dtype before PV and the
output to the input dtype. So rel L2(out) < 8e-3 for bf16 (8 mantissa bits: 2^-9 per
rounding) and < 2e-3 for fp16; lse (fp32 throughout) within 2e-3 absolute; rows with no
key exactly 0 and -inf.
"""

from itertools import pairwise

import pytest
import torch

from mla_backend import formats, ops
from mla_backend import reference as ref
from tests.helpers import capture_graph, e4m3_codes, paged_case, rel_l2

pytestmark = pytest.mark.gpu
TOL = {torch.bfloat16: 8e-3, torch.float16: 2e-3}
_seed = [1000]


def _fresh_seed():
    _seed[0] += 1
    return _seed[0]


def _check(lens, s_q, heads, dtype=torch.bfloat16, causal=True, strided=False, scale=None):
    q, cache, table, seq = paged_case(lens, s_q, heads, dtype=dtype, device="cuda",
                                      seed=_fresh_seed())
    if strided:  # the layer's slice of a cross-layer buffer [blocks, layers, 64, 576]
        big = torch.full((cache.shape[0], 3, 64, 576), float("nan"), dtype=dtype, device="cuda")
        big[:, 2] = cache
        cache = big[:, 2]
    scale = scale if scale is not None else 576 ** -0.5
    plan = ops.plan_decode(seq, s_q, heads)
    out = torch.full((len(lens), s_q, heads, 512), float("nan"), dtype=dtype, device="cuda")
    got, lse = ops.mla_decode(q, cache, table, seq, plan, scale, causal=causal, out=out)
    assert got.data_ptr() == out.data_ptr()
    want, want_lse = ref.mla_decode(q, cache, table, seq, None, scale, causal=causal)
    assert not got.isnan().any(), "unwritten or NaN output"
    assert rel_l2(got, want) < TOL[dtype], rel_l2(got, want)
    empty = torch.isinf(want_lse)
    assert torch.equal(torch.isinf(lse), empty) and bool((lse[empty] < 0).all())
    assert torch.all(got[empty] == 0)
    assert torch.allclose(lse[~empty], want_lse[~empty], atol=2e-3)
    return plan


HEADS = [1, 2, 5, 8, 16, 20, 32, 48, 64, 100, 128]


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("s_q", [1, 2, 4])
def test_heads_and_query_lengths(heads, s_q):
    _check([1, 37, 700, 64, 2049, 128], s_q, heads)


@pytest.mark.parametrize("s_q", [3, 5, 8])
@pytest.mark.parametrize("heads", [1, 16, 128])
def test_long_query_blocks(s_q, heads):
    _check([9, 300, 4, 1000], s_q, heads)


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


def _split_and_empty(plan) -> tuple[int, int]:
    """(requests split across CTAs, empty requests) of a plan (metadata P[0..B], U)."""
    meta = plan.metadata.cpu().tolist()
    P, U = meta[:-1], meta[-1]
    split = sum(1 for a, b in pairwise(P) if b > a and a // U != (b - 1) // U)
    return split, sum(1 for a, b in pairwise(P) if a == b)


@pytest.mark.parametrize("heads", [16, 128])
def test_more_requests_than_ctas_split_and_empty(heads):
    """More requests than CTAs: the combine takes split requests by the CTA they start in."""
    g = torch.Generator().manual_seed(_fresh_seed())
    lens = torch.randint(0, 1500, (300,), generator=g)
    lens[::7] = 0
    plan = _check(lens.tolist(), 1, heads)
    assert 300 > plan.num_ctas + 3  # the by-CTA combine grid is the smaller one
    split, empty = _split_and_empty(plan)
    assert split > 0 and empty > 0


def test_single_long_request_many_splits():
    plan = _check([40000], 1, 16)
    meta = plan.metadata.cpu()
    assert int(meta[-1]) * plan.num_ctas >= int(meta[-2]) > int(meta[-1])  # really split


def test_large_scale_sharp_softmax():
    _check([300, 2000], 1, 32, scale=0.5)


def test_planner_matches_python_twin():
    seq = torch.randint(0, 20000, (300,), generator=torch.Generator().manual_seed(8),
                        dtype=torch.int32)
    seq[::7] = 0
    for heads in (16, 128):
        plan = ops.plan_decode(seq.cuda(), 1, heads)
        min_units = -(-ops.MIN_TOKENS_PER_CTA // plan.unit_tokens)
        want = ref.plan_decode_metadata(seq, plan.num_ctas, min_units, plan.unit_tokens)
        assert torch.equal(plan.metadata.cpu(), want)


def test_plan_reused_by_several_layers_and_refilled_in_place():
    q, cache, table, seq = paged_case([100, 900, 3000], 1, 16, device="cuda", seed=_fresh_seed())
    plan = ops.plan_decode(seq, 1, 16)
    for layer in range(3):  # every layer of a step shares the plan and its scratch
        ql = q * (layer + 1)
        got, _ = ops.mla_decode(ql, cache, table, seq, plan, 0.05)
        want, _ = ref.mla_decode(ql, cache, table, seq, None, 0.05)
        assert rel_l2(got, want) < TOL[torch.bfloat16]
    # new lengths stay within each request's blocks (the caller's contract)
    seq2 = torch.tensor([64, 5, 2999], dtype=torch.int32, device="cuda")
    same = ops.plan_decode(seq2, 1, 16, out=plan)
    assert same is plan
    got, _ = ops.mla_decode(q, cache, table, seq2, plan, 0.05)
    want, _ = ref.mla_decode(q, cache, table, seq2, None, 0.05)
    assert rel_l2(got, want) < TOL[torch.bfloat16]


def test_cuda_graph_capture_and_replay_with_new_lengths():
    lens = [2000, 2000, 64, 64]  # block tables sized for the longest replay below
    q, cache, table, seq = paged_case(lens, 2, 16, device="cuda", seed=_fresh_seed())
    seq_buf = seq.clone()
    plan = ops.plan_decode(seq_buf, 2, 16)
    out = torch.empty(len(lens), 2, 16, 512, dtype=q.dtype, device="cuda")

    def step():
        ops.plan_decode(seq_buf, 2, 16, out=plan)
        return ops.mla_decode(q, cache, table, seq_buf, plan, 0.05, out=out)[1]

    graph, lse = capture_graph(step)
    for new in ([400, 1999, 0, 1], [2000, 2, 64, 30], [500, 2000, 64, 1]):
        seq_buf.copy_(torch.tensor(new, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        want, want_lse = ref.mla_decode(q, cache, table, seq_buf, None, 0.05)
        assert not out.isnan().any() and rel_l2(out, want) < TOL[torch.bfloat16]
        assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))


@pytest.mark.parametrize("kv_fp8", [False, True])
def test_workspace_plans_every_batch_and_s_q_and_graphs_share_it(kv_fp8):
    """One workspace serves plans of any batch <= max and s_q <= max (vLLM's builder keeps
    one per model); graphs captured at two batch sizes replay, alternating, against plans
    refilled into the same memory."""
    heads, dtype = 16, torch.bfloat16
    cache_dtype = torch.float8_e4m3fn if kv_fp8 else None
    ws = ops.decode_workspace(8, 4, heads, device="cuda", kv_cache_dtype=cache_dtype)
    kw = {"kv_scale": 0.5} if kv_fp8 else {}

    def case(lens, s_q):
        q, cache, table, seq = paged_case(lens, s_q, heads, dtype=dtype, device="cuda",
                                          seed=_fresh_seed())
        if kv_fp8:  # the reference dequantizes the same fp8 bytes with the same scale
            cache = formats.quantize_fp8_per_tensor(cache, 0.5)
        return q, cache, table, seq

    for lens, s_q in (([5, 3000, 0], 1), ([700] * 8, 4), ([1], 2), ([0, 64, 129, 4000], 3)):
        q, cache, table, seq = case(lens, s_q)
        plan = ops.plan_decode(seq, s_q, heads, kv_cache_dtype=cache_dtype, workspace=ws)
        assert plan.metadata.data_ptr() == ws.metadata.data_ptr()
        got, _ = ops.mla_decode(q, cache, table, seq, plan, 0.05, **kw)
        want, _ = ref.mla_decode(q, cache, table, seq, None, 0.05, **kw)
        assert rel_l2(got, want) < TOL[dtype]
    with pytest.raises(ValueError, match="workspace holds plans of batch <= 8, s_q <= 4"):
        ops.plan_decode(torch.zeros(9, dtype=torch.int32, device="cuda"), 1, heads,
                        kv_cache_dtype=cache_dtype, workspace=ws)

    graphs = {}
    for batch in (2, 6):
        q, cache, table, seq = case([3000] * batch, 1)
        out = torch.empty(batch, 1, heads, 512, dtype=dtype, device="cuda")

        def step(q=q, cache=cache, table=table, seq=seq, out=out):
            plan = ops.plan_decode(seq, 1, heads, kv_cache_dtype=cache_dtype, workspace=ws)
            ops.mla_decode(q, cache, table, seq, plan, 0.05, out=out, **kw)

        g, _ = capture_graph(step)
        graphs[batch] = (g, q, cache, table, seq, out)
    gen = torch.Generator().manual_seed(_fresh_seed())
    for batch in (6, 2, 6, 2):
        g, q, cache, table, seq, out = graphs[batch]
        seq.copy_(torch.randint(0, 3001, (batch,), generator=gen, dtype=torch.int32))
        out.fill_(float("nan"))
        g.replay()
        want, _ = ref.mla_decode(q, cache, table, seq, None, 0.05, **kw)
        assert not out.isnan().any() and rel_l2(out, want) < TOL[dtype]


def test_random_shapes_fuzz():
    g = torch.Generator().manual_seed(_fresh_seed())
    for _ in range(12):
        batch = int(torch.randint(1, 20, (1,), generator=g))
        heads = int(torch.randint(1, 129, (1,), generator=g))
        s_q = int(torch.randint(1, 9, (1,), generator=g))
        lens = torch.randint(0, 5000, (batch,), generator=g).tolist()
        _check(lens, s_q, heads)


# ---- per-tensor fp8 cache (576 bytes per token, value = e4m3 * kv_scale)

def _check_fp8(lens, s_q, heads, dtype=torch.bfloat16, scale_as_tensor=False, strided=False,
               population=None):
    q, cache16, table, seq = paged_case(lens, s_q, heads, dtype=dtype, device="cuda",
                                        seed=_fresh_seed())
    kv_scale = float(cache16.float().nan_to_num(0).abs().amax() / 448)
    cache = formats.quantize_fp8_per_tensor(cache16, kv_scale)  # NaN in unused slots stays NaN
    if population is not None:  # used tokens' bytes replaced by random codes of the population
        raw = cache.view(torch.uint8)
        used = ~((raw & 0x7F) == 0x7F).all(-1)
        g = torch.Generator().manual_seed(_fresh_seed())
        raw[used] = e4m3_codes(population, (int(used.sum()), 576), g).cuda()
        kv_scale = 0.01
    if strided:
        big = torch.zeros(cache.shape[0], 2, 64, 576, dtype=torch.float8_e4m3fn, device="cuda")
        big[:, 1] = cache
        cache = big[:, 1]
    scale_arg = torch.tensor([kv_scale], device="cuda") if scale_as_tensor else kv_scale
    plan = ops.plan_decode(seq, s_q, heads, kv_cache_dtype=torch.float8_e4m3fn)
    out = torch.full((len(lens), s_q, heads, 512), float("nan"), dtype=dtype, device="cuda")
    got, lse = ops.mla_decode(q, cache, table, seq, plan, 576 ** -0.5, kv_scale=scale_arg,
                              out=out)
    # the reference dequantizes the same fp8 bytes: the only extra rounding in the kernel is
    # the dequantized value to q's dtype, inside the bf16/fp16 tolerances
    want, want_lse = ref.mla_decode(q, cache, table, seq, None, 576 ** -0.5, kv_scale=kv_scale)
    assert not got.isnan().any()
    assert rel_l2(got, want) < TOL[dtype], rel_l2(got, want)
    empty = torch.isinf(want_lse)
    assert torch.equal(torch.isinf(lse), empty) and torch.all(got[empty] == 0)
    assert torch.allclose(lse[~empty], want_lse[~empty], atol=2e-3)


# rows = s_q * H <= 16: the mma.sync kernel; more: the wgmma kernel's fp8 producer
@pytest.mark.parametrize("heads", [1, 16, 20, 64, 128])
@pytest.mark.parametrize("s_q", [1, 2, 4])
def test_fp8_cache_heads_and_query_lengths(heads, s_q):
    _check_fp8([1, 37, 700, 0, 2049], s_q, heads)


@pytest.mark.parametrize("heads", [16, 64])
def test_fp8_cache_fp16_tensor_scale_strided(heads):
    _check_fp8([300, 5, 1500], 2, heads, dtype=torch.float16, scale_as_tensor=True, strided=True)


# every e4m3 code, subnormals alone and the largest binades alone: the kernels' conversion
# (convert_e4m3x16; a bit-level variant was tried, docs/kernels/sparse_decode.md, v5)
# against the float32 dequantization; a flushed subnormal or a wrong exponent is a wrong
# output, not a rounding
@pytest.mark.parametrize("population", ["every", "subnormal", "largest"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [8, 64])  # mma.sync and wgmma kernels
def test_fp8_cache_every_e4m3_code(population, dtype, heads):
    _check_fp8([700, 64, 5], 1, heads, dtype=dtype, population=population)


@pytest.mark.parametrize("heads", [8, 64])
def test_fp8_cache_nan_code_reaches_the_output(heads):
    """An e4m3 NaN (0x7F / 0xFF) in a token of request 1 makes request 1's rows NaN, as in
    the reference; request 0 is unaffected."""
    q, cache16, table, seq = paged_case([300, 200], 1, heads, device="cuda", seed=_fresh_seed())
    cache = formats.quantize_fp8_per_tensor(cache16, 0.02)
    cache.view(torch.uint8)[int(table[1, 1]), 7, 130] = 0xFF  # token 71 of request 1
    plan = ops.plan_decode(seq, 1, heads, kv_cache_dtype=torch.float8_e4m3fn)
    got, _ = ops.mla_decode(q, cache, table, seq, plan, 576 ** -0.5, kv_scale=0.02)
    want, _ = ref.mla_decode(q, cache, table, seq, None, 576 ** -0.5, kv_scale=0.02)
    assert want[1].isnan().all() and got[1].isnan().all()
    assert not got[0].isnan().any() and rel_l2(got[0], want[0]) < TOL[torch.bfloat16]


@pytest.mark.parametrize("heads", [8, 128])
def test_fp8_cache_one_long_request_many_splits_and_page_tails(heads):
    # one request split over every CTA, plus lengths ending 1 and 63 keys into a page
    _check_fp8([30001, 65, 127], 1, heads)


@pytest.mark.parametrize("heads", [16, 64])
def test_fp8_cache_cuda_graph(heads):
    from mla_backend import formats
    lens = [2000, 64, 900]
    q, cache16, table, seq = paged_case(lens, 1, heads, device="cuda", seed=_fresh_seed())
    cache = formats.quantize_fp8_per_tensor(cache16, 0.02)
    scale = torch.tensor([0.02], device="cuda")
    seq_buf = seq.clone()
    plan = ops.plan_decode(seq_buf, 1, heads, kv_cache_dtype=torch.float8_e4m3fn)
    out = torch.empty(3, 1, heads, 512, dtype=q.dtype, device="cuda")

    def step():
        ops.plan_decode(seq_buf, 1, heads, kv_cache_dtype=torch.float8_e4m3fn, out=plan)
        ops.mla_decode(q, cache, table, seq_buf, plan, 0.05, kv_scale=scale, out=out)

    graph, _ = capture_graph(step)
    for new in ([1999, 3, 900], [10, 64, 0]):
        seq_buf.copy_(torch.tensor(new, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        want, _ = ref.mla_decode(q, cache, table, seq_buf, None, 0.05, kv_scale=0.02)
        assert not out.isnan().any() and rel_l2(out, want) < TOL[torch.bfloat16]
