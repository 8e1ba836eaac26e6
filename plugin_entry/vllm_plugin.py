"""vLLM `vllm.general_plugins` entry point.

vLLM calls `register()` once in every process (API server, engine core, each worker). It
must stay cheap and idempotent and import neither CUDA nor our extension. The attention
backend is registered by string path, so vLLM imports it only in the worker that selects
`--attention-backend CUSTOM`.
"""

_registered = False


def register() -> None:
    """Register mla_backend with vLLM. The dense/sparse backend classes land with the vLLM
    backend work; until then there is nothing to register and this is a no-op."""
    global _registered
    if _registered:
        return
    _registered = True
