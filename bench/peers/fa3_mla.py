"""FA3 MLA as vLLM 0.25's FLASH_ATTN_MLA calls it: vllm.vllm_flash_attn.flash_attn_varlen_func
(fa_version=3) with q = q_pe, q_v = q_nope and k / v = the rope / latent views of the same
cache, and get_scheduler_metadata for its split-KV schedule."""

from __future__ import annotations

import argparse

import torch

from bench.common import Kernel, NotApplicable
from bench.dense_inputs import BF16, D_QK, D_ROPE, D_V, I32, PAGE, SCALE, Inputs

FA3_SPLITS_CG = 32               # vLLM attention_config.flash_attn_max_num_splits_for_cuda_graph


def build(x: Inputs, args: argparse.Namespace) -> Kernel:
    """Metadata + attention per call (vLLM: metadata once per step); args.fa3_page: the page
    size FA3 sees the cache with (it must divide ours)."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

    page = args.fa3_page
    if PAGE % page:
        raise NotApplicable(f"--fa3-page {page} does not divide the cache's page {PAGE}")
    p = x.pool
    r = PAGE // page
    cache = p.cache.view(-1, page, D_QK)                  # same memory, `page`-token pages
    k = cache[..., D_V:].unsqueeze(-2)                    # k_pe cache [pages, page, 1, 64]
    v = cache[..., :D_V].unsqueeze(-2)                    # latent cache [pages, page, 1, 512]
    if r == 1:
        tables = p.tables
    else:
        sub = torch.arange(r, device="cuda")
        tables = [(t.long()[:, :, None] * r + sub).reshape(x.B, -1).to(I32).contiguous()
                  for t in p.tables]

    def metadata() -> torch.Tensor:
        return get_scheduler_metadata(
            batch_size=x.B, max_seqlen_q=x.s_q, max_seqlen_k=p.max_len, num_heads_q=x.H,
            num_heads_kv=1, headdim=D_ROPE, cache_seqlens=p.seq_lens, qkv_dtype=BF16,
            headdim_v=D_V, page_size=page, cu_seqlens_q=x.cu_q, causal=True,
            num_splits=FA3_SPLITS_CG)

    def call(i: int, meta: torch.Tensor, want_lse: bool = False) -> object:
        return flash_attn_varlen_func(
            q=x.q_pe[i], k=k, v=v, q_v=x.q_nope[i], max_seqlen_q=x.s_q, cu_seqlens_q=x.cu_q,
            max_seqlen_k=p.max_len, seqused_k=p.seq_lens, block_table=tables[i],
            softmax_scale=SCALE, causal=True, return_softmax_lse=want_lse, fa_version=3,
            scheduler_metadata=meta, num_splits=FA3_SPLITS_CG, cp_world_size=1, cp_rank=0,
            cp_tot_seqused_k=None)

    def check() -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = call(0, metadata(), want_lse=True)     # out [T, H, 512], lse [H, T]
        return (out.view(x.B, x.s_q, x.H, D_V),
                lse.transpose(0, 1).reshape(x.B, x.s_q, x.H))

    meta_once = metadata()
    return Kernel(step=lambda i: call(i, metadata()), check=check,
                  step_premeta=lambda i: call(i, meta_once))
