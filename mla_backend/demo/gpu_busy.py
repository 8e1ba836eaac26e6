"""GPU busy time of a span of engine steps, from torch's profiler (CUPTI activity records).

An engine's step loop measured by the wall clock includes the host: scheduling, input
preparation, output processing. With a few layers that host time is most of a step and it
varies from step to step by tens of percent, more than attention backends differ. The GPU's
busy time is what the backend changes: the union of the intervals in which a kernel, a copy or
a memset ran, so that overlapping work counts once and idle gaps (the GPU waiting for the
host) not at all. Kernels replayed from CUDA graphs are recorded like any other.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile

# chrome-trace categories of the GPU's own activity records
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def union_us(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) spans (any unit)."""
    total, end = 0.0, None
    for s, e in sorted(spans):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def gpu_spans(trace: dict) -> tuple[list[tuple[float, float]], int, dict[str, float]]:
    """The GPU activity spans (µs) of a chrome trace as torch's profiler exports it, how many
    of them are kernels, and the µs of each activity name (summed). A kernel launched early by
    programmatic dependent launch counts its wait for the kernel before it in its own µs (the
    union counts that time once)."""
    spans, kernels, by_name = [], 0, {}
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "X" and ev.get("cat") in GPU_CATEGORIES:
            dur = float(ev.get("dur", 0.0))
            spans.append((float(ev["ts"]), float(ev["ts"]) + dur))
            kernels += ev["cat"] == "kernel"
            name = str(ev.get("name", "?"))
            by_name[name] = by_name.get(name, 0.0) + dur
    return spans, kernels, by_name


def read_trace(path: str) -> tuple[float, int, dict[str, float]]:
    """A chrome trace file's (.json or .json.gz) GPU busy µs, kernel count and µs by name."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        spans, kernels, by_name = gpu_spans(json.load(f))
    return union_us(spans), kernels, by_name


def top_names(by_name: dict[str, float], n: int, per: float = 1.0) -> list[list]:
    """The n activity names with the most µs, as [name, µs / per], most first."""
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:n]
    return [[name[:120], round(us / per, 2)] for name, us in ranked]


class GpuBusy:
    """start() ... stop(): the GPU's busy µs and kernel count in between (on every device the
    process drives; the engine runs in this process)."""

    def __init__(self) -> None:
        self._prof = None
        self.busy_us: float | None = None
        self.kernels: int | None = None
        self.by_name: dict[str, float] = {}  # µs per activity name, summed

    def top(self, n: int, per: float = 1.0) -> list[list]:
        """The n activity names with the most µs, as [name, µs / per], most first."""
        return top_names(self.by_name, n, per)

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CUDA])
        self._prof.start()

    def stop(self) -> None:
        import torch

        torch.cuda.synchronize()
        self._prof.stop()
        with tempfile.TemporaryDirectory(prefix="gpu_busy_") as tmp:
            path = os.path.join(tmp, "trace.json")
            self._prof.export_chrome_trace(path)
            self.busy_us, self.kernels, self.by_name = read_trace(path)
        self._prof = None
