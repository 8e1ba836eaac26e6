"""The SGLang gpu tier (scripts/gpu-sglang): SGLang's attention test kit against mla_backend,
and tiny DeepSeek-V3 engines. Collected only where SGLang imports and a CUDA device exists
(the kit imports sgl_kernel, whose import needs the GPU): the GPU machine with SGLang's kit.
The vLLM environment's default `python -m pytest` never sees this folder; scripts/gpu-sglang
fails when no test passed."""

import importlib.util

import torch

_RUNS = importlib.util.find_spec("sglang") is not None and torch.cuda.is_available()
collect_ignore_glob = [] if _RUNS else ["test_*.py"]
