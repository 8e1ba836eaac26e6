"""Rows of the end-to-end decode benchmark (bench/e2e_decode.py, vLLM and SGLang alike) timed
in interleaved engine processes: each backend's median over every timed call of all its
engines, the calls themselves, and their spread, printed beside ours vs the best peer so that a
difference smaller than the spreads reads as not resolved."""

from __future__ import annotations

import itertools
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench import common
from mla_backend.demo import engines

DEFAULT_ROUNDS = 2  # engine processes per backend, started in turn


@dataclass
class SpreadRow(common.BenchRow):
    """A results row that also carries each backend's spread over its timed calls, in
    percent of its median, and, where `us` is the GPU's busy time, the wall times per step of
    the same calls."""

    spread_pct: dict[str, float] = field(default_factory=dict)
    wall_us_rounds: dict[str, list[float]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        doc = super().to_json()
        doc["spread_pct"] = {k: round(v, 2) for k, v in self.spread_pct.items()}
        if self.wall_us_rounds:
            doc["wall_us_rounds"] = {k: [round(x, 2) for x in v]
                                     for k, v in self.wall_us_rounds.items()}
        return doc


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


def engine_timer(start: Callable[[str, str], dict], label: str, log_stem: str, logs: str,
                 on_timing: Callable[[dict], None] | None = None,
                 field: str = "step_us_all") -> Callable[[], list[float]]:
    """A timer for common.time_in_rounds: each call starts one engine process, round r's, by
    start(log_path, label) (an engine run's result with "timing") and returns the timing's
    `field`: its step times (us), or gpu_busy_us_all, the GPU's busy µs per step; on_timing,
    if given, sees each timing."""
    rounds = itertools.count()

    def one_engine() -> list[float]:
        r = next(rounds)
        what = f"{label} round {r}"
        log_path = os.path.join(logs, f"{log_stem}-round{r}.log")
        common.log(f"{what}: starting (log {log_path})")
        res = start(log_path, what)
        if "timing" not in res:
            raise RuntimeError(f"not timed: {res.get('timing_error', 'no timing')}")
        t = res["timing"]
        if on_timing is not None:
            on_timing(t)
        common.log(f"{what}: {t['step_us']:.0f} us per step ({t['decode_tokens_per_s']:.0f}"
                   f" tokens/s; calls: {', '.join(f'{x:.0f}' for x in t['step_us_all'])};"
                   f" engine start {res['engine_start_s']:.0f} s)")
        if field not in t:
            raise RuntimeError(f"the engine's timing has no {field}")
        if field != "step_us_all":
            common.log(f"{what}: {field}: {', '.join(f'{x:.1f}' for x in t[field])}")
        return list(t[field])

    return one_engine


class WallTimes:
    """Under --gpu-busy: each backend's wall times per step, kept beside the GPU busy times the
    row is made of, and each engine's kernels by GPU time, logged."""

    def __init__(self, heads: int) -> None:
        self.heads = heads
        self.us: dict[str, list[float]] = {}

    def seen(self, key: str, t: dict) -> None:
        """engine_timer's on_timing for backend `key`."""
        self.us.setdefault(key, []).extend(t["step_us_all"])
        if t.get("gpu_top_us_per_step"):
            common.log(f"H={self.heads} {key}: {t['gpu_kernels_per_step'][-1]:.0f} kernels per "
                       "step; GPU us per step by kernel: " + "; ".join(
                           f"{us:.1f} {name}" for name, us in t["gpu_top_us_per_step"]))

    def keep(self, row: SpreadRow) -> None:
        """The wall times of the backends in the row, into it."""
        row.wall_us_rounds = {k: v for k, v in self.us.items() if k in row.us}
        row.notes["timed"] = "us: the GPU's busy us per decode step; wall us per step: " + (
            ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in row.wall_us_rounds.items()))


def failure_recorder(skipped: dict[str, str]) -> Callable[[str, Exception], None]:
    """common.time_in_rounds' `failed`: why a backend stopped, into `skipped`, and logged."""
    def failed(key: str, e: Exception) -> None:
        skipped[key] = common.short_error(e)
        common.log(str(e) if isinstance(e, engines.EngineFailed) else skipped[key])

    return failed

