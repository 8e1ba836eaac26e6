"""vLLM `vllm.general_plugins` entry point (installed as mla_backend_entry.vllm_plugin).

vLLM calls `register()` once in every process (API server, engine core, each worker). It
stays cheap and idempotent and imports neither CUDA nor our extension: it registers the
attention backend by string path (mla_backend.vllm.registration), so vLLM imports the backend
only in the worker that selects `--attention-backend CUSTOM`.
"""

from mla_backend.vllm.registration import ROUTER, register

__all__ = ["ROUTER", "register"]
