"""bench/dense_decode.py: how one config times its kernels side by side (rounds, medians,
per-call and per-layer times, the correctness gate, a kernel failing mid-way), with stand-in
kernels and timings (no GPU)."""

import json
from types import SimpleNamespace

import pytest
import torch

from bench import common, report
from bench import dense_decode as dd


def _inputs():
    pool = SimpleNamespace(seq_len=1024, dtype_label="bf16", tokens=4096,
                           cache=torch.empty(1, dtype=torch.bfloat16))
    return SimpleNamespace(H=16, s_q=1, B=4, pool=pool, nsets=2, T=4)


@pytest.fixture
def stand_ins(monkeypatch):
    """Kernels whose step returns their name (step_premeta, where `times` lists
    "<name>/kernel": that name); time_graph gives each call of either the next of its listed
    times (raising where the list holds an exception)."""
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

    def build(n):
        premeta = (lambda i: f"{n}/kernel") if f"{n}/kernel" in times else None
        return lambda x, a: dd.Kernel(step=lambda i: n, check=lambda: None,
                                      step_premeta=premeta)

    def builders():
        return {n: build(n) for n in times if not n.endswith("/kernel")}
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


def _args(rounds):
    return SimpleNamespace(rounds=rounds, budget_ms=1.0, verbose=False)


def test_per_layer_amortizes_the_metadata_over_the_layers():
    assert dd.LAYERS_PER_STEP == 61
    assert dd.per_layer_us(161.0, 100.0) == pytest.approx(101.0)   # 61 us of plan / 61
    assert dd.per_layer_us(30.0, 10.0, layers=2) == pytest.approx(20.0)
    assert dd.per_layer_us(50.0, 50.0) == pytest.approx(50.0)


def test_per_call_and_kernel_only_timed_in_the_same_rounds(stand_ins):
    stand_ins.times.update({"ours": [40, 42, 41], "ours/kernel": [20, 21, 22],
                            "flashmla": [30, 31, 32], "flashmla/kernel": [25, 26, 27],
                            "flashinfer_mla": [28, 29, 30]})
    row, _ = dd.bench_config(_inputs(), ["ours", "flashmla", "flashinfer_mla"], _args(3), None,
                             stand_ins.builders())
    # each kernel first in turn; within its turn per call and kernel only back to back, the
    # kernel's first, third, ... turn per call first, its second kernel only first
    assert stand_ins.calls == [
        "ours", "ours/kernel", "flashmla", "flashmla/kernel", "flashinfer_mla",
        "flashmla/kernel", "flashmla", "flashinfer_mla", "ours/kernel", "ours",
        "flashinfer_mla", "ours", "ours/kernel", "flashmla", "flashmla/kernel"]
    assert row.us == {"ours": 41.0, "flashmla": 31.0, "flashinfer_mla": 29.0}  # per call
    assert row.us_kernel_only == {"ours": 21.0, "flashmla": 26.0}
    assert row.us_kernel_only_rounds == {"ours": [20.0, 21.0, 22.0],
                                         "flashmla": [25.0, 26.0, 27.0]}
    ours_pl = 21.0 + (41.0 - 21.0) / 61
    flashmla_pl = 26.0 + (31.0 - 26.0) / 61
    assert row.us_per_layer == pytest.approx({"ours": ours_pl, "flashmla": flashmla_pl,
                                              "flashinfer_mla": 29.0})  # no metadata timed
    # the best peer differs: flashinfer per call, flashmla per layer
    assert row.speedup_vs_best_peer == pytest.approx(29.0 / 41.0)
    assert row.speedup_vs_best_peer_per_layer == pytest.approx(flashmla_pl / ours_pl)


