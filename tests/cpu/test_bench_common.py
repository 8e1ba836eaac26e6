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


def test_time_in_rounds_drops_every_timing_of_a_kernel_whose_second_variant_fails():
    def timer(name, values):
        it = iter(values)

        def run():
            call, only = next(it)
            if only is None:
                raise RuntimeError(f"{name} kernel-only broke")
            return (common.Timing(us=call, ncalls=4, reps=3, nsets=2, spread=0.0),
                    common.Timing(us=only, ncalls=4, reps=3, nsets=2, spread=0.0))
        return run

    fails: list[str] = []
    got = common.time_in_rounds({"ours": timer("ours", [(10.0, 8.0), (11.0, 9.0)]),
                                 "fa3": timer("fa3", [(7.0, 5.0), (7.5, None)])}, 2,
                                lambda name, e: fails.append(name))
    assert fails == ["fa3"] and set(got) == {"ours"}
    assert [(c.us, o.us) for c, o in got["ours"]] == [(10.0, 8.0), (11.0, 9.0)]


def _per_layer_row(config, us, us_per_layer, kernel_only):
    row = common.BenchRow(config=config, us=us, per_layer=True, us_per_layer=us_per_layer,
                          us_kernel_only=kernel_only)
    row.finalize(flops=1e9, nbytes=1e6, copy_bw_gbs=2000.0)
    return row


def test_per_layer_rows_carry_both_speedups_and_other_rows_neither(tmp_path):
    dense = _per_layer_row({"H": 16}, {"ours": 20.0, "fa3": 18.0, "flashinfer": 19.0},
                           {"ours": 15.0, "fa3": 16.0, "flashinfer": 19.0},
                           {"ours": 14.9, "fa3": 15.9})
    peers_only = _per_layer_row({"H": 32}, {"fa3": 18.0}, {"fa3": 16.0}, {"fa3": 15.9})
    sparse = common.BenchRow(config={"H": 64}, us={"ours": 10.0, "flashmla": 12.0})
    sparse.finalize(flops=1e9, nbytes=1e6, copy_bw_gbs=2000.0)
    assert dense.speedup_vs_best_peer == pytest.approx(18.0 / 20.0)
    assert dense.speedup_vs_best_peer_per_layer == pytest.approx(16.0 / 15.0)
    assert dense.gbs_ours_per_layer == pytest.approx(1e6 / 15.0 / 1e3)
    assert dense.pct_copy_per_layer == pytest.approx(100.0 * 1e6 / 15.0 / 1e3 / 2000.0)
    path = tmp_path / "r.json"
    common.write_results(path, job="j", gpu="test", date="2026-11-26", commit="x",
                         copy_bw_gbs=2000.0, rows=[dense, peers_only, sparse])
    rows = json.loads(path.read_text())["rows"]
    assert rows[0]["us_per_layer"] == {"ours": 15.0, "fa3": 16.0, "flashinfer": 19.0}
    assert rows[0]["us_kernel_only"] == {"ours": 14.9, "fa3": 15.9}
    assert rows[0]["speedup_vs_best_peer_per_layer"] == pytest.approx(16.0 / 15.0, abs=1e-4)
    assert rows[1]["speedup_vs_best_peer_per_layer"] is None   # no ours: no speedup, no zero
    assert rows[1]["speedup_vs_best_peer"] is None
    assert not any("per_layer" in k or "kernel_only" in k for k in rows[2])


def test_per_layer_table_and_summary_lead_with_the_per_layer_figures(monkeypatch):
    lines: list[str] = []
    monkeypatch.setattr(common, "log", lambda *parts: lines.append(" ".join(map(str, parts))))
    a = _per_layer_row({"H": 16}, {"ours": 20.0, "fa3": 18.0, "flashinfer": 19.0},
                       {"ours": 15.0, "fa3": 16.0, "flashinfer": 19.0},
                       {"ours": 14.9, "fa3": 15.9})
    b = _per_layer_row({"H": 32}, {"ours": 10.0, "fa3": 20.0}, {"ours": 9.0, "fa3": 18.0},
                       {"ours": 8.9, "fa3": 17.9})
    b.uncounted_us["flashinfer"] = 30.0          # failed the gate: shown, not counted
    common.print_table([a, b], ["ours", "fa3", "flashinfer"], 2000.0)
    row_a = next(line for line in lines if line.strip().startswith("16 |"))
    assert "15.0/20.0" in row_a and "16.0/18.0" in row_a
    assert " 19.0 " in row_a and "19.0/" not in row_a   # no metadata timed: one number
    assert row_a.split()[-2:] == ["1.067", "0.900"]      # per layer, then per call
    row_b = next(line for line in lines if line.strip().startswith("32 |"))
    assert "30.0!" in row_b
    lines.clear()
    common.print_summary([a, b])
    assert lines[-1].startswith("geometric mean speedup vs best peer: per layer")
    gm_layer = (16.0 / 15.0 * 18.0 / 9.0) ** 0.5
    gm_call = (18.0 / 20.0 * 20.0 / 10.0) ** 0.5
    assert f"per layer {gm_layer:.3f}x" in lines[-1]
    assert f"per call {gm_call:.3f}x" in lines[-1]
    assert lines[-1].index("per layer") < lines[-1].index("per call")
    assert any(line.startswith("per layer: rows below 1.0x: 0/2") for line in lines)
    assert any(line.startswith("per call: rows below 1.0x: 1/2") for line in lines)


def test_write_results_puts_a_bench_s_extra_keys_before_the_rows(tmp_path):
    path = tmp_path / "r.json"
    common.write_results(path, job="j", gpu="test", date="2026-11-26", commit="x",
                         copy_bw_gbs=None, rows=[], extra={"layers_per_step": 61})
    doc = json.loads(path.read_text())
    assert list(doc) == ["job", "gpu", "date", "commit", "copy_bandwidth_gbs",
                         "layers_per_step", "rows"]


def test_sgl_kernel_flashmla_peer_is_skipped_where_sgl_kernel_does_not_import(monkeypatch):
    import sys

    import torch

    from bench.peers import flashmla_sgl
    from bench.sparse_inputs import Case

    monkeypatch.setitem(sys.modules, "sgl_kernel", None)  # import fails as where it is absent
    c = Case("decode", 16, 1, 1, 1, 4, torch.zeros(1, 64, 656, dtype=torch.uint8),
             [torch.zeros(1, 1, 16, 576)], [torch.zeros(1, 1, 4, dtype=torch.int32)], 0.04)
    with pytest.raises(common.NotApplicable, match="sgl-kernel's FlashMLA is not importable"):
        flashmla_sgl.build_sparse(c)
