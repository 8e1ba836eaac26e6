"""Run one SGLang engine (sgl.Engine) in a process of its own and write what it generated as
JSON, in the form mla_backend.demo.engines.compare reads.

    python -m mla_backend.demo.sglang_run SPEC.json RESULT.json

SPEC keys: model (dir with config.json + model.safetensors), backend (attention backend name),
graphs (bool: decode CUDA graphs), kv_cache_dtype ("auto" / "fp8_e4m3"), context_length,
chunked_prefill_size, max_running_requests, mem_fraction_static, prompts (token-id lists),
max_new_tokens, logprobs (top-k per position); optional: engine_args (more sgl.Engine
arguments), env (variables added to the child's environment). `run(spec, log_path)` starts
this module in a child process (the Engine spawns its scheduler; one engine per process frees
the GPU on exit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


def _engine(spec: dict):
    import sglang as sgl

    return sgl.Engine(
        model_path=spec["model"], skip_tokenizer_init=True, attention_backend=spec["backend"],
        kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
        context_length=spec.get("context_length", 4096),
        chunked_prefill_size=spec.get("chunked_prefill_size", 1024),
        max_running_requests=spec.get("max_running_requests", 16),
        cuda_graph_max_bs_decode=spec.get("max_running_requests", 16),
        mem_fraction_static=spec.get("mem_fraction_static", 0.3),
        disable_cuda_graph=not spec.get("graphs", True), random_seed=0, log_level="info",
        **spec.get("engine_args", {}))


def _outputs(results: list[dict]) -> list[dict]:
    """SGLang's meta_info -> {token_ids, logprobs: per position [[token, logprob], ...]}."""
    outs = []
    for r in results:
        top = r["meta_info"]["output_top_logprobs"]
        outs.append({"token_ids": list(r["output_ids"]),
                     "logprobs": [[[int(t), float(lp)] for lp, t, _ in (pos or [])]
                                  for pos in top]})
    return outs


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    start = time.time()
    engine = _engine(spec)
    started = time.time()
    try:
        results = engine.generate(
            input_ids=spec["prompts"], return_logprob=True,
            top_logprobs_num=spec.get("logprobs", 5),
            sampling_params={"max_new_tokens": spec.get("max_new_tokens", 12),
                             "temperature": 0.0, "ignore_eos": True})
    finally:
        engine.shutdown()
    with open(out_path, "w") as f:
        json.dump({"outputs": _outputs(results), "engine_start_s": started - start,
                   "generate_s": time.time() - started}, f)
    return 0


def run(spec: dict, log_path: str, timeout_s: float = 600) -> dict:
    """Run one engine in a child process (its output to log_path) and return its result."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        with open(log_path, "w") as log:
            try:
                rc = subprocess.run([sys.executable, "-m", "mla_backend.demo.sglang_run",
                                     spec_path, out_path], stdout=log, stderr=subprocess.STDOUT,
                                    timeout=timeout_s,
                                    env=dict(os.environ, PYTHONUNBUFFERED="1",
                                             **spec.get("env", {}))).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        if rc != 0 or not os.path.exists(out_path):
            with open(log_path) as f:
                tail = "".join(f.readlines()[-40:])
            raise RuntimeError(f"SGLang engine {spec['backend']} failed (exit {rc}); log "
                               f"{log_path}:\n{tail}")
        with open(out_path) as f:
            return json.load(f)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
