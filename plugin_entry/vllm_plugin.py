"""vLLM `vllm.general_plugins` entry point.

vLLM calls `register()` once in every process (API server, engine core, each worker). It
must stay cheap and idempotent and import neither CUDA nor our extension: the attention
backend is registered by string path, so vLLM imports it only in the worker that selects
`--attention-backend CUSTOM`. One class holds the CUSTOM slot for dense and sparse MLA models
(mla_backend.vllm.router.MLABackendRouter picks the backend per layer).
"""

import logging

ROUTER = "mla_backend.vllm.router.MLABackendRouter"
_logger = logging.getLogger("mla_backend")
_registered = False


def register() -> None:
    """Register mla_backend as vLLM's AttentionBackendEnum.CUSTOM (once per process). A CUSTOM
    backend that something else registered first is left in place, with a warning."""
    global _registered
    if _registered:
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    try:
        current = AttentionBackendEnum.CUSTOM.get_path()
    except ValueError:  # CUSTOM is empty until someone registers it
        current = None
    if current not in (None, ROUTER):
        _logger.warning("mla_backend: AttentionBackendEnum.CUSTOM is already registered as %s; "
                        "leaving it (mla_backend's backend is %s)", current, ROUTER)
    else:
        register_backend(AttentionBackendEnum.CUSTOM, ROUTER)
    _registered = True
