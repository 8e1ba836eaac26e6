"""The GPU busy time of engine steps (mla_backend.demo.gpu_busy): the union of activity spans
from a profiler trace, on hand-worked cases (no GPU)."""

import pytest

from mla_backend.demo import gpu_busy


@pytest.mark.parametrize("spans, total", [
    ([], 0.0),
    ([(0, 10)], 10.0),
    ([(0, 10), (20, 25)], 15.0),  # an idle gap counts nothing
    ([(0, 10), (5, 12)], 12.0),  # overlapping work counts once
    ([(5, 12), (0, 10), (1, 2), (12, 13)], 13.0),  # any order, nested, touching
])
def test_union_of_spans(spans, total):
    assert gpu_busy.union_us(spans) == total


def test_gpu_spans_take_kernels_copies_and_sets_only():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "mla", "ts": 100.0, "dur": 30.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "HtoD", "ts": 140.0, "dur": 5.0},
        {"ph": "X", "cat": "gpu_memset", "name": "set", "ts": 150.0, "dur": 1.0},
        {"ph": "X", "cat": "kernel", "name": "norm", "ts": 110.0, "dur": 4.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 90.0, "dur": 50.0},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 0.0},
        {"ph": "M", "name": "process_name"},
    ]}
    spans, kernels, by_name = gpu_busy.gpu_spans(trace)
    assert kernels == 2  # not the instant marker
    assert by_name == {"mla": 30.0, "HtoD": 5.0, "set": 1.0, "norm": 4.0}
    assert sorted(spans) == [(100.0, 130.0), (110.0, 114.0), (140.0, 145.0), (150.0, 151.0)]
    assert gpu_busy.union_us(spans) == 36.0


def test_top_names_per_step():
    busy = gpu_busy.GpuBusy()
    busy.by_name = {"a": 10.0, "b": 40.0, "c": 20.0}
    assert busy.top(2, per=10) == [["b", 4.0], ["c", 2.0]]
