"""The gpu tier's comparison (tests.helpers.assert_attention_close and its parts) on CPU
tensors: it passes a correctly rounded output and fails on the errors it exists to catch,
among them the gpu negative controls' perturbations, simulated with the float32 reference
standing in for the kernel (its output rounded to bf16, as the kernel's is)."""

import pytest
import torch

from mla_backend import formats
from mla_backend import reference as ref
from tests.helpers import (
    DENSE_OUT_TOL,
    LSE_ATOL,
    PAGE,
    SPARSE_OUT_TOL,
    assert_attention_close,
    assert_lse_close,
    assert_rows_close,
    case_gen,
    case_seed,
    dense_row_keys,
    nan_outputs,
    paged_case,
    rel_l2,
    row_errors,
    sparse_case,
    sparse_kernel_keys,
    sparse_row_keys,
)

SCALE = 576 ** -0.5
RAGGED = [1, 37, 700, 64, 2049, 128]
TOL = DENSE_OUT_TOL[torch.bfloat16]


def _ragged(heads=16, s_q=1, tag="cpu"):
    q, cache, table, seq = paged_case(RAGGED, s_q, heads, seed=case_seed(tag, heads, s_q))
    want, want_lse = ref.mla_decode(q, cache, table, seq, None, SCALE)
    return (q, cache, table, seq), want, want_lse, dense_row_keys(seq, s_q)


def test_rounded_reference_passes():
    _, want, want_lse, keys = _ragged()
    got = want.to(torch.bfloat16)
    lse = want_lse + (torch.rand(want_lse.shape) - 0.5) * LSE_ATOL  # within atol
    assert_attention_close(got, lse, want, want_lse, TOL, "rounded", keys=keys)


def test_an_error_in_the_long_request_passes_whole_output_but_not_per_row():
    """The issue's case: a 15% error confined to the 2049-key request scores under 8e-3 in
    whole-output rel L2 (the 1-key request holds most of the norm)."""
    _, want, want_lse, keys = _ragged()
    noise = torch.randn(want[4].shape, generator=torch.Generator().manual_seed(1))
    got = want.clone()
    got[4] += 0.15 * want[4].norm() * noise / noise.norm()
    assert abs(float(row_errors(got, want)[4, 0]) - 0.15) < 1e-4
    assert rel_l2(got, want) < TOL
    with pytest.raises(AssertionError, match=r"out: 1 of 6 rows over rel L2 0.008; worst row "
                                             r"\(4, 0\) \(2049 keys\): rel L2 1.500e-01"):
        assert_attention_close(got.bfloat16(), want_lse, want, want_lse, TOL, keys=keys)


def test_nan_left_from_the_poison_fails():
    _, want, want_lse, keys = _ragged()
    got, lse = want.bfloat16(), want_lse.clone()
    got[2, 0, 3, 100] = float("nan")
    with pytest.raises(AssertionError, match=r"out has NaN .* first \(2, 0, 3\) \(700 keys\)"):
        assert_attention_close(got, lse, want, want_lse, TOL, keys=keys)
    with pytest.raises(AssertionError, match=r"1 of 6 rows over .*\(1 with NaN\)"):
        assert_rows_close(got, want, TOL)
    got = want.bfloat16()
    lse[5, 0, 7] = float("nan")
    with pytest.raises(AssertionError, match=r"lse: 1 of 96 elements .*NaN: 1"):
        assert_attention_close(got, lse, want, want_lse, TOL, keys=keys)


def test_lse_off_by_more_than_atol_fails_and_names_the_element():
    _, want, want_lse, keys = _ragged()
    lse = want_lse.clone()
    lse[3, 0, 9] += 1.5 * LSE_ATOL
    with pytest.raises(AssertionError, match=r"worst \(row, head\) \(3, 0, 9\) \(64 keys\)"):
        assert_lse_close(lse, want_lse, keys=keys)


def test_rows_without_keys_must_be_zero_and_minus_inf():
    q, cache, table, seq = paged_case([0, 2, 50], 4, 2, seed=3)
    want, want_lse = ref.mla_decode(q, cache, table, seq, None, SCALE)
    keys = dense_row_keys(seq, 4)
    assert keys.tolist() == [[0, 0, 0, 0], [0, 0, 1, 2], [47, 48, 49, 50]]
    got, lse = want.bfloat16(), want_lse.clone()
    assert_attention_close(got, lse, want, want_lse, TOL, keys=keys)
    bad = got.clone()
    bad[1, 0, 1, 0] = 1e-20
    with pytest.raises(AssertionError, match=r"not exactly 0 at \(row, head\) \(1, 0, 1\)"):
        assert_attention_close(bad, lse, want, want_lse, TOL, keys=keys)
    with pytest.raises(AssertionError, match=r"worst row \(1, 0\) \(0 keys\)"):
        assert_rows_close(bad, want, TOL, keys=keys)
    for wrong in (0.0, float("inf")):
        bad_lse = lse.clone()
        bad_lse[0, 2, 0] = wrong
        with pytest.raises(AssertionError, match="-inf mismatches: 1"):
            assert_lse_close(bad_lse, want_lse)
    bad_lse = lse.clone()
    bad_lse[2, 1, 1] = float("-inf")
    with pytest.raises(AssertionError, match="-inf mismatches: 1"):
        assert_lse_close(bad_lse, want_lse)