def test_results_keep_the_per_call_fields_and_add_the_per_layer_ones(stand_ins, tmp_path):
    stand_ins.times.update({"ours": [40, 42], "ours/kernel": [20, 22],
                            "triton_mla": [50, 52]})
    row, _ = dd.bench_config(_inputs(), ["ours", "triton_mla"], _args(2), 3000.0,
                             stand_ins.builders())
    path = tmp_path / "dense.json"
    common.write_results(path, job=dd.JOB, gpu="test", date="2026-11-26", commit="x",
                         copy_bw_gbs=3000.0, rows=[row],
                         extra=dd.results_extra(["ours", "triton_mla"], dd.PER_STEP_METADATA))
    doc = json.loads(path.read_text())
    assert doc["layers_per_step"] == 61
    assert set(doc["per_step_metadata"]) == {"ours", "triton_mla"}
    assert "never timed" in dd.PER_STEP_METADATA["flashinfer_mla"]
    got = doc["rows"][0]
    ours_pl = 21.0 + 20.0 / 61
    assert got["us"] == {"ours": 41.0, "triton_mla": 51.0}
    assert got["us_rounds"] == {"ours": [40.0, 42.0], "triton_mla": [50.0, 52.0]}
    assert got["speedup_vs_best_peer"] == pytest.approx(51.0 / 41.0, abs=1e-4)
    assert got["us_per_layer"] == {"ours": round(ours_pl, 2), "triton_mla": 51.0}
    assert got["speedup_vs_best_peer_per_layer"] == pytest.approx(51.0 / ours_pl, abs=1e-4)
    assert got["us_kernel_only"] == {"ours": 21.0}
    assert got["us_kernel_only_rounds"] == {"ours": [20.0, 22.0]}
    flops = 2.0 * 16 * 1 * 4096 * (576 + 512)
    assert got["tflops_ours"] == pytest.approx(flops / 41.0 / 1e6, abs=0.05)
    assert got["tflops_ours_per_layer"] == pytest.approx(flops / ours_pl / 1e6, abs=0.05)

    md = report.table(doc).splitlines()
    assert "ours µs per layer (per call)" in md[0]
    assert md[0].index("ours / best peer per layer") < md[0].index("ours / best peer per call")
    cells = [c.strip() for c in md[2].strip("|").split("|")]
    assert f"{round(ours_pl, 2):.1f} (41.0)" in cells and "51.0" in cells   # triton: one
    assert cells[-2:] == [f"{51.0 / ours_pl:.2f}", f"{51.0 / 41.0:.2f}"]
    assert f"per layer (per-step metadata amortized over 61 layers): **{51.0 / ours_pl:.3f}**" \
        in "\n".join(md)


def test_failed_or_ungated_kernels_count_in_neither_time(stand_ins):
    stand_ins.times.update({"ours": [40, 40], "ours/kernel": [20, 20],
                            "flashmla": [30, 30], "flashmla/kernel": [25, RuntimeError("boom")],
                            "fa3_mla": [35, 35], "fa3_mla/kernel": [5, 5],
                            "triton_mla": [45, 45]})
    stand_ins.gate["fa3_mla"] = False
    row, ours_bad = dd.bench_config(_inputs(), ["ours", "flashmla", "fa3_mla", "triton_mla"],
                                    _args(2), None, stand_ins.builders())
    assert not ours_bad
    assert set(row.us) == set(row.us_per_layer) == {"ours", "triton_mla"}
    assert set(row.us_kernel_only) == {"ours"}
    assert "boom" in row.skipped["flashmla"]            # failed in round 2: no time at all
    assert "flashmla" not in row.uncounted_us and "flashmla" not in row.us_rounds
    assert "correctness gate failed" in row.skipped["fa3_mla"]
    assert row.uncounted_us["fa3_mla"] == 35.0
    assert row.uncounted_us_per_layer["fa3_mla"] == pytest.approx(5.0 + 30.0 / 61)
    ours_pl = 20.0 + 20.0 / 61
    assert row.speedup_vs_best_peer == pytest.approx(45.0 / 40.0)   # triton, not fa3
    assert row.speedup_vs_best_peer_per_layer == pytest.approx(45.0 / ours_pl)


def test_a_step_that_cannot_be_captured_gives_per_layer_equal_to_per_call(stand_ins):
    stand_ins.times.update({"ours": [common.GraphCaptureError("host sync")],
                            "ours/kernel": [12, 14], "flashmla": [15, 16]})
    row, _ = dd.bench_config(_inputs(), ["ours", "flashmla"], _args(2), None,
                             stand_ins.builders())
    # round 1: the step fails to capture, so the metadata-outside call is timed in its place
    # and no kernel-only time is taken; round 2 times only that
    assert stand_ins.calls == ["ours", "ours/kernel", "flashmla", "flashmla", "ours/kernel"]
    assert row.us["ours"] == 13.0 and row.us_per_layer["ours"] == 13.0
    assert "ours" not in row.us_kernel_only and "ours" not in row.us_kernel_only_rounds
    assert "capture" in row.notes["ours"]


