"""What the multi-GPU e2e tests rely on, checked without a GPU: the worker ranks read from an
engine's log in the form vLLM 0.25 writes it (its own prefixing and process naming), the
backend-selection line they look for (as 0.25 and 0.33 log it), the distance of logprobs from
uniform, the hooks reaching every worker through a throwaway
`vllm.general_plugins` distribution and reporting by rank, the DCP lse perturbation, and the
harness starting engines in the background with the environment a multi-GPU engine needs."""

import io
import json
import math
import os
import threading
import types
from importlib import metadata

import pytest
import torch

from mla_backend import ops
from mla_backend.demo import engines
from mla_backend.ops import dense
from tests.e2e import harness, parallel, worker_hooks

# ------------------------------------------------------------------ ranks in the log


def _vllm_process_name(monkeypatch, tp, dcp, rank) -> str:
    """The name vLLM 0.25's worker gives itself (WorkerProc.setup_proc_title_and_log_prefix)
    for this rank, with parallel-group stand-ins."""
    from vllm.v1.executor import multiproc_executor as mp

    def group(size, r):
        return types.SimpleNamespace(world_size=size, rank_in_group=r)

    names = []
    monkeypatch.setattr(mp, "model_parallel_is_initialized", lambda: True)
    for fn, g in [("get_dp_group", group(1, 0)), ("get_pp_group", group(1, 0)),
                  ("get_pcp_group", group(1, 0)), ("get_tp_group", group(tp, rank)),
                  ("get_dcp_group", group(dcp, rank % dcp))]:
        monkeypatch.setattr(mp, fn, lambda g=g: g)
    monkeypatch.setattr(mp, "set_process_title", lambda name: None)
    monkeypatch.setattr(mp, "decorate_logs", names.append)
    mp.WorkerProc.setup_proc_title_and_log_prefix(enable_ep=False)
    return names[0]


@pytest.mark.parametrize("tp, dcp", [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)])
def test_rank_names_are_vllms_worker_names(monkeypatch, tp, dcp):
    pytest.importorskip("vllm")
    assert parallel.rank_names(tp, dcp) == [_vllm_process_name(monkeypatch, tp, dcp, r)
                                            for r in range(tp)]


def _worker_lines(name, pid, lines, color):
    """Lines as a vLLM worker writes them after vLLM's _add_prefix decorated its stdout."""
    from vllm.utils import system_utils

    out = io.StringIO()
    os.environ["VLLM_LOGGING_COLOR"] = "1" if color else "0"
    try:
        system_utils._add_prefix(out, name, pid)
    finally:
        os.environ.pop("VLLM_LOGGING_COLOR")
    for line in lines:
        out.write(line + "\n")
    return out.getvalue()


@pytest.mark.parametrize("color", [False, True])
def test_ranks_logging_reads_vllms_prefixed_lines(color):
    pytest.importorskip("vllm")
    chose = "INFO 11-26 14:00:00 [cuda.py:416] Using AttentionBackendEnum.CUSTOM backend."
    log = (_worker_lines("Worker_TP0_DCP0", 11, [chose, "INFO other"], color)
           + "(EngineCore_DP0 pid=9) " + chose + "\n"  # not a worker
           + _worker_lines("Worker_TP1_DCP1", 12, ["INFO loading", chose], color))
    if color:
        assert "\x1b[" in log
    found = parallel.ranks_logging(log, parallel.CUSTOM_SELECTED)
    assert found == {"Worker_TP0_DCP0": 1, "Worker_TP1_DCP1": 1}
    assert parallel.missing_ranks(log, parallel.CUSTOM_SELECTED, 2, 2) == []
    assert parallel.missing_ranks(log, parallel.CUSTOM_SELECTED, 4, 2) == [
        "Worker_TP2_DCP0", "Worker_TP3_DCP1"]
    only_rank0 = _worker_lines("Worker_TP0", 11, [chose], color)
    assert parallel.missing_ranks(only_rank0, parallel.CUSTOM_SELECTED, 2) == ["Worker_TP1"]


