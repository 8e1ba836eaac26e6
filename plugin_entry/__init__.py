"""Entry-point functions for serving frameworks, installed as the package mla_backend_entry
(this folder's name in the source tree is plugin_entry). Nothing heavy is imported here:
these run in every vLLM process (API server included), before CUDA is initialised."""