def test_min_tokens_per_cta_is_a_bench_option_recorded_in_the_results(tmp_path):
    assert dd.parse_args([]).min_tokens_per_cta is None
    args = dd.parse_args(["--min-tokens-per-cta", "256", "--batch", "1", "--peers="])
    assert args.min_tokens_per_cta == 256 and args.kernels == ["ours"]
    with pytest.raises(SystemExit):
        dd.parse_args(["--min-tokens-per-cta", "0"])
    path = tmp_path / "dense.json"
    for value in (None, 256):
        doc = common.write_results(path, job=dd.JOB, gpu="test", date="2026-11-26", commit="x",
                                   copy_bw_gbs=None, rows=[],
                                   extra=dd.results_extra(["ours"], dd.PER_STEP_METADATA, value))
        assert json.loads(path.read_text())["min_tokens_per_cta"] == value == \
            doc["min_tokens_per_cta"]


def test_mma_max_rows_is_a_bench_option_recorded_in_the_results(tmp_path):
    assert dd.parse_args([]).mma_max_rows is None
    assert dd.parse_args(["--mma-max-rows", "0"]).mma_max_rows == 0
    for bad in ("-1", "17"):
        with pytest.raises(SystemExit):
            dd.parse_args(["--mma-max-rows", bad])
    path = tmp_path / "dense.json"
    for value in (None, 0):
        common.write_results(path, job=dd.JOB, gpu="test", date="2026-11-26", commit="x",
                             copy_bw_gbs=None, rows=[],
                             extra=dd.results_extra(["ours"], dd.PER_STEP_METADATA, None, value))
        assert json.loads(path.read_text())["mma_max_rows"] == value



def test_equal_lengths_and_whole_extra_are_bench_options_recorded_in_the_results(tmp_path,
                                                                                  monkeypatch):
    from bench import dense_inputs

    args = dd.parse_args([])
    assert (args.equal_lengths, args.whole_extra) == (False, None)
    args = dd.parse_args(["--equal-lengths", "--whole-extra", "-1"])
    assert (args.equal_lengths, args.whole_extra) == (True, -1)
    with pytest.raises(SystemExit):
        dd.parse_args(["--whole-extra", "-2"])
    drawn = dense_inputs.draw_seq_lens(5, 1000, 3)
    assert len(set(drawn)) > 1 and sum(drawn) == 5000  # ragged around the mean by default
    monkeypatch.setattr(dense_inputs, "EQUAL_LENGTHS", True)
    assert dense_inputs.draw_seq_lens(5, 1000, 3) == [1000] * 5
    path = tmp_path / "dense.json"
    common.write_results(path, job=dd.JOB, gpu="test", date="2026-11-27", commit="x",
                         copy_bw_gbs=None, rows=[],
                         extra=dd.results_extra(["ours"], dd.PER_STEP_METADATA, None, None, None,
                                                True, 8))
    doc = json.loads(path.read_text())
    assert (doc["equal_lengths"], doc["whole_extra"]) == (True, 8)


# the planner knobs the bench can replace: option, results field, a good value, bad values
@pytest.mark.parametrize("option,field,good,bads", [
    ("--whole-extra", "whole_extra", 8, ("-2",)),
    ("--align-extra", "align_extra", -1, ("-2", "1025")),
    ("--restart-pad", "restart_pad", 0, ("-2", "256")),
    ("--lpt-extra", "lpt_extra", 8, ("-2", "1025")),
])
def test_plan_knob_is_a_bench_option_recorded_in_the_results(option, field, good, bads, tmp_path):
    assert getattr(dd.parse_args([]), field) is None
    assert getattr(dd.parse_args([option, str(good)]), field) == good
    for bad in bads:
        with pytest.raises(SystemExit):
            dd.parse_args([option, bad])
    path = tmp_path / "dense.json"
    common.write_results(path, job=dd.JOB, gpu="test", date="2026-11-27", commit="x",
                         copy_bw_gbs=None, rows=[],
                         extra=dd.results_extra(["ours"], dd.PER_STEP_METADATA, **{field: 3}))
    assert json.loads(path.read_text())[field] == 3
    assert field in {k[0] for k in dd.PLAN_KNOBS}
