"""sparse_mla_decode / sparse_mla_prefill with the query in two parts, (q_nope [.., 512],
q_pe [.., 64]), as vLLM's and SGLang's absorbed MLA path produce it: the kernels read the
latent part through one TMA tensor map and the rope part through another, each with its own
strides, so the result must equal, bit for bit, the same call on the joined [.., 576] query
(the same kernel, plan and keys), and match the float32 reference.

The parts come as vLLM 0.25 hands them (q_nope a transposed view of a [H, T, 512] bmm
output, heads outermost; q_pe the rope columns of a [T, H, 192] projection whose other
columns are NaN, so a read of the wrong columns shows), as two views of one [.., 576]
tensor, with a size-1 s_q of odd stride and a batch expanded from one row; a part the TMA
cannot read in place (2 bytes off 16-byte alignment, or a head stride that is no 16-byte
multiple) is joined by the op with one copy, and the result is again the joined call's.

Every sparse kernel, in small form: the 64-row kernel on a bf16 cache (one tile, two
co-placed tiles, the L2-prefetching producer of a cache above 65536 slots) and on fp8_ds_mla
(one tile, the paired 2-CTA launch), the narrow kernel (bf16, H <= 16); uniform and
topk_length plans, split, whole-request and more-groups-than-CTAs schedules; prefill over
flat and paged caches; a CUDA graph replayed on new values in the parts' buffers.
"""

import pytest
import torch

from mla_backend import ops
from mla_backend import reference as ref
from tests.helpers import (
    PAGE,
    SPARSE_OUT_TOL,
    assert_attention_close,
    capture_graph,
    case_gen,
    nan_outputs,
    sparse_cache,
    sparse_case,
    sparse_kernel_keys,
    sparse_row_keys,
)

pytestmark = pytest.mark.gpu
SCALE = 576 ** -0.5


def _slots(cache: torch.Tensor) -> int:
    return cache.shape[0] * cache.shape[1] if cache.dim() == 3 else cache.shape[0]


def _vllm_parts(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_nope, q_pe) of q [B, s_q, H, 576] (or [T, H, 576]) laid out as vLLM 0.25's
    forward_mqa gets them: q_nope the [T, H, 512] transpose of a [H, T, 512] buffer, q_pe
    columns 128.. of a [T, H, 192] buffer whose other columns are NaN."""
    lead, heads = q.shape[:-2], q.shape[-2]
    flat = q.reshape(-1, heads, ops.D_QK)
    nope_buf = flat[..., :ops.D_V].transpose(0, 1).contiguous()               # [H, T, 512]
    proj = torch.full((flat.shape[0], heads, 192), float("nan"), dtype=q.dtype,
                      device=q.device)
    proj[..., 128:] = flat[..., ops.D_V:]
    q_nope = nope_buf.transpose(0, 1).view(*lead, heads, ops.D_V)
    q_pe = proj[..., 128:].view(*lead, heads, ops.D_QK - ops.D_V)
    assert not q_pe.is_contiguous() and (heads == 1 or not q_nope.is_contiguous())
    assert ops.rows_in_place(q_nope) and ops.rows_in_place(q_pe)  # read in place, no copy
    return q_nope, q_pe


def _decode(q, cache, idx, plan, length=None):
    """sparse_mla_decode into NaN-poisoned caller-owned out and lse."""
    first = q[0] if isinstance(q, tuple) else q
    out, lse = nan_outputs(first)
    got, got_lse = ops.sparse_mla_decode(q, cache, idx, plan, SCALE, topk_length=length,
                                         out=out, lse=lse)
    assert got.data_ptr() == out.data_ptr() and got_lse.data_ptr() == lse.data_ptr()
    return got, got_lse


def _assert_same(got, lse, want, want_lse, what):
    assert torch.equal(got, want) and torch.equal(lse, want_lse), \
        f"{what}: differs from the call on the joined query"


def _check_pairs(q, cache, idx, plan, length, what, pairs):
    """Each pair's call equals the joined call bit for bit; the joined call matches the
    reference on the kernel's keys."""
    want, want_lse = _decode(q, cache, idx, plan, length)
    ref_out, ref_lse = ref.sparse_mla_decode(q, sparse_kernel_keys(cache), idx, None, SCALE,
                                             length)
    assert_attention_close(want, want_lse, ref_out, ref_lse, SPARSE_OUT_TOL, what,
                           keys=sparse_row_keys(idx, _slots(cache), length))
    for name, pair in pairs:
        kept = tuple(t.clone() for t in pair)
        got, lse = _decode(pair, cache, idx, plan, length)
        _assert_same(got, lse, want, want_lse, f"{what}, {name}")
        assert all(torch.equal(a, b) for a, b in zip(pair, kept, strict=True)), \
            f"{what}, {name}: the parts were modified"


