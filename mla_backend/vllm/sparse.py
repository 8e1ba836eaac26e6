"""Sparse MLA (DeepSeek-V3.2 DSA) on mla_backend's sparse kernel: the backend class vLLM
selects, for vLLM 0.25 and 0.33.

The two releases run sparse layers differently, so the builder and the impl come from one
of two modules (the one version switch of the sparse path):
- sparse_own_path (vLLM 0.25): every token of the step comes to our impl, which maps the
  indexer's top-k positions to cache slots and runs our kernel.
- sparse_common_path (vLLM 0.33, which added SparseMLACommonImpl's kernel hook): vLLM's
  sparse common path converts the top-k once per step for all layers, sends prefills of
  at most index_topk tokens to its dense MLA prefill, and calls our kernel for the rest.
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend

from .. import ops
from . import support, version

# vLLM 0.33 added the sparse common path's kernel hook (SparseMLACommonImpl._forward_mqa_kernel);
# vLLM 0.26 removed SparseMLAAttentionImpl, the base of the 0.25 path.
SPARSE_COMMON_PATH = version.at_least((0, 33, 0))


class MLASparseBackend(support.HopperMLABackendMixin, AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(support.SPARSE_KV_CACHE_DTYPES)

    @staticmethod
    def get_builder_cls():
        if SPARSE_COMMON_PATH:
            from .sparse_common_path import MLASparseMetadataBuilder
        else:
            from .sparse_own_path import MLASparseMetadataBuilder
        return MLASparseMetadataBuilder

    @staticmethod
    def get_impl_cls():
        if SPARSE_COMMON_PATH:
            from .sparse_common_path import MLASparseImpl
        else:
            from .sparse_own_path import MLASparseImpl
        return MLASparseImpl

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla,
                             has_sink, use_sparse, use_mm_prefix, device_capability) -> str | None:
        return support.sparse_combination_reason(head_size, dtype, kv_cache_dtype, block_size,
                                                 device_capability)

    # Asked by vLLM 0.33 (since 0.28): on the sparse common path every token is its own
    # query row and vLLM maps tokens to requests from the device query_start_loc, so a
    # batch whose CPU query lengths differ from the device's (adaptive verification) is
    # served; the 0.25 path is never asked.
    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        return SPARSE_COMMON_PATH

    # Asked by vLLM 0.33 (since 0.28): the sparse common path converts top-k positions
    # to rows of the cache viewed flat (block * block_stride_rows + offset); whole 64-row
    # pages between blocks let our kernel read that flat view as 64-token pages.
    @classmethod
    def customize_spec(cls, spec):
        return replace(spec, block_stride_alignment=support.BLOCK_SIZE
                       * spec.state_content_size_bytes)

    # vLLM 0.25 only (0.29 takes the shape from the KV-cache spec): it passes
    # cache_dtype_str="auto" for every MLA layer (MLAAttentionSpec leaves kv_quant_mode at
    # NONE) while it sizes the pages from the spec's cache_dtype_str, so with fp8_ds_mla the
    # 656-byte pages were viewed as 576 ("shape '[N, 64, 576]' is invalid"), which also
    # stops FLASHMLA_SPARSE. Layers are built before the cache is allocated, so the shape
    # follows the dtype the layers hold (set by the 0.25 impl).
    layer_cache_dtype: ClassVar[str | None] = None

    @classmethod
    def get_kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
        if cache_dtype_str == "auto" and cls.layer_cache_dtype == "fp8_ds_mla":
            cache_dtype_str = cls.layer_cache_dtype
        if cache_dtype_str == "fp8_ds_mla":  # 656 bytes per token (mla_backend.formats)
            return (num_blocks, block_size, ops.FP8_DS_MLA_BYTES)
        return (num_blocks, block_size, head_size)
