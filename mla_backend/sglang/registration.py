"""Registering mla_backend as SGLang's attention backend `mla_backend`.

`register()` runs in every SGLang process (the launcher before argv is parsed, the Engine,
each scheduler) through the `sglang.srt.plugins` entry point (mla_backend_entry.sglang_plugin).
It stays cheap: it touches SGLang's argument lists, its backend registry and its hook registry,
and imports neither CUDA, sgl_kernel nor our kernels. The factory it registers runs in the
scheduler that builds the backend; the heavy imports happen there.
"""

from __future__ import annotations

import logging

from .support import NAME, PAGE_SIZE, page_size_reason

_logger = logging.getLogger("sglang.mla_backend")
_SERVER_ARGS_INIT = "sglang.srt.server_args.ServerArgs.__post_init__"
DRAFT_BACKEND = "flashmla"
SPARSE_DRAFT_BACKEND = "dsa"  # the draft default for DSA models (their draft layers index too)
_registered = False


def uses_mla_backend(server_args) -> bool:
    """Whether any attention role (all, prefill, decode) of these ServerArgs is ours."""
    return NAME in (getattr(server_args, "attention_backend", None),
                    getattr(server_args, "prefill_attention_backend", None),
                    getattr(server_args, "decode_attention_backend", None))


def set_defaults(server_args, *args, **kwargs) -> None:
    """BEFORE hook on ServerArgs.__post_init__, for our backend: an unset --page-size becomes
    64 (any other explicit value is refused; SGLang shows the ValueError), and with speculative
    decoding an unset --speculative-draft-attention-backend becomes flashmla, or dsa for a DSA
    model, whose draft layers run an indexer (SGLang builds the draft model's multi-step
    backends from a fixed list of names; the target model, whose verify steps run on our
    kernel, stays on mla_backend)."""
    if not uses_mla_backend(server_args):
        return None
    if server_args.page_size is None:
        server_args.page_size = PAGE_SIZE
        _logger.info("%s: page size set to %d", NAME, PAGE_SIZE)
    reason = page_size_reason(server_args.page_size)
    if reason:
        raise ValueError(reason)
    if (getattr(server_args, "speculative_algorithm", None)
            and not getattr(server_args, "speculative_draft_attention_backend", None)):
        draft = SPARSE_DRAFT_BACKEND if _is_sparse_model(server_args) else DRAFT_BACKEND
        server_args.speculative_draft_attention_backend = draft
        _logger.info("%s: the draft model runs on --speculative-draft-attention-backend %s",
                     NAME, draft)
    return None


def _is_sparse_model(server_args) -> bool:
    """Whether SGLang runs the served model with DeepSeek sparse attention, from the model's
    config (read here as SGLang reads it: ServerArgs is read-only once resolved, so the draft
    default must be set before)."""
    import json

    if not getattr(server_args, "model_path", None):
        return False  # no model to read (SGLang refuses such arguments itself)
    from sglang.srt.configs.model_config import is_deepseek_dsa
    from sglang.srt.utils.hf_transformers_utils import get_config

    overrides = json.loads(getattr(server_args, "json_model_override_args", None) or "{}")
    config = get_config(server_args.model_path,
                        trust_remote_code=getattr(server_args, "trust_remote_code", False),
                        revision=getattr(server_args, "revision", None),
                        model_override_args=overrides)
    return is_deepseek_dsa(config)


def check_page_size(result, server_args, *args, **kwargs) -> None:
    """AFTER hook: SGLang's own overrides must have left the page size at 64."""
    if uses_mla_backend(server_args):
        reason = page_size_reason(server_args.page_size)
        if reason:
            raise ValueError(reason)
    return None


def create_backend(runner):
    """SGLang's factory for `mla_backend` (runs in the scheduler that builds the backend)."""
    from .factory import create_backend as create

    return create(runner)


def register() -> None:
    """Add `mla_backend` to SGLang's attention-backend choices, register its factory and the
    ServerArgs hooks (once per process)."""
    global _registered
    if _registered:
        return
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import (
        ATTENTION_BACKEND_CHOICES,
        CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS,
        add_attention_backend_choices,
        add_chunked_prefix_cache_attention_backend,
    )

    if NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([NAME])
    # prefill runs on SGLang's FlashInfer MLA code, which reads the chunked prefix cache
    if NAME not in CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS:
        add_chunked_prefix_cache_attention_backend(NAME)
    register_attention_backend(NAME)(create_backend)
    HookRegistry.register(_SERVER_ARGS_INIT, set_defaults, HookType.BEFORE)
    HookRegistry.register(_SERVER_ARGS_INIT, check_page_size, HookType.AFTER)
    _registered = True
