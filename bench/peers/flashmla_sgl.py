"""FlashMLA as SGLang 0.5.17 ships it (sgl-kernel's `sgl_kernel.flash_mla`), called the way
SGLang's `dsa` backend calls it: sparse decode over the 656-byte fp8 cache (`flashmla_kv`)
and sparse attention over the bf16 cache viewed as rows (`flashmla_sparse`, decode and
prefill). Its fp8 decode takes FlashMLA's tensor-metadata route (get_mla_metadata with the
lengths, then the kernel with tile_scheduler_metadata and num_splits), not the per-call
schedule object that vLLM's build uses (bench/peers/flashmla.py)."""

from __future__ import annotations

import torch

from bench.common import Kernel, NotApplicable
from bench.peers.flashmla import pad_heads
from bench.sparse_inputs import D_QK, D_V, Case


def _flash_mla():
    try:
        from sgl_kernel import flash_mla
    except Exception as e:  # noqa: BLE001 - no sgl-kernel here (or not for this GPU)
        raise NotApplicable(f"sgl-kernel's FlashMLA is not importable: {e}") from e
    return flash_mla


def build_sparse(c: Case) -> Kernel:
    """fp8 (656-byte) decode: every query token a request of its own, as SGLang flattens
    them; lengths min(context, topk) = topk; the metadata in the timed call (SGLang runs it
    once per step). bf16 cache and prefill: flash_mla_sparse_fwd with topk_length as SGLang
    passes it. Heads padded to 64 / 128 outside the timed call, as SGLang pads them."""
    fm = _flash_mla()
    rows = c.batch * c.s_q
    if c.job == "decode" and c.kv.dtype == torch.uint8:
        hp = 64 if c.H <= 64 else 128
        qs = [pad_heads(q, 2).reshape(rows, 1, hp, D_QK) for q in c.qs]
        idx = [i.reshape(rows, 1, c.topk) for i in c.idx]
        k_cache = c.kv.view(torch.float8_e4m3fn).unsqueeze(-2)     # [blocks, 64, 1, 656]
        lens = torch.full((rows,), c.topk, dtype=torch.int32, device="cuda")
        no_table = torch.empty((rows, 0), dtype=torch.int32, device="cuda")

        def step(i):
            sched, splits = fm.get_mla_metadata(
                cache_seqlens=lens, num_q_tokens_per_head_k=hp, num_heads_k=1,
                num_heads_q=hp, is_fp8_kvcache=True, topk=c.topk)
            out = fm.flash_mla_with_kvcache(
                q=qs[i], k_cache=k_cache, block_table=no_table, cache_seqlens=lens,
                head_dim_v=D_V, tile_scheduler_metadata=sched, num_splits=splits,
                softmax_scale=c.scale, causal=False, is_fp8_kvcache=True, indices=idx[i])[0]
            return out[:, 0, :c.H].reshape(c.batch, c.s_q, c.H, D_V)
    else:
        kv = c.kv.reshape(-1, 1, D_QK)
        qs = [pad_heads(q.reshape(-1, c.H, D_QK), 1) for q in c.qs]
        idx = [i.reshape(-1, 1, c.topk) for i in c.idx]
        lens = torch.full((rows,), c.topk, dtype=torch.int32, device="cuda")

        def step(i):
            out = fm.flash_mla_sparse_fwd(qs[i], kv, idx[i], c.scale, d_v=D_V,
                                          topk_length=lens)[0][:, :c.H]
            return out.view(c.batch, c.s_q, c.H, D_V) if c.job == "decode" else out
    return Kernel(step=step, check=lambda: step(0))
