"""Sparse MLA (DeepSeek-V3.2 DSA) on mla_backend's sparse kernel through vLLM's sparse
common path: builder and impl for vLLM 0.33 (sparse.py picks this module there).

What runs where: vLLM's V3.2 attention layer projects q, writes the cache and runs the
indexer; vLLM's SparseMLACommonMetadataBuilder splits decodes from prefills and maps tokens
to requests; SparseMLACommonImpl converts the indexer's top-k positions to cache rows once
per step for all layers of an index group, and sends prefills whose sequences fit in
index_topk to vLLM's dense MLA prefill (the same attention, since such a prefill's top-k
selects every earlier token). The rest — decode rows, and longer prefills — come to
`MLASparseImpl._forward_mqa_kernel`, which runs `ops.sparse_mla_decode` with one query token
per request. The builder plans exactly those rows (one GPU planner launch per step, shared
by all layers, no host sync) into a workspace sized for max_num_batched_tokens, so decode
steps are captured as FULL CUDA graphs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.model_executor.layers.attention.sparse_mla_attention import (
    SparseMLACommonImpl,
    SparseMLACommonMetadata,
    SparseMLACommonMetadataBuilder,
)
from vllm.v1.attention.backend import AttentionCGSupport

from .. import ops
from . import support

logger = logging.getLogger("vllm.mla_backend")


@dataclass(kw_only=True)
class MLASparseMetadata(SparseMLACommonMetadata):
    # the rows forward_mqa gets: one query token each, index_topk keys
    plan: ops.SparsePlan | None = None


def mqa_rows(metadata: SparseMLACommonMetadata, layer) -> int:
    """Query rows that reach forward_mqa: only the decode tokens when vLLM runs this
    step's prefills on its dense MLA prefill (the layer's own routing decision), else
    every token."""
    if metadata.prefill is not None and layer._use_sparse_mha(metadata):
        return metadata.num_decode_tokens
    return metadata.num_actual_tokens


def kv_cache_pages(kv_cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache as our kernel's 64-token pages, numbered as vLLM numbers its converted
    top-k rows (block * block_stride_rows + offset, block_stride_rows = stride(0) in rows):
    the flat row view of the cache, cut into 64-row pages."""
    blocks, tokens, width = kv_cache.shape
    if tokens != block_size or kv_cache.stride(1) != width or kv_cache.stride(2) != 1:
        raise ValueError(f"{support.NAME}: kv_cache {tuple(kv_cache.shape)} strides "
                         f"{kv_cache.stride()} is not [blocks, {block_size}, {width}] with "
                         f"contiguous token rows")
    stride_rows, rest = divmod(kv_cache.stride(0), width)
    if rest or stride_rows % support.BLOCK_SIZE:
        raise ValueError(f"{support.NAME}: kv_cache block stride {kv_cache.stride(0)} is not a "
                         f"whole number of {support.BLOCK_SIZE}-row pages of {width} "
                         f"(MLASparseBackend.customize_spec asks vLLM for that alignment)")
    pages = ((blocks - 1) * stride_rows + block_size) // support.BLOCK_SIZE
    return kv_cache.as_strided((pages, support.BLOCK_SIZE, width),
                               (support.BLOCK_SIZE * width, width, 1))


class MLASparseMetadataBuilder(SparseMLACommonMetadataBuilder[MLASparseMetadata]):
    metadata_cls = MLASparseMetadata
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        reason = support.sparse_config_reason(vllm_config)
        if reason:
            raise ValueError(reason)
        # single-token queries (plus speculative tokens) are decodes: graph-captured steps
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        self.layer = vllm_config.compilation_config.static_forward_context[layer_names[0]]
        self.num_heads = self.model_config.get_num_attention_heads(vllm_config.parallel_config)
        self.workspace = ops.sparse_workspace(vllm_config.scheduler_config.max_num_batched_tokens,
                                              self.num_heads, device=device)
        # the schedule is tuned per cache format (the plan is correct on either)
        self.kv_cache_dtype = (torch.uint8 if vllm_config.cache_config.cache_dtype == "fp8_ds_mla"
                               else torch.bfloat16)
        logger.info("mla_backend: sparse MLA (DSA) on %s kernels through vLLM's sparse common "
                    "path (%d query heads, index_topk %d, cache %s, CUDA graphs %s)",
                    support.NAME, self.num_heads, self.topk_tokens,
                    vllm_config.cache_config.cache_dtype, self._cudagraph_support.name)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        metadata.plan = ops.plan_sparse_decode(mqa_rows(metadata, self.layer), 1, self.num_heads,
                                               self.topk_tokens, workspace=self.workspace,
                                               kv_cache_dtype=self.kv_cache_dtype)
        return metadata


class MLASparseImpl(SparseMLACommonImpl[MLASparseMetadata]):
    # Untested with our kernel: DCP (vLLM filters the top-k per rank and merges by lse) and
    # prefill context parallelism (vLLM 0.33 defaults it to True for MLA impls).
    supports_dcp: bool = False
    supports_pcp: bool = False

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                 kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name,
                 topk_indices_buffer: torch.Tensor | None = None, indexer=None,
                 **mla_args) -> None:
        support.check_layer_args(alibi_slopes, sliding_window, logits_soft_cap, attn_type)
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                         kv_cache_dtype, logits_soft_cap, attn_type,
                         kv_sharing_target_layer_name, indexer=indexer,
                         topk_indices_buffer=topk_indices_buffer, **mla_args)
        if self.topk_indices_buffer is None:
            raise ValueError(f"{support.NAME}: a sparse MLA layer needs the indexer's "
                             "topk_indices_buffer")
        # the kernel reads bf16 q over a bf16 or fp8_ds_mla cache
        self.supports_quant_query_input = False
        self._step_plan: ops.SparsePlan | None = None

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        # vLLM's forward_mqa converts the top-k, then calls _forward_mqa_kernel, which is
        # not given the metadata: the step's plan is handed over here.
        self._step_plan = attn_metadata.plan
        return super().forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)

    def _forward_mqa_kernel(self, q, kv_cache, topk_indices, valid_counts, *, layer,
                            block_size, is_decode):
        # (ql_nope [T, H, 512], q_pe [T, H, 64]) strided views, handed on as they are (the op
        # joins them by one copy only where a part's rows are not 16-byte aligned), or one
        # [T, H, 576] tensor; each token its own request of one query token
        tokens, heads = (q[0] if isinstance(q, tuple) else q).shape[:2]
        query = tuple(t.unsqueeze(1) for t in q) if isinstance(q, tuple) else q.unsqueeze(1)
        # -1 marks no key (the kernel skips it): valid_counts is not needed
        out, lse = ops.sparse_mla_decode(query, kv_cache_pages(kv_cache, block_size),
                                         topk_indices.view(tokens, 1, -1), self._step_plan,
                                         self.scale)
        return out.view(tokens, heads, ops.D_V), lse.view(tokens, heads)
