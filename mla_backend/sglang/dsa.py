"""DeepSeek sparse attention (DSA, DeepSeek-V3.2) on mla_backend's sparse kernel, for SGLang
0.5.17.

The backend is SGLang's DeepseekSparseAttnBackend with its attention calls replaced: the
parent keeps building the step's metadata (page_table_1, the indexer's lengths, DeepGEMM's
paged-MQA schedule, its CUDA-graph buffers) and answers get_indexer_metadata, so SGLang's
indexer runs unchanged. Every query token of every mode (decode, prefill / chunked prefill /
extend, target-verify, draft-extend) then runs on one `ops.sparse_mla_decode` call with the
token as its own request and its top-k cache slots as its keys (sparse_index.py maps them).

Choices that make every token sparse and every index a cache slot:
  * use_mha is always False: SGLang's dsa backend sends short prefills (keys <= index_topk)
    to a dense MHA kernel (FA3); here they go through the indexer and the sparse kernel,
    whose top-k then holds every earlier key: the same attention.
  * get_topk_transform_method is always PAGED: the indexer returns cache slots (fused top-k)
    or positions (unfused), never offsets into a gathered ragged buffer (SGLang's RAGGED
    route for an fp8 cache under flashmla_sparse prefill).
  * The parent's kernel choice (dsa_prefill_impl / dsa_decode_impl) only steers its metadata:
    "flashmla_sparse" for both, so it prepares no FlashMLA tile schedule we never read.

The plan: no topk_length (a -1 index is skipped by the kernel; SGLang does not promise that
valid indices come first), so the plan is uniform, made on the host from (tokens, heads,
topk) with no GPU work, and the same for a CUDA graph's capture and its replays. The
workspace is allocated once (its addresses never change).
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.layers.attention.dsa.dsa_topk_backend import TopkTransformMethod
from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend

from .. import ops
from . import sparse_index
from .support import FP8_CACHE, NAME

logger = logging.getLogger("sglang.mla_backend")

# the parent's kernel choice, for its metadata only (see the module docstring)
_PARENT_IMPL = "flashmla_sparse"


class MLASparseBackend(DeepseekSparseAttnBackend):

    def __init__(self, model_runner, skip_prefill: bool = False, speculative_step_id=0,
                 topk=0, speculative_num_steps=0,
                 seed_dsa_topk_from_draft_extend: bool = False):
        super().__init__(model_runner, skip_prefill, speculative_step_id, topk,
                         speculative_num_steps, seed_dsa_topk_from_draft_extend)
        self.init_sparse_state(model_runner)

    def init_sparse_state(self, model_runner) -> None:
        """What our attention path keeps beside the parent's state: the cache format, the
        plan workspace, the step's query rows."""
        self.dsa_prefill_impl = self.dsa_decode_impl = _PARENT_IMPL
        self.enable_auto_select_prefill_impl = False
        self.use_mha = False
        self.kv_fp8 = model_runner.kv_cache_dtype == FP8_CACHE
        # one workspace for every call: a plan of up to MAX_SPARSE_GROUPS query tokens
        self.sparse_workspace = ops.sparse_workspace(ops.MAX_SPARSE_GROUPS, self.num_q_heads,
                                                     device=self.device)
        self._plan: ops.SparsePlan | None = None
        self._step_rows: torch.Tensor | None = None
        logger.info("%s: DSA sparse attention on %s kernels (%d query heads, cache %s, "
                    "index_topk %d, top-k %s)", NAME, NAME, self.num_q_heads,
                    "fp8 656-byte" if self.kv_fp8 else "bfloat16", self.dsa_index_topk,
                    "slots from the indexer" if self.use_fused_topk
                    else "positions mapped to slots here")

    # ---- routing the parent's decisions --------------------------------------------------

    def set_dsa_prefill_impl(self, forward_batch=None):
        self.use_mha = False  # every extend is sparse MLA (module docstring)

    def get_topk_transform_method(self, forward_mode=None) -> TopkTransformMethod:
        return TopkTransformMethod.PAGED

    # ---- metadata ------------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch):
        super().init_forward_metadata(forward_batch)
        self._step_rows = self._rows_of_step(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        super().init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
        # graph modes (decode, verify, draft-extend v2) build their rows inside the forward
        self._step_rows = None

    def _rows_of_step(self, forward_batch) -> torch.Tensor | None:
        """page_table_1 row of each query token, for extends with unfused (position) top-k;
        decode and expanded modes build theirs in the forward (static shapes, graph-safe)."""
        mode = forward_batch.forward_mode
        if (self.use_fused_topk or mode.is_decode_or_idle() or mode.is_target_verify()
                or mode.is_draft_extend_v2()):
            return None
        return sparse_index.query_rows(mode, forward_batch.batch_size,
                                       forward_batch.extend_seq_lens_cpu, self.device)

    def _plan_for(self, tokens: int, topk: int, cache_dtype: torch.dtype) -> ops.SparsePlan:
        plan = self._plan
        if plan is None or (plan.batch, plan.topk) != (tokens, topk):
            plan = ops.plan_sparse_decode(tokens, 1, self.num_q_heads, topk,
                                          workspace=self.sparse_workspace,
                                          kv_cache_dtype=cache_dtype)
            self._plan = plan
        return plan

    # ---- forward -------------------------------------------------------------------------

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                       q_rope=None, k_rope=None, topk_indices=None, **kwargs):
        return self._sparse_attention(q, k, v, layer, forward_batch, save_kv_cache, q_rope,
                                      k_rope, topk_indices)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                       q_rope=None, k_rope=None, topk_indices=None, **kwargs):
        return self._sparse_attention(q, k, v, layer, forward_batch, save_kv_cache, q_rope,
                                      k_rope, topk_indices)

    def _sparse_attention(self, q, k, v, layer, forward_batch, save_kv_cache, q_rope, k_rope,
                          topk_indices):
        if layer.is_cross_attention:
            raise ValueError(f"{NAME}: DSA attention is causal self-attention; layer "
                             f"{layer.layer_id} is cross-attention")
        if k is not None and save_kv_cache:
            self._write_kv(layer, forward_batch.out_cache_loc, k, v, k_rope)
        heads = layer.tp_q_head_num
        query = sparse_index.absorbed_query(q, q_rope, heads, layer.head_dim, layer.v_head_dim)
        # the latent part of a pair, or the whole query: its tokens and dtype
        latent = query[0] if isinstance(query, tuple) else query
        tokens = latent.shape[0]
        out_width = heads * layer.v_head_dim
        if tokens == 0:
            return latent.new_empty(0, out_width)
        if topk_indices is None:
            raise ValueError(f"{NAME}: layer {layer.layer_id} got no top-k indices in "
                             f"{forward_batch.forward_mode}; a DSA layer attends to its "
                             f"indexer's top-k")
        indices = self._cache_slots(sparse_index.pad_rows(topk_indices, tokens),
                                    forward_batch)
        cache = sparse_index.paged_cache(self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                                         self.kv_fp8)
        out = latent.new_empty(tokens, heads, layer.v_head_dim)
        step = ops.MAX_SPARSE_GROUPS
        for start in range(0, tokens, step):  # one call, unless a prefill exceeds the grid
            end = min(tokens, start + step)
            plan = self._plan_for(end - start, indices.shape[1], cache.dtype)
            ops.sparse_mla_decode(sparse_index.query_tokens(query, start, end), cache,
                                  indices[start:end].unsqueeze(1), plan, layer.scaling,
                                  out=out[start:end].unsqueeze(1))
        return out.view(tokens, out_width)

    def _write_kv(self, layer, loc, k, v, k_rope) -> None:
        """SGLang's own writer (bf16 rows, or its 656-byte fp8 quantizer)."""
        if k_rope is None:  # one [T, 1, 576] key: split into the latent and rope parts
            k = k.view(k.shape[0], 1, -1)
            k, k_rope = k[..., :layer.v_head_dim], k[..., layer.v_head_dim:]
        self.token_to_kv_pool.set_mla_kv_buffer(layer, loc, k, k_rope)

    def _cache_slots(self, topk_indices: torch.Tensor, forward_batch) -> torch.Tensor:
        """int32 [tokens, topk] cache slots (-1 = none) for the kernel."""
        if self.use_fused_topk:  # the indexer wrote slots already
            return topk_indices.to(torch.int32)
        mode = forward_batch.forward_mode
        rows = self._step_rows
        if rows is None and mode.is_decode_or_idle():
            rows = sparse_index.query_rows(mode, forward_batch.batch_size, None,
                                           topk_indices.device)
        page_table_1 = self.forward_metadata.page_table_1
        return sparse_index.slots_from_positions(page_table_1, topk_indices, rows)
