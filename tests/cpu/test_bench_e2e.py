"""bench/e2e_decode.py's arguments per engine and model (--arch v3 / v32 with its caches), the
engine specs, the model it writes and, for SGLang (bench/e2e_sglang.py), the interleaved
rounds, the rows they make and the results files, with the engine runners replaced by fakes
(no GPU)."""

import json

import pytest

from bench import common, e2e_decode, e2e_sglang, e2e_spread
from mla_backend.demo import engines, sglang_run


def test_vllm_arguments_as_before():
    args = e2e_decode._parse([])
    assert args.engine == "vllm" and args.backends == ["ours", "flashmla", "fa3_mla"]
    assert (args.heads, args.batch, args.context, args.steps, args.repeats) == (
        [128, 16], 64, 8192, 128, 5)
    assert args.rounds == 2 and args.log_interval is None  # engines interleaved, as for SGLang
    assert (args.arch, args.kv_cache_dtype) == ("v3", "auto")


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
    (["--rounds", "0"], "--rounds 0: must be 1 or more"),
    (["--log-interval", "8"], "--log-interval 8: only with --engine sglang"),
    (["--engine", "sglang", "--rounds", "0"], "--rounds 0: must be 1 or more"),
    (["--engine", "sglang", "--steps", "16"], "--steps 16 --log-interval 16: each timed call"),
    (["--arch", "v4"], "argument --arch: invalid choice: 'v4'"),
    (["--kv-cache-dtype", "fp8_ds_mla"],
     "--kv-cache-dtype fp8_ds_mla: not a cache of --engine vllm --arch v3; choose from auto"),
    (["--engine", "sglang", "--kv-cache-dtype", "fp8_e4m3"],
     "--kv-cache-dtype fp8_e4m3: not a cache of --engine sglang --arch v3; choose from auto"),
    (["--arch", "v32", "--kv-cache-dtype", "fp8_e4m3"],
     "--kv-cache-dtype fp8_e4m3: not a cache of --engine vllm --arch v32; choose from auto, "
     "fp8_ds_mla"),
    (["--arch", "v32", "--engine", "sglang", "--kv-cache-dtype", "fp8_ds_mla"],
     "--kv-cache-dtype fp8_ds_mla: not a cache of --engine sglang --arch v32; choose from "
     "bfloat16, fp8_e4m3"),
    (["--arch", "v32", "--backends", "ours", "flashmla"],
     "--backends flashmla: not a backend of --engine vllm --arch v32 --kv-cache-dtype auto; "
     "choose from ours, flashmla_sparse, fa3_mla_sparse"),
    (["--arch", "v32", "--kv-cache-dtype", "fp8_ds_mla", "--backends", "fa3_mla_sparse"],
     "--backends fa3_mla_sparse: not a backend of --engine vllm --arch v32 --kv-cache-dtype "
     "fp8_ds_mla; choose from ours, flashmla_sparse"),
    (["--arch", "v32", "--engine", "sglang", "--backends", "flashmla_kv"],
     "--backends flashmla_kv: not a backend of --engine sglang --arch v32 --kv-cache-dtype "
     "bfloat16; choose from ours, flashmla_sparse"),
    (["--arch", "v32", "--engine", "sglang", "--kv-cache-dtype", "fp8_e4m3", "--backends",
      "flashmla_sparse"], "--backends flashmla_sparse: not a backend of --engine sglang --arch "
                          "v32 --kv-cache-dtype fp8_e4m3; choose from ours, flashmla_kv"),
    (["--arch", "v32", "--context", "2176"],
     "--context 2176 --steps 128: with --arch v32 the prompts (context - steps - 1 tokens) "
     "must be longer than index_topk 2048"),
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
                              "repeats": 5, "log_interval": 16, "gpu_busy": False}
    assert "prompts" not in spec  # timing only
    busy = e2e_sglang.engine_spec("/m", "ours", batch=64, context=8192, steps=128, repeats=5,
                                  log_interval=16, gpu_busy=True)
    assert busy["timing"]["gpu_busy"] is True


