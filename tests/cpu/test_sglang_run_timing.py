"""mla_backend.demo.sglang_run without SGLang: the decode-step time from SGLang's own step
records (which records a timed call counts), the outputs' form, the child's environment, and
the child's whole run against a stand-in engine that keeps step records as SGLang's scheduler
does."""

import gzip
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


class _ProfilingScheduler(_Scheduler):
    """_Scheduler with SGLang's profiler calls: a started profile writes, during the next
    generate, a decode trace of its num_steps steps (each one 100 µs kernel, a 30 µs kernel
    inside it and a 5 µs copy after it) named as SGLang names it; `writes` False: it never
    stops by itself."""

    def __init__(self, step_s, writes=True, **kwargs):
        super().__init__(step_s, **kwargs)
        self.writes, self.profiles, self.stopped, self.pending = writes, [], 0, None

    def start_profile(self, **kw):
        self.profiles.append(kw)
        self.pending = kw

    def stop_profile(self):
        self.stopped += 1
        self.pending = None

    def generate(self, input_ids, sampling_params, **kw):
        out = super().generate(input_ids, sampling_params, **kw)
        if self.pending and self.writes:
            p, self.pending, events = self.pending, None, []
            for i in range(p["num_steps"]):
                t = 1000.0 * i
                events += [{"ph": "X", "cat": "kernel", "name": "attn", "ts": t, "dur": 100.0},
                           {"ph": "X", "cat": "kernel", "name": "norm", "ts": t + 10, "dur": 30.0},
                           {"ph": "X", "cat": "gpu_memcpy", "name": "HtoD", "ts": t + 100,
                            "dur": 5.0}]
            path = f"{p['output_dir']}/{p['profile_id']}-TP-0-DECODE.trace.json.gz"
            with gzip.open(path, "wt") as f:
                json.dump({"traceEvents": events}, f)
        return out


def _timed_run(monkeypatch, tmp_path, **scheduler_kw):
    made = []

    def make_engine(**kwargs):
        made.append(_ProfilingScheduler({64: 0.004}, **scheduler_kw, **kwargs))
        return made[-1]

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=make_engine))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 100}))
    spec = {"model": str(model), "backend": "mla_backend", "max_running_requests": 64,
            "timing": {"prompt_len": 10, "batch": 64, "steps": 48, "repeats": 2,
                       "log_interval": 16, "gpu_busy": True}}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    assert sglang_run.main([str(tmp_path / "spec.json"), str(tmp_path / "out.json")]) == 0
    return made[0], json.loads((tmp_path / "out.json").read_text())


def test_gpu_busy_reads_sglangs_decode_trace_of_each_timed_call(monkeypatch, tmp_path):
    engine, out = _timed_run(monkeypatch, tmp_path)
    # one profile per timed call, decode only, GPU only, stopping by itself 2 steps early
    assert [p["profile_id"] for p in engine.profiles] == ["busy0", "busy1"]
    for p in engine.profiles:
        assert (p["num_steps"], p["activities"], p["profile_by_stage"], p["profile_stages"]) == (
            46, ["GPU"], True, ["decode"])
    assert engine.stopped == 0
    timing = out["timing"]
    assert timing["gpu_busy_us_all"] == pytest.approx([105.0, 105.0])  # 100 + 5, norm inside
    assert timing["gpu_kernels_per_step"] == pytest.approx([2.0, 2.0])
    assert timing["gpu_top_us_per_step"] == [["attn", 100.0], ["norm", 30.0], ["HtoD", 5.0]]
    assert timing["step_us_all"] == pytest.approx([4000.0] * 2)  # the wall records as before


def test_gpu_busy_profile_that_never_stopped_is_stopped_and_an_error(monkeypatch, tmp_path):
    engine, out = _timed_run(monkeypatch, tmp_path, writes=False)
    assert engine.stopped == 1 and "timing" not in out
    assert "no decode trace of profile busy0" in out["timing_error"]