def test_backend_selection_line_is_the_one_the_e2e_tests_read():
    """vLLM's CUDA platform logs the selected backend as "Using %s backend." with the enum
    member (platforms/cuda.py, in 0.25 and 0.33; that module needs libcuda to import, so its
    source is read), which formats to the line the e2e tests look for."""
    import importlib.util
    import logging
    import pathlib
    import re

    pytest.importorskip("vllm")
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    vllm_dir = pathlib.Path(importlib.util.find_spec("vllm").submodule_search_locations[0])
    source = (vllm_dir / "platforms" / "cuda.py").read_text()
    assert re.search(r'logger\.info\(\s*"Using %s backend\.",\s*selected_backend\s*\)', source)
    record = logging.LogRecord("vllm.platforms.cuda", logging.INFO, "cuda.py", 1,
                               "Using %s backend.", (AttentionBackendEnum.CUSTOM,), None)
    assert record.getMessage() == parallel.CUSTOM_SELECTED


def _record_line(pid: int, message: str) -> str:
    """One log record as vLLM 0.25's formatter writes it with PID_TAG_ENV's prefix (the
    format of vllm.logger with VLLM_LOGGING_PREFIX inserted), from process pid."""
    import logging

    from vllm.logging_utils import NewLineFormatter

    fmt = (parallel.PID_TAG_ENV["VLLM_LOGGING_PREFIX"]
           + "%(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s")
    record = logging.LogRecord("vllm.platforms.cuda", logging.INFO, "cuda.py", 416, message,
                               None, None)
    record.process = pid
    return NewLineFormatter(fmt, datefmt="%m-%d %H:%M:%S").format(record)


def test_ranks_logging_survives_interleaved_writes():
    """Two ranks logging at once: the prefixes and the records of two processes interleave
    (the prefix and the record are separate writes); each record carries its pid."""
    pytest.importorskip("vllm")
    chose = parallel.CUSTOM_SELECTED
    a, b = _record_line(11, chose), _record_line(12, chose)
    assert a.startswith("[pid 11] INFO ") and a.endswith(chose)
    log = ("(Worker_TP0 pid=11) [pid 11] INFO loading\n"
           "(Worker_TP1 pid=12) [pid 12] INFO loading\n"
           f"(Worker_TP0 pid=11) (Worker_TP1 pid=12) {b}\n{a}\n")
    assert parallel.ranks_logging(log, chose) == {"Worker_TP0": 1, "Worker_TP1": 1}
    assert parallel.missing_ranks(log, chose, 2) == []
    # a record from a process that is no worker (no worker prefix with its pid) counts for none
    assert parallel.ranks_logging(f"(EngineCore_DP0 pid=9) {_record_line(9, chose)}\n",
                                  chose) == {}


def test_above_uniform():
    vocab = 2048
    uniform = [{"logprobs": [[[t, -math.log(vocab)] for t in range(5)]] * 3}]
    assert parallel.above_uniform(uniform, vocab) == pytest.approx(0.0, abs=1e-9)
    peaked = [{"logprobs": [[[1, -0.5], [2, -2.0]], [[3, -1.5], [4, -3.0]], []]}]
    assert parallel.above_uniform(peaked, vocab) == pytest.approx(-1.0 + math.log(vocab))
    with pytest.raises(ValueError, match="no logprobs"):
        parallel.above_uniform([{"logprobs": []}], vocab)


# ------------------------------------------------------------------ hooks in every worker


def test_plugin_distribution_declares_the_entry_point(tmp_path):
    folder = worker_hooks.write_plugin(tmp_path / "plugin")
    found = [ep for dist in metadata.distributions(path=[folder])
             for ep in dist.entry_points if ep.group == "vllm.general_plugins"]
    assert [(ep.name, ep.value) for ep in found] == [
        ("mla_backend_e2e_worker_hooks", "tests.e2e.worker_hooks:register")]
    assert found[0].load() is worker_hooks.register


def test_register_without_options_does_nothing(monkeypatch, hooks):
    monkeypatch.delenv(worker_hooks.OPTIONS_ENV, raising=False)
    before = ops.mla_decode
    worker_hooks.register()
    assert ops.mla_decode is before


def _fake_decode(monkeypatch):
    def fake(q, *args, **kwargs):
        lead = q.shape[:-1]
        return torch.zeros(*lead, 512), torch.zeros(lead)
    monkeypatch.setattr(dense, "mla_decode", fake)


