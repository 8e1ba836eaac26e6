"""mla_backend.demo.sglang_run without SGLang: the decode-step time from SGLang's own step
records (which records a timed call counts), the outputs' form, the child's environment, and
the child's whole run against a stand-in engine that keeps step records as SGLang's scheduler
does."""

import json
import sys
import types

import pytest

from mla_backend.demo import engines, sglang_run


class _Engine:
    """get_server_info as sgl.Engine returns it, with step records keyed as they arrive."""

    def __init__(self, records):
        self.records = records

    def get_server_info(self):
        return {"internal_states": [{"step_time_dict": self.records}]}


def test_step_times_reads_int_or_str_keys():
    got = sglang_run.step_times(_Engine({"64": [0.1], 3: [0.2, 0.3]}))
    assert got == {64: [0.1], 3: [0.2, 0.3]}
    assert sglang_run.step_times(_Engine({})) == {}


def test_a_timed_call_counts_its_whole_batch_records_less_the_first():
    before = {64: [0.5, 0.004], 8: [0.002]}
    # the call added: one record spanning its prefill (0.9), three of pure decode, and one of
    # a smaller batch (not counted)
    after = {64: [0.5, 0.004, 0.9, 0.003, 0.0031, 0.0035], 8: [0.002, 0.001]}
    assert sglang_run.repeat_step_s(before, after, 64) == pytest.approx(0.0031)


def test_a_timed_call_with_too_few_records_says_what_to_change():
    with pytest.raises(RuntimeError, match="1 step records of batch 64.*raise steps or lower "
                                           "log_interval"):
        sglang_run.repeat_step_s({}, {64: [0.9]}, 64)
    with pytest.raises(RuntimeError, match="0 step records of batch 64"):
        sglang_run.repeat_step_s({64: [0.1]}, {64: [0.1], 32: [0.1, 0.2, 0.3]}, 64)


def test_outputs_carry_prompt_length_tokens_and_ranked_logprobs():
    results = [{"output_ids": [5, 6], "meta_info": {"output_top_logprobs": [
        [(-0.1, 5, None), (-2.0, 9, None)], [(-0.3, 6, None)]]}}]
    assert sglang_run._outputs([[1, 2, 3]], results) == [
        {"prompt_len": 3, "token_ids": [5, 6], "logprobs": [[[5, -0.1], [9, -2.0]], [[6, -0.3]]]}]


@pytest.mark.parametrize("timing", [None, {"batch": 4, "prompt_len": 8, "steps": 32}])
def test_run_starts_the_sglang_runner_with_step_records_when_timing(monkeypatch, timing):
    seen = {}

    def fake(spec, log, **kw):
        seen.update(kw, spec=spec, log=log)
        return {"outputs": []}

    monkeypatch.setattr(engines, "run_engine", fake)
    spec = {"backend": "flashmla", "env": {"FLASHINFER_JIT_VERBOSE": "1"}}
    if timing:
        spec["timing"] = timing
    assert sglang_run.run(spec, "/tmp/x.log", timeout_s=30) == {"outputs": []}
    assert seen["runner"] == "mla_backend.demo.sglang_run" and seen["engine"] == "SGLang"
    assert seen["label"] == "SGLang engine flashmla" and seen["timeout_s"] == 30
    want = {"FLASHINFER_JIT_VERBOSE": "1"}
    if timing:
        want["SGLANG_RECORD_STEP_TIME"] = "1"
    assert seen["env"] == want


class _Scheduler:
    """A stand-in for sgl.Engine that keeps step records as SGLang's scheduler does: one per
    `decode_log_interval` decode steps, the time since the previous record over the interval,
    keyed by the running batch; every call is preceded by idle time and a prefill."""

    def __init__(self, step_s, **kwargs):
        self.kwargs, self.step_s, self.now, self.tic, self.count = kwargs, step_s, 0.0, 0.0, 0
        self.records = {}
        self.calls = []

    def generate(self, input_ids, sampling_params, **kw):
        self.calls.append((len(input_ids), sampling_params["max_new_tokens"], kw))
        self.now += 5.0 + 0.5  # idle, then the prefill of every prompt (first token)
        interval = self.kwargs["decode_log_interval"]
        for _ in range(sampling_params["max_new_tokens"] - 1):
            self.now += self.step_s[len(input_ids)]
            self.count += 1
            if self.count % interval == 0:
                self.records.setdefault(len(input_ids), []).append(
                    (self.now - self.tic) / interval)
                self.tic = self.now
        return [{"output_ids": [7] * sampling_params["max_new_tokens"],
                 "meta_info": {"output_top_logprobs": [[(-0.1, 7, None)]] * sampling_params[
                     "max_new_tokens"]}} for _ in input_ids]

    def get_server_info(self):
        return {"internal_states": [{"step_time_dict": {str(k): list(v) for k, v in
                                                        self.records.items()}}]}

    def shutdown(self):
        self.calls.append("shutdown")


def test_the_runner_times_decode_steps_not_prefill(monkeypatch, tmp_path):
    engines_made = []

    def make_engine(**kwargs):
        engines_made.append(_Scheduler({3: 0.02, 64: 0.004}, **kwargs))
        return engines_made[-1]

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=make_engine))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 100}))
    spec = {"model": str(model), "backend": "mla_backend", "prompts": [[1, 2], [3], [4, 5, 6]],
            "max_new_tokens": 4, "logprobs": 1, "max_running_requests": 64,
            "timing": {"prompt_len": 10, "batch": 64, "steps": 48, "repeats": 3,
                       "log_interval": 16}}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    assert sglang_run.main([str(tmp_path / "spec.json"), str(tmp_path / "out.json")]) == 0
    out = json.loads((tmp_path / "out.json").read_text())
    (engine,) = engines_made
    assert engine.kwargs["decode_log_interval"] == 16 and engine.kwargs["load_format"] == "auto"
    # the prompts, a warm-up call, three timed calls of 1 + 48 tokens, then shutdown
    assert [c[:2] for c in engine.calls[:-1]] == [(3, 4), (64, 49), (64, 49), (64, 49),
                                                  (64, 49)]
    assert engine.calls[-1] == "shutdown"
    assert [o["prompt_len"] for o in out["outputs"]] == [2, 1, 3]
    assert out["timing"]["step_us_all"] == pytest.approx([4000.0] * 3)
    assert out["timing"]["decode_tokens_per_s"] == pytest.approx(64 / 0.004)
    assert "prompts" not in out["spec"] and out["spec"]["backend"] == "mla_backend"
