"""The factory SGLang calls for `--attention-backend mla_backend` (in each scheduler process).

It checks the configuration first (a ValueError with one actionable sentence, which SGLang
reports as the scheduler's start-up error), registers the DeepSeek-side policy for our name,
and returns the dense backend (DeepSeek-V2/V3/R1) or the DSA backend (DeepSeek-V3.2 and other
models SGLang runs with DeepSeek sparse attention).
"""

from __future__ import annotations

import torch

from . import support

# SGLang's DeepSeek model asks, per batch, which forward method to take (MHA prefill, chunked
# MHA, absorbed MLA). Dense: our prefill is SGLang's FlashInfer MLA code, as in its flashmla
# backend, so we take flashmla's policy. DSA: the dsa backend's policy, which reads the
# backend's use_mha (always False in ours: absorbed MLA with the indexer for every batch).
_DENSE_POLICY = "handle_attention_flashmla"
_SPARSE_POLICY = "handle_attention_dsa"


def is_sparse_model(runner) -> bool:
    """Whether SGLang runs this model with DeepSeek sparse attention (an indexer's top-k)."""
    from sglang.srt.configs.model_config import is_deepseek_dsa

    return is_deepseek_dsa(runner.model_config.hf_config)


def config_reason(runner) -> str | None:
    """Why this model / server configuration cannot run on mla_backend, or None."""
    from sglang.srt.configs.model_config import AttentionArch
    from sglang.srt.runtime_context import get_parallel, get_spec

    config = runner.model_config
    sparse = is_sparse_model(runner)
    is_mla = sparse or getattr(config, "attention_arch", None) == AttentionArch.MLA
    reason = support.model_reason(
        is_mla=is_mla, kv_lora_rank=getattr(config, "kv_lora_rank", None),
        qk_rope_head_dim=getattr(config, "qk_rope_head_dim", None))
    reason = reason or support.page_size_reason(runner.page_size)
    parallel = get_parallel()
    heads = config.num_attention_heads // parallel.attn_tp_size
    reason = reason or support.parallel_reason(heads, getattr(parallel, "attn_dcp_size", 1))
    if sparse:
        pool = getattr(runner, "token_to_kv_pool", None)
        reason = reason or support.sparse_dtype_reason(runner.dtype, runner.kv_cache_dtype)
        reason = reason or support.sparse_cache_reason(
            runner.kv_cache_dtype, getattr(pool, "kv_cache_dim", None),
            bool(getattr(pool, "dsa_kv_cache_store_fp8", False)))
        reason = reason or support.sparse_parallel_reason(
            getattr(parallel, "attn_cp_size", 1),
            getattr(runner, "hisparse_coordinator", None) is not None)
        reason = reason or support.sparse_split_reason(*_phase_backends(runner))
    else:
        reason = reason or support.dtype_reason(runner.dtype, runner.kv_cache_dtype)
        spec = get_spec()
        reason = reason or support.speculative_reason(spec.speculative_num_draft_tokens,
                                                      spec.speculative_eagle_topk)
    return reason or support.platform_reason(_device_capability(runner), _extension_error())


def _phase_backends(runner) -> tuple[str | None, str | None]:
    """(prefill, decode) attention backend names as SGLang resolves them for this runner
    (ServerArgs.get_attention_backends' rule, read field by field: a test kit's server
    arguments may be a partial stand-in); a draft worker's override is one backend for both."""
    args = getattr(runner, "server_args", None)
    if args is None or getattr(runner, "is_draft_worker", False):
        return None, None
    both = getattr(args, "attention_backend", None)
    return (getattr(args, "prefill_attention_backend", None) or both,
            getattr(args, "decode_attention_backend", None) or both)


def _device_capability(runner) -> tuple[int, int] | None:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(torch.device(runner.device))


def _extension_error() -> str | None:
    from .. import _extension

    return None if _extension.is_available() else _extension.why_unavailable()


def register_deepseek_policy(sparse: bool = False) -> None:
    """Our name in SGLang's DeepSeek model: the forward-method policy (flashmla's for dense
    models, dsa's for DSA models), and the query and key handed over in two parts (nope,
    rope) so the KV write needs no concatenation."""
    from sglang.srt.models.deepseek_common import attention_backend_handler as handler
    from sglang.srt.models.deepseek_common.utils import FORWARD_ABSORB_CORE_ATTENTION_BACKENDS

    policy = _SPARSE_POLICY if sparse else _DENSE_POLICY
    handler.AttentionBackendRegistry.register(support.NAME, getattr(handler, policy))
    if support.NAME not in FORWARD_ABSORB_CORE_ATTENTION_BACKENDS:
        FORWARD_ABSORB_CORE_ATTENTION_BACKENDS.append(support.NAME)


def create_backend(runner):
    reason = config_reason(runner)
    if reason:
        raise ValueError(f"--attention-backend {support.NAME}: {reason}")
    sparse = is_sparse_model(runner)
    register_deepseek_policy(sparse)
    if sparse:
        from .dsa import MLASparseBackend

        return MLASparseBackend(runner)
    from .dense import MLADenseBackend

    return MLADenseBackend(runner)
