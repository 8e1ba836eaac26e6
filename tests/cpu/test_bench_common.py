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
