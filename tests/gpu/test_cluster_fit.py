"""Launches whose 2-CTA clusters do not all fit on the GPU at once (a GPU with fewer SMs, or
GPCs with odd SM counts, than the plan assumed) against the float32 reference.

A plan made for four times this GPU's SMs (num_sms) has four times the CTAs, so its pairs of
row tiles cannot all be resident together. The launchers then run every kernel without
clusters: sparse fp8_ds_mla at two or more row tiles, which shares each page's conversion
between two CTAs, falls back to its unpaired twin, and the kernels that cluster only for
placement (dense, both cache types, and sparse bf16) launch plain grids. Each case checks the
answer and, with the profiler, which kernel ran. The same shapes planned for this GPU run
paired, which the same check confirms, so the fallback case is not passing on the paired
kernel (on the H100 and the H200 every pair of a one-wave plan fits; a GPU where they do not
would fail that case, and would run those launches unpaired).
"""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from mla_backend import formats, ops
from mla_backend import reference as ref
from tests.helpers import (
    DENSE_OUT_TOL,
    SPARSE_OUT_TOL,
    assert_attention_close,
    case_gen,
    case_seed,
    dense_row_keys,
    nan_outputs,
    paged_case,
    sparse_case,
    sparse_kernel_keys,
    sparse_row_keys,
)

pytestmark = pytest.mark.gpu
SCALE = 576 ** -0.5


def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def _wgmma_launches(fn) -> list[str]:
    """The names of the wgmma decode kernels fn launches."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if "decode_wgmma_kernel" in e.name]


def _paired(names: list[str]) -> bool:
    """Whether the one wgmma kernel launched is a paired instantiation (its third template
    argument, kPaired)."""
    assert len(names) == 1, names
    args = names[0].split("decode_wgmma_kernel<", 1)[1].split(",")
    assert args[2].strip() in ("true", "false"), names[0]
    return args[2].strip() == "true"


@pytest.mark.parametrize("sms_factor,paired", [(1, True), (4, False)])
@pytest.mark.parametrize("kv_fp8", [False, True])
@pytest.mark.parametrize("heads,s_q", [(128, 1), (64, 2), (128, 2)])
def test_dense_pairs_that_do_not_fit_run_unpaired(heads, s_q, kv_fp8, sms_factor, paired):
    lens = [3000, 1, 0, 700, 4097, 64, 1500, 2049]
    q, cache16, table, seq = paged_case(lens, s_q, heads, device="cuda",
                                        seed=case_seed("cluster fit", lens, s_q, heads, kv_fp8))
    kv_scale = None
    cache = cache16
    if kv_fp8:
        kv_scale = float(cache16.float().nan_to_num(0).abs().amax() / 448)
        cache = formats.quantize_fp8_per_tensor(cache16, kv_scale)
    plan = ops.plan_decode(seq, s_q, heads, kv_cache_dtype=cache.dtype,
                           num_sms=_sms() * sms_factor)
    assert plan.rows_per_cta == 64 and plan.num_ctas == _sms() * sms_factor // (heads * s_q // 64)
    out, lse = nan_outputs(q)
    names = _wgmma_launches(lambda: ops.mla_decode(q, cache, table, seq, plan, SCALE, out=out,
                                                   lse=lse, kv_scale=kv_scale))
    what = f"H {heads} s_q {s_q} fp8 {kv_fp8} planned for {sms_factor}x the SMs"
    want, want_lse = ref.mla_decode(q, cache, table, seq, None, SCALE, kv_scale=kv_scale)
    assert_attention_close(out, lse, want, want_lse, DENSE_OUT_TOL[q.dtype], what,
                           keys=dense_row_keys(seq, s_q, True))
    # no dense kernel has a paired instantiation: both cache types cluster for placement only
    assert not _paired(names), what


@pytest.mark.parametrize("sms_factor,paired", [(1, True), (4, False)])
@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
def test_sparse_pairs_that_do_not_fit_run_unpaired(fmt, sms_factor, paired):
    batch, s_q, heads, topk = 6, 2, 128, 2048
    lengths = [0, 5, topk - 3, topk + 100, 33, topk]
    q, cache, idx, length = sparse_case(batch, s_q, heads, topk, fmt, clustered=True,
                                        lengths=lengths, num_blocks=80,
                                        g=case_gen("cluster fit", fmt, sms_factor))
    plan = ops.plan_sparse_decode(batch, s_q, heads, topk, topk_length=length, device="cuda",
                                  kv_cache_dtype=cache.dtype, num_sms=_sms() * sms_factor)
    out, lse = nan_outputs(q)
    names = _wgmma_launches(lambda: ops.sparse_mla_decode(q, cache, idx, plan, SCALE,
                                                          topk_length=length, out=out, lse=lse))
    slots = cache.shape[0] * cache.shape[1]
    want, want_lse = ref.sparse_mla_decode(q, sparse_kernel_keys(cache), idx, None, SCALE, length)
    what = f"sparse {fmt} H {heads} planned for {sms_factor}x the SMs"
    assert_attention_close(out, lse, want, want_lse, SPARSE_OUT_TOL, what,
                           keys=sparse_row_keys(idx, slots, length))
    assert _paired(names) == (paired and fmt == "fp8_ds_mla"), what
