"""The SGLang half of bench/e2e_decode.py (`python -m bench.e2e_decode --engine sglang`):
decode-step time of a DeepSeek-shaped model through sgl.Engine, mla_backend vs SGLang's
`flashmla` (and `flashinfer`, `triton` with --backends), on one GPU.

What is timed: SGLang's scheduler's own decode-step records (SGLANG_RECORD_STEP_TIME): the
wall time of each run of `log_interval` decode steps over their number, taken where the whole
batch decodes. Each engine (mla_backend.demo.sglang_run, dummy weights, decode CUDA graphs up
to the batch, SGLang's overlap scheduler) first generates once from `batch` prompts of
context - steps - 1 tokens, which puts them in the radix cache; each timed call then sends
the same prompts again for 1 + steps tokens, and its step time is the median of its records
less the first (that interval spans the idle time and the prefill of the uncached tails).
A step is everything the engine does for one decode step of the batch: the forward of
`layers` layers (attention, MLP, MoE) in the graph, the step's attention metadata, sampling,
and the scheduler's work between steps where it is not overlapped. Not timed: engine start,
graph capture, every prefill, the client's side.

Engines interleaved: `rounds` engine processes per backend, started in turn (round r starts
with backend r mod n, bench.common.round_orders), each timing `repeats` calls. A backend's
`us` is the median of all its calls, `us_rounds` all of them in order, `spread_pct` their
(max - min) / median, printed beside ours vs the best peer: a difference smaller than the
spreads is not resolved.
"""

from __future__ import annotations

import itertools
import os
import statistics
from dataclasses import dataclass, field
from typing import Any

from bench import common
from mla_backend.demo import engines, sglang_run

# key in the results -> SGLang's --attention-backend name
BACKENDS = {"ours": "mla_backend", "flashmla": "flashmla", "flashinfer": "flashinfer",
            "triton": "triton"}
DEFAULT_BACKENDS = ["ours", "flashmla"]
DEFAULT_ROUNDS = 2


@dataclass
class SpreadRow(common.BenchRow):
    """A results row that also carries each backend's spread over its timed calls, in
    percent of its median."""

    spread_pct: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        doc = super().to_json()
        doc["spread_pct"] = {k: round(v, 2) for k, v in self.spread_pct.items()}
        return doc


def engine_spec(model: str, backend: str, *, batch: int, context: int, steps: int,
                repeats: int, log_interval: int) -> dict:
    """sglang_run's spec for one timing engine (no compared prompts)."""
    return {"model": model, "backend": BACKENDS[backend], "load_format": "dummy",
            "graphs": True, "context_length": context + steps + 64,
            "chunked_prefill_size": 8192, "max_running_requests": batch,
            "mem_fraction_static": 0.6,
            # prefill (not timed) on FlashInfer's paged MLA kernel only: one JIT build
            "engine_args": {"flashinfer_mla_disable_ragged": True},
            "timing": {"prompt_len": context - steps - 1, "batch": batch, "steps": steps,
                       "repeats": repeats, "log_interval": log_interval}}


def assemble_row(config: dict, timings: dict[str, list[list[float]]],
                 skipped: dict[str, str]) -> SpreadRow:
    """The row of one config from each backend's step times (us), one list per engine
    process (round); backends that failed are in `skipped` with why."""
    row = SpreadRow(config=dict(config), skipped=dict(skipped))
    for key, rounds in timings.items():
        calls = [us for r in rounds for us in r]
        if not calls:
            row.skipped.setdefault(key, "no timed call")
            continue
        med = statistics.median(calls)
        row.us[key] = med
        row.us_rounds[key] = calls
        row.spread_pct[key] = 100.0 * (max(calls) - min(calls)) / med
    peers = [v for k, v in row.us.items() if k != "ours"]
    if "ours" in row.us and peers:
        row.speedup_vs_best_peer = min(peers) / row.us["ours"]
    return row


def verdict(row: SpreadRow) -> str:
    """One line: each backend's median and spread, and whether ours vs the best peer differs
    by more than the larger of the two spreads."""
    parts = ", ".join(f"{k} {v:.0f} us (spread {row.spread_pct[k]:.1f}%)"
                      for k, v in row.us.items())
    line = f"{common.config_label(row.config)}: {parts}"
    peers = {k: v for k, v in row.us.items() if k != "ours"}
    if "ours" not in row.us or not peers:
        return line
    best = min(peers, key=peers.get)
    diff = 100.0 * abs(peers[best] - row.us["ours"]) / peers[best]
    spread = max(row.spread_pct["ours"], row.spread_pct[best])
    resolved = "resolved" if diff > spread else "not resolved"
    return (f"{line}; ours vs {best}: {row.speedup_vs_best_peer:.3f}x, a difference of "
            f"{diff:.1f}% against a spread of {spread:.1f}%: {resolved}")


def time_row(args, model: str, config: dict, logs: str) -> SpreadRow:
    """Time every backend of args.backends on one model in args.rounds interleaved rounds."""
    heads = config["H"]

    def timer(key: str):
        spec = engine_spec(model, key, batch=args.batch, context=args.context,
                           steps=args.steps, repeats=args.repeats,
                           log_interval=args.log_interval)
        rounds = itertools.count()

        def one_engine() -> list[float]:
            r = next(rounds)
            label = f"H={heads} {BACKENDS[key]} round {r}"
            log_path = os.path.join(logs, f"sglang-h{heads}-{key}-round{r}.log")
            common.log(f"{label}: starting (log {log_path})")
            res = sglang_run.run(spec, log_path, timeout_s=900, label=label)
            if "timing" not in res:
                raise RuntimeError(f"not timed: {res.get('timing_error', 'no timing')}")
            t = res["timing"]
            common.log(f"{label}: {t['step_us']:.0f} us per step ({t['decode_tokens_per_s']:.0f}"
                       f" tokens/s; calls: {', '.join(f'{x:.0f}' for x in t['step_us_all'])};"
                       f" engine start {res['engine_start_s']:.0f} s)")
            return t["step_us_all"]

        return one_engine

    skipped: dict[str, str] = {}

    def failed(key: str, e: Exception) -> None:
        skipped[key] = common.short_error(e)
        common.log(str(e) if isinstance(e, engines.EngineFailed) else skipped[key])

    timings = common.time_in_rounds({k: timer(k) for k in args.backends}, args.rounds, failed)
    return assemble_row(config, timings, skipped)