def test_workers_report_by_rank(tmp_path, monkeypatch, hooks):
    """Each process with vLLM's parallel groups writes its report after every hooked call;
    read_reports keeps those, by vLLM's worker name."""
    _fake_decode(monkeypatch)
    env = worker_hooks.engine_env(str(tmp_path / "plugin"), str(tmp_path / "reports"),
                                  {"count": True})
    (tmp_path / "reports" / "stale.json").write_text("{}")
    env = worker_hooks.engine_env(str(tmp_path / "plugin"), str(tmp_path / "reports"),
                                  {"count": True})
    assert not (tmp_path / "reports" / "stale.json").exists()  # a rerun starts empty
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(hooks, "_ranks",
                        lambda: {"tp": 1, "tp_size": 2, "dcp": 1, "dcp_size": 2})
    worker_hooks.register()
    ops.mla_decode(torch.zeros(3, 4, 128, 576), "cache", "table", "lens", "plan", 0.1)
    ops.mla_decode(torch.zeros(3, 1, 128, 576), "cache", "table", "lens", "plan", 0.1)
    (tmp_path / "reports" / "1.json").write_text(json.dumps({"ranks": {}}))  # the driver's
    reports = worker_hooks.read_reports(str(tmp_path / "reports"))
    assert list(reports) == ["Worker_TP1_DCP1"]
    assert reports["Worker_TP1_DCP1"]["mla_decode_calls_by_s_q"] == {"1": 1, "4": 1}
    (tmp_path / "reports" / "2.json").write_text(
        (tmp_path / "reports" / f"{os.getpid()}.json").read_text())
    with pytest.raises(ValueError, match="two worker processes report rank Worker_TP1_DCP1"):
        worker_hooks.read_reports(str(tmp_path / "reports"))


def test_register_needs_a_report_folder(monkeypatch, hooks):
    monkeypatch.setenv(worker_hooks.OPTIONS_ENV, json.dumps({"count": True}))
    monkeypatch.delenv(worker_hooks.REPORT_DIR_ENV, raising=False)
    with pytest.raises(RuntimeError, match="MLA_E2E_WORKER_HOOKS_DIR"):
        worker_hooks.register()


@pytest.mark.parametrize("rank", [0, 1])
def test_lse_shifted_on_dcp_rank_1(monkeypatch, hooks, rank):
    _fake_decode(monkeypatch)
    monkeypatch.setattr(hooks, "_ranks",
                        lambda: {"tp": rank, "tp_size": 2, "dcp": rank, "dcp_size": 2})
    hooks.install({"perturb": "lse_shifted_on_dcp_rank_1"})
    out, lse = ops.mla_decode(torch.zeros(2, 1, 128, 576), "c", "t", "l", "p", 0.1)
    assert torch.equal(lse, torch.full((2, 1, 128), hooks.LSE_SHIFT * rank))
    assert not out.any()
    assert hooks.report()["perturbed_calls"] == rank


def test_lse_shift_refuses_an_engine_without_dcp(monkeypatch, hooks):
    _fake_decode(monkeypatch)
    monkeypatch.setattr(hooks, "_ranks",
                        lambda: {"tp": 1, "tp_size": 2, "dcp": 0, "dcp_size": 1})
    hooks.install({"perturb": "lse_shifted_on_dcp_rank_1"})
    with pytest.raises(RuntimeError, match="needs decode context parallelism"):
        ops.mla_decode(torch.zeros(2, 1, 64, 576), "c", "t", "l", "p", 0.1)


# ------------------------------------------------------------------ harness


