"""`python -m mla_backend.demo --engine vllm|sglang`: the engine check, the spec each engine
runner gets, and the run through both backends with the runners replaced by fakes (no GPU):
vLLM's spec as it always was, SGLang's ours vs flashmla."""

import importlib.util
import sys

import pytest

from mla_backend.demo import __main__ as demo
from mla_backend.demo import engines, sglang_run


def _fake_result(backend, step_us, tokens, busy_us=None):
    outputs = [{"prompt_len": n, "token_ids": tokens,
                "logprobs": [[[t, -0.5], [t + 1, -2.0]] for t in tokens]} for n in (5, 40, 700)]
    timing = {"step_us": step_us, "decode_tokens_per_s": 32 / step_us * 1e6,
              "step_us_all": [step_us]}
    if busy_us is not None:
        timing["gpu_busy_us_all"] = busy_us
    return {"outputs": outputs, "engine_start_s": 1.0, "timing": timing}


def test_default_engine_is_vllm_and_baselines_differ():
    args = demo._parse([])
    assert args.engine == "vllm" and args.baseline is None
    assert demo.ENGINES == {"vllm": ("CUSTOM", None), "sglang": ("mla_backend", "flashmla")}
    with pytest.raises(SystemExit):
        demo._parse(["--engine", "tensorrt"])


def test_vllm_spec_is_unchanged():
    args = demo._parse(["--batch", "48", "--context", "1024", "--tp", "2", "--eager",
                        "--kv-cache-dtype", "fp8", "--max-tokens", "8"])
    spec = demo.engine_spec(args, "/m", False, [[1, 2]])
    assert spec == {"model": "/m", "tokenizer": False, "mode": "eager", "kv_cache_dtype": "fp8",
                    "max_model_len": 1536, "max_num_seqs": 64, "tensor_parallel_size": 2,
                    "gpu_memory_utilization": 0.5, "prompts": [[1, 2]], "max_tokens": 8,
                    "logprobs": 5, "timing": {"prompt_len": 1016, "batch": 48, "steps": 32,
                                              "repeats": 3, "gpu_busy": False}}
    # one GPU: the engine core in the runner's process, where the profiler sees its kernels
    spec = demo.engine_spec(demo._parse([]), "/m", False, [[1, 2]])
    assert spec["timing"]["gpu_busy"] is True and spec["tensor_parallel_size"] == 1


def test_sglang_spec_maps_the_options():
    args = demo._parse(["--engine", "sglang", "--batch", "48", "--context", "1024",
                        "--kv-cache-dtype", "fp8", "--max-tokens", "8"])
    spec = demo.engine_spec(args, "/m", False, [[1, 2]] * 3)
    assert spec == {"model": "/m", "graphs": True, "kv_cache_dtype": "fp8_e4m3",
                    "context_length": 1536, "chunked_prefill_size": 8192,
                    "max_running_requests": 48, "mem_fraction_static": 0.3,
                    "engine_args": {"flashinfer_mla_disable_ragged": True},
                    "prompts": [[1, 2]] * 3, "max_new_tokens": 8, "logprobs": 5,
                    "timing": {"prompt_len": 1016, "batch": 48, "steps": 32, "repeats": 3,
                               "gpu_busy": True, "log_interval": 8}}
    args = demo._parse(["--engine", "sglang", "--model", "/ckpt", "--tp", "8", "--eager"])
    spec = demo.engine_spec(args, "/ckpt", True, [[1]])
    assert spec["graphs"] is False and spec["kv_cache_dtype"] == "auto"
    assert spec["engine_args"]["tp_size"] == 8
    assert spec["mem_fraction_static"] is None  # a real checkpoint: SGLang's own choice


@pytest.mark.parametrize("engine, package, hint", [("vllm", "vllm", "pip install vllm=="),
                                                   ("sglang", "sglang", "sglang==0.5.17")])
def test_engine_not_importable_is_named_with_its_install(monkeypatch, capsys, engine, package,
                                                         hint):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == package else real(name, *a))
    wrote = []
    monkeypatch.setattr(demo.tiny_model, "write_checkpoint", lambda *a, **k: wrote.append(a))
    assert demo.main(["--engine", engine]) == 2
    err = capsys.readouterr().err
    assert f"--engine {engine}: the {package} package is not importable by {sys.executable}" in err
    assert hint in err
    assert wrote == []  # refused before any work