def test_rows_take_the_median_of_every_call_and_its_spread():
    row = e2e_spread.assemble_row(
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
    clear = e2e_spread.assemble_row({"H": 16}, {"ours": [[100.0, 101.0]],
                                                "flashmla": [[110.0, 111.0]]}, {})
    assert e2e_spread.verdict(clear).endswith(
        "ours vs flashmla: 1.100x, a difference of 9.0% against a spread of 1.0%: resolved")
    blurred = e2e_spread.assemble_row({"H": 16}, {"ours": [[100.0, 120.0]],
                                                  "flashmla": [[112.0, 113.0]]}, {})
    assert e2e_spread.verdict(blurred).endswith("against a spread of 18.2%: not resolved")
    alone = e2e_spread.assemble_row({"H": 16}, {"ours": [[100.0]]}, {})
    assert e2e_spread.verdict(alone) == "H=16: ours 100 us (spread 0.0%)"


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


@pytest.mark.parametrize("argv, cache, backends", [
    (["--arch", "v32"], "auto", ["ours", "flashmla_sparse"]),
    (["--arch", "v32", "--kv-cache-dtype", "fp8_ds_mla"], "fp8_ds_mla",
     ["ours", "flashmla_sparse"]),
    (["--arch", "v32", "--backends", "ours", "fa3_mla_sparse"], "auto", ["ours", "fa3_mla_sparse"]),
    (["--arch", "v32", "--engine", "sglang"], "bfloat16", ["ours", "flashmla_sparse"]),
    (["--arch", "v32", "--engine", "sglang", "--kv-cache-dtype", "fp8_e4m3"], "fp8_e4m3",
     ["ours", "flashmla_kv"]),
])
def test_v32_arguments_and_defaults(argv, cache, backends):
    args = e2e_decode._parse(argv)
    assert (args.arch, args.kv_cache_dtype, args.backends) == ("v32", cache, backends)
    assert (args.heads, args.batch, args.context, args.steps) == ([128, 16], 64, 8192, 128)
    # the prompts outgrow the top-k: the indexer selects
    assert args.context - args.steps - 1 > e2e_decode.V32_INDEX_TOPK == 2048


@pytest.mark.parametrize("cache, names", [
    ("auto", {"ours": "CUSTOM", "flashmla_sparse": "FLASHMLA_SPARSE",
              "fa3_mla_sparse": "FLASH_ATTN_MLA_SPARSE"}),
    ("fp8_ds_mla", {"ours": "CUSTOM", "flashmla_sparse": "FLASHMLA_SPARSE"}),
])
def test_vllm_v32_engine_specs(cache, names):
    args = e2e_decode._parse(["--arch", "v32", "--kv-cache-dtype", cache, "--backends",
                              *names])
    for key, backend in names.items():
        spec = e2e_decode.vllm_spec(args, "/m", key)
        assert (spec["backend"], spec["kv_cache_dtype"]) == (backend, cache)
        assert spec["mode"] == "graphs" and spec["load_format"] == "dummy"
        assert spec["timing"] == {"prompt_len": 8192 - 128 - 1, "batch": 64, "steps": 128,
                                  "repeats": 5, "gpu_busy": False}
    v3 = e2e_decode.vllm_spec(e2e_decode._parse([]), "/m", "flashmla")
    assert (v3["backend"], v3["kv_cache_dtype"]) == ("FLASHMLA", "auto")


def test_vllm_refuses_only_what_vllm_025_cannot_start():
    refused = e2e_decode.vllm_refuses("FLASHMLA_SPARSE", "fp8_ds_mla", "0.25.0")
    assert refused.startswith("vLLM 0.25.0: FLASHMLA_SPARSE does not start with fp8_ds_mla")
    assert e2e_decode.vllm_refuses("FLASHMLA_SPARSE", "fp8_ds_mla", "0.33.0") is None
    assert e2e_decode.vllm_refuses("FLASHMLA_SPARSE", "auto", "0.25.0") is None
    assert e2e_decode.vllm_refuses("CUSTOM", "fp8_ds_mla", "0.25.0") is None
    assert e2e_decode.vllm_refuses("FLASHMLA_SPARSE", "fp8_ds_mla", None) is None


@pytest.mark.parametrize("cache, kernel", [("bfloat16", "flashmla_sparse"),
                                           ("fp8_e4m3", "flashmla_kv")])
def test_sglang_v32_engine_specs(cache, kernel):
    def spec(key):
        return e2e_sglang.engine_spec("/m", key, batch=64, context=8192, steps=128, repeats=5,
                                      log_interval=16, arch="v32", kv_cache_dtype=cache)

    ours, peer = spec("ours"), spec(kernel)
    assert (ours["backend"], ours["kv_cache_dtype"]) == ("mla_backend", cache)
    assert "env" not in ours and "engine_args" not in ours  # no dsa kernels, no FA3 switch
    assert (peer["backend"], peer["kv_cache_dtype"]) == ("dsa", cache)
    assert peer["engine_args"] == {"dsa_prefill_backend": kernel, "dsa_decode_backend": kernel}
    assert peer["env"] == {"SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD": "0"}
    for s in (ours, peer):
        assert s["graphs"] and s["load_format"] == "dummy" and s["max_running_requests"] == 64
        assert s["timing"]["prompt_len"] == 8192 - 128 - 1
    other = "flashmla_kv" if kernel == "flashmla_sparse" else "flashmla_sparse"
    with pytest.raises(ValueError, match=f"backend '{other}': not one of arch v32 with "
                                         f"kv_cache_dtype {cache}; choose from ours, {kernel}"):
        spec(other)
    with pytest.raises(ValueError, match="kv_cache_dtype 'auto': arch v32 takes bfloat16, "
                                         "fp8_e4m3"):
        e2e_sglang.engine_spec("/m", "ours", batch=64, context=8192, steps=128, repeats=5,
                               log_interval=16, arch="v32", kv_cache_dtype="auto")


@pytest.mark.parametrize("argv, job", [
    ([], "e2e_decode"),
    (["--engine", "sglang"], "e2e_decode_sglang"),
    (["--arch", "v32"], "e2e_decode_v32"),
    (["--arch", "v32", "--kv-cache-dtype", "fp8_ds_mla"], "e2e_decode_v32_fp8_ds_mla"),
    (["--arch", "v32", "--engine", "sglang"], "e2e_decode_sglang_v32"),
    (["--arch", "v32", "--engine", "sglang", "--kv-cache-dtype", "fp8_e4m3"],
     "e2e_decode_sglang_v32_fp8_e4m3"),
    (["--gpu-busy"], "e2e_decode_gpu_busy"),
    (["--engine", "sglang", "--gpu-busy"], "e2e_decode_sglang_gpu_busy"),
])
def test_results_file_names_keep_engines_models_and_caches_apart(argv, job):
    assert e2e_decode.results_job(e2e_decode._parse(argv)) == job


def test_v32_model_config_and_row_config(tmp_path):
    args = e2e_decode._parse(["--arch", "v32", "--kv-cache-dtype", "fp8_ds_mla"])
    path = e2e_decode.write_model(args, str(tmp_path / "m"), 128)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV32ForCausalLM"]
    assert (cfg["index_topk"], cfg["index_n_heads"], cfg["index_head_dim"]) == (2048, 64, 128)
    assert (cfg["hidden_size"], cfg["q_lora_rank"], cfg["kv_lora_rank"],
            cfg["qk_rope_head_dim"], cfg["num_attention_heads"]) == (7168, 1536, 512, 64, 128)
    assert cfg["num_hidden_layers"] == 4 and cfg["max_position_embeddings"] == 8192 + 1024
    assert path == str(tmp_path / "m")
    assert e2e_decode.row_config(args, 128) == {
        "model": "DeepSeek-V3.2 attention dims and indexer", "arch": "v32", "H": 128,
        "layers": 4, "batch": 64, "context": 8192, "dtype": "bf16",
        "kv_cache_dtype": "fp8_ds_mla", "index_topk": 2048}
    v3 = e2e_decode._parse([])
    e2e_decode.write_model(v3, str(tmp_path / "v3"), 16)
    assert "index_topk" not in json.loads((tmp_path / "v3" / "config.json").read_text())
    assert e2e_decode.row_config(v3, 16)["arch"] == "v3"
    assert "index_topk" not in e2e_decode.row_config(v3, 16)


def _fake_gpu(monkeypatch):
    monkeypatch.setattr(engines, "engine_missing", lambda engine: None)
    monkeypatch.setattr(common, "gpu_name", lambda: "NVIDIA Test GPU")


def test_vllm_v32_fp8_bench_skips_what_vllm_025_cannot_start(monkeypatch, tmp_path):
    started = []

    def fake_run_engine(spec, log_path, *, label="", timeout_s=900, **kw):
        with open(f"{spec['model']}/config.json") as f:
            model = json.load(f)
        started.append((spec["backend"], spec["kv_cache_dtype"], model["index_topk"],
                        model["num_attention_heads"]))
        return {"engine_start_s": 60.0,
                "timing": {"step_us": 2000.0, "decode_tokens_per_s": 32000.0,
                           "step_us_all": [2000.0, 2100.0]}}

    _fake_gpu(monkeypatch)
    monkeypatch.setattr(engines, "run_engine", fake_run_engine)
    monkeypatch.setattr(e2e_decode, "_vllm_version", lambda: "0.25.0")
    assert e2e_decode.main(["--arch", "v32", "--kv-cache-dtype", "fp8_ds_mla", "--heads", "16",
                            "--out", str(tmp_path), "--logs", str(tmp_path)]) == 0
    assert started == [("CUSTOM", "fp8_ds_mla", 2048, 16)] * 2  # one engine per round
    doc = json.loads((tmp_path / "e2e_decode_v32_fp8_ds_mla-test-gpu-"
                      f"{common.today()}.json").read_text())
    assert doc["engine"] == "vllm"
    (row,) = doc["rows"]
    assert row["config"]["arch"] == "v32" and row["config"]["kv_cache_dtype"] == "fp8_ds_mla"
    assert row["speedup_vs_best_peer"] is None
    assert row["us_rounds"] == {"ours": [2000.0, 2100.0] * 2}  # every repeat of both rounds
    assert row["us"] == {"ours": 2050.0}
    assert doc["engine_version"].startswith("vllm ")
    assert row["skipped"]["flashmla_sparse"].startswith("vLLM 0.25.0: FLASHMLA_SPARSE does not")


def test_sglang_v32_bench_runs_dsa_with_named_kernels(monkeypatch, tmp_path):
    started = []

    def fake_run(spec, log_path, timeout_s=600, *, label="", progress=False):
        started.append((label, spec["backend"], spec["kv_cache_dtype"],
                        spec.get("engine_args", {}).get("dsa_decode_backend"),
                        spec.get("env", {})))
        base = 900.0 if spec["backend"] == "mla_backend" else 1000.0
        calls = [base + i for i in range(spec["timing"]["repeats"])]
        return {"engine_start_s": 30.0,
                "timing": {"step_us": calls[1], "decode_tokens_per_s": 64e6 / calls[1],
                           "step_us_all": calls}}

    _fake_gpu(monkeypatch)
    monkeypatch.setattr(sglang_run, "run", fake_run)
    assert e2e_decode.main(["--engine", "sglang", "--arch", "v32", "--kv-cache-dtype",
                            "fp8_e4m3", "--heads", "128", "--rounds", "1", "--repeats", "2",
                            "--out", str(tmp_path), "--logs", str(tmp_path)]) == 0
    threshold = {"SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD": "0"}
    assert started == [("H=128 mla_backend round 0", "mla_backend", "fp8_e4m3", None, {}),
                       ("H=128 dsa flashmla_kv round 0", "dsa", "fp8_e4m3", "flashmla_kv",
                        threshold)]
    doc = json.loads((tmp_path / "e2e_decode_sglang_v32_fp8_e4m3-test-gpu-"
                      f"{common.today()}.json").read_text())
    (row,) = doc["rows"]
    assert row["config"]["kv_cache_dtype"] == "fp8_e4m3" and row["config"]["index_topk"] == 2048
    assert row["us"] == {"ours": 900.5, "flashmla_kv": 1000.5}
    assert row["speedup_vs_best_peer"] == pytest.approx(1000.5 / 900.5, abs=1e-4)


def test_vllm_bench_interleaves_engines_and_reports_the_spread(monkeypatch, tmp_path):
    starts = []

    def fake_run_engine(spec, log_path, *, label="", timeout_s=900, **kw):
        starts.append((spec["backend"], log_path.rsplit("/", 1)[-1]))
        if spec["backend"] == "FLASH_ATTN_MLA":
            raise engines.EngineFailed("FLASH_ATTN_MLA failed (exit 1)")
        base = 900.0 if spec["backend"] == "CUSTOM" else 1000.0
        calls = [base + 10 * len(starts) + i for i in range(spec["timing"]["repeats"])]
        return {"engine_start_s": 30.0,
                "timing": {"step_us": calls[1], "decode_tokens_per_s": 64e6 / calls[1],
                           "step_us_all": calls}}

    _fake_gpu(monkeypatch)
    monkeypatch.setattr(engines, "run_engine", fake_run_engine)
    out = tmp_path / "r.json"
    assert e2e_decode.main(["--heads", "16", "--repeats", "2", "--out", str(out),
                            "--logs", str(tmp_path)]) == 0
    # round 0 starts with ours, round 1 with the next backend; FLASH_ATTN_MLA failed once
    # and was not started again
    assert starts == [("CUSTOM", "h16-ours-round0.log"), ("FLASHMLA", "h16-flashmla-round0.log"),
                      ("FLASH_ATTN_MLA", "h16-fa3_mla-round0.log"),
                      ("FLASHMLA", "h16-flashmla-round1.log"), ("CUSTOM", "h16-ours-round1.log")]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["us_rounds"] == {"ours": [910.0, 911.0, 950.0, 951.0],
                                "flashmla": [1020.0, 1021.0, 1040.0, 1041.0]}
    assert row["us"] == {"ours": 930.5, "flashmla": 1030.5}
    assert row["spread_pct"]["ours"] == pytest.approx(100 * 41 / 930.5, abs=0.01)
    assert row["speedup_vs_best_peer"] == pytest.approx(1030.5 / 930.5, abs=1e-4)
    assert row["skipped"]["fa3_mla"].startswith("EngineFailed")



def test_vllm_bench_gpu_busy_times_the_gpu_and_keeps_the_wall_times(monkeypatch, tmp_path):
    specs = []

    def fake_run_engine(spec, log_path, *, label="", timeout_s=900, **kw):
        specs.append(spec)
        n = len(specs)
        wall = [4000.0 + 500 * n + i for i in range(spec["timing"]["repeats"])]
        gpu = [(2000.0 if spec["backend"] == "CUSTOM" else 2100.0) + n + i
               for i in range(spec["timing"]["repeats"])]
        return {"engine_start_s": 30.0,
                "timing": {"step_us": wall[0], "decode_tokens_per_s": 64e6 / wall[0],
                           "step_us_all": wall, "gpu_busy_us_all": gpu}}

    _fake_gpu(monkeypatch)
    monkeypatch.setattr(engines, "run_engine", fake_run_engine)
    out = tmp_path / "r.json"
    assert e2e_decode.main(["--heads", "16", "--repeats", "2", "--rounds", "1", "--backends",
                            "ours", "flashmla", "--gpu-busy", "--out", str(out),
                            "--logs", str(tmp_path)]) == 0
    assert all(s["timing"]["gpu_busy"] for s in specs)
    doc = json.loads(out.read_text())
    assert doc["timed"].startswith("the GPU's busy time per decode step")
    (row,) = doc["rows"]
    assert row["us_rounds"] == {"ours": [2001.0, 2002.0], "flashmla": [2102.0, 2103.0]}
    assert row["wall_us_rounds"] == {"ours": [4500.0, 4501.0], "flashmla": [5000.0, 5001.0]}
    assert row["speedup_vs_best_peer"] == pytest.approx(2102.5 / 2001.5, abs=1e-4)


def test_a_timing_without_gpu_busy_fails_that_backend(monkeypatch, tmp_path):
    def fake_run_engine(spec, log_path, *, label="", timeout_s=900, **kw):
        return {"engine_start_s": 30.0,
                "timing": {"step_us": 1.0, "decode_tokens_per_s": 1.0, "step_us_all": [1.0]}}

    _fake_gpu(monkeypatch)
    monkeypatch.setattr(engines, "run_engine", fake_run_engine)
    out = tmp_path / "r.json"
    assert e2e_decode.main(["--heads", "16", "--rounds", "1", "--backends", "ours",
                            "--gpu-busy", "--out", str(out), "--logs", str(tmp_path)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["us"] == {} and "no gpu_busy_us_all" in row["skipped"]["ours"]


def test_sglang_bench_gpu_busy_times_the_gpu_and_keeps_the_wall_times(monkeypatch, tmp_path):
    specs = []

    def fake_run(spec, log_path, timeout_s=600, *, label="", progress=False):
        specs.append(spec)
        ours = spec["backend"] == "mla_backend"
        wall = [(2600.0 if ours else 2700.0) + i for i in range(spec["timing"]["repeats"])]
        gpu = [(2400.0 if ours else 2450.0) + i for i in range(spec["timing"]["repeats"])]
        return {"engine_start_s": 30.0,
                "timing": {"step_us": wall[0], "decode_tokens_per_s": 64e6 / wall[0],
                           "step_us_all": wall, "gpu_busy_us_all": gpu,
                           "gpu_kernels_per_step": [99.0], "gpu_top_us_per_step": [["k", 1.0]]}}

    monkeypatch.setattr(sglang_run, "run", fake_run)
    _fake_gpu(monkeypatch)
    out = tmp_path / "r.json"
    assert e2e_decode.main(["--engine", "sglang", "--heads", "16", "--backends", "ours",
                            "flashinfer", "--rounds", "1", "--repeats", "2", "--gpu-busy",
                            "--out", str(out), "--logs", str(tmp_path)]) == 0
    assert [s["timing"]["gpu_busy"] for s in specs] == [True, True]
    doc = json.loads(out.read_text())
    assert doc["timed"].startswith("the GPU's busy time per decode step")
    (row,) = doc["rows"]
    assert row["us_rounds"] == {"ours": [2400.0, 2401.0], "flashinfer": [2450.0, 2451.0]}
    assert row["wall_us_rounds"] == {"ours": [2600.0, 2601.0], "flashinfer": [2700.0, 2701.0]}
