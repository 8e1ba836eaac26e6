"""Negative controls for the gpu tier: the kernels, unchanged, called the wrong way from the
test, must be rejected by the tier's own comparison, tests.helpers.assert_attention_close
at the tolerances the positive tests use (DENSE_OUT_TOL, SPARSE_OUT_TOL, LSE_ATOL). Each
test first checks that the correct call passes (the case itself is sound), then that the
wrong one raises AssertionError: a weakened comparison (a whole-output error, lse not
compared, a wider tolerance) fails these tests.

The wrong variants:
- dense, ragged batch [1, 37, 700, 64, 2049, 128], H 16 and 128:
  - the 2049-key request's last 33 keys dropped (its length given as 2016): the
    whole-output rel L2 stays under the tolerance, the per-row check does not;
  - the 700-key request's last block-table entry (60 keys) pointing at a page of the
    2049-key request;
  - the softmax scale off by 1%;
- dense, one 40000-key request that the plan spreads over every CTA: one split left out,
  the pages of one middle CTA's share pointing at the request's first page;
- per-tensor fp8 cache at s_q 1 and 8: the kv scale applied twice (kv_scale ** 2);
- sparse decode (bf16 and fp8_ds_mla) and sparse prefill: one valid index per query row
  set to -1 (the last one inside topk_length: a dropped key); the softmax scale off by 1%;
- fp8_ds_mla decode with wrong scales: each token's tile scales rotated by one tile, or
  squared.
"""

import pytest
import torch

from mla_backend import formats, ops
from mla_backend import reference as ref
from tests.helpers import (
    DENSE_OUT_TOL,
    PAGE,
    SPARSE_OUT_TOL,
    assert_attention_close,
    case_gen,
    case_seed,
    dense_row_keys,
    nan_outputs,
    paged_case,
    rel_l2,
    sparse_case,
    sparse_kernel_keys,
    sparse_row_keys,
)

pytestmark = pytest.mark.gpu
SCALE = 576 ** -0.5
RAGGED = [1, 37, 700, 64, 2049, 128]


# ---------------------------------------------------------------------------- dense

def _dense_case(lens, s_q, heads, tag, fp8=False):
    """paged_case on the GPU (a per-tensor fp8 copy of its cache with fp8) and kv_scale."""
    q, cache, table, seq = paged_case(lens, s_q, heads, device="cuda",
                                      seed=case_seed("negative", tag, lens, s_q, heads, fp8))
    kv_scale = None
    if fp8:
        kv_scale = float(cache.float().nan_to_num(0).abs().amax() / 448)
        cache = formats.quantize_fp8_per_tensor(cache, kv_scale)
    return q, cache, table, seq, kv_scale


def _dense_run(q, cache, table, seq, scale, kv_scale):
    fp8 = cache.dtype == torch.float8_e4m3fn
    plan = ops.plan_decode(seq, q.shape[1], q.shape[2],
                           kv_cache_dtype=torch.float8_e4m3fn if fp8 else None)
    out, lse = nan_outputs(q)
    return ops.mla_decode(q, cache, table, seq, plan, scale, kv_scale=kv_scale, out=out,
                          lse=lse)


def _dense_control(case, what, **wrong):
    """The correct call passes the comparison; the call with `wrong` (block_table, seq_lens,
    scale or kv_scale replaced) fails it. Returns the wrong call's out and the failure."""
    q, cache, table, seq, kv_scale = case
    right = {"block_table": table, "seq_lens": seq, "scale": SCALE, "kv_scale": kv_scale}
    want, want_lse = ref.mla_decode(q, cache, table, seq, None, SCALE, kv_scale=kv_scale)
    keys = dense_row_keys(seq, q.shape[1])
    tol = DENSE_OUT_TOL[q.dtype]
    got, lse = _dense_run(q, cache, table, seq, SCALE, kv_scale)
    assert_attention_close(got, lse, want, want_lse, tol, f"{what}: the correct call", keys=keys)
    args = right | wrong
    got, lse = _dense_run(q, cache, args["block_table"], args["seq_lens"], args["scale"],
                          args["kv_scale"])
    with pytest.raises(AssertionError) as failure:
        assert_attention_close(got, lse, want, want_lse, tol, what, keys=keys)
    return got, want, failure.value


