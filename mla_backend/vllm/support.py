"""What the vLLM backends accept, as reasons vLLM shows the user.

vLLM's `validate_configuration` collects terse reasons ("dtype not supported"); the
functions here return one sentence that says what was asked, what we run and what to
change. They need no GPU, so the cpu test tier checks them against vLLM's real classes.
"""

from __future__ import annotations

import torch

from .. import _extension, ops
from . import version

NAME = "MLA_BACKEND"
HEAD_SIZE = ops.D_QK  # 512 latent + 64 rope
BLOCK_SIZE = ops.PAGE_SIZE
MODEL_DTYPES = (torch.bfloat16, torch.float16)
# "auto" = the model dtype; fp8 / fp8_e4m3 = per-tensor e4m3 with layer._k_scale.
DENSE_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3")
_CACHE_DTYPE_OF = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def dense_kv_cache_reason(kv_cache_dtype: str | None, dtype: torch.dtype) -> str | None:
    kv = kv_cache_dtype or "auto"
    if kv == "fp8_ds_mla":
        return ("kv_cache_dtype fp8_ds_mla is DeepSeek-V3.2's sparse-attention cache; dense MLA "
                "models use --kv-cache-dtype fp8 (per-tensor e4m3) or auto")
    if kv not in DENSE_KV_CACHE_DTYPES:
        return (f"kv_cache_dtype {kv} is not supported by {NAME}; use one of "
                f"{', '.join(DENSE_KV_CACHE_DTYPES)}")
    if kv in _CACHE_DTYPE_OF and _CACHE_DTYPE_OF[kv] != dtype:
        return (f"kv_cache_dtype {kv} with model dtype {dtype}: {NAME} keeps a 16-bit cache in "
                f"the model dtype; use --kv-cache-dtype auto (or fp8)")
    return None


def _platform_reason(block_size: int | None, device_capability) -> str | None:
    """Block size, GPU and extension: the same for the dense and the sparse backend."""
    if block_size is not None and block_size % BLOCK_SIZE != 0:
        return (f"--block-size {block_size}: {NAME} pages hold {BLOCK_SIZE} tokens; use a "
                f"multiple of {BLOCK_SIZE} or leave --block-size unset")
    if device_capability is not None and device_capability.major != 9:
        return (f"{NAME} kernels run on Hopper GPUs (compute capability 9.x, sm_90a); this GPU "
                f"is {device_capability.major}.{device_capability.minor}")
    if not _extension.is_available():
        return f"{NAME}'s CUDA extension is not available{_extension.why_unavailable()}"
    return None


def _head_size_reason(head_size: int) -> str | None:
    if head_size != HEAD_SIZE:
        return (f"{NAME} runs MLA with a {HEAD_SIZE}-dim latent cache (kv_lora_rank 512 + "
                f"qk_rope_head_dim 64); this model's is {head_size}")
    return None


def dense_combination_reason(head_size: int, dtype: torch.dtype, kv_cache_dtype: str | None,
                             block_size: int | None, device_capability) -> str | None:
    """Why a dense MLA layer cannot run on our kernels, or None."""
    if _head_size_reason(head_size):
        return _head_size_reason(head_size)
    if dtype not in MODEL_DTYPES:
        return f"model dtype {dtype} is not supported by {NAME}; use --dtype bfloat16 or float16"
    reason = dense_kv_cache_reason(kv_cache_dtype, dtype)
    if reason:
        return reason
    return _platform_reason(block_size, device_capability) or config_reason()


def _query_tokens_per_draft(vllm_config) -> int:
    """Query tokens each speculative token adds to a decode row: 2 with parallel drafting,
    except on model runner V2, whose drafters add one (vLLM 0.31 made the runner's
    threshold follow this: vllm.v1.attention.backend.max_decode_query_len)."""
    spec = vllm_config.speculative_config
    if not spec.parallel_drafting:
        return 1
    if version.at_least((0, 31, 0)) and vllm_config.use_v2_model_runner:
        return 1
    return 2


def max_decode_query_len(vllm_config) -> int:
    """Query tokens per request that vLLM sends down the decode path (1, or 1 + the
    speculative tokens, doubled drafts with parallel drafting on model runner V1): the
    builder's reorder_batch_threshold for a backend with QueryLenSupport.UNIFORM and no DCP."""
    spec = vllm_config.speculative_config
    if vllm_config.parallel_config.decode_context_parallel_size > 1:
        return 1
    if spec is None or spec.num_speculative_tokens is None:
        return 1
    return 1 + _query_tokens_per_draft(vllm_config) * spec.num_speculative_tokens


def decode_heads(vllm_config) -> int:
    """Query heads our decode kernel sees per GPU: heads per TP rank, all-gathered over DCP."""
    heads = vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
    return heads * vllm_config.parallel_config.decode_context_parallel_size


def config_reason(vllm_config=None) -> str | None:
    """Limits that depend on the whole engine config (heads per GPU, speculative tokens)."""
    if vllm_config is None:
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None or vllm_config.model_config is None:
        return None
    heads = decode_heads(vllm_config)
    if heads > ops.MAX_HEADS:
        return (f"{heads} query heads per GPU (heads / tensor-parallel size x decode-context-"
                f"parallel size): {NAME} decodes at most {ops.MAX_HEADS}")
    q_len = max_decode_query_len(vllm_config)
    if q_len > ops.MAX_Q_TOKENS_PER_REQ:
        per_draft = _query_tokens_per_draft(vllm_config)
        how = " (1 + 2 x num_speculative_tokens with parallel drafting)" if per_draft == 2 else ""
        return (f"speculative decoding sends {q_len} query tokens per request to the decode "
                f"kernel{how}; {NAME} decodes at most {ops.MAX_Q_TOKENS_PER_REQ} (use "
                f"num_speculative_tokens <= {(ops.MAX_Q_TOKENS_PER_REQ - 1) // per_draft})")
    return None


