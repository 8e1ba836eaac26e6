"""SGLang's fp8 DSA cache writer against formats.py, byte for byte, on the GPU (its quantizer
is a Triton kernel: no CPU path). The 656-byte token our sparse kernel reads (docs/formats.md)
must be what DSATokenToKVPool.set_mla_kv_buffer writes for --kv-cache-dtype fp8_e4m3: the
512 e4m3 values, the 4 float32 tile scales, the 64 bf16 rope values, at the same bytes."""

import pytest
import torch
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

from mla_backend import formats

pytestmark = pytest.mark.gpu


def _pool():
    return DSATokenToKVPool(size=64 * 4, page_size=64, kv_lora_rank=512,
                            dtype=torch.float8_e4m3fn, qk_rope_head_dim=64, layer_num=1,
                            device="cuda", index_head_dim=128, enable_memory_saver=False,
                            kv_cache_dim=formats.FP8_DS_MLA_BYTES)


def _written(k_nope, k_rope, loc):
    pool = _pool()
    assert pool.dsa_kv_cache_store_fp8 and pool.kv_cache_dim == 656
    layer = type("Layer", (), {"layer_id": 0})()
    pool.set_mla_kv_buffer(layer, loc, k_nope.unsqueeze(1), k_rope.unsqueeze(1))
    return pool.kv_buffer[0].view(torch.uint8)[loc, 0]


def _exact_scale_keys(tokens, gen):
    """k_nope whose every 128-value tile has amax 448 * 2^e (e from -8 to 4, per tile): its
    scale amax / 448 = 2^e is exact however a kernel divides (IEEE or approximate), and so is
    x / 2^e, so the bytes depend on the layout and the e4m3 rounding alone."""
    tiles = torch.rand(tokens, 4, 128, device="cuda", generator=gen) * 2 - 1
    peak = torch.randint(0, 128, (tokens, 4, 1), device="cuda", generator=gen)
    sign = torch.where(torch.rand(tokens, 4, 1, device="cuda", generator=gen) < 0.5, -1.0, 1.0)
    tiles.scatter_(2, peak, sign)  # one value of magnitude 1 per tile: the amax
    exp = torch.randint(-8, 5, (tokens, 4, 1), device="cuda", generator=gen).float()
    return (tiles * 448.0 * torch.exp2(exp)).reshape(tokens, 512).to(torch.bfloat16)


def test_sglang_fp8_writer_matches_formats_byte_for_byte():
    gen = torch.Generator(device="cuda").manual_seed(7)
    tokens = 200
    k_nope = _exact_scale_keys(tokens, gen)
    k_rope = torch.randn(tokens, 64, device="cuda", generator=gen).to(torch.bfloat16)
    loc = torch.randperm(64 * 4, device="cuda", generator=gen)[:tokens] + 64
    sglang_bytes = _written(k_nope, k_rope, loc)
    ours = formats.quantize_fp8_ds_mla(k_nope, k_rope)
    # region by region first, so a failure says which part of the layout differs
    assert torch.equal(sglang_bytes[:, 528:], ours[:, 528:]), "rope bytes"
    assert torch.equal(sglang_bytes[:, 512:528], ours[:, 512:528]), "tile scales"
    mismatch = (sglang_bytes[:, :512] != ours[:, :512]).sum().item()
    assert mismatch == 0, f"{mismatch} of {tokens * 512} e4m3 value bytes differ"


def test_sglang_fp8_cache_dequantizes_to_its_input():
    # any keys (scales not powers of two, where a kernel's division may round differently):
    # the layout read back through formats.py gives the written keys within fp8 rounding
    gen = torch.Generator(device="cuda").manual_seed(8)
    k_nope = torch.randn(64, 512, device="cuda", generator=gen).to(torch.bfloat16)
    k_rope = torch.randn(64, 64, device="cuda", generator=gen).to(torch.bfloat16)
    loc = torch.arange(64, 128, device="cuda")
    keys = formats.dequantize_fp8_ds_mla(_written(k_nope, k_rope, loc))
    torch.testing.assert_close(keys[:, 512:], k_rope.float(), atol=0, rtol=0)
    torch.testing.assert_close(keys[:, :512], k_nope.float(), atol=0.02, rtol=0.07)
