"""Run one SGLang engine (sgl.Engine) in a process of its own and write what it generated (and
how fast it decodes) as JSON, in the form mla_backend.demo.engines.compare reads.

    python -m mla_backend.demo.sglang_run SPEC.json RESULT.json

SPEC keys: model (dir with config.json, and model.safetensors unless load_format is "dummy"),
backend (attention backend name), graphs (bool: decode CUDA graphs), kv_cache_dtype ("auto" /
"fp8_e4m3"), load_format, context_length, chunked_prefill_size, max_running_requests (also
the largest decode graph), mem_fraction_static (default: SGLang's), prompts (token-id lists),
max_new_tokens, logprobs (top-k per position); optional: engine_args (more sgl.Engine
arguments), env (variables added to the child's environment), timing {prompt_len, batch,
steps, repeats, log_interval, gpu_busy}: decode-step time (see _time_decode). `run(spec, log_path)`
starts this module in a child process (the Engine spawns its scheduler; one engine per
process frees the GPU on exit).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

from . import engines, gpu_busy

# SGLang's scheduler records decode-step times only with this set (read when it starts)
STEP_TIME_ENV = {"SGLANG_RECORD_STEP_TIME": "1"}
# SGLang's `dsa` sends prefills whose keys fit in index_topk to a dense FA3 kernel unless this
# is 0 (FA3 is not in every SGLang install; mla_backend never takes that route)
DSA_SPARSE_PREFILL_ENV = {"SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD": "0"}


def dsa_spec(prefill: str, decode: str, kv_cache_dtype: str) -> dict:
    """Spec keys that run SGLang's own `dsa` backend on a DSA model with its kernels named
    (`prefill`, `decode`: its --dsa-*-backend names; on Hopper its decode default for a bf16
    cache is FA3), an explicit cache (its "auto" depends on the GPU) and every prefill on them."""
    return {"backend": "dsa", "kv_cache_dtype": kv_cache_dtype, "env": DSA_SPARSE_PREFILL_ENV,
            "engine_args": {"dsa_prefill_backend": prefill, "dsa_decode_backend": decode}}


def _engine(spec: dict):
    import sglang as sgl

    extra = dict(spec.get("engine_args", {}))
    if spec.get("mem_fraction_static") is not None:  # else SGLang's own choice
        extra["mem_fraction_static"] = spec["mem_fraction_static"]
    if spec.get("timing"):
        extra["decode_log_interval"] = spec["timing"].get("log_interval", 16)
    return sgl.Engine(
        model_path=spec["model"], skip_tokenizer_init=True, attention_backend=spec["backend"],
        kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
        load_format=spec.get("load_format", "auto"),
        context_length=spec.get("context_length", 4096),
        chunked_prefill_size=spec.get("chunked_prefill_size", 1024),
        max_running_requests=spec.get("max_running_requests", 16),
        cuda_graph_max_bs_decode=spec.get("max_running_requests", 16),
        disable_cuda_graph=not spec.get("graphs", True), random_seed=0, log_level="info",
        **extra)


def _outputs(prompts: list[list[int]], results: list[dict]) -> list[dict]:
    """SGLang's meta_info -> {prompt_len, token_ids, logprobs: per position [[token, logprob],
    ...]}."""
    outs = []
    for prompt, r in zip(prompts, results, strict=True):
        top = r["meta_info"]["output_top_logprobs"]
        outs.append({"prompt_len": len(prompt), "token_ids": list(r["output_ids"]),
                     "logprobs": [[[int(t), float(lp)] for lp, t, _ in (pos or [])]
                                  for pos in top]})
    return outs


def step_times(engine) -> dict[int, list[float]]:
    """Every decode-step time SGLang's scheduler recorded so far (SGLANG_RECORD_STEP_TIME), in
    order: one per `decode_log_interval` decode steps, the interval's wall time over its steps,
    keyed by the running batch size (int keys, or str after serialization)."""
    state = engine.get_server_info()["internal_states"][0]
    return {int(bs): list(times) for bs, times in state.get("step_time_dict", {}).items()}


def repeat_step_s(before: dict, after: dict, batch: int) -> float:
    """One timed generate call's decode-step time from SGLang's step records before and after
    it (step_times): the records it added with the whole batch running, less the first (its
    interval began before the call: it spans the idle time and the prefill); their median."""
    new = after.get(batch, [])[len(before.get(batch, [])):]
    if len(new) < 2:
        raise RuntimeError(f"{len(new)} step records of batch {batch} in a timed call; need 2 "
                           "or more: raise steps or lower log_interval")
    return statistics.median(new[1:])


def start_decode_profile(engine, out_dir: str, profile_id: str, steps: int) -> int:
    """SGLang's own profiler (torch's, in the scheduler process) over the next `steps` - 2
    decode batches, GPU activity only: it starts at the first decode batch and stops by
    itself at the one after the last, inside a timed call of `steps` decode steps (2 spare,
    so the stop comes within the call). Returns the number of steps it records."""
    n = steps - 2
    if n < 1:
        raise ValueError(f"steps {steps}: the GPU busy timing needs 3 or more")
    engine.start_profile(output_dir=out_dir, num_steps=n, activities=["GPU"],
                         profile_by_stage=True, profile_stages=["decode"],
                         profile_id=profile_id, with_stack=False, record_shapes=False)
    return n


def decode_trace(engine, out_dir: str, profile_id: str) -> str:
    """The decode trace start_decode_profile's profile wrote (SGLang names it after the id,
    the rank and the stage); a profile that did not stop by itself is stopped and is an
    error."""
    names = [f for f in sorted(os.listdir(out_dir))
             if f.startswith(profile_id) and "decode" in f.lower() and ".trace.json" in f]
    if not names:
        try:
            engine.stop_profile()
        except Exception:  # not in progress: nothing to stop
            pass
        raise RuntimeError(f"no decode trace of profile {profile_id} in {out_dir} "
                           f"({sorted(os.listdir(out_dir))}): the profile did not stop within "
                           "the timed call")
    return os.path.join(out_dir, names[0])


def _time_decode(engine, model: str, timing: dict) -> dict:
    """Decode-step time of `batch` requests whose `prompt_len`-token prompts are in SGLang's
    radix cache (a first generate puts them there and warms up), each timed call generating
    1 + `steps` tokens (the first from the prefill of the uncached tail): SGLang's own
    per-step records (repeat_step_s), median of `repeats` calls. Prefill is not in it.
    With timing["gpu_busy"], also the GPU's busy µs per decode step of each call
    (start_decode_profile; gpu_busy.read_trace: the union of kernels, copies and memsets)."""
    import torch

    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, vocab, (timing["prompt_len"],), generator=gen).tolist()
               for _ in range(timing["batch"])]
    params = {"max_new_tokens": 1 + timing.get("steps", 64), "temperature": 0.0,
              "ignore_eos": True}
    engine.generate(input_ids=prompts, sampling_params=params)
    step_s, busy = [], []
    with tempfile.TemporaryDirectory(prefix="sglang_busy_") as traces:
        for r in range(timing.get("repeats", 3)):
            before = step_times(engine)
            if timing.get("gpu_busy"):
                n = start_decode_profile(engine, traces, f"busy{r}", timing.get("steps", 64))
            engine.generate(input_ids=prompts, sampling_params=params)
            step_s.append(repeat_step_s(before, step_times(engine), timing["batch"]))
            if timing.get("gpu_busy"):
                us, kernels, by_name = gpu_busy.read_trace(decode_trace(engine, traces,
                                                                        f"busy{r}"))
                busy.append((us / n, kernels / n, gpu_busy.top_names(by_name, 16, n)))
    result = engines.step_timing(step_s, timing)
    if busy:
        result["gpu_busy_us_all"] = [b[0] for b in busy]
        result["gpu_kernels_per_step"] = [b[1] for b in busy]
        result["gpu_top_us_per_step"] = busy[-1][2]  # the last call's
    return result


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    start = time.time()
    engine = _engine(spec)
    result = {"spec": {k: v for k, v in spec.items() if k != "prompts"},
              "engine_start_s": time.time() - start}
    try:
        if spec.get("prompts"):
            started = time.time()
            out = engine.generate(
                input_ids=spec["prompts"], return_logprob=True,
                top_logprobs_num=spec.get("logprobs", 5),
                sampling_params={"max_new_tokens": spec.get("max_new_tokens", 12),
                                 "temperature": 0.0, "ignore_eos": True})
            result["outputs"] = _outputs(spec["prompts"], out)
            result["generate_s"] = time.time() - started
        if spec.get("timing"):
            try:
                result["timing"] = _time_decode(engine, spec["model"], spec["timing"])
            except Exception as e:  # the outputs above still stand; the caller reports this
                result["timing_error"] = f"{type(e).__name__}: {e}"
    finally:
        engine.shutdown()
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


def run(spec: dict, log_path: str, timeout_s: float = 600, *, label: str = "",
        progress: bool = False) -> dict:
    """Run one engine in a child process (its output to log_path) and return its result;
    engines.EngineFailed with the log's tail if it fails. A spec with timing gets SGLang's
    step records switched on."""
    env = dict(spec.get("env", {}), **(STEP_TIME_ENV if spec.get("timing") else {}))
    return engines.run_engine(spec, log_path, label=label or f"SGLang engine {spec['backend']}",
                              progress=progress, timeout_s=timeout_s, env=env,
                              runner=engines.SGLANG_RUNNER, engine="SGLang")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
