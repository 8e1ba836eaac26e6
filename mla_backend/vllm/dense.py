"""Dense MLA (DeepSeek-V2/V3) on mla_backend's decode kernel, for vLLM 0.25 and 0.33.

What runs where: vLLM's common MLA layer projects q, absorbs W_UK, writes the KV cache and
runs prefills (`forward_mha`, vLLM's MLA prefill backend); decode rows — and spec-decode
verification rows, which have the same query length in every request of a step — come to
`MLADenseImpl.forward_mqa`, which calls `ops.mla_decode` with the plan the builder made for
the step (one GPU planner launch per step, shared by all layers, no host sync).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.kv_cache_interface import is_quantized_kv_cache

from .. import ops
from . import support

# Under vLLM's logger, so the line shows with vLLM's own logging settings.
logger = logging.getLogger("vllm.mla_backend")


class MLADenseBackend(support.HopperMLABackendMixin, MLACommonBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = list(support.MODEL_DTYPES)
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(support.DENSE_KV_CACHE_DTYPES)

    @staticmethod
    def get_builder_cls() -> type[MLADenseMetadataBuilder]:
        return MLADenseMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[MLADenseImpl]:
        return MLADenseImpl

    # vLLM 0.25 asks the backend for the cache layout; later releases take it from the
    # KV-cache spec and no longer call this. The kernel indexes blocks by stride(0) (its TMA
    # map takes the cache's own strides), so a layer's slice of a cross-layer buffer
    # [blocks, layers, 64, 576] is fine.
    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        return (1, 0, 2, 3) if include_num_layers_dimension else (0, 1, 2)

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla,
                             has_sink, use_sparse, use_mm_prefix, device_capability) -> str | None:
        return support.dense_combination_reason(head_size, dtype, kv_cache_dtype, block_size,
                                                device_capability)


@dataclass
class MLADenseDecodeMetadata(MLACommonDecodeMetadata):
    plan: ops.DecodePlan


@dataclass
class MLADenseMetadata(MLACommonMetadata[MLADenseDecodeMetadata]):
    pass


def decode_shape(num_decodes: int, num_decode_tokens: int) -> tuple[int, int]:
    """(batch, query tokens per request) of the decode rows. vLLM orders decodes first and,
    with QueryLenSupport.UNIFORM, gives every decode request the same query length (CUDA-graph
    padding requests included: their seq_len is 0)."""
    s_q, rest = divmod(num_decode_tokens, num_decodes)
    if rest or not 1 <= s_q <= ops.MAX_Q_TOKENS_PER_REQ:
        raise RuntimeError(
            f"{support.NAME}: {num_decode_tokens} decode tokens over {num_decodes} requests is "
            f"not a uniform query length in [1, {ops.MAX_Q_TOKENS_PER_REQ}]")
    return num_decodes, s_q


class MLADenseMetadataBuilder(MLACommonMetadataBuilder[MLADenseMetadata]):
    # Decode steps (spec-decode verification included) are captured as FULL CUDA graphs: the
    # plan lives in a workspace allocated here, refilled in place by build().
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.UNIFORM
    reorder_batch_threshold: int = 1  # raised to 1 + speculative tokens by the base class

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, MLADenseMetadata)
        reason = support.config_reason(vllm_config)
        if reason:
            raise ValueError(reason)
        self.decode_heads = self.num_heads * self.dcp_world_size
        self.kv_cache_dtype = (torch.float8_e4m3fn
                               if is_quantized_kv_cache(vllm_config.cache_config.cache_dtype)
                               else None)
        max_q_len = self.reorder_batch_threshold  # 1 + speculative tokens (checked above)
        max_batch = max(vllm_config.scheduler_config.max_num_seqs,
                        self.compilation_config.max_cudagraph_capture_size or 0)
        self.workspace = ops.decode_workspace(max_batch, max_q_len, self.decode_heads,
                                              device=device, kv_cache_dtype=self.kv_cache_dtype)
        logger.info("mla_backend: dense MLA decode on %s kernels (%d query heads, cache %s, up "
                    "to %d query tokens per request, CUDA graphs %s)", support.NAME,
                    self.decode_heads, vllm_config.cache_config.cache_dtype, max_q_len,
                    self._cudagraph_support.name)

    # max_query_len: passed since vLLM 0.33 (the decode rows' longest query); the uniform
    # query length comes from the token count either way.
    def _build_decode(self, block_table_tensor, seq_lens_device, max_seq_len,
                      query_start_loc_cpu, query_start_loc_device, num_decode_tokens,
                      dcp_tot_seq_lens_device, max_query_len: int | None = None
                      ) -> MLADenseDecodeMetadata:
        batch, s_q = decode_shape(block_table_tensor.shape[0], num_decode_tokens)
        plan = ops.plan_decode(seq_lens_device, s_q, self.decode_heads,
                               kv_cache_dtype=self.kv_cache_dtype, workspace=self.workspace)
        return MLADenseDecodeMetadata(block_table=block_table_tensor, seq_lens=seq_lens_device,
                                      dcp_tot_seq_lens=dcp_tot_seq_lens_device, plan=plan)


class MLADenseImpl(MLACommonImpl[MLADenseMetadata]):
    # Decode context parallelism: vLLM all-gathers the heads (the plan covers heads x DCP
    # ranks), decodes each rank's shard of the sequence and merges the shards by our lse.
    can_return_lse_for_decode: bool = True
    supports_dcp: bool = True
    # Prefill context parallelism is untested with our decode: vLLM 0.33 defaults it to True.
    supports_pcp: bool = False

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                 kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name,
                 **mla_args) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                         kv_cache_dtype, logits_soft_cap, attn_type,
                         kv_sharing_target_layer_name, **mla_args)
        support.check_layer_args(alibi_slopes, sliding_window, logits_soft_cap, attn_type)
        # The fp8 kernel reads bf16/fp16 q and dequantizes the e4m3 cache itself.
        self.supports_quant_query_input = False
        self.kv_fp8 = is_quantized_kv_cache(kv_cache_dtype)

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        decode = attn_metadata.decode
        plan = decode.plan
        # (ql_nope [T, H, 512], q_pe [T, H, 64]) strided views, read as they are; or, with
        # DCP (vLLM joins them for the all-gather), one [T, H, 576] tensor
        parts = q if isinstance(q, tuple) else (q,)
        tokens, heads = parts[0].shape[:2]
        q = tuple(t.view(plan.batch, plan.q_tokens_per_req, heads, t.shape[-1]) for t in parts)
        if len(q) == 2 and not all(ops.rows_in_place(t) for t in q):
            q = (torch.cat(q, dim=-1),)  # rows the kernel cannot load in place: one copy
        out, lse = ops.mla_decode(q if len(q) == 2 else q[0], kv_c_and_k_pe_cache,
                                  decode.block_table, decode.seq_lens, plan, self.scale,
                                  causal=True,
                                  kv_scale=layer._k_scale if self.kv_fp8 else None)
        return out.view(tokens, heads, ops.D_V), lse.view(tokens, heads)
