"""tests/sglang_gpu/engine_runs.py on CPU, the engine replaced by a fake: one run per
configuration in a session, reuse across sessions only under the same cache key (same
checkpoint bytes, same spec), the log and the report written either way; BASE merged with a
configuration's engine arguments and environment."""

import json
import math

import pytest

from mla_backend.demo import tiny_model
from tests.sglang_gpu import engine_runs

CONFIGS = {"ref": {"backend": "flashmla"},
           "ours": {"backend": "mla_backend", "kv_cache_dtype": "fp8_e4m3",
                    "engine_args": {"tp_size": 2}, "env": {"A": "1"}}}


@pytest.fixture
def fake_engine(monkeypatch, tmp_path):
    """sglang_run.run replaced: records each spec it starts, writes a log, returns outputs."""
    started = []

    def run(spec, log_path, timeout_s, label):
        started.append(spec)
        with open(log_path, "w") as f:
            f.write(f"log of {spec['backend']}\n")
        return {"engine_start_s": 1.0, "generate_s": 2.0,
                "outputs": [{"prompt_len": 1, "token_ids": [3], "logprobs": [[[3, -0.5]]]}]}

    monkeypatch.setattr(engine_runs.sglang_run, "run", run)
    monkeypatch.setenv("SGLANG_E2E_OUT", str(tmp_path / "out"))
    monkeypatch.setattr(engine_runs, "_report", {})
    return started


def _model(path) -> str:
    return tiny_model.write_config(str(path), arch="v3", heads=4)


def test_full_spec_merges_engine_args_and_env():
    spec = engine_runs.full_spec("/m", [[1]], CONFIGS["ours"])
    assert spec["engine_args"] == dict(engine_runs.BASE["engine_args"], tp_size=2)
    assert spec["env"] == {"A": "1"} and spec["kv_cache_dtype"] == "fp8_e4m3"
    assert spec["graphs"] and spec["model"] == "/m" and spec["prompts"] == [[1]]
    assert engine_runs.BASE["engine_args"] == {"max_total_tokens": 16384}  # not mutated


def test_cache_key_follows_checkpoint_bytes_and_spec(tmp_path):
    a, b, c = (_model(tmp_path / n) for n in "abc")
    tiny_model.write_config(c, arch="v3", heads=8)
    key = engine_runs.cache_key(engine_runs.full_spec(a, [[1]], CONFIGS["ref"]))
    # the same checkpoint in another folder: the same key
    assert engine_runs.cache_key(engine_runs.full_spec(b, [[1]], CONFIGS["ref"])) == key
    assert engine_runs.cache_key(engine_runs.full_spec(c, [[1]], CONFIGS["ref"])) != key
    assert engine_runs.cache_key(engine_runs.full_spec(a, [[2]], CONFIGS["ref"])) != key
    assert engine_runs.cache_key(engine_runs.full_spec(a, [[1]], CONFIGS["ours"])) != key


def test_our_runs_are_keyed_by_our_code_and_extension():
    assert {"sources", "extension"} <= engine_runs._identity(True).keys()
    assert not {"sources", "extension"} & engine_runs._identity(False).keys()


def test_each_configuration_runs_once_per_session(fake_engine, tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_E2E_CACHE_DIR", raising=False)
    engines = engine_runs.Engines("g", _model(tmp_path / "m"), [[1]], CONFIGS)
    first = engines.run("ref")
    assert engines.run("ref") is first and len(fake_engine) == 1
    assert first["log"] == "log of flashmla\n"
    engines.run("ours")
    assert [s["backend"] for s in fake_engine] == ["flashmla", "mla_backend"]
    # a new session without a cache runs again
    engine_runs.Engines("g", _model(tmp_path / "m"), [[1]], CONFIGS).run("ref")
    assert len(fake_engine) == 3


def test_cached_runs_are_reused_across_sessions(fake_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_E2E_CACHE_DIR", str(tmp_path / "cache"))
    engine_runs.Engines("g", _model(tmp_path / "m1"), [[1]], CONFIGS).run("ref")
    out = tmp_path / "out"
    (out / "engine-g-ref.log").unlink()
    # next session: the same checkpoint in a new folder, the run comes from the cache
    again = engine_runs.Engines("g", _model(tmp_path / "m2"), [[1]], CONFIGS).run("ref")
    assert len(fake_engine) == 1 and again["outputs"][0]["token_ids"] == [3]
    assert (out / "engine-g-ref.log").read_text() == "log of flashmla\n"
    report = json.loads((out / "sglang-e2e-report.json").read_text())
    assert report["g ref"]["from_cache"] is True
    # other prompts: another key, another run
    engine_runs.Engines("g", _model(tmp_path / "m2"), [[2]], CONFIGS).run("ref")
    assert len(fake_engine) == 2


def test_closeness_rule_and_tolerance(fake_engine):
    def result(lp_b):
        pos = [[[3, -0.5], [4, lp_b]], [[5, -0.2], [6, -2.0]]]
        return {"outputs": [{"prompt_len": 1, "token_ids": [3, 5], "logprobs": pos}]}

    assert engine_runs.tolerance("spread", result(-1.0), result(-1.005)) == engine_runs.FLOOR
    tol = engine_runs.tolerance("spread", result(-1.0), result(-1.25))
    assert tol == pytest.approx(0.5)  # 2 x the spread above the floor
    engine_runs.check_close("close", result(-1.4), result(-1.0), tol)
    with pytest.raises(AssertionError, match="max_abs_logprob_diff"):
        engine_runs.check_close("far", result(-1.6), result(-1.0), tol)
    assert engine_runs._report["far"]["failed"]


def test_uniform_reference_is_refused(fake_engine):
    vocab = engine_runs.VOCAB
    flat = [[[t, -math.log(vocab)] for t in range(5)]]
    with pytest.raises(AssertionError):
        engine_runs.assert_not_uniform("flat", {"outputs": [
            {"prompt_len": 1, "token_ids": [0], "logprobs": flat}]})
    engine_runs.assert_not_uniform("peaked", {"outputs": [
        {"prompt_len": 1, "token_ids": [0], "logprobs": [[[0, -0.1], [1, -3.0]]]}]})
