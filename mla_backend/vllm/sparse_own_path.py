"""Sparse MLA (DeepSeek-V3.2 DSA) on mla_backend's sparse kernel: builder and impl for
vLLM 0.25 (sparse.py picks this module there).

What runs where: vLLM's MLA layer projects q, absorbs W_UK and writes the cache; the
model's indexer writes each token's top-k request-local positions into the shared
`topk_indices_buffer` (-1 padded). Every token of the step — prefill and decode alike —
comes to `MLASparseImpl.forward_mqa`, which maps the positions through the block table to
global cache slots (vLLM's own Triton helper) and runs `ops.sparse_mla_decode` with one
query token per request over the bf16 or fp8_ds_mla cache. The plan (one GPU planner launch
per step, no host sync) is made by the builder into a workspace sized for
max_num_batched_tokens, so decode steps are captured as FULL CUDA graphs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from vllm.utils.torch_utils import np_to_pinned_tensor
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionMetadata,
    AttentionMetadataBuilder,
    SparseMLAAttentionImpl,
)
from vllm.v1.attention.backends.mla.sparse_utils import triton_convert_req_index_to_global_index

from .. import ops
from . import support
from .sparse import MLASparseBackend

logger = logging.getLogger("vllm.mla_backend")


@dataclass
class MLASparseMetadata(AttentionMetadata):
    num_actual_tokens: int
    req_id_per_token: torch.Tensor  # int32 [T]: the request of each token
    block_table: torch.Tensor       # int32 [num_reqs, max_blocks]
    plan: ops.SparsePlan            # T requests of one query token, H heads, index_topk keys


def request_of_token(query_start_loc_cpu: torch.Tensor) -> np.ndarray:
    """int32 [T]: request r for each of its query_start_loc[r+1] - query_start_loc[r] tokens."""
    starts = np.asarray(query_start_loc_cpu, dtype=np.int32)
    return np.repeat(np.arange(starts.shape[0] - 1, dtype=np.int32), np.diff(starts))


class MLASparseMetadataBuilder(AttentionMetadataBuilder[MLASparseMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        reason = support.sparse_config_reason(vllm_config)
        if reason:
            raise ValueError(reason)
        # single-token queries (plus speculative tokens) are decodes: graph-captured steps
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        model_config = vllm_config.model_config
        self.num_heads = model_config.get_num_attention_heads(vllm_config.parallel_config)
        self.topk = model_config.hf_config.index_topk
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.req_id_per_token = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.workspace = ops.sparse_workspace(max_tokens, self.num_heads, device=device)
        # the schedule is tuned per cache format (the plan is correct on either)
        self.kv_cache_dtype = (torch.uint8 if vllm_config.cache_config.cache_dtype == "fp8_ds_mla"
                               else torch.bfloat16)
        logger.info("mla_backend: sparse MLA (DSA) on %s kernels (%d query heads, index_topk "
                    "%d, cache %s, CUDA graphs %s)", support.NAME, self.num_heads, self.topk,
                    vllm_config.cache_config.cache_dtype, self._cudagraph_support.name)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        cm = common_attn_metadata
        tokens = cm.num_actual_tokens
        req = request_of_token(cm.query_start_loc_cpu)
        # zero-filled past the real tokens: graph-padding rows read request 0's table
        self.req_id_per_token.fill_(0)
        host = np_to_pinned_tensor(req) if self.req_id_per_token.is_cuda else torch.from_numpy(req)
        self.req_id_per_token[:req.shape[0]].copy_(host, non_blocking=True)
        plan = ops.plan_sparse_decode(tokens, 1, self.num_heads, self.topk,
                                      workspace=self.workspace,
                                      kv_cache_dtype=self.kv_cache_dtype)
        return MLASparseMetadata(num_actual_tokens=tokens,
                                 req_id_per_token=self.req_id_per_token[:tokens],
                                 block_table=cm.block_table_tensor, plan=plan)


class MLASparseImpl(SparseMLAAttentionImpl[MLASparseMetadata]):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                 kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name,
                 topk_indices_buffer: torch.Tensor | None = None, indexer=None,
                 **mla_args) -> None:
        support.check_layer_args(alibi_slopes, sliding_window, logits_soft_cap, attn_type)
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        MLASparseBackend.layer_cache_dtype = kv_cache_dtype
        self.kv_lora_rank = mla_args["kv_lora_rank"]
        # layers that reuse an earlier layer's top-k (IndexCache) have no indexer
        self.topk_indices_buffer = (indexer.topk_indices_buffer if indexer is not None
                                    else topk_indices_buffer)
        if self.topk_indices_buffer is None:
            raise ValueError(f"{support.NAME}: a sparse MLA layer needs the indexer's "
                             "topk_indices_buffer")

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        # (ql_nope [T, H, 512], q_pe [T, H, 64]) strided views, handed on as they are (the op
        # joins them by one copy only where a part's rows are not 16-byte aligned), or one
        # [T, H, 576] tensor; each token its own request of one query token
        tokens, heads = (q[0] if isinstance(q, tuple) else q).shape[:2]
        query = tuple(t.unsqueeze(1) for t in q) if isinstance(q, tuple) else q.unsqueeze(1)
        local = self.topk_indices_buffer[:tokens]
        slots = triton_convert_req_index_to_global_index(
            attn_metadata.req_id_per_token, attn_metadata.block_table, local,
            BLOCK_SIZE=support.BLOCK_SIZE, NUM_TOPK_TOKENS=local.shape[1])
        out, lse = ops.sparse_mla_decode(query, kv_c_and_k_pe_cache, slots.view(tokens, 1, -1),
                                         attn_metadata.plan, self.scale)
        return out.view(tokens, heads, ops.D_V), lse.view(tokens, heads)
