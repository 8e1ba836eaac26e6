"""The vLLM engine runner's decode-step timing (mla_backend.demo.engine_run._decode_step_s),
driven by a fake engine whose steps take a known time: whole-batch steps, steps whose
outputs arrive in two parts, and an engine core that runs in its own process."""

import gc
import types

import pytest

pytest.importorskip("vllm")

from mla_backend.demo import engine_run  # noqa: E402

STEP_S = 0.003


class FakeEngine:
    """`batch` requests: the first step prefills (one token each), every later step gives each
    request one more token; steps listed in `split` return their outputs in two calls."""

    def __init__(self, split=()):
        self.split, self.reqs, self.clock, self.step_no, self.pending = set(split), {}, 0.0, 0, []
        self.gc_during_steps = set()

    def add_request(self, rid, prompt, params):
        self.reqs[rid] = (0, params.max_tokens)

    def has_unfinished_requests(self):
        return bool(self.pending) or any(n < m for n, m in self.reqs.values())

    def _out(self, rid):
        n = self.reqs[rid][0]
        return types.SimpleNamespace(request_id=rid,
                                     outputs=[types.SimpleNamespace(token_ids=[7] * n)])

    def step(self):
        self.gc_during_steps.add(gc.isenabled())
        if self.pending:  # the second part of a split step: no GPU time
            outs, self.pending = self.pending, []
            return outs
        self.clock += STEP_S
        self.step_no += 1
        live = [r for r, (n, m) in self.reqs.items() if n < m]
        for r in live:
            n, m = self.reqs[r]
            self.reqs[r] = (n + 1, m)
        outs = [self._out(r) for r in live]
        if self.step_no in self.split:
            half = len(outs) // 2
            outs, self.pending = outs[:half], outs[half:]
        return outs


@pytest.mark.parametrize("split", [(), (5, 9, 10, 17)])
def test_step_time_counts_engine_steps_however_outputs_arrive(monkeypatch, split):
    engine = FakeEngine(split)
    monkeypatch.setattr(engine_run.time, "perf_counter", lambda: engine.clock)
    llm = types.SimpleNamespace(llm_engine=engine)
    prompts = [{"prompt_token_ids": [1, 2, 3]} for _ in range(4)]
    got = engine_run._decode_step_s(llm, prompts, steps=24, tag="t")
    assert got == pytest.approx(STEP_S)


def test_too_few_decode_steps_is_an_error(monkeypatch):
    engine = FakeEngine()
    monkeypatch.setattr(engine_run.time, "perf_counter", lambda: engine.clock)
    llm = types.SimpleNamespace(llm_engine=engine)
    with pytest.raises(RuntimeError, match="whole-batch decode steps seen; raise steps"):
        engine_run._decode_step_s(llm, [{"prompt_token_ids": [1]}] * 2, steps=1, tag="t")


@pytest.mark.parametrize("enabled", [True, False])
def test_garbage_collector_is_off_during_the_steps_and_restored(monkeypatch, enabled):
    engine = FakeEngine()
    monkeypatch.setattr(engine_run.time, "perf_counter", lambda: engine.clock)
    llm = types.SimpleNamespace(llm_engine=engine)
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        engine_run._decode_step_s(llm, [{"prompt_token_ids": [1]}] * 3, steps=8, tag="t")
        assert engine.gc_during_steps == {False}
        assert gc.isenabled() is enabled
        engine.step = lambda: 1 / 0  # an engine error still restores the collector
        engine.add_request("x", None, types.SimpleNamespace(max_tokens=2))
        with pytest.raises(ZeroDivisionError):
            engine_run._decode_step_s(llm, [{"prompt_token_ids": [1]}], steps=8, tag="u")
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()



class FakeBusy:
    """A gpu_busy.GpuBusy stand-in that notes the engine step at which it started and
    stopped."""

    def __init__(self, engine):
        self.engine, self.started, self.stopped, self.steps = engine, None, None, None

    def start(self):
        self.started = self.engine.step_no

    def stop(self):
        self.stopped = self.engine.step_no


def test_gpu_busy_spans_the_timed_steps(monkeypatch):
    engine = FakeEngine()
    monkeypatch.setattr(engine_run.time, "perf_counter", lambda: engine.clock)
    llm = types.SimpleNamespace(llm_engine=engine)
    busy = FakeBusy(engine)
    got = engine_run._decode_step_s(llm, [{"prompt_token_ids": [1]}] * 4, steps=24, tag="t",
                                    busy=busy)
    assert got == pytest.approx(STEP_S)
    # step 1 prefills, step 2 is the first whole-batch decode step (the first stamp); the
    # recorder runs from there to the last step (25 tokens each), over the 23 steps between
    assert (busy.started, busy.stopped, busy.steps) == (2, 25, 23)


CLIENT_S = 0.0002


class FakeCoreProcess:
    """vLLM's engine core in a process of its own: from the first request on it runs a step
    every STEP_S whether or not the client reads; the client's step() returns the oldest step
    it has not read (waiting for it if none is ready) and costs CLIENT_S. `clock` is the
    client's time."""

    def __init__(self):
        self.clock, self.t0, self.reqs, self.read = 0.0, None, {}, 0

    def add_request(self, rid, prompt, params):
        self.t0 = self.clock if self.t0 is None else self.t0
        self.reqs[rid] = params.max_tokens

    def has_unfinished_requests(self):
        return self.read < max(self.reqs.values(), default=0)

    def step(self):
        k = self.read + 1
        self.clock = max(self.clock, self.t0 + k * STEP_S) + CLIENT_S
        self.read = k
        return [types.SimpleNamespace(request_id=r, outputs=[types.SimpleNamespace(token_ids=[7] * k)])
                for r, m in self.reqs.items() if k <= m]


def test_a_collection_before_the_steps_does_not_let_a_separate_core_run_ahead(monkeypatch):
    """The one collection before the timed steps takes 0.5 s here: were the requests already
    added, the core would produce every token meanwhile and the timed span would be the client
    reading that backlog (CLIENT_S a step, not STEP_S)."""
    engine = FakeCoreProcess()
    monkeypatch.setattr(engine_run.time, "perf_counter", lambda: engine.clock)

    def slow_collect(*a):
        engine.clock += 0.5

    monkeypatch.setattr(engine_run.gc, "collect", slow_collect)
    llm = types.SimpleNamespace(llm_engine=engine)
    got = engine_run._decode_step_s(llm, [{"prompt_token_ids": [1]}] * 4, steps=24, tag="t")
    assert got == pytest.approx(STEP_S)
