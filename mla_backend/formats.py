"""KV-cache token formats: pack (quantize) and unpack (dequantize) in PyTorch.

fp8_ds_mla (DeepSeek-V3.2, 656 bytes per token), as vLLM 0.25's CUDA cache writer
(`concat_and_cache_mla(..., kv_cache_dtype="fp8_ds_mla")`, csrc/cache_kernels.cu) writes it:
  bytes [0, 512)    512 latent values in float8 e4m3, value i at byte i, stored as x / s_t
  bytes [512, 528)  4 little-endian float32 tile scales, s_t for latent tile t = [128t, 128t+128)
                    s_t = max(amax(|x| over the tile) / 448, FLT_MIN) (IEEE division in float32)
  bytes [528, 656)  64 rope values, the input bf16 bits unchanged
  quantization: float32 x / s_t (IEEE division), to e4m3 with round-to-nearest-even,
  saturating at +-448. The per-tensor k_scale does not enter this format.
How this was established, and the GPU test that compares bytes against vLLM's own writer:
docs/formats.md.

Per-tensor fp8 (vLLM's "fp8" / "fp8_e4m3" KV cache, 576 bytes per token): every value
stored as e4m3(x / scale) with one float32 scale for the whole cache; dequant x = q * scale.
"""

from __future__ import annotations

import torch

KV_LORA_RANK = 512
ROPE_DIM = 64
FP8_DS_MLA_TILE = 128
FP8_DS_MLA_NUM_TILES = KV_LORA_RANK // FP8_DS_MLA_TILE
FP8_DS_MLA_BYTES = KV_LORA_RANK + 4 * FP8_DS_MLA_NUM_TILES + 2 * ROPE_DIM  # 656
FP8_E4M3_MAX = 448.0
_FLT_MIN = torch.finfo(torch.float32).tiny

_SCALES_BEGIN = KV_LORA_RANK
_ROPE_BEGIN = KV_LORA_RANK + 4 * FP8_DS_MLA_NUM_TILES


def _check_last_dim(name: str, t: torch.Tensor, size: int, dtypes: tuple[torch.dtype, ...]):
    if t.shape[-1:] != (size,) or t.dtype not in dtypes:
        raise ValueError(f"{name} must have last dim {size} and dtype in "
                         f"{[str(d) for d in dtypes]}; got shape {tuple(t.shape)} dtype {t.dtype}")


def _to_e4m3_saturating(x: torch.Tensor) -> torch.Tensor:
    # torch's cast rounds to nearest even but does not saturate; clamp first (NaN stays NaN).
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_fp8_ds_mla(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """kv_c [..., 512] and k_pe [..., 64] (bf16) -> packed tokens [..., 656] uint8."""
    _check_last_dim("kv_c", kv_c, KV_LORA_RANK, (torch.bfloat16,))
    _check_last_dim("k_pe", k_pe, ROPE_DIM, (torch.bfloat16,))
    if kv_c.shape[:-1] != k_pe.shape[:-1]:
        raise ValueError(f"kv_c {tuple(kv_c.shape)} and k_pe {tuple(k_pe.shape)} must have the "
                         "same leading dims")
    lead = kv_c.shape[:-1]
    tiles = kv_c.float().reshape(*lead, FP8_DS_MLA_NUM_TILES, FP8_DS_MLA_TILE)
    # fmaxf in the CUDA writer ignores NaN; nan_to_num(nan=0) reproduces that for the amax.
    amax = torch.nan_to_num(tiles.abs(), nan=0.0).amax(dim=-1)
    # Divide by a tensor: a Python-scalar divisor may become a multiply by 1/448 on CUDA.
    scales = torch.clamp_min(amax / torch.full_like(amax, FP8_E4M3_MAX), _FLT_MIN)
    values = _to_e4m3_saturating(tiles / scales.unsqueeze(-1))
    packed = torch.empty(*lead, FP8_DS_MLA_BYTES, dtype=torch.uint8, device=kv_c.device)
    packed[..., :_SCALES_BEGIN] = values.reshape(*lead, KV_LORA_RANK).view(torch.uint8)
    packed[..., _SCALES_BEGIN:_ROPE_BEGIN] = scales.contiguous().view(torch.uint8).reshape(
        *lead, 4 * FP8_DS_MLA_NUM_TILES)
    packed[..., _ROPE_BEGIN:] = k_pe.contiguous().view(torch.uint8).reshape(*lead, 2 * ROPE_DIM)
    return packed


def unpack_fp8_ds_mla(packed: torch.Tensor):
    """packed [..., 656] uint8 -> (values [..., 512] e4m3, scales [..., 4] float32,
    rope [..., 64] bf16)."""
    _check_last_dim("packed", packed, FP8_DS_MLA_BYTES, (torch.uint8,))
    lead = packed.shape[:-1]
    flat = packed.reshape(-1, FP8_DS_MLA_BYTES)
    values = flat[:, :_SCALES_BEGIN].contiguous().view(torch.float8_e4m3fn)
    scales = flat[:, _SCALES_BEGIN:_ROPE_BEGIN].contiguous().view(torch.float32)
    rope = flat[:, _ROPE_BEGIN:].contiguous().view(torch.bfloat16)
    return (values.reshape(*lead, KV_LORA_RANK), scales.reshape(*lead, FP8_DS_MLA_NUM_TILES),
            rope.reshape(*lead, ROPE_DIM))


def dequantize_fp8_ds_mla(packed: torch.Tensor) -> torch.Tensor:
    """packed [..., 656] uint8 -> [..., 576] float32: e4m3 value * tile scale, then rope."""
    values, scales, rope = unpack_fp8_ds_mla(packed)
    lead = packed.shape[:-1]
    latent = values.float().reshape(*lead, FP8_DS_MLA_NUM_TILES, FP8_DS_MLA_TILE)
    latent = (latent * scales.unsqueeze(-1)).reshape(*lead, KV_LORA_RANK)
    return torch.cat([latent, rope.float()], dim=-1)


def quantize_fp8_per_tensor(kv: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """kv [..., D] float -> e4m3(kv / scale), saturating; the cache vLLM calls "fp8"."""
    scale_t = torch.as_tensor(scale, dtype=torch.float32, device=kv.device)
    return _to_e4m3_saturating(kv.float() / scale_t)


def dequantize_fp8_per_tensor(q: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """q [..., D] float8_e4m3fn -> float32 q * scale."""
    if q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"q must be float8_e4m3fn; got shape {tuple(q.shape)} dtype {q.dtype}")
    scale_t = torch.as_tensor(scale, dtype=torch.float32, device=q.device)
    return q.float() * scale_t
