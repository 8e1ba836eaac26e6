"""tests/e2e/hooks.py in every process of a multi-GPU engine (or of an SGLang engine, whose
model runs in a scheduler process it spawns).

A tensor-parallel engine runs its model in worker processes that the engine spawns, so a
module imported into the engine's own process (engine_run's "preload") never reaches them.
vLLM calls every `vllm.general_plugins` entry point in each of its processes, workers
included; `write_plugin(folder)` writes a throwaway distribution whose entry point is
`register` below, and an engine started with that folder on PYTHONPATH and
$MLA_E2E_WORKER_HOOKS set (hooks' options as JSON) installs the hooks in each process. Each
process writes its report (tests.e2e.hooks.report(), with its tensor- and decode-context-
parallel ranks) to $MLA_E2E_WORKER_HOOKS_DIR/<pid>.json after every hooked call;
`read_reports` collects those of the worker processes by rank.
"""

from __future__ import annotations

import json
import os
import pathlib

OPTIONS_ENV = "MLA_E2E_WORKER_HOOKS"
REPORT_DIR_ENV = "MLA_E2E_WORKER_HOOKS_DIR"
DIST = "mla_backend_e2e_worker_hooks-0.dist-info"
ENTRY = "mla_backend_e2e_worker_hooks = tests.e2e.worker_hooks:register"


def register() -> None:
    """The entry point: install the hooks with $MLA_E2E_WORKER_HOOKS' options (nothing when it
    is unset), reporting to $MLA_E2E_WORKER_HOOKS_DIR/<pid>.json."""
    raw = os.environ.get(OPTIONS_ENV)
    if not raw:
        return
    from tests.e2e import hooks

    folder = os.environ.get(REPORT_DIR_ENV)
    if not folder:
        raise RuntimeError(f"{OPTIONS_ENV} is set but {REPORT_DIR_ENV} is not")
    hooks.install(json.loads(raw), report_path=os.path.join(folder, f"{os.getpid()}.json"))


def write_plugin(folder: str | os.PathLike, group: str = "vllm.general_plugins") -> str:
    """The throwaway distribution (metadata and entry point only; the module is this file,
    found through the repository root on PYTHONPATH) in folder; returns folder. group: the
    engine's plugin group, called in each of its processes (vLLM's general plugins, or
    SGLang's "sglang.srt.plugins")."""
    dist = pathlib.Path(folder) / DIST
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: mla-backend-e2e-worker-hooks\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(f"[{group}]\n{ENTRY}\n")
    return str(folder)


def engine_env(plugin_folder: str, report_dir: str, options: dict) -> dict:
    """The environment variables that turn the hooks on for one engine (PYTHONPATH aside)."""
    os.makedirs(report_dir, exist_ok=True)
    for old in pathlib.Path(report_dir).glob("*.json"):
        old.unlink()
    return {OPTIONS_ENV: json.dumps(options, sort_keys=True), REPORT_DIR_ENV: report_dir}


def rank_name(ranks: dict) -> str:
    """The worker's process name as vLLM gives it (Worker_TP1_DCP1; tests/e2e/parallel.py)."""
    name = "Worker"
    if ranks.get("tp_size", 1) > 1:
        name += f"_TP{ranks['tp']}"
    if ranks.get("dcp_size", 1) > 1:
        name += f"_DCP{ranks['dcp']}"
    return name


def read_reports(report_dir: str) -> dict[str, dict]:
    """The reports of the processes that ran hooked calls inside vLLM's parallel groups (the
    workers), by rank_name; ValueError when two processes claim the same rank."""
    reports: dict[str, dict] = {}
    for path in sorted(pathlib.Path(report_dir).glob("*.json")):
        rep = json.loads(path.read_text())
        if not rep.get("ranks"):
            continue
        name = rank_name(rep["ranks"])
        if name in reports:
            raise ValueError(f"two worker processes report rank {name} in {report_dir}")
        reports[name] = rep
    return reports
