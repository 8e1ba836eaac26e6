"""FlashMLA as vLLM 0.25 ships it (vllm.v1.attention.ops.flashmla): dense decode over a bf16
cache (FLASHMLA), dense decode over a per-tensor fp8 cache with an fp8 q (FLASHMLA with
kv_cache_dtype "fp8"), and sparse decode / prefill (FLASHMLA_SPARSE)."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from bench.common import Kernel, NotApplicable
from bench.dense_inputs import D_V, FP8_MAX, REL_L2_TOL, SCALE, Inputs, reference
from bench.sparse_inputs import D_QK, Case


def _require_flashmla_dense() -> None:
    from vllm.v1.attention.ops.flashmla import is_flashmla_dense_supported

    ok, why = is_flashmla_dense_supported()
    if not ok:
        raise NotApplicable(f"FlashMLA dense not supported here: {why}")


def build_dense(x: Inputs, args: argparse.Namespace) -> Kernel:
    """flash_mla_with_kvcache over the bf16 cache, a fresh schedule per call (its metadata
    kernel is timed: vLLM's first layer of a step runs it); step_premeta: one schedule per
    input set, filled by its first call."""
    from vllm.v1.attention.ops.flashmla import flash_mla_with_kvcache, get_mla_metadata

    _require_flashmla_dense()
    p = x.pool
    k_cache = p.cache.unsqueeze(-2)                       # [nb, 64, 1, 576]
    qs = [x.q4(i) for i in range(x.nsets)]                # reshape_query_for_spec_decode
    scheds = [get_mla_metadata()[0] for _ in range(x.nsets)]  # filled by their first call

    def call(i: int, sched: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return flash_mla_with_kvcache(q=qs[i], k_cache=k_cache, block_table=p.tables[i],
                                      cache_seqlens=p.seq_lens, head_dim_v=D_V,
                                      tile_scheduler_metadata=sched, softmax_scale=SCALE,
                                      causal=True, is_fp8_kvcache=False)

    def step(i: int) -> object:
        # A fresh (empty) schedule: this call runs FlashMLA's metadata kernel, as the first
        # layer of a vLLM step does; included in the timing like our planner.
        return call(i, get_mla_metadata()[0])

    def check() -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = step(0)                                # lse [B, H, s_q]
        return out, lse.transpose(1, 2)

    return Kernel(step=step, check=check, step_premeta=lambda i: call(i, scheds[i]))


def quantize_q_fp8(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q -> (float8_e4m3fn q / q_scale, q_scale [1] float32), q_scale = amax|q| / 448: a
    static per-tensor quantization like vLLM's MLA layer applies to the decode q
    (_DecodeConcatQuantFP8 with layer._q_scale) before FlashMLA's fp8 path."""
    from mla_backend import formats

    q_scale = (q.abs().amax().float() / FP8_MAX).reshape(1)
    return formats.quantize_fp8_per_tensor(q, q_scale).contiguous(), q_scale


def build_dense_fp8(x: Inputs, args: argparse.Namespace) -> Kernel:
    """FlashMLA's dense fp8 path as vLLM 0.25's FlashMLAImpl.forward_mqa calls it for
    kv_cache_dtype "fp8": fp8 q and cache, descale_q / descale_k [1] float32, metadata from
    get_mla_metadata_dense_fp8(seq_lens, s_q * H, 1) (FlashMLAMetadataBuilder)."""
    from vllm.v1.attention.ops.flashmla import (
        flash_mla_with_kvcache_fp8,
        get_mla_metadata_dense_fp8,
    )

    _require_flashmla_dense()
    p = x.pool
    k_cache = p.cache.unsqueeze(-2)                       # [nb, 64, 1, 576] e4m3
    if p.kv_scale_t is None:
        raise NotApplicable("FlashMLA's fp8 path needs an fp8 cache")
    descale_k = p.kv_scale_t.reshape(1)
    quant = [quantize_q_fp8(x.q4(i)) for i in range(x.nsets)]   # [B, s_q, H, 576] e4m3

    def metadata() -> tuple[torch.Tensor, torch.Tensor]:
        return get_mla_metadata_dense_fp8(p.seq_lens, x.s_q * x.H, 1)

    def call(i: int, meta: tuple[torch.Tensor, torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        tile_md, num_splits = meta
        q8, q_scale = quant[i]
        return flash_mla_with_kvcache_fp8(
            q=q8, k_cache=k_cache, block_table=p.tables[i], cache_seqlens=p.seq_lens,
            head_dim_v=D_V, tile_scheduler_metadata=tile_md, num_splits=num_splits,
            softmax_scale=SCALE, causal=True, descale_q=q_scale, descale_k=descale_k)

    def check() -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = call(0, metadata())                    # out [B, s_q, H, 512], lse [B, H, s_q]
        return out, lse.transpose(1, 2)

    def want() -> tuple[torch.Tensor, torch.Tensor]:
        q8, q_scale = quant[0]
        return reference(x, q=q8.float() * q_scale)       # its own q quantization included

    meta_once = metadata()
    tol = args.fp8_peer_tol if args.fp8_peer_tol != REL_L2_TOL else None
    # metadata per call: vLLM runs it once per step (FlashMLAMetadataBuilder), timed like ours
    return Kernel(step=lambda i: call(i, metadata()), check=check,
                  step_premeta=lambda i: call(i, meta_once), want=want, tol=tol)


def pad_heads(q: torch.Tensor, heads_dim: int) -> torch.Tensor:
    """Zero-pad the heads to 64 or 128, as vLLM's FlashMLA sparse backend does."""
    H = q.shape[heads_dim]
    target = 64 if H <= 64 else 128
    if H == target:
        return q
    shape = list(q.shape)
    shape[heads_dim] = target
    out = torch.zeros(shape, dtype=q.dtype, device=q.device)
    out.narrow(heads_dim, 0, H).copy_(q)
    return out


def build_sparse(c: Case) -> Kernel:
    """fp8_ds_mla decode: flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=) with a
    fresh schedule per call (vLLM builds one per step); a bf16 cache (decode) and prefill:
    flash_mla_sparse_fwd over the keys as rows. Heads padded to 64 / 128 as vLLM pads them,
    outside the timed call."""
    from vllm.v1.attention.ops import flashmla

    ok, why = flashmla.is_flashmla_sparse_supported()
    if not ok:
        raise NotApplicable(f"FlashMLA sparse unavailable: {why}")
    if c.job == "decode" and c.kv.dtype == torch.uint8:
        qs = [pad_heads(q, 2) for q in c.qs]
        k_cache = c.kv.unsqueeze(-2)
        dummy_table = torch.zeros(c.batch, 1, dtype=torch.int32, device="cuda")
        seqlens = torch.ones(c.batch, dtype=torch.int32, device="cuda")

        def step(i):
            sched, _ = flashmla.get_mla_metadata()
            return flashmla.flash_mla_with_kvcache(
                qs[i], k_cache, dummy_table, seqlens, D_V, sched, softmax_scale=c.scale,
                causal=False, is_fp8_kvcache=True, indices=c.idx[i])[0][..., :c.H, :]
    else:
        kv = c.kv.reshape(-1, 1, D_QK)
        qs = [pad_heads(q.reshape(-1, c.H, D_QK), 1) for q in c.qs]
        idx = [i.reshape(-1, 1, c.topk) for i in c.idx]

        def step(i):
            out = flashmla.flash_mla_sparse_fwd(qs[i], kv, idx[i], c.scale, d_v=D_V)[0]
            out = out[:, :c.H]
            return out.view(c.batch, c.s_q, c.H, D_V) if c.job == "decode" else out
    return Kernel(step=step, check=lambda: step(0))
