"""bench/e2e_decode.py's arguments per engine and, for SGLang (bench/e2e_sglang.py), the
interleaved rounds, the rows they make and the results file, with the engine runner replaced
by a fake (no GPU)."""

import json

import pytest

from bench import common, e2e_decode, e2e_sglang
from mla_backend.demo import engines, sglang_run


def test_vllm_arguments_as_before():
    args = e2e_decode._parse([])
    assert args.engine == "vllm" and args.backends == ["ours", "flashmla", "fa3_mla"]
    assert (args.heads, args.batch, args.context, args.steps, args.repeats) == (
        [128, 16], 64, 8192, 128, 5)
    assert args.rounds is None and args.log_interval is None


def test_sglang_arguments_and_defaults():
    args = e2e_decode._parse(["--engine", "sglang"])
    assert args.backends == ["ours", "flashmla"]
    assert args.rounds == 2 and args.log_interval == 16
    args = e2e_decode._parse(["--engine", "sglang", "--backends", "ours", "flashmla", "triton",
                              "flashinfer", "--rounds", "4", "--steps", "64",
                              "--log-interval", "32"])
    assert args.backends == ["ours", "flashmla", "triton", "flashinfer"] and args.rounds == 4


@pytest.mark.parametrize("argv, message", [
    (["--backends", "triton"], "--backends triton: not a backend of --engine vllm"),
    (["--engine", "sglang", "--backends", "fa3_mla"],
     "--backends fa3_mla: not a backend of --engine sglang; choose from ours, flashmla"),
    (["--rounds", "3"], "--rounds 3: only with --engine sglang"),
    (["--log-interval", "8"], "--log-interval 8: only with --engine sglang"),
    (["--engine", "sglang", "--rounds", "0"], "--rounds 0: must be 1 or more"),
    (["--engine", "sglang", "--steps", "16"], "--steps 16 --log-interval 16: each timed call"),
])
def test_bad_arguments_are_named(capsys, argv, message):
    with pytest.raises(SystemExit):
        e2e_decode._parse(argv)
    assert message in capsys.readouterr().err


def test_sglang_engine_spec():
    spec = e2e_sglang.engine_spec("/m", "ours", batch=64, context=8192, steps=128, repeats=5,
                                  log_interval=16)
    assert spec["backend"] == "mla_backend" and spec["load_format"] == "dummy"
    assert spec["graphs"] and spec["max_running_requests"] == 64
    assert spec["context_length"] == 8192 + 128 + 64
    assert spec["timing"] == {"prompt_len": 8192 - 128 - 1, "batch": 64, "steps": 128,
                              "repeats": 5, "log_interval": 16}
    assert "prompts" not in spec  # timing only


def test_rows_take_the_median_of_every_call_and_its_spread():
    row = e2e_sglang.assemble_row(
        {"H": 16}, {"ours": [[100.0, 102.0], [98.0, 101.0]], "flashmla": [[110.0, 111.0]],
                    "triton": []}, {"flashinfer": "RuntimeError: boom"})
    assert row.us == {"ours": 100.5, "flashmla": 110.5}
    assert row.us_rounds == {"ours": [100.0, 102.0, 98.0, 101.0], "flashmla": [110.0, 111.0]}
    assert row.spread_pct["ours"] == pytest.approx(100 * 4 / 100.5)
    assert row.speedup_vs_best_peer == pytest.approx(110.5 / 100.5)
    assert row.skipped == {"flashinfer": "RuntimeError: boom", "triton": "no timed call"}
    doc = row.to_json()
    assert doc["spread_pct"] == {"ours": 3.98, "flashmla": 0.9}
    assert doc["us_rounds"]["ours"] == [100.0, 102.0, 98.0, 101.0]


def test_verdict_compares_the_difference_with_the_spreads():
    clear = e2e_sglang.assemble_row({"H": 16}, {"ours": [[100.0, 101.0]],
                                                "flashmla": [[110.0, 111.0]]}, {})
    assert e2e_sglang.verdict(clear).endswith(
        "ours vs flashmla: 1.100x, a difference of 9.0% against a spread of 1.0%: resolved")
    blurred = e2e_sglang.assemble_row({"H": 16}, {"ours": [[100.0, 120.0]],
                                                  "flashmla": [[112.0, 113.0]]}, {})
    assert e2e_sglang.verdict(blurred).endswith("against a spread of 18.2%: not resolved")
    alone = e2e_sglang.assemble_row({"H": 16}, {"ours": [[100.0]]}, {})
    assert e2e_sglang.verdict(alone) == "H=16: ours 100 us (spread 0.0%)"


def test_sglang_bench_interleaves_engines_and_writes_results(monkeypatch, tmp_path):
    starts = []

    def fake_run(spec, log_path, timeout_s=600, *, label="", progress=False):
        starts.append((spec["backend"], log_path.rsplit("/", 1)[-1]))
        if spec["backend"] == "triton":
            raise engines.EngineFailed("triton failed (exit 1)")
        base = 900.0 if spec["backend"] == "mla_backend" else 1000.0
        calls = [base + i for i in range(spec["timing"]["repeats"])]
        return {"engine_start_s": 30.0,
                "timing": {"step_us": calls[1], "decode_tokens_per_s": 64e6 / calls[1],
                           "step_us_all": calls}}

    monkeypatch.setattr(sglang_run, "run", fake_run)
    monkeypatch.setattr(engines, "engine_missing", lambda engine: None)
    monkeypatch.setattr(common, "gpu_name", lambda: "NVIDIA Test GPU")
    out = tmp_path / "r.json"
    assert e2e_decode.main(["--engine", "sglang", "--heads", "16", "--backends", "ours",
                            "flashmla", "triton", "--repeats", "3", "--out", str(out),
                            "--logs", str(tmp_path)]) == 0
    # round 0 starts with ours, round 1 with flashmla; triton failed once and was dropped
    assert starts == [("mla_backend", "sglang-h16-ours-round0.log"),
                      ("flashmla", "sglang-h16-flashmla-round0.log"),
                      ("triton", "sglang-h16-triton-round0.log"),
                      ("flashmla", "sglang-h16-flashmla-round1.log"),
                      ("mla_backend", "sglang-h16-ours-round1.log")]
    doc = json.loads(out.read_text())
    assert doc["job"] == "e2e_decode" and doc["engine"] == "sglang"
    assert doc["gpu"] == "NVIDIA Test GPU"
    (row,) = doc["rows"]
    assert row["config"]["H"] == 16 and row["config"]["batch"] == 64
    assert row["us"] == {"ours": 901.0, "flashmla": 1001.0}
    assert row["us_rounds"]["ours"] == [900.0, 901.0, 902.0, 900.0, 901.0, 902.0]
    assert row["speedup_vs_best_peer"] == pytest.approx(1001 / 901, abs=1e-4)
    assert row["spread_pct"] == {"ours": 0.22, "flashmla": 0.2}
    assert row["skipped"] == {"triton": "EngineFailed: triton failed (exit 1)"}


def test_default_results_name_keeps_the_engines_apart():
    assert common.resolve_out(None, "e2e_decode_sglang", "NVIDIA H100 80GB HBM3",
                              "2026-11-27").name == "e2e_decode_sglang-h100-80gb-hbm3-2026-11-27.json"
