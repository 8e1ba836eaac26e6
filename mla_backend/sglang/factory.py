"""The factory SGLang calls for `--attention-backend mla_backend` (in each scheduler process).

It checks the configuration first (a ValueError with one actionable sentence, which SGLang
reports as the scheduler's start-up error), registers the DeepSeek-side policy for our name,
and returns the dense backend.
"""

from __future__ import annotations

import torch

from . import support

# SGLang's DeepSeek model asks, per batch, which forward method to take (MHA prefill, chunked
# MHA, absorbed MLA). Our prefill is SGLang's FlashInfer MLA code, as in its flashmla backend,
# so we take flashmla's policy.
_POLICY = "handle_attention_flashmla"


def config_reason(runner) -> str | None:
    """Why this model / server configuration cannot run on mla_backend, or None."""
    from sglang.srt.configs.model_config import AttentionArch, is_deepseek_dsa
    from sglang.srt.runtime_context import get_parallel, get_spec

    config = runner.model_config
    is_mla = getattr(config, "attention_arch", None) == AttentionArch.MLA
    reason = support.model_reason(
        is_mla=is_mla, is_dsa=is_mla and is_deepseek_dsa(config.hf_config),
        kv_lora_rank=getattr(config, "kv_lora_rank", None),
        qk_rope_head_dim=getattr(config, "qk_rope_head_dim", None))
    reason = reason or support.page_size_reason(runner.page_size)
    reason = reason or support.dtype_reason(runner.dtype, runner.kv_cache_dtype)
    parallel = get_parallel()
    heads = config.num_attention_heads // parallel.attn_tp_size
    reason = reason or support.parallel_reason(heads, getattr(parallel, "attn_dcp_size", 1))
    spec = get_spec()
    reason = reason or support.speculative_reason(spec.speculative_num_draft_tokens,
                                                  spec.speculative_eagle_topk)
    return reason or support.platform_reason(_device_capability(runner), _extension_error())


def _device_capability(runner) -> tuple[int, int] | None:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(torch.device(runner.device))


def _extension_error() -> str | None:
    from .. import _extension

    return None if _extension.is_available() else _extension.why_unavailable()


def register_deepseek_policy() -> None:
    """Our name in SGLang's DeepSeek model: flashmla's forward-method policy, and the query
    and key handed over in two parts (nope, rope) so the KV write needs no concatenation."""
    from sglang.srt.models.deepseek_common import attention_backend_handler as handler
    from sglang.srt.models.deepseek_common.utils import FORWARD_ABSORB_CORE_ATTENTION_BACKENDS

    handler.AttentionBackendRegistry.register(support.NAME, getattr(handler, _POLICY))
    if support.NAME not in FORWARD_ABSORB_CORE_ATTENTION_BACKENDS:
        FORWARD_ABSORB_CORE_ATTENTION_BACKENDS.append(support.NAME)


def create_backend(runner):
    reason = config_reason(runner)
    if reason:
        raise ValueError(f"--attention-backend {support.NAME}: {reason}")
    register_deepseek_policy()
    from .dense import MLADenseBackend

    return MLADenseBackend(runner)
