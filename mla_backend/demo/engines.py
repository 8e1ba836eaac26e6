"""Start engines in child processes (vLLM: mla_backend.demo.engine_run, SGLang:
mla_backend.demo.sglang_run) and compare what they generated. Used by the demo, the e2e tests
and bench/e2e_decode.py."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time


class EngineFailed(RuntimeError):
    pass


VLLM_RUNNER = "mla_backend.demo.engine_run"
SGLANG_RUNNER = "mla_backend.demo.sglang_run"
# engine -> (its Python package, how to install it)
PACKAGES = {"vllm": ("vllm", "pip install vllm==0.25.0 (or a 0.33.x release)"),
            "sglang": ("sglang", 'pip install "sglang==0.5.17"')}
SGLANG_ENTRY_POINT = "mla_backend_entry.sglang_plugin:register"


def sglang_entry_point_installed() -> bool:
    """Whether this package's sglang.srt.plugins entry point is installed: SGLang's scheduler
    processes load the plugin only through it."""
    from importlib.metadata import entry_points

    return any(ep.name == "mla_backend" and ep.value == SGLANG_ENTRY_POINT
               for ep in entry_points(group="sglang.srt.plugins"))


def engine_missing(engine: str) -> str | None:
    """Why `engine` ("vllm" or "sglang") cannot run from this Python (None: it can): its
    package is not importable, or, for SGLang, this package's plugin entry point is not
    installed. (vLLM's runner registers the plugin itself where the entry point is missing.)"""
    package, install = PACKAGES[engine]
    if importlib.util.find_spec(package) is None:
        return (f"--engine {engine}: the {package} package is not importable by "
                f"{sys.executable}; install it there ({install}) or pick another --engine")
    if engine == "sglang" and not sglang_entry_point_installed():
        return ("--engine sglang: mla_backend's sglang.srt.plugins entry point is not installed "
                f"in {sys.executable} (SGLang loads the backend only through it): from the "
                "clone, python -m pip install --no-build-isolation -e .")
    return None


def run_engine(spec: dict, log_path: str, *, label: str = "", progress: bool = False,
               timeout_s: float = 900, env: dict | None = None,
               runner: str = VLLM_RUNNER, engine: str = "vLLM") -> dict:
    """Run one engine (python -m `runner` SPEC RESULT) and return its result. Its output goes
    to log_path; with progress, stderr shows the seconds until it ends: one line updated in
    place on a terminal, else a plain line now and then (a log stays short)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        child_env = dict(os.environ, **(env or {}))
        child_env.setdefault("PYTHONUNBUFFERED", "1")
        start = time.time()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", runner, spec_path, out_path],
                stdout=log, stderr=subprocess.STDOUT, env=child_env)
            done = threading.Event()
            tty = sys.stderr.isatty()
            if progress:
                if not tty:
                    print(f"{label}: starting {engine} and generating (log: {log_path})",
                          file=sys.stderr, flush=True)
                threading.Thread(target=_tick, args=(label, engine, start, done, tty),
                                 daemon=True).start()
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = "timeout"
            finally:
                done.set()
        if progress:
            finished = f"{label}: finished in {time.time() - start:.0f} s"
            print(f"\r{finished}" + " " * 20 if tty else finished, file=sys.stderr, flush=True)
        if rc != 0 or not os.path.exists(out_path):
            with open(log_path) as f:
                tail = "".join(f.readlines()[-40:])
            raise EngineFailed(f"{label or 'engine'} failed (exit {rc}); log {log_path}:\n{tail}")
        with open(out_path) as f:
            return json.load(f)


def _tick(label: str, engine: str, start: float, done: threading.Event, tty: bool) -> None:
    """Progress: on a terminal every 2 s, rewriting one line; elsewhere a new line a minute."""
    while not done.wait(2.0 if tty else 60.0):
        elapsed = time.time() - start
        if tty:
            print(f"\r{label}: starting {engine} and generating ... {elapsed:.0f} s", end="",
                  file=sys.stderr, flush=True)
        else:
            print(f"{label}: still running after {elapsed:.0f} s", file=sys.stderr, flush=True)


def step_timing(step_s: list[float], timing: dict) -> dict:
    """A runner's decode timing result from its repeats' seconds per step (median of them),
    with the timing spec it ran."""
    step = statistics.median(step_s)
    return {"step_us": step * 1e6, "decode_tokens_per_s": timing["batch"] / step,
            "step_us_all": [s * 1e6 for s in step_s], **timing}


def _lead(top: dict, own: int, other: int) -> float | None:
    return top[own] - top[other] if own in top and other in top else None


def compare(a: list[dict], b: list[dict]) -> dict:
    """Greedy outputs of two engines on the same prompts. Per prompt, positions are compared
    up to and including the first where the chosen tokens differ (after it the contexts
    differ). At each compared position: the largest |logprob_a - logprob_b| over tokens in
    both top-k lists, and the top-k overlap. Where the tokens part: both tokens and each
    engine's logprob margin of its token over the other's."""
    max_diff, positions, matched, total, divergences = 0.0, 0, 0, 0, []
    min_overlap = None
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        n = min(len(x["token_ids"]), len(y["token_ids"]))
        total += n
        for j in range(n):
            lx, ly = dict(map(tuple, x["logprobs"][j])), dict(map(tuple, y["logprobs"][j]))
            common = lx.keys() & ly.keys()
            overlap = len(common) / max(1, min(len(lx), len(ly)))
            min_overlap = overlap if min_overlap is None else min(min_overlap, overlap)
            if common:
                max_diff = max(max_diff, max(abs(lx[t] - ly[t]) for t in common))
            positions += 1
            ta, tb = x["token_ids"][j], y["token_ids"][j]
            if ta != tb:
                # each engine's lead of its own token over the other's (None: the other's
                # token is not in its top-k): a near-tie reads as small margins
                divergences.append({"prompt": i, "position": j, "tokens": [ta, tb],
                                    "margins": [_lead(lx, ta, tb), _lead(ly, tb, ta)]})
                break
            matched += 1
    return {"max_abs_logprob_diff": max_diff, "positions_compared": positions,
            "min_topk_overlap": min_overlap if min_overlap is not None else 1.0,
            "matching_tokens": matched, "total_tokens": total, "divergences": divergences}
