"""KV token formats: exact byte layout on hand-built tokens, round-trip error bounds."""

import struct

import pytest
import torch

from mla_backend import formats as fmt

FLT_MIN = torch.finfo(torch.float32).tiny


def _token(latent, rope):
    return (torch.tensor(latent, dtype=torch.float32).to(torch.bfloat16).view(1, 512),
            torch.tensor(rope, dtype=torch.float32).to(torch.bfloat16).view(1, 64))


def test_fp8_ds_mla_byte_layout_hand_built():
    latent = [0.0] * 512
    latent[0], latent[1], latent[2] = 448.0, -1.0, 0.5          # tile 0: amax 448 -> scale 1
    latent[128] = 896.0                                          # tile 1: scale 2
    latent[129] = -3.0                                           # 3 / 2 = 1.5 exactly
    latent[300] = 7.0                                            # tile 2: scale 7/448
    rope = [float(i) - 32.0 for i in range(64)]                  # tile 3 stays all zero
    packed = fmt.quantize_fp8_ds_mla(*_token(latent, rope))
    assert packed.shape == (1, 656) and packed.dtype == torch.uint8
    b = bytes(packed[0].tolist())
    # e4m3: 448 = 0x7E, -1 = 0xB8, 0.5 = 0x30, 1.5 = 0x3C, -1.5 = 0xBC
    assert b[0] == 0x7E and b[1] == 0xB8 and b[2] == 0x30 and b[3] == 0x00
    assert b[128] == 0x7E and b[129] == 0xBC
    assert b[300] == 0x7E                                        # 7 / (7/448) = 448
    scales = struct.unpack("<4f", b[512:528])
    assert scales[0] == 1.0 and scales[1] == 2.0
    assert scales[2] == struct.unpack("<f", struct.pack("<f", 7.0 / 448.0))[0]
    assert scales[3] == FLT_MIN                                  # all-zero tile
    rope_bits = struct.unpack("<64H", b[528:656])
    want = torch.tensor(rope, dtype=torch.float32).to(torch.bfloat16).view(torch.int16)
    assert list(rope_bits) == [int(x) & 0xFFFF for x in want.tolist()]


def test_fp8_ds_mla_scale_uses_true_division():
    # amax whose float32 quotient by 448 differs from amax * float32(1/448)
    amax = None
    for cand in torch.linspace(1.0, 3.0, 4001).to(torch.bfloat16).float():
        a = torch.tensor([float(cand)])
        if (a / torch.tensor([448.0])).item() != (a * torch.tensor([1.0 / 448.0])).item():
            amax = float(cand)
            break
    assert amax is not None
    latent = [0.0] * 512
    latent[0] = amax
    packed = fmt.quantize_fp8_ds_mla(*_token(latent, [0.0] * 64))
    scale = struct.unpack("<f", bytes(packed[0, 512:516].tolist()))[0]
    assert scale == (torch.tensor([amax]) / torch.tensor([448.0])).item()


def test_fp8_ds_mla_nan_does_not_poison_the_scale():
    latent = [1.0] * 512
    latent[5] = float("nan")
    packed = fmt.quantize_fp8_ds_mla(*_token(latent, [0.0] * 64))
    _, scales, _ = fmt.unpack_fp8_ds_mla(packed)
    assert scales[0, 0].item() == (torch.tensor([1.0]) / torch.tensor([448.0])).item()


def test_fp8_ds_mla_round_trip_error_bound():
    g = torch.Generator().manual_seed(0)
    kv_c = (torch.randn(257, 512, generator=g) * torch.logspace(-3, 2, 257).unsqueeze(1))
    kv_c = kv_c.to(torch.bfloat16)
    k_pe = torch.randn(257, 64, generator=g).to(torch.bfloat16)
    packed = fmt.quantize_fp8_ds_mla(kv_c, k_pe)
    back = fmt.dequantize_fp8_ds_mla(packed)
    assert back.shape == (257, 576) and back.dtype == torch.float32
    assert torch.equal(back[:, 512:], k_pe.float())              # rope is exact
    x = kv_c.float().view(257, 4, 128)
    scale = x.abs().amax(-1, keepdim=True) / 448.0
    err = (back[:, :512].view(257, 4, 128) - x).abs()
    # e4m3: 3 mantissa bits -> half an ulp is 2^-4 relative for normals; subnormal step 2^-9
    bound = torch.maximum(x.abs() * 2.0 ** -4, scale * 2.0 ** -10) * 1.0001
    assert torch.all(err <= bound)
    assert (err > 0).any()                                       # it really is lossy


def test_fp8_ds_mla_batched_shape_and_errors():
    kv_c = torch.randn(2, 3, 512).to(torch.bfloat16)
    k_pe = torch.randn(2, 3, 64).to(torch.bfloat16)
    assert fmt.quantize_fp8_ds_mla(kv_c, k_pe).shape == (2, 3, 656)
    with pytest.raises(ValueError, match=r"kv_c must have last dim 512.*float32"):
        fmt.quantize_fp8_ds_mla(kv_c.float(), k_pe)
    with pytest.raises(ValueError, match=r"k_pe must have last dim 64.*\(2, 3, 65\)"):
        fmt.quantize_fp8_ds_mla(kv_c, torch.randn(2, 3, 65).to(torch.bfloat16))
    with pytest.raises(ValueError, match="same leading dims"):
        fmt.quantize_fp8_ds_mla(kv_c, k_pe[:1])
    with pytest.raises(ValueError, match=r"packed must have last dim 656"):
        fmt.dequantize_fp8_ds_mla(torch.zeros(2, 576, dtype=torch.uint8))


def test_fp8_per_tensor_round_trip_and_saturation():
    x = torch.tensor([0.0, 1.0, -2.5, 1000.0, -1e6, 0.013])
    q = fmt.quantize_fp8_per_tensor(x, 0.5)
    assert q.dtype == torch.float8_e4m3fn
    back = fmt.dequantize_fp8_per_tensor(q, 0.5)
    assert back[0] == 0 and back[1] == 1.0 and back[2] == -2.5
    assert back[3] == 224.0 and back[4] == -224.0                # saturated at 448 * 0.5
    assert abs(back[5] - 0.013) <= 0.013 * 2 ** -4 + 0.5 * 2 ** -10
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fmt.dequantize_fp8_per_tensor(x, 1.0)
