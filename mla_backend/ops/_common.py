"""What the dense and the sparse ops share: the shapes every kernel takes, the argument checks
(ValueError / TypeError naming the argument, its shape and dtype) and the output allocation."""

from __future__ import annotations

import math

import torch

D_QK = 576  # query / key width: 512 latent + 64 rope
D_V = 512  # output width: the latent part
PAGE_SIZE = 64  # tokens per cache block (vLLM's block_size)
MAX_HEADS = 128


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)} dtype {t.dtype} device {t.device}"


def _require_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    return t


def _require(cond: bool, name: str, t: torch.Tensor, what: str) -> None:
    if not cond:
        raise ValueError(f"{name} {what}; got {_describe(t)}")


def _query_parts(q: object) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A query as the kernels take it: one tensor of whole rows [..., 576], or the pair
    (q_nope [..., 512], q_pe [..., 64]) read through their own strides, with no copy."""
    if not isinstance(q, (tuple, list)):
        return _require_tensor("q", q), None
    if len(q) != 2:
        raise TypeError(f"q must be a tensor or a pair (q_nope, q_pe); got {len(q)} items")
    nope, pe = _require_tensor("q_nope (q[0])", q[0]), _require_tensor("q_pe (q[1])", q[1])
    _require(nope.dim() >= 1 and nope.shape[-1] == D_V, "q_nope (q[0])", nope,
             f"must have a last dim of {D_V}")
    _require(pe.shape[:-1] == nope.shape[:-1] and pe.shape[-1] == D_QK - D_V, "q_pe (q[1])", pe,
             f"must be q_nope's shape {tuple(nope.shape[:-1])} with a last dim of {D_QK - D_V}")
    if pe.dtype != nope.dtype:
        raise TypeError(f"q_pe (q[1]) must have q_nope's dtype {nope.dtype}; got {_describe(pe)}")
    if pe.device != nope.device:
        raise ValueError(f"q_pe (q[1]) is on {pe.device} but q_nope is on {nope.device}")
    return nope, pe


def rows_in_place(t: torch.Tensor) -> bool:
    """Whether the kernels' 16-byte loads can read t's rows where they lie: a contiguous last
    dim, a 16-byte aligned start and 16-byte multiple strides (16-bit elements)."""
    return (t.stride(-1) == 1 and all(t.stride(i) % 8 == 0 for i in range(t.dim() - 1))
            and t.data_ptr() % 16 == 0)


def _require_aligned_rows(name: str, t: torch.Tensor) -> None:
    _require(rows_in_place(t), name, t,
             "must be 16-byte aligned with a contiguous last dim and 16-byte aligned strides")


def _require_cuda(tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    for name, t in tensors.items():
        if t.device.type != "cuda":
            raise ValueError(f"{name} must be on a CUDA device; got {_describe(t)}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but q is on {device}")


def _require_hopper(op: str, device: torch.device) -> None:
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        raise RuntimeError(
            f"mla_backend.ops.{op} runs on Hopper GPUs (compute capability 9.x, sm_90a); "
            f"{torch.cuda.get_device_name(device)} is {major}.{minor}")


def _check_heads(num_heads) -> None:
    if not (isinstance(num_heads, int) and 1 <= num_heads <= MAX_HEADS):
        raise ValueError(f"num_heads must be an int in [1, {MAX_HEADS}]; got {num_heads!r}")


def _check_softmax_scale(softmax_scale) -> None:
    if not (isinstance(softmax_scale, (float, int)) and math.isfinite(softmax_scale)
            and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite float; got {softmax_scale!r}")


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_lse(lse: object, shape: tuple[int, ...]) -> torch.Tensor:
    """A caller-owned lse: contiguous float32 of `shape` (its device is checked with q's)."""
    lse = _require_tensor("lse", lse)
    dims = ", ".join(str(n) for n in shape)
    _require(tuple(lse.shape) == tuple(shape) and lse.dtype == torch.float32
             and lse.is_contiguous(), "lse", lse, f"must be contiguous torch.float32 [{dims}]")
    return lse


def _out_and_lse(q: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, s_q, H, 512] in q's dtype and lse [B, s_q, H] float32, for q
    [B, s_q, H, 576]: the caller's (already checked) or new."""
    batch, s_q, heads, _ = q.shape
    if out is None:
        out = torch.empty(batch, s_q, heads, D_V, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(batch, s_q, heads, dtype=torch.float32, device=q.device)
    return out, lse
