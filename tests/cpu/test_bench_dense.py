"""bench/dense_decode.py: how one config times its kernels side by side (rounds, medians,
the correctness gate, a kernel failing mid-way), with stand-in kernels and timings (no GPU)."""

from types import SimpleNamespace

import pytest
import torch

from bench import common
from bench import dense_decode as dd


def _inputs():
    pool = SimpleNamespace(seq_len=1024, dtype_label="bf16", tokens=4096,
                           cache=torch.empty(1, dtype=torch.bfloat16))
    return SimpleNamespace(H=16, s_q=1, B=4, pool=pool, nsets=2, T=4)


@pytest.fixture
def stand_ins(monkeypatch):
    """Kernels whose step returns their name; time_graph gives each call of a kernel the
    next of its listed times (raising where the list holds an exception)."""
    calls: list[str] = []
    times: dict[str, list] = {}

    def time_graph(step, nsets, budget_ms):
        name = step(0)
        calls.append(name)
        t = times[name][calls.count(name) - 1]
        if isinstance(t, Exception):
            raise t
        return common.Timing(us=float(t), ncalls=8, reps=3, nsets=nsets, spread=0.0)

    monkeypatch.setattr(common, "time_graph", time_graph)
    monkeypatch.setattr(common, "cuda_alive", lambda: True)
    monkeypatch.setattr(dd, "reference", lambda x: None)
    gate = {}
    monkeypatch.setattr(dd, "gate", lambda kernel, want, tol=dd.REL_L2_TOL:
                        (gate.get(kernel.step(0), True), "rel L2 1e-3"))

    def builders():
        return {n: (lambda x, a, n=n: dd.Kernel(step=lambda i, n=n: n, check=lambda: None))
                for n in times}
    return SimpleNamespace(calls=calls, times=times, gate=gate, builders=builders)


def test_kernels_timed_in_rounds_each_first_in_turn(stand_ins):
    stand_ins.times.update({"ours": [10, 30, 11], "flashmla": [20, 21, 22],
                            "fa3_mla": [5, 6, 50]})
    args = SimpleNamespace(rounds=3, budget_ms=1.0, verbose=False)
    row, ours_bad = dd.bench_config(_inputs(), ["ours", "flashmla", "fa3_mla"], args, None,
                                    stand_ins.builders())
    assert stand_ins.calls == ["ours", "flashmla", "fa3_mla", "flashmla", "fa3_mla", "ours",
                               "fa3_mla", "ours", "flashmla"]
    assert row.us == {"ours": 11.0, "flashmla": 21.0, "fa3_mla": 6.0}  # medians of the rounds
    assert row.us_rounds["ours"] == [10.0, 30.0, 11.0]
    assert row.speedup_vs_best_peer == pytest.approx(6.0 / 11.0)
    assert not ours_bad and not row.skipped


def test_default_rounds_put_each_kernel_first_once(stand_ins):
    stand_ins.times.update({"ours": [1, 2], "flashmla": [3, 4]})
    args = SimpleNamespace(rounds=0, budget_ms=1.0, verbose=False)
    row, _ = dd.bench_config(_inputs(), ["ours", "flashmla"], args, None, stand_ins.builders())
    assert stand_ins.calls == ["ours", "flashmla", "flashmla", "ours"]
    assert row.us == {"ours": 1.5, "flashmla": 3.5}


def test_gate_failure_and_a_kernel_failing_mid_way(stand_ins):
    stand_ins.times.update({"ours": [10, 10], "flashmla": [20, RuntimeError("boom")],
                            "fa3_mla": [5, 5]})
    stand_ins.gate["ours"] = False
    args = SimpleNamespace(rounds=2, budget_ms=1.0, verbose=False)
    row, ours_bad = dd.bench_config(_inputs(), ["ours", "flashmla", "fa3_mla"], args, None,
                                    stand_ins.builders())
    assert ours_bad and "ours" not in row.us and row.uncounted_us["ours"] == 10.0
    assert "correctness gate failed" in row.skipped["ours"]
    assert "flashmla" not in row.us and "boom" in row.skipped["flashmla"]  # no made-up time
    assert row.us == {"fa3_mla": 5.0} and row.speedup_vs_best_peer is None