@pytest.mark.parametrize("heads", [16, 128])
def test_dense_dropped_keys_of_the_longest_request(heads):
    case = _dense_case(RAGGED, 1, heads, "dropped keys")
    seq = case[3]
    short = seq.clone()
    short[4] -= 33  # its last page (1 key) and the last 32 keys of the page before
    got, want, failure = _dense_control(case, "2049-key request read as 2016", seq_lens=short)
    # the 1-key request holds most of the norm: a single whole-output number passes...
    assert rel_l2(got, want) < DENSE_OUT_TOL[torch.bfloat16], rel_l2(got, want)
    # ... the per-row check names the request
    assert "out: 1 of 6 rows over" in str(failure) and "(4, 0) (2049 keys)" in str(failure), \
        str(failure)


@pytest.mark.parametrize("heads", [16, 128])
def test_dense_last_page_read_from_another_request(heads):
    case = _dense_case(RAGGED, 1, heads, "wrong page")
    table = case[2]
    wrong = table.clone()
    wrong[2, 10] = table[4, 5]  # the 700-key request's last page (60 keys)
    _dense_control(case, "700-key request's last page from another request", block_table=wrong)


@pytest.mark.parametrize("heads", [16, 128])
def test_dense_one_split_left_out(heads):
    case = _dense_case([40000], 1, heads, "split")
    q, _, table, seq, _ = case
    plan = ops.plan_decode(seq, 1, heads)
    meta = plan.metadata.cpu().tolist()
    units, per_cta = meta[1], meta[-1]
    assert units >= 4 * per_cta, "the request must be split over several CTAs"
    cta = units // per_cta // 2
    tokens = per_cta * plan.unit_tokens
    first, last = cta * tokens // PAGE, ((cta + 1) * tokens - 1) // PAGE
    wrong = table.clone()
    wrong[0, first:last + 1] = table[0, 0]
    _dense_control(case, f"CTA {cta}'s share (pages {first}..{last}) read from page 0",
                   block_table=wrong)


@pytest.mark.parametrize("heads", [16, 128])
def test_dense_softmax_scale_off_by_one_percent(heads):
    _dense_control(_dense_case(RAGGED, 1, heads, "scale"), "softmax scale * 1.01",
                   scale=SCALE * 1.01)


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("s_q", [1, 8])
def test_fp8_kv_scale_applied_twice(s_q, heads):
    case = _dense_case(RAGGED, s_q, heads, "kv scale", fp8=True)
    kv_scale = case[4]
    _dense_control(case, f"kv_scale {kv_scale:.4g} squared", kv_scale=kv_scale ** 2)


# ---------------------------------------------------------------------------- sparse

def _drop_last_valid(idx, num_slots, length):
    """idx with its last valid entry (in range, inside topk_length) of every row set to -1."""
    j = torch.arange(idx.shape[-1], device=idx.device)
    valid = (idx >= 0) & (idx < num_slots)
    if length is not None:
        valid &= j < length.view((-1,) + (1,) * (idx.dim() - 1))
    last = torch.where(valid, j, -1).amax(-1, keepdim=True)
    assert (last >= 0).all(), "every row needs a valid entry to drop"
    return torch.where(j == last, -1, idx)


def _wrong_tile_scales(cache, how):
    """An fp8_ds_mla cache whose per-token tile scales are rotated by one tile or squared."""
    bad = cache.clone()
    scales = bad[..., 512:528].contiguous().view(torch.float32)
    wrong = scales.roll(1, -1) if how == "rotated" else scales * scales
    bad[..., 512:528] = wrong.contiguous().view(torch.uint8)
    return bad