HEADS = [1, 8, 16, 20, 32, 64, 100, 128]


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("s_q", [1, 2])
def test_decode_pair_equals_joined(fmt, heads, s_q):
    """Every kernel and tile shape: vLLM's layout and two views of one tensor; a plan from
    topk_length (ragged, one request empty) and a uniform plan."""
    g = case_gen("parts decode", fmt, heads, s_q)
    q, cache, idx, length = sparse_case(3, s_q, heads, 256, fmt, lengths=[256, 77, 0], g=g)
    pairs = [("vLLM layout", _vllm_parts(q)), ("views of one tensor", (q[..., :512], q[..., 512:]))]
    plan = ops.plan_sparse_decode(3, s_q, heads, 256, topk_length=length)
    what = f"pair decode {fmt} H {heads} s_q {s_q}"
    _check_pairs(q, cache, idx, plan, length, what + " topk_length", pairs)
    plan = ops.plan_sparse_decode(3, s_q, heads, 256, device="cuda", kv_cache_dtype=cache.dtype)
    _check_pairs(q, cache, idx, plan, None, what + " uniform", pairs)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("min_units", [3, 8, 16])
def test_decode_pair_under_split_and_whole_request_schedules(fmt, heads, min_units):
    """A uniform plan whose CTAs split requests at odd places (3 units), hold whole
    requests (8: no merge) or two requests (16)."""
    g = case_gen("parts schedules", fmt, heads)
    q, cache, idx, _ = sparse_case(8, 2, heads, 512, fmt, num_blocks=40, g=g)
    plan = ops.plan_sparse_decode(8, 2, heads, 512, device="cuda", _min_units_per_cta=min_units)
    _check_pairs(q, cache, idx, plan, None, f"pair schedule {min_units} {fmt} H {heads}",
                 [("vLLM layout", _vllm_parts(q))])


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("heads", [16, 128])
def test_decode_pair_more_groups_than_ctas(fmt, heads):
    """200 query groups with ragged lengths (some empty): groups split across CTAs and
    merged by the combine kernel."""
    g = case_gen("parts more groups", fmt, heads)
    lengths = torch.randint(0, 700, (100,), generator=g)
    lengths[::9] = 0
    q, cache, idx, length = sparse_case(100, 2, heads, 640, fmt, num_blocks=80,
                                        lengths=lengths.tolist(), g=g)
    plan = ops.plan_sparse_decode(100, 2, heads, 640, topk_length=length)
    assert plan.num_ctas < 200
    _check_pairs(q, cache, idx, plan, length, f"pair more groups {fmt} H {heads}",
                 [("vLLM layout", _vllm_parts(q))])


