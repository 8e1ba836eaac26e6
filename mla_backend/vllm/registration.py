"""Registering mla_backend as vLLM's `AttentionBackendEnum.CUSTOM`.

The backend is registered by string path, so this imports neither CUDA, our extension nor
the adapters: vLLM imports them only in the worker that selects `--attention-backend CUSTOM`.
One class holds the CUSTOM slot for dense and sparse MLA models (router.MLABackendRouter
picks the backend per layer). Called by the `vllm.general_plugins` entry point
(mla_backend_entry.vllm_plugin) in every vLLM process, and by code that runs a vLLM engine in
its own process without that entry point installed.
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

    from .version import unsupported_reason

    unsupported = unsupported_reason()
    if unsupported:  # registered all the same: selecting CUSTOM then says why it cannot run
        _logger.warning("mla_backend: %s", unsupported)

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
