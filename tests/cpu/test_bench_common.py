"""The bench harness's side-by-side bookkeeping (bench/common.py), which needs no GPU."""

import json

import pytest

from bench import common


@pytest.mark.parametrize("names,rounds", [(["ours", "flashmla"], 4), (["a", "b", "c"], 6),
                                          (["ours"], 3)])
def test_round_orders_put_each_kernel_first_equally_often(names, rounds):
    orders = common.round_orders(names, rounds)
    assert len(orders) == rounds
    for order in orders:
        assert sorted(order) == sorted(names)  # every kernel timed once per round
    firsts = [order[0] for order in orders]
    assert {n: firsts.count(n) for n in names} == {n: rounds // len(names) for n in names}
    lasts = [order[-1] for order in orders]
    assert {n: lasts.count(n) for n in names} == {n: rounds // len(names) for n in names}


def test_round_orders_two_kernels_alternate():
    assert common.round_orders(["ours", "flashmla"], 3) == [
        ["ours", "flashmla"], ["flashmla", "ours"], ["ours", "flashmla"]]


def test_round_orders_rejects_no_rounds():
    with pytest.raises(ValueError, match="rounds"):
        common.round_orders(["ours"], 0)


def test_results_carry_rounds_only_when_timed_in_rounds(tmp_path):
    plain = common.BenchRow(config={"H": 64}, us={"ours": 10.0, "flashmla": 12.0})
    rounds = common.BenchRow(config={"H": 128}, us={"ours": 20.0, "flashmla": 19.0},
                             us_rounds={"ours": [19.5, 20.5], "flashmla": [19.0, 19.0]})
    for r in (plain, rounds):
        r.finalize(flops=1e9, nbytes=1e6, copy_bw_gbs=3000.0)
    path = tmp_path / "r.json"
    common.write_results(path, job="sparse_prefill", gpu="test", date="2026-11-24",
                         commit="x", copy_bw_gbs=3000.0, rows=[plain, rounds])
    rows = json.loads(path.read_text())["rows"]
    assert "us_rounds" not in rows[0]
    assert rows[1]["us_rounds"] == {"ours": [19.5, 20.5], "flashmla": [19.0, 19.0]}
    assert rows[0]["speedup_vs_best_peer"] == pytest.approx(1.2)
    assert rows[1]["speedup_vs_best_peer"] == pytest.approx(0.95)


def test_time_in_rounds_follows_round_orders_and_drops_a_failing_kernel():
    calls: list[str] = []
    fails: list[str] = []

    def timer(name, us_per_call):
        def run():
            calls.append(name)
            us = us_per_call[calls.count(name) - 1]
            if us is None:
                raise RuntimeError(f"{name} broke")
            return common.Timing(us=us, ncalls=4, reps=3, nsets=2, spread=0.0)
        return run

    timers = {"ours": timer("ours", [1.0, 2.0, 3.0]), "flashmla": timer("flashmla", [5.0, None]),
              "fa3": timer("fa3", [7.0, 8.0, 9.0])}
    got = common.time_in_rounds(timers, 3, lambda name, e: fails.append(f"{name}: {e}"))
    assert calls == ["ours", "flashmla", "fa3", "flashmla", "fa3", "ours", "fa3", "ours"]
    assert fails == ["flashmla: flashmla broke"]  # reported once, then not timed again
    assert {k: [t.us for t in v] for k, v in got.items()} == {"ours": [1.0, 2.0, 3.0],
                                                             "fa3": [7.0, 8.0, 9.0]}