@pytest.mark.parametrize("heads", [32, 64])
def test_decode_pair_bf16_cache_larger_than_l2(heads):
    """A bf16 cache of 70400 slots: the producer that prefetches each fill's rows to L2
    (one row tile, 65536 slots or more)."""
    g = case_gen("parts larger than L2", heads)
    q, cache, idx, length = sparse_case(16, 1, heads, 2048, "bf16", num_blocks=1100,
                                        lengths=torch.randint(0, 2100, (16,), generator=g).tolist(),
                                        g=g)
    assert _slots(cache) >= 65536
    plan = ops.plan_sparse_decode(16, 1, heads, 2048, topk_length=length)
    _check_pairs(q, cache, idx, plan, length, f"pair larger than L2 H {heads}",
                 [("vLLM layout", _vllm_parts(q))])


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("heads", [20, 128])
def test_decode_pair_size_one_and_expanded_dims(fmt, heads):
    """Parts with a size-1 s_q of odd stride, and parts whose batch is expanded from one
    row (stride 0): the tensor maps step over neither by the reported stride."""
    g = case_gen("parts views", fmt, heads)
    q, cache, idx, length = sparse_case(3, 2, heads, 192, fmt, lengths=[192, 70, 0], g=g)
    nope_buf = torch.empty(3, 5, heads, 512, dtype=q.dtype, device="cuda")
    pe_buf = torch.empty(3, 7, heads, 64, dtype=q.dtype, device="cuda")
    one_token = (nope_buf[:, 2:3], pe_buf[:, 4:5])
    one_token[0].copy_(q[:, :1, :, :512])
    one_token[1].copy_(q[:, :1, :, 512:])
    idx1 = idx[:, :1].contiguous()
    plan = ops.plan_sparse_decode(3, 1, heads, 192, topk_length=length)
    _check_pairs(q[:, :1].contiguous(), cache, idx1, plan, length,
                 f"pair one token {fmt} H {heads}", [("size-1 s_q", one_token)])
    expanded = q[:1].expand(3, -1, -1, -1)
    pair = (expanded[..., :512], expanded[..., 512:])
    assert pair[0].stride(0) == 0 and pair[1].stride(0) == 0
    plan = ops.plan_sparse_decode(3, 2, heads, 192, topk_length=length)
    _check_pairs(expanded.contiguous(), cache, idx, plan, length,
                 f"pair expanded batch {fmt} H {heads}", [("expanded", pair)])


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """t's values in a view 2 bytes off 16-byte alignment."""
    spare = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = spare[1:].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16 == 2
    return view


def _odd_head_stride(t: torch.Tensor) -> torch.Tensor:
    """t's values in a view whose head stride is 4 elements wider (8 bytes: no 16-byte
    multiple)."""
    wide = torch.full(t.shape[:-1] + (t.shape[-1] + 4,), float("nan"), dtype=t.dtype,
                      device=t.device)
    view = wide[..., :t.shape[-1]]
    view.copy_(t)
    return view


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("heads", [16, 128])
def test_decode_parts_not_readable_in_place_are_joined(fmt, heads):
    """A part 2 bytes off 16-byte alignment, or with a head stride that is no 16-byte
    multiple, cannot be read by TMA: the op joins the two by one copy, the result is the
    joined call's."""
    g = case_gen("parts misaligned", fmt, heads)
    q, cache, idx, length = sparse_case(3, 2, heads, 256, fmt, lengths=[256, 77, 5], g=g)
    nope, pe = _vllm_parts(q)
    pairs = [("q_pe misaligned", (nope, _misaligned(pe))),
             ("q_nope misaligned", (_misaligned(nope), pe)),
             ("q_pe odd head stride", (nope, _odd_head_stride(pe))),
             ("q_nope odd head stride", (_odd_head_stride(nope), pe))]
    assert not any(ops.rows_in_place(a) and ops.rows_in_place(b) for _, (a, b) in pairs)
    plan = ops.plan_sparse_decode(3, 2, heads, 256, topk_length=length)
    _check_pairs(q, cache, idx, plan, length, f"pair not in place {fmt} H {heads}", pairs)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("heads", [1, 16, 64, 128])
def test_prefill_pair_equals_joined(fmt, heads):
    """sparse_mla_prefill over a flat and a paged cache: the pair in vLLM's layout, and a
    misaligned pair (joined), give the joined query's result."""
    g = case_gen("parts prefill", fmt, heads)
    tokens, topk = 200, 1024
    q, cache, idx, _ = sparse_case(tokens, 1, heads, topk, fmt, num_blocks=40, g=g)
    length = torch.randint(0, topk + 50, (tokens,), generator=g, dtype=torch.int32).cuda()
    q2, idx2 = q[:, 0], idx[:, 0]
    flat = cache.reshape(-1, cache.shape[-1])
    nope, pe = _vllm_parts(q2)
    want_ref, want_ref_lse = ref.sparse_mla_prefill(q2, sparse_kernel_keys(flat), idx2, SCALE,
                                                    length)
    for name, kv in (("flat", flat), ("paged", cache)):
        want, want_lse = ops.sparse_mla_prefill(q2, kv, idx2, SCALE, length)
        what = f"pair prefill {name} {fmt} H {heads}"
        assert_attention_close(want, want_lse, want_ref, want_ref_lse, SPARSE_OUT_TOL, what,
                               keys=sparse_row_keys(idx2, flat.shape[0], length))
        for pair_name, pair in (("vLLM layout", (nope, pe)),
                                ("q_pe misaligned", (nope, _misaligned(pe)))):
            out, lse = nan_outputs(q2)
            got, got_lse = ops.sparse_mla_prefill(pair, kv, idx2, SCALE, length, out=out,
                                                  lse=lse)
            assert got.data_ptr() == out.data_ptr() and got.shape == (tokens, heads, 512)
            _assert_same(got, got_lse, want, want_lse, f"{what}, {pair_name}")