def test_sglang_without_our_entry_point_is_refused(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(engines, "sglang_entry_point_installed", lambda: False)
    msg = engines.engine_missing("sglang")
    assert "sglang.srt.plugins entry point is not installed" in msg
    assert "pip install --no-build-isolation -e ." in msg
    monkeypatch.setattr(engines, "sglang_entry_point_installed", lambda: True)
    assert engines.engine_missing("sglang") is None


def test_sglang_demo_runs_ours_then_flashmla(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(engines, "engine_missing", lambda engine: None)
    calls = []

    def fake_run(spec, log, timeout_s=600, *, label="", progress=False):
        calls.append((spec["backend"], log, label, progress))
        ours = spec["backend"] == "mla_backend"
        return _fake_result(spec["backend"], 500.0 if ours else 600.0,
                            [7, 8, 9] if ours else [7, 8, 4])

    monkeypatch.setattr(sglang_run, "run", fake_run)
    monkeypatch.setattr(engines, "run_engine", lambda *a, **k: pytest.fail("vLLM runner used"))
    assert demo.main(["--engine", "sglang", "--logs", str(tmp_path), "--context", "256"]) == 0
    assert [(b, lbl, p) for b, _, lbl, p in calls] == [("mla_backend", "[mla_backend]", True),
                                                       ("flashmla", "[baseline]", True)]
    assert calls[0][1] == str(tmp_path / "engine-mla_backend.log")
    out = capsys.readouterr().out
    assert out.startswith("mla_backend demo in SGLang: tiny DeepSeek-V3")
    assert "  mla_backend           : 7 8 9" in out and "  flashmla              : 7 8 4" in out
    assert "prompt 0 parts at generated token 2: mla_backend chose 9, flashmla 4" in out
    assert "generated tokens agree: until they part" in out and "(6/9)" in out
    # no GPU busy time in these results: the wall clock, said so
    assert "  mla_backend against flashmla: 1.20x by the wall clock" in out


def test_vllm_demo_keeps_its_runner_and_names(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(engines, "engine_missing", lambda engine: None)
    seen = []

    def fake_run_engine(spec, log, *, label="", progress=False):
        seen.append((spec["backend"], label))
        with open(log, "w") as f:
            f.write("Using FLASHMLA attention backend\n" if spec["backend"] is None else "")
        return _fake_result(spec["backend"], 500.0, [7, 8, 9])

    monkeypatch.setattr(engines, "run_engine", fake_run_engine)
    monkeypatch.setattr(sglang_run, "run", lambda *a, **k: pytest.fail("SGLang runner used"))
    assert demo.main(["--logs", str(tmp_path), "--context", "256"]) == 0
    assert seen == [("CUSTOM", "[CUSTOM]"), (None, "[baseline]")]
    out = capsys.readouterr().out
    assert out.startswith("mla_backend demo: tiny DeepSeek-V3")
    assert "  CUSTOM (mla_backend)  : 7 8 9" in out and "  FLASHMLA              : 7 8 9" in out
    assert "generated tokens agree: yes (9/9)" in out


def test_vllm_demo_compares_by_gpu_busy_time_and_shows_the_wall_clock(monkeypatch, capsys,
                                                                      tmp_path):
    monkeypatch.setattr(engines, "engine_missing", lambda engine: None)

    def fake_run_engine(spec, log, *, label="", progress=False):
        with open(log, "w") as f:
            f.write("Using FLASH_ATTN_MLA attention backend\n" if spec["backend"] is None else "")
        ours = spec["backend"] == "CUSTOM"
        # ours slower by the (host-bound) wall clock, faster on the GPU
        return _fake_result(spec["backend"], 3300.0 if ours else 2300.0, [7, 8, 9],
                            busy_us=[410.0, 400.0, 405.0] if ours else [440.0, 450.0, 445.0])

    monkeypatch.setattr(engines, "run_engine", fake_run_engine)
    assert demo.main(["--logs", str(tmp_path), "--context", "256"]) == 0
    out = capsys.readouterr().out
    assert "  CUSTOM (mla_backend)  : GPU busy 405 us per step; 3300 us per step by the wall " \
           "clock (9697 tokens/s)" in out
    assert "  FLASH_ATTN_MLA        : GPU busy 445 us per step; 2300 us per step" in out
    assert "  CUSTOM (mla_backend) against FLASH_ATTN_MLA: 1.10x by GPU busy time" in out
    assert "speedup" not in out
