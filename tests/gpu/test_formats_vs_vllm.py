"""fp8_ds_mla bytes from vLLM's own cache writer (torch.ops._C_cache_ops.concat_and_cache_mla,
kv_cache_dtype="fp8_ds_mla") read through formats: the layout (where the e4m3 values, the four
float32 tile scales and the bf16 rope sit) must be the one vLLM writes, on every vLLM release we
support. Needs the GPU and vLLM's compiled ops (on the GPU machine: the vLLM kit's parts 0 and 1,
or the vLLM 0.33 kit)."""

import inspect

import pytest
import torch

from mla_backend import formats as fmt

pytestmark = pytest.mark.gpu


def _vllm_ops():
    try:
        import vllm._C_stable_libtorch  # noqa: F401  registers torch.ops._C_cache_ops
        from vllm import _custom_ops as ops
    except ImportError as e:
        pytest.skip(f"vLLM's compiled ops are not installed here ({e})")
    return ops


def _written(tokens):
    """vLLM's writer on random rows spanning 7 decades (one tile all zero) at permuted slots."""
    ops = _vllm_ops()
    g = torch.Generator().manual_seed(tokens)
    mag = torch.logspace(-4, 3, tokens).unsqueeze(1)
    kv_c = (torch.randn(tokens, 512, generator=g) * mag).to(torch.bfloat16).cuda()
    kv_c[0, 128:256] = 0  # an all-zero tile
    k_pe = torch.randn(tokens, 64, generator=g).to(torch.bfloat16).cuda()
    num_blocks = -(-tokens // 64) + 2
    cache = torch.zeros(num_blocks, 64, 656, dtype=torch.uint8, device="cuda")
    slots = torch.randperm(num_blocks * 64, generator=g)[:tokens].cuda()
    torch.ops._C_cache_ops.concat_and_cache_mla(kv_c, k_pe, cache, slots, "fp8_ds_mla",
                                                torch.tensor(1.0, device="cuda"))
    return ops, kv_c, k_pe, cache, slots


def _writer_scales_like_ours() -> bool:
    """vLLM 0.25's writer stores each tile's amax / 448 as is (ours does the same); vLLM 0.33's
    stores a power of two no smaller than that (seen on the H100, 2026-11-26: 2^-13 for tiles
    whose amax / 448 is ~1e-6), which our kernels read as any other float32 scale."""
    import vllm
    return tuple(int(x) for x in vllm.__version__.split(".")[:2]) < (0, 33)


@pytest.mark.parametrize("tokens", [1, 64, 1000])
def test_fp8_ds_mla_bytes_of_vllm_writer(tokens):
    _, kv_c, k_pe, cache, slots = _written(tokens)
    theirs = cache.view(-1, 656)[slots]
    ours = fmt.quantize_fp8_ds_mla(kv_c, k_pe)
    if _writer_scales_like_ours():
        mismatch = (theirs != ours).any(-1)
        assert not mismatch.any(), f"{int(mismatch.sum())} of {tokens} tokens differ"
        return
    _, scales, rope = fmt.unpack_fp8_ds_mla(theirs)
    assert torch.equal(rope, k_pe), "rope bytes differ from the bf16 k_pe written"
    exponent = torch.log2(scales)
    assert torch.equal(exponent, exponent.round()), "scales are not powers of two"
    # Each value within one e4m3 rounding (3 mantissa bits: 2^-4 relative, 2^-10 of the scale
    # in the subnormal range) of the input: the layout read as written, nothing saturated.
    x = kv_c.float().reshape(tokens, 4, 128)
    deq = fmt.dequantize_fp8_ds_mla(theirs)[:, :512].reshape(tokens, 4, 128)
    bound = torch.maximum(x.abs() * 2.0**-4, scales.unsqueeze(-1) * 2.0**-10)
    assert ((deq - x).abs() <= bound).all(), "a value is further than one e4m3 rounding"


@pytest.mark.parametrize("tokens", [64, 1000])
def test_fp8_ds_mla_dequant_equals_vllm_upconvert(tokens):
    """formats.dequantize_fp8_ds_mla on the writer's bytes equals vLLM's own upconvert to bf16
    (cp_gather_and_upconvert_fp8_kv_cache), every row of the cache in block order."""
    ops, _, _, cache, _ = _written(tokens)
    rows = cache.shape[0] * 64
    table = torch.arange(cache.shape[0], dtype=torch.int32, device="cuda").unsqueeze(0)
    zero = torch.zeros(1, dtype=torch.int32, device="cuda")
    theirs = torch.full((rows, 576), float("nan"), dtype=torch.bfloat16, device="cuda")
    upconvert = ops.cp_gather_and_upconvert_fp8_kv_cache
    if "seq_lens" in inspect.signature(upconvert).parameters:  # vLLM 0.25
        upconvert(cache, theirs, table, torch.tensor([rows], dtype=torch.int32, device="cuda"),
                  zero, 1)
    else:  # vLLM 0.33 dropped seq_lens (dst's rows bound the gather) and added seq_starts
        upconvert(cache, theirs, table, zero, 1, zero)
    ours = fmt.dequantize_fp8_ds_mla(cache.view(rows, 656)).to(torch.bfloat16)
    assert torch.equal(theirs, ours)
