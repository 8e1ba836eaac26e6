"""Run one vLLM engine in this process and write what it generated (and how fast) as JSON.

    python -m mla_backend.demo.engine_run SPEC.json RESULT.json

One engine per process: the demo, the e2e tests and bench/e2e_decode.py start this module
once per backend, so every engine starts clean and frees its GPU memory on exit.

SPEC keys: model (dir), backend (an AttentionBackendEnum name, or null for vLLM's choice),
mode ("eager": enforce_eager; "graphs": FULL CUDA graphs for decode, no torch.compile;
"default": vLLM's default -O2), kv_cache_dtype, load_format, max_model_len, max_num_seqs,
max_num_batched_tokens, tensor_parallel_size, decode_context_parallel_size,
gpu_memory_utilization, kv_cache_memory_bytes (a fixed KV cache: vLLM then skips its memory
profiling, so engines can share GPUs), speculative (vLLM's speculative_config or null),
async_scheduling (null: vLLM's default), tokenizer (bool: the model dir has one), prompts
(token-id lists), max_tokens, logprobs, and optionally timing {prompt_len, batch, steps,
repeats, gpu_busy}: decode-step time (see _time_decode; gpu_busy: also the GPU's busy time
per step, gpu_busy.py), and preload {module: options}: modules
imported into the engine's process before the engine is built (see _preload).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import time

from . import engines, gpu_busy

ENTRY_POINT = "mla_backend_entry.vllm_plugin:register"


def entry_point_installed() -> bool:
    """Whether this package's vllm.general_plugins entry point is installed (then every
    vLLM process, the engine core included, loads the plugin)."""
    from importlib.metadata import entry_points

    return any(ep.name == "mla_backend" and ep.value == ENTRY_POINT
               for ep in entry_points(group="vllm.general_plugins"))


def _preload(spec: dict) -> dict:
    """Import each module named in spec["preload"] and call its install(options), before the
    engine exists, so that what it patches (e.g. an op looked up at call time) is what the
    engine runs. The engine core and its one worker must then run in this process:
    VLLM_ENABLE_V1_MULTIPROCESSING=0 and one GPU (vLLM's uni-process executor). Returns the
    imported modules by name."""
    preload = spec.get("preload") or {}
    if preload:
        if spec.get("tensor_parallel_size", 1) > 1:
            raise ValueError("preload modules reach the engine only with one GPU "
                             "(tensor_parallel_size 1): other ranks run in other processes")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    modules = {}
    for name, options in preload.items():
        modules[name] = importlib.import_module(name)
        modules[name].install(options or {})
    return modules


def _llm(spec: dict):
    if (spec.get("timing") or {}).get("gpu_busy"):
        # the profiler records the GPU work of this process: keep the engine core in it
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if not entry_point_installed():
        # Our package is importable (PYTHONPATH) but not pip-installed: vLLM's engine-core
        # process would not load the plugin, so keep the engine in this process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from mla_backend.vllm.registration import register

        register()
    from vllm import LLM

    kwargs = dict(model=spec["model"], skip_tokenizer_init=not spec.get("tokenizer", False),
                  dtype="bfloat16", max_model_len=spec.get("max_model_len", 4096),
                  max_num_seqs=spec.get("max_num_seqs", 64),
                  gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.5),
                  kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
                  load_format=spec.get("load_format", "auto"), seed=0)
    if spec.get("tensor_parallel_size", 1) > 1:
        kwargs["tensor_parallel_size"] = spec["tensor_parallel_size"]
    if spec.get("decode_context_parallel_size", 1) > 1:
        kwargs["decode_context_parallel_size"] = spec["decode_context_parallel_size"]
    if spec.get("kv_cache_memory_bytes"):
        kwargs["kv_cache_memory_bytes"] = spec["kv_cache_memory_bytes"]
    if spec.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    if spec.get("backend"):
        kwargs["attention_config"] = {"backend": spec["backend"]}
    mode = spec.get("mode", "graphs")
    if mode == "eager":
        kwargs["enforce_eager"] = True
    elif mode == "graphs":
        kwargs["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    elif mode != "default":
        raise ValueError(f"mode must be eager, graphs or default; got {mode!r}")
    if spec.get("async_scheduling") is not None:
        kwargs["async_scheduling"] = spec["async_scheduling"]
    if spec.get("speculative"):
        # a copy: vLLM stores objects (its ModelConfig) into the dict it is given
        kwargs["speculative_config"] = dict(spec["speculative"])
    return LLM(**kwargs)


def _prompt(ids):
    return {"prompt_token_ids": list(ids)}


def _generate(llm, spec: dict) -> list[dict]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=spec.get("max_tokens", 16), temperature=0.0,
                            logprobs=spec.get("logprobs", 5), detokenize=False, ignore_eos=True)
    outs = llm.generate([_prompt(p) for p in spec["prompts"]], params, use_tqdm=False)
    results = []
    for out in outs:
        comp = out.outputs[0]
        top = []
        for pos in comp.logprobs or []:
            top.append(sorted(([int(t), float(lp.logprob)] for t, lp in pos.items()),
                              key=lambda x: -x[1]))
        results.append({"prompt_len": len(out.prompt_token_ids),
                        "token_ids": [int(t) for t in comp.token_ids], "logprobs": top})
    return results


def _decode_step_s(llm, prompts: list[dict], steps: int, tag: str, busy=None) -> float:
    """Drive the engine step by step: once every request has its first token (prefill done),
    each engine step gives each of them one new token. The step time is the span between the
    first and the last engine step that returned the whole batch, over the tokens the slowest
    request gained between them: a step whose outputs arrive in parts, or are not returned on
    their own, still counts once. Prefill is not in it. Python's garbage collector is off
    while the steps run (after one collection), as timeit does: a collection of the engine's
    large heap inside the timed span would be charged to the backend under test. The
    collection comes before the requests are added: an engine core in its own process (the
    package pip-installed) would run ahead during it, and the timed span would then be this
    process reading that backlog, faster than the engine ran.

    busy (a gpu_busy.GpuBusy), if given, records the GPU over the same span: started after the
    first whole-batch step, stopped after the last; busy.steps is set to the steps it saw."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=1 + steps, temperature=0.0, ignore_eos=True,
                            detokenize=False)
    produced: dict[str, int] = {}
    stamps = []  # (time, tokens of the request with the fewest)
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{tag}-{i}", prompt, params)
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.perf_counter()
            for o in outs:
                produced[o.request_id] = len(o.outputs[0].token_ids)
            decoding = len(produced) == len(prompts) and min(produced.values()) >= 2
            if decoding and len(outs) == len(prompts):
                stamps.append((now, min(produced.values())))
                if busy is not None and len(stamps) == 1:
                    busy.start()
        if busy is not None and stamps:
            busy.stop()
    finally:
        if gc_was_enabled:
            gc.enable()
    (t0, n0), (t1, n1) = (stamps[0], stamps[-1]) if stamps else ((0.0, 0), (0.0, 0))
    if len(stamps) < 3 or n1 - n0 < 2:
        raise RuntimeError(f"only {len(stamps)} whole-batch decode steps seen; raise steps")
    if busy is not None:
        busy.steps = n1 - n0
    return (t1 - t0) / (n1 - n0)