def _sparse_case(fmt, heads, tag):
    return sparse_case(3, 2, heads, 512, fmt, lengths=[512, 77, 300],
                       g=case_gen("negative", tag, fmt, heads))


def _sparse_control(case, what, indices=None, scale=SCALE, cache=None):
    """The correct sparse_mla_decode passes; the one with wrong indices, scale or cache
    bytes fails."""
    q, right_cache, idx, length = case
    want, want_lse = ref.sparse_mla_decode(q, sparse_kernel_keys(right_cache), idx, None, SCALE,
                                           length)
    keys = sparse_row_keys(idx, right_cache.shape[0] * PAGE, length)

    def run(kv, ind, sc):
        plan = ops.plan_sparse_decode(q.shape[0], q.shape[1], q.shape[2], ind.shape[2],
                                      topk_length=length, kv_cache_dtype=kv.dtype)
        out, lse = nan_outputs(q)
        return ops.sparse_mla_decode(q, kv, ind, plan, sc, topk_length=length, out=out, lse=lse)

    got, lse = run(right_cache, idx, SCALE)
    assert_attention_close(got, lse, want, want_lse, SPARSE_OUT_TOL, f"{what}: the correct call",
                           keys=keys)
    got, lse = run(right_cache if cache is None else cache, idx if indices is None else indices,
                   scale)
    with pytest.raises(AssertionError):
        assert_attention_close(got, lse, want, want_lse, SPARSE_OUT_TOL, what, keys=keys)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("heads", [16, 128])
def test_sparse_one_dropped_key_per_row(fmt, heads):
    case = _sparse_case(fmt, heads, "dropped key")
    q, cache, idx, length = case
    _sparse_control(case, "last valid index of every row dropped",
                    indices=_drop_last_valid(idx, cache.shape[0] * PAGE, length))


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("heads", [16, 128])
def test_sparse_softmax_scale_off_by_one_percent(fmt, heads):
    _sparse_control(_sparse_case(fmt, heads, "scale"), "softmax scale * 1.01",
                    scale=SCALE * 1.01)


@pytest.mark.parametrize("how", ["rotated", "squared"])
@pytest.mark.parametrize("heads", [16, 128])
def test_fp8_ds_mla_wrong_tile_scales(how, heads):
    case = _sparse_case("fp8_ds_mla", heads, "tile scales")
    _sparse_control(case, f"tile scales {how}", cache=_wrong_tile_scales(case[1], how))


@pytest.mark.parametrize("heads", [16, 128])
def test_sparse_prefill_one_dropped_key_per_token(heads):
    g = case_gen("negative prefill", heads)
    tokens, topk = 64, 512
    q, cache, idx, _ = sparse_case(tokens, 1, heads, topk, "bf16", num_blocks=40, g=g)
    q, idx = q[:, 0], idx[:, 0]
    kv = cache.reshape(-1, 576)
    length = torch.randint(64, topk + 50, (tokens,), generator=g, dtype=torch.int32).cuda()
    want, want_lse = ref.sparse_mla_prefill(q, kv, idx, SCALE, length)
    keys = sparse_row_keys(idx, kv.shape[0], length)

    def run(ind):
        out, lse = nan_outputs(q)
        return ops.sparse_mla_prefill(q, kv, ind, SCALE, length, out=out, lse=lse)

    got, lse = run(idx)
    assert_attention_close(got, lse, want, want_lse, SPARSE_OUT_TOL,
                           "sparse prefill: the correct call", keys=keys)
    got, lse = run(_drop_last_valid(idx, kv.shape[0], length))
    with pytest.raises(AssertionError):
        assert_attention_close(got, lse, want, want_lse, SPARSE_OUT_TOL,
                               "sparse prefill, last valid index of every token dropped",
                               keys=keys)