def test_nan_outputs_shapes():
    out, lse = nan_outputs(torch.zeros(3, 2, 5, 576, dtype=torch.float16))
    assert out.shape == (3, 2, 5, 512) and out.dtype == torch.float16 and out.isnan().all()
    assert lse.shape == (3, 2, 5) and lse.dtype == torch.float32 and lse.isnan().all()
    out, lse = nan_outputs(torch.zeros(7, 4, 576, dtype=torch.bfloat16), fill=float("inf"))
    assert out.shape == (7, 4, 512) and lse.shape == (7, 4) and torch.isinf(lse).all()


def test_sparse_row_keys():
    idx = torch.tensor([[[0, 5, -1, 99, 3]], [[1, 1, 1, 1, 1]]], dtype=torch.int32)
    assert sparse_row_keys(idx, 10).tolist() == [[3], [5]]
    length = torch.tensor([2, 4], dtype=torch.int32)
    assert sparse_row_keys(idx, 10, length).tolist() == [[2], [4]]
    assert sparse_row_keys(idx[:, 0], 10, length).tolist() == [2, 4]  # prefill rows


def test_case_seed_depends_on_the_case_only():
    assert case_seed("a", [1, 2], torch.bfloat16) == case_seed("a", [1, 2], torch.bfloat16)
    assert case_seed("a", [1, 2], torch.bfloat16) != case_seed("a", [1, 2], torch.float16)


# ---- the gpu negative controls, with the reference (rounded to bf16) as the kernel


def _dense_wrong(heads, how):
    (q, cache, table, seq), want, want_lse, keys = _ragged(heads, tag="control")
    scale, wrong_seq, wrong_table = SCALE, seq, table
    if how == "dropped keys":
        wrong_seq = seq.clone()
        wrong_seq[4] -= 33
    elif how == "wrong page":
        wrong_table = table.clone()
        wrong_table[2, 10] = table[4, 5]
    else:
        scale = SCALE * 1.01
    got, lse = ref.mla_decode(q, cache, wrong_table, wrong_seq, None, scale)
    return got.bfloat16(), lse, want, want_lse, keys


@pytest.mark.parametrize("how", ["dropped keys", "wrong page", "scale"])
@pytest.mark.parametrize("heads", [16, 128])
def test_dense_controls_fail(heads, how):
    got, lse, want, want_lse, keys = _dense_wrong(heads, how)
    with pytest.raises(AssertionError):
        assert_attention_close(got, lse, want, want_lse, TOL, how, keys=keys)
    if how == "dropped keys":  # the per-row out check alone catches it; one number does not
        assert rel_l2(got, want) < TOL
        with pytest.raises(AssertionError, match=r"\(4, 0\) \(2049 keys\)"):
            assert_rows_close(got, want, TOL, how, keys)


def test_fp8_kv_scale_twice_fails():
    q, cache16, table, seq = paged_case(RAGGED, 2, 16, seed=case_seed("fp8 control"))
    kv_scale = float(cache16.float().nan_to_num(0).abs().amax() / 448)
    cache = formats.quantize_fp8_per_tensor(cache16, kv_scale)
    want, want_lse = ref.mla_decode(q, cache, table, seq, None, SCALE, kv_scale=kv_scale)
    keys = dense_row_keys(seq, 2)
    got, lse = ref.mla_decode(q, cache, table, seq, None, SCALE, kv_scale=kv_scale)
    assert_attention_close(got.bfloat16(), lse, want, want_lse, TOL, keys=keys)
    got, lse = ref.mla_decode(q, cache, table, seq, None, SCALE, kv_scale=kv_scale ** 2)
    with pytest.raises(AssertionError):
        assert_attention_close(got.bfloat16(), lse, want, want_lse, TOL, keys=keys)


@pytest.mark.parametrize("how", ["dropped key", "scale", "rotated", "squared"])
@pytest.mark.parametrize("heads", [16, 128])
def test_sparse_controls_fail(heads, how):
    fmt = "fp8_ds_mla" if how in ("rotated", "squared") else "bf16"
    q, cache, idx, length = sparse_case(3, 2, heads, 512, fmt, lengths=[512, 77, 300],
                                        g=case_gen("sparse control", heads, how), device="cpu")
    slots = cache.shape[0] * PAGE
    keys = sparse_row_keys(idx, slots, length)
    want, want_lse = ref.sparse_mla_decode(q, sparse_kernel_keys(cache), idx, None, SCALE, length)
    got, lse = ref.sparse_mla_decode(q, sparse_kernel_keys(cache), idx, None, SCALE, length)
    assert_attention_close(got.bfloat16(), lse, want, want_lse, SPARSE_OUT_TOL, keys=keys)
    scale, wrong_idx, wrong_cache = SCALE, idx, cache
    if how == "dropped key":
        j = torch.arange(idx.shape[-1])
        valid = (idx >= 0) & (idx < slots) & (j < length.view(-1, 1, 1))
        last = torch.where(valid, j, -1).amax(-1, keepdim=True)
        wrong_idx = torch.where(j == last, -1, idx)
        assert ((wrong_idx != idx).sum(-1) == 1).all()
    elif how == "scale":
        scale = SCALE * 1.01
    else:
        wrong_cache = cache.clone()
        scales = wrong_cache[..., 512:528].contiguous().view(torch.float32)
        scales = scales.roll(1, -1) if how == "rotated" else scales * scales
        wrong_cache[..., 512:528] = scales.contiguous().view(torch.uint8)
    got, lse = ref.sparse_mla_decode(q, sparse_kernel_keys(wrong_cache), wrong_idx, None, scale,
                                     length)
    with pytest.raises(AssertionError):
        assert_attention_close(got.bfloat16(), lse, want, want_lse, SPARSE_OUT_TOL, how,
                               keys=keys)