# DeepSeek-V3.2 (sparse) caches: "auto" = bf16; fp8_ds_mla = 656-byte tokens (formats.py).
SPARSE_KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_ds_mla")


def sparse_combination_reason(head_size: int, dtype: torch.dtype, kv_cache_dtype: str | None,
                              block_size: int | None, device_capability) -> str | None:
    """Why a DeepSeek-V3.2 sparse MLA layer cannot run on our kernels, or None."""
    if _head_size_reason(head_size):
        return _head_size_reason(head_size)
    if dtype != torch.bfloat16:
        return (f"model dtype {dtype}: {NAME}'s sparse (DeepSeek-V3.2) kernels run bfloat16; "
                f"use --dtype bfloat16")
    kv = kv_cache_dtype or "auto"
    if kv in ("fp8", "fp8_e4m3"):
        return (f"kv_cache_dtype {kv}: for DeepSeek-V3.2 {NAME} reads vLLM's fp8_ds_mla cache "
                f"(vLLM rewrites fp8 to fp8_ds_mla only for FLASHMLA_SPARSE); use "
                f"--kv-cache-dtype fp8_ds_mla")
    if kv not in SPARSE_KV_CACHE_DTYPES:
        return (f"kv_cache_dtype {kv} is not supported by {NAME} for DeepSeek-V3.2; use one of "
                f"{', '.join(SPARSE_KV_CACHE_DTYPES)}")
    return _platform_reason(block_size, device_capability) or sparse_config_reason()


def sparse_config_reason(vllm_config=None) -> str | None:
    """Engine-wide limits of the sparse path: heads per GPU, tokens per step, index_topk,
    no DCP."""
    if vllm_config is None:
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None or vllm_config.model_config is None:
        return None
    if vllm_config.parallel_config.decode_context_parallel_size > 1:
        if version.at_least((0, 33, 0)):  # FLASHMLA_SPARSE runs DCP on Hopper in vLLM 0.33
            return (f"decode context parallelism with DeepSeek-V3.2: {NAME}'s sparse path does "
                    f"not run it; use --decode-context-parallel-size 1, or --attention-backend "
                    f"FLASHMLA_SPARSE")
        # vLLM 0.25 on Hopper: FLASHMLA_SPARSE returns no lse for the DCP merge,
        # FLASH_ATTN_MLA_SPARSE refuses DCP, FLASHINFER_MLA_SPARSE needs Blackwell
        return (f"decode context parallelism with DeepSeek-V3.2: neither {NAME}'s sparse path "
                f"nor any vLLM 0.25 sparse MLA backend for Hopper runs it; use "
                f"--decode-context-parallel-size 1")
    if getattr(vllm_config.attention_config, "hisparse_config", None) is not None:
        # vLLM 0.33's host-offloaded sparse cache calls the kernel on staged copies of it
        return (f"hisparse_config (host-offloaded sparse KV cache): {NAME}'s sparse path does "
                f"not run it; leave attention_config.hisparse_config unset")
    heads = vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
    if heads > ops.MAX_HEADS:
        return (f"{heads} query heads per GPU (heads / tensor-parallel size): {NAME} runs at "
                f"most {ops.MAX_HEADS}")
    tokens = getattr(vllm_config.scheduler_config, "max_num_batched_tokens", None)
    if tokens is not None and tokens > ops.MAX_SPARSE_GROUPS:
        return (f"max_num_batched_tokens {tokens}: {NAME}'s sparse attention takes at most "
                f"{ops.MAX_SPARSE_GROUPS} tokens per step; use --max-num-batched-tokens "
                f"{ops.MAX_SPARSE_GROUPS} or less")
    topk = getattr(vllm_config.model_config.hf_config, "index_topk", None)
    if topk is not None and not (1 <= topk <= ops.MAX_TOPK and topk % 128 == 0):
        return (f"index_topk {topk}: {NAME} supports multiples of 128 up to {ops.MAX_TOPK} "
                f"(vLLM's index conversion works on 128-wide tiles)")
    return None


NOT_MLA_REASON = (f"{NAME} implements MLA attention only (DeepSeek-V2/V3/V3.2 and models built "
                  f"on them); this model's attention is not MLA: leave --attention-backend unset")


class HopperMLABackendMixin:
    """What the dense and the sparse backend classes answer alike (put it before vLLM's
    base class): our name, 64-token pages, the 576-dim latent, Hopper."""

    @staticmethod
    def get_name() -> str:
        return NAME

    # kv_cache_spec: passed since vLLM 0.31; our pages are 64 tokens whatever the spec.
    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        return [BLOCK_SIZE]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [HEAD_SIZE]

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return capability.major == 9

    # Asked since vLLM 0.28 (adaptive verification trims drafts on the device, so the CPU
    # query lengths no longer match): our decode rows take one query length per step, read
    # from the CPU token counts, so such batches are refused.
    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        return False


def check_layer_args(alibi_slopes, sliding_window, logits_soft_cap, attn_type) -> None:
    """An MLA layer our impls can run: decoder self-attention without alibi, sliding window
    or logits soft-cap (DeepSeek models use none); ValueError naming what is not."""
    from vllm.v1.attention.backend import AttentionType

    unsupported = {"alibi_slopes": alibi_slopes, "sliding_window": sliding_window,
                   "logits_soft_cap": logits_soft_cap}
    used = [name for name, value in unsupported.items() if value]
    if used:
        raise ValueError(f"{NAME} does not support {', '.join(used)} in MLA layers")
    if attn_type != AttentionType.DECODER:
        raise ValueError(f"{NAME} supports decoder self-attention only; got attn_type {attn_type}")
