"""mla_decode on the inputs a serving engine hands it, against the float32 reference and
against itself:

- the query in two parts, as vLLM's absorbed MLA path produces it: q_nope a transposed view
  of a [H, T, 512] buffer (heads outermost) and q_pe the rope columns of a [T, H, 576]
  buffer whose other columns are NaN. The kernels read both through their strides, so the
  result must equal, bit for bit, the call on the joined tensor, and match the reference;
- a block table with entries outside the cache (a negative id, one past the last block)
  inside a request's used pages: the call must finish without a memory fault (a fault would
  take the serving process down), those requests' rows stay finite, and every other
  request's rows match the reference.

Every dense kernel: mma.sync and wgmma (rows = s_q * H <= 16 run on each in turn, the
few_rows_kernel fixture; more rows on wgmma), 16-bit and per-tensor fp8 caches.
"""

import pytest
import torch

from mla_backend import formats, ops
from mla_backend import reference as ref
from tests.helpers import (
    DENSE_OUT_TOL,
    assert_attention_close,
    case_seed,
    dense_row_keys,
    nan_outputs,
    paged_case,
)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("few_rows_kernel")]
SCALE = 576 ** -0.5
LENS = [700, 1, 64, 0, 2500, 129]


def _case(s_q, heads, dtype, kv_fp8, *key):
    q, cache, table, seq = paged_case(LENS, s_q, heads, dtype=dtype, device="cuda",
                                      seed=case_seed(s_q, heads, dtype, kv_fp8, *key))
    kv_scale = None
    if kv_fp8:
        kv_scale = float(cache.float().nan_to_num(0).abs().amax() / 448)
        cache = formats.quantize_fp8_per_tensor(cache, kv_scale)
    plan = ops.plan_decode(seq, s_q, heads, kv_cache_dtype=cache.dtype if kv_fp8 else None)
    return q, cache, table, seq, plan, kv_scale


def _vllm_parts(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_nope, q_pe) [B, s_q, H, 512 | 64] laid out as vLLM 0.25's forward_mqa gets them."""
    batch, s_q, heads, _ = q.shape
    tokens = batch * s_q
    flat = q.reshape(tokens, heads, ops.D_QK)
    nope_buf = flat[..., :ops.D_V].transpose(0, 1).contiguous()  # [H, T, 512]
    pe_buf = torch.full_like(flat, float("nan"))                  # [T, H, 576]
    pe_buf[..., ops.D_V:] = flat[..., ops.D_V:]
    q_nope = nope_buf.transpose(0, 1).view(batch, s_q, heads, ops.D_V)
    q_pe = pe_buf[..., ops.D_V:].view(batch, s_q, heads, ops.D_QK - ops.D_V)
    assert not q_nope.is_contiguous() and not q_pe.is_contiguous()
    return q_nope, q_pe


def _call(q, cache, table, seq, plan, kv_scale):
    out, lse = nan_outputs(q[0] if isinstance(q, tuple) else q)
    return ops.mla_decode(q, cache, table, seq, plan, SCALE, kv_scale=kv_scale, out=out,
                          lse=lse)


@pytest.mark.parametrize("kv_fp8", [False, True])
@pytest.mark.parametrize(("s_q", "heads", "dtype"), [
    (1, 16, torch.bfloat16), (2, 8, torch.float16), (1, 128, torch.bfloat16),
    (2, 64, torch.float16), (4, 128, torch.bfloat16)])
def test_query_in_two_strided_parts(s_q, heads, dtype, kv_fp8):
    q, cache, table, seq, plan, kv_scale = _case(s_q, heads, dtype, kv_fp8, "parts")
    whole, whole_lse = _call(q, cache, table, seq, plan, kv_scale)
    got, lse = _call(_vllm_parts(q), cache, table, seq, plan, kv_scale)
    what = f"two-part q s_q {s_q} H {heads} {dtype} fp8 {kv_fp8}"
    assert torch.equal(got, whole) and torch.equal(lse.nan_to_num(), whole_lse.nan_to_num()), \
        f"{what}: differs from the call on the joined query"
    want, want_lse = ref.mla_decode(q, cache, table, seq, None, SCALE, kv_scale=kv_scale)
    assert_attention_close(got, lse, want, want_lse, DENSE_OUT_TOL[dtype], what,
                           keys=dense_row_keys(seq, s_q))


@pytest.mark.parametrize("kv_fp8", [False, True])
@pytest.mark.parametrize(("s_q", "heads"), [(1, 16), (2, 8), (1, 64), (2, 128)])
def test_block_ids_outside_the_cache_do_not_fault(s_q, heads, kv_fp8):
    q, cache, table, seq, plan, kv_scale = _case(s_q, heads, torch.bfloat16, kv_fp8, "bad")
    bad = [0, 4]  # requests of 700 and 2500 keys: an entry inside their used pages is broken
    table = table.clone()
    table[0, 3] = -7
    table[4, 10] = cache.shape[0]
    table[4, 20] = 2**31 - 1
    got, lse = _call(q, cache, table, seq, plan, kv_scale)
    torch.cuda.synchronize()  # a memory fault surfaces here
    what = f"bad block ids s_q {s_q} H {heads} fp8 {kv_fp8}"
    assert torch.isfinite(got[bad].float()).all() and torch.isfinite(lse[bad]).all(), \
        f"{what}: the broken requests' rows are not finite"
    good = [b for b in range(len(LENS)) if b not in bad]
    want, want_lse = ref.mla_decode(q[good], cache, table[good], seq[good], None, SCALE,
                                    kv_scale=kv_scale)
    assert_attention_close(got[good], lse[good], want, want_lse,
                           DENSE_OUT_TOL[torch.bfloat16], what,
                           keys=dense_row_keys(seq[good], s_q))
