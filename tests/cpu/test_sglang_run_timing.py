"""mla_backend.demo.sglang_run without SGLang: the decode-step time from SGLang's own step
records (which records a timed call counts), the outputs' form, and the child's environment."""

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
