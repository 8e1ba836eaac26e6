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
_registered = False


def uses_mla_backend(server_args) -> bool:
    """Whether any attention role (all, prefill, decode) of these ServerArgs is ours."""
    return NAME in (getattr(server_args, "attention_backend", None),
                    getattr(server_args, "prefill_attention_backend", None),
                    getattr(server_args, "decode_attention_backend", None))


def set_defaults(server_args, *args, **kwargs) -> None:
    """BEFORE hook on ServerArgs.__post_init__, for our backend: an unset --page-size becomes
    64 (any other explicit value is refused; SGLang shows the ValueError), and with speculative
    decoding an unset --speculative-draft-attention-backend becomes flashmla (SGLang builds the
    draft model's multi-step backends from a fixed list of names; the target model, whose
    verify steps run on our kernel, stays on mla_backend)."""
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
        server_args.speculative_draft_attention_backend = DRAFT_BACKEND
        _logger.info("%s: the draft model runs on --speculative-draft-attention-backend %s",
                     NAME, DRAFT_BACKEND)
    return None


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