@pytest.fixture
def clean_harness(monkeypatch, tmp_path):
    for name, value in [("_results", {}), ("_report", {}), ("_pending", {}), ("_pool", [])]:
        monkeypatch.setattr(harness, name, value)
    monkeypatch.delenv("E2E_CACHE_DIR", raising=False)
    monkeypatch.setenv("E2E_REPORT", str(tmp_path / "report.json"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    yield str(model)
    for pool in harness._pool:
        pool.shutdown(wait=True)


def test_multi_gpu_engine_env_and_spec(tmp_path, monkeypatch, clean_harness):
    seen = {}

    def fake(spec, log_path, label="", timeout_s=0, env=None):
        seen[label] = (spec, env)
        open(log_path, "w").close()
        reports = env.get(worker_hooks.REPORT_DIR_ENV)
        if reports:  # what a worker would write
            with open(os.path.join(reports, "77.json"), "w") as f:
                json.dump({"ranks": {"tp": 0, "tp_size": 2, "dcp": 0, "dcp_size": 1},
                           "sparse_mla_decode_calls": 5}, f)
        return {"outputs": []}

    monkeypatch.setattr(engines, "run_engine", fake)
    prompts = [[5, 6, 7]]
    res = harness.run(tmp_path, "tp2", {"count": True}, model=clean_harness, backend="CUSTOM",
                      tensor_parallel_size=2, prompts=prompts)
    spec, env = seen["tp2"]
    assert spec["prompts"] == prompts and spec["worker_hooks"] == {"count": True}
    assert "preload" not in spec
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert env["VLLM_ALLREDUCE_USE_SYMM_MEM"] == "0"
    assert env["VLLM_LOGGING_PREFIX"] == "[pid %(process)d] "
    for k, v in harness.NO_MULTICAST.items():
        assert env.get(k, os.environ.get(k)) == v
    plugin = env["PYTHONPATH"].split(os.pathsep)[0]
    assert os.path.isdir(os.path.join(plugin, worker_hooks.DIST))
    assert str(harness.ROOT) in env["PYTHONPATH"].split(os.pathsep)
    assert json.loads(env[worker_hooks.OPTIONS_ENV]) == {"count": True}
    assert res["hooks_by_rank"] == {"Worker_TP0": {
        "ranks": {"tp": 0, "tp_size": 2, "dcp": 0, "dcp_size": 1}, "sparse_mla_decode_calls": 5}}
    # one GPU: hooks preloaded into the engine's process, workers not spawned
    harness.run(tmp_path, "tp1", {"count": True}, model=clean_harness, backend="CUSTOM")
    spec, env = seen["tp1"]
    assert spec["preload"] == {harness.HOOKS: {"count": True}} and "worker_hooks" not in spec
    assert spec["prompts"] == harness.prompts()
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in env and worker_hooks.OPTIONS_ENV not in env


def test_started_engines_run_side_by_side(tmp_path, monkeypatch, clean_harness):
    """start() runs up to $E2E_PARALLEL_ENGINES engines at once; run() waits for a started
    key and raises what its engine raised; the report gets every engine."""
    monkeypatch.setenv("E2E_PARALLEL_ENGINES", "2")
    both = threading.Barrier(2, timeout=10)  # passes only if two engines run at once

    def fake(spec, log_path, label="", timeout_s=0, env=None):
        open(log_path, "w").close()
        if label in ("a", "b"):
            both.wait()
        if label == "bad":
            raise engines.EngineFailed("bad failed (exit 1)")
        return {"outputs": [], "engine_start_s": 1.0, "label": label}

    monkeypatch.setattr(engines, "run_engine", fake)
    for key in ("a", "b", "bad"):
        harness.start(tmp_path, key, model=clean_harness, backend=key)
    harness.start(tmp_path, "a", model=clean_harness, backend="a")  # started once
    assert harness.run(tmp_path, "b", model=clean_harness, backend="b")["label"] == "b"
    assert harness.run(tmp_path, "a", model=clean_harness, backend="a")["label"] == "a"
    with pytest.raises(engines.EngineFailed, match="bad failed"):
        harness.run(tmp_path, "bad", model=clean_harness, backend="bad")
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report) == {"a", "b"}


def test_failures_counts_positions_per_prompt():
    cmp = {"positions_compared": 7, "max_abs_logprob_diff": 0.01, "min_topk_overlap": 1.0}
    assert harness.failures(cmp, 0.02, num_prompts=4) == ["positions_compared 7 < 8"]
    assert harness.failures(dict(cmp, positions_compared=8), 0.02, num_prompts=4) == []
    assert harness.failures(dict(cmp, positions_compared=8), 0.02) == [
        f"positions_compared 8 < {2 * len(harness.PROMPT_LENS)}"]