@pytest.mark.parametrize("fmt, heads", [("fp8_ds_mla", 64), ("fp8_ds_mla", 128), ("bf16", 16),
                                        ("bf16", 128)])
def test_cuda_graph_with_the_parts_buffers(fmt, heads):
    """Plan + attention captured once on the parts as views of fixed buffers (vLLM's bmm
    output and projection), replayed after new values are written into those buffers: each
    replay equals an eager call on the joined query."""
    tokens, topk = 12, 256
    g = case_gen("parts graph", fmt, heads)
    # every slot holds a key (random indices may name any)
    cache = sparse_cache(20, torch.ones(20, PAGE, dtype=torch.bool), fmt, g).cuda()
    nope_buf = torch.zeros(heads, tokens, 512, dtype=torch.bfloat16, device="cuda")
    proj = torch.zeros(tokens, heads, 192, dtype=torch.bfloat16, device="cuda")
    pair = (nope_buf.transpose(0, 1).unsqueeze(1), proj[..., 128:].unsqueeze(1))
    idx = torch.full((tokens, 1, topk), -1, dtype=torch.int32, device="cuda")
    length = torch.zeros(tokens, dtype=torch.int32, device="cuda")
    ws = ops.sparse_workspace(tokens, heads, device="cuda")
    out, lse = nan_outputs(pair[0])

    def step():
        plan = ops.plan_sparse_decode(tokens, 1, heads, topk, topk_length=length, workspace=ws)
        ops.sparse_mla_decode(pair, cache, idx, plan, SCALE, out=out, lse=lse)

    graph, _ = capture_graph(step)
    for rnd in range(2):
        r = case_gen("parts graph replay", fmt, heads, rnd)
        q = torch.randn(tokens, 1, heads, 576, generator=r).to(torch.bfloat16).cuda()
        nope_buf.copy_(q[:, 0, :, :512].transpose(0, 1))
        proj.copy_(torch.randn(tokens, heads, 192, generator=r).to(torch.bfloat16))
        proj[..., 128:] = q[:, 0, :, 512:]
        idx.copy_(torch.randint(-1, cache.shape[0] * PAGE, idx.shape, generator=r,
                                dtype=torch.int32))
        length.copy_(torch.randint(0, topk + 1, (tokens,), generator=r, dtype=torch.int32))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        plan = ops.plan_sparse_decode(tokens, 1, heads, topk, topk_length=length)
        want, want_lse = _decode(q, cache, idx, plan, length)
        _assert_same(out, lse, want, want_lse, f"graph replay {rnd} {fmt} H {heads}")


def test_pair_argument_errors_on_the_gpu():
    q, cache, idx, length = sparse_case(2, 1, 16, 64, "bf16", lengths=[64, 3],
                                        g=case_gen("parts errors"))
    plan = ops.plan_sparse_decode(2, 1, 16, 64, topk_length=length)
    nope, pe = _vllm_parts(q)
    with pytest.raises(ValueError, match=r"q_pe \(q\[1\]\) is on cpu but q_nope is on cuda"):
        ops.sparse_mla_decode((nope, pe.cpu()), cache, idx, plan, 0.1)
    with pytest.raises(TypeError, match=r"q_nope \(q\[0\]\) must be bfloat16 for the sparse "
                                        r"kernels; got shape \(2, 1, 16, 512\) dtype "
                                        r"torch.float16"):
        ops.sparse_mla_decode((nope.half(), pe.half()), cache, idx, plan, 0.1)
    with pytest.raises(ValueError, match=r"q_pe \(q\[1\]\) must be q_nope's shape \(2, 1, 16\) "
                                         r"with a last dim of 64"):
        ops.sparse_mla_decode((nope, pe[:, :, :8]), cache, idx, plan, 0.1)