def _time_decode(llm, timing: dict) -> dict:
    """Decode-step time of `batch` requests whose prompts are in vLLM's prefix cache, from
    the engine's own step loop (_decode_step_s). Median of repeats."""
    import torch
    from vllm import SamplingParams

    gen = torch.Generator().manual_seed(1)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    prompts = [_prompt(torch.randint(2, vocab, (timing["prompt_len"],), generator=gen).tolist())
               for _ in range(timing["batch"])]
    steps = timing.get("steps", 64)
    # prefill once (later requests find the prompts in the prefix cache) and warm up
    llm.generate(prompts, SamplingParams(max_tokens=1 + steps, temperature=0.0,
                                         ignore_eos=True, detokenize=False), use_tqdm=False)
    step_s, gpu = [], []
    for r in range(timing.get("repeats", 3)):
        busy = gpu_busy.GpuBusy() if timing.get("gpu_busy") else None
        step_s.append(_decode_step_s(llm, prompts, steps, f"timing{r}", busy))
        if busy is not None:
            gpu.append({"busy_us": busy.busy_us / busy.steps,
                        "kernels": busy.kernels / busy.steps,
                        "top": busy.top(16, busy.steps)})
    result = engines.step_timing(step_s, timing)
    if gpu:
        result["gpu_busy_us_all"] = [g["busy_us"] for g in gpu]
        result["gpu_kernels_per_step"] = [g["kernels"] for g in gpu]
        result["gpu_top_us_per_step"] = gpu[-1]["top"]  # the last repeat's
    return result


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    t0 = time.perf_counter()
    preloaded = _preload(spec)
    llm = _llm(spec)
    result = {"spec": {k: v for k, v in spec.items() if k != "prompts"},
              "engine_start_s": time.perf_counter() - t0}
    cfg = getattr(llm.llm_engine, "vllm_config", None)
    if cfg is not None:
        result["use_v2_model_runner"] = bool(getattr(cfg, "use_v2_model_runner", False))
        result["cudagraph_mode"] = str(cfg.compilation_config.cudagraph_mode)
    if spec.get("prompts"):
        result["outputs"] = _generate(llm, spec)
    if spec.get("timing"):
        try:
            result["timing"] = _time_decode(llm, spec["timing"])
        except Exception as e:  # the outputs above still stand; the caller reports this
            result["timing_error"] = f"{type(e).__name__}: {e}"
    # what each preloaded module saw in the engine (if it reports anything)
    reports = {name: mod.report() for name, mod in preloaded.items() if hasattr(mod, "report")}
    if reports:
        result["preload"] = reports
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
