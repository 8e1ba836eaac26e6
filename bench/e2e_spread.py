"""Rows of the end-to-end decode benchmark (bench/e2e_decode.py, vLLM and SGLang alike) timed
in interleaved engine processes: each backend's median over every timed call of all its
engines, the calls themselves, and their spread, printed beside ours vs the best peer so that a
difference smaller than the spreads reads as not resolved."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from bench import common

DEFAULT_ROUNDS = 2  # engine processes per backend, started in turn


@dataclass
class SpreadRow(common.BenchRow):
    """A results row that also carries each backend's spread over its timed calls, in
    percent of its median."""

    spread_pct: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        doc = super().to_json()
        doc["spread_pct"] = {k: round(v, 2) for k, v in self.spread_pct.items()}
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
