"""The SGLang e2e tier's negative controls on CPU: a configuration with "worker_hooks" runs
with tests/e2e/hooks.py installed by SGLang's own plugin loader (the throwaway
`sglang.srt.plugins` entry point of tests/e2e/worker_hooks.py), and check_fails passes only
on a perturbed engine whose outputs break the closeness rule."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.sglang_gpu import engine_runs

ROOT = pathlib.Path(__file__).resolve().parents[2]
OPTIONS = {"perturb": "partial_page_dropped"}


def _out(token, logprob):
    return {"prompt_len": 1, "token_ids": [token, token],
            "logprobs": [[[token, logprob]], [[token, logprob]]]}


def test_hooked_spec_puts_the_plugin_first_and_whitelists_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/opt/sg/site")
    spec = {"backend": "mla_backend", "env": {"A": "1"}, "worker_hooks": OPTIONS}
    run_spec, reports = engine_runs._hooked(spec, tmp_path / "h")
    assert "worker_hooks" not in run_spec and reports == tmp_path / "h" / "reports"
    env = run_spec["env"]
    assert env["A"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path / "h" / "plugin"), str(ROOT),
                                                   "/opt/sg/site"]
    assert env["SGLANG_PLUGINS"] == "mla_backend,mla_backend_e2e_worker_hooks"
    assert json.loads(env["MLA_E2E_WORKER_HOOKS"]) == OPTIONS
    entry = (tmp_path / "h" / "plugin" / "mla_backend_e2e_worker_hooks-0.dist-info"
             / "entry_points.txt").read_text()
    assert entry.startswith("[sglang.srt.plugins]\n")
    # without hooks the spec runs as it is
    assert engine_runs._hooked({"backend": "flashmla"}, tmp_path / "x") == (
        {"backend": "flashmla"}, None)


def test_sglangs_plugin_loader_installs_the_perturbation(tmp_path):
    # a fresh interpreter, as SGLang's scheduler process is: its load_plugins() must run the
    # hooks' entry point, which replaces ops.mla_decode by the perturbing wrapper
    run_spec, _ = engine_runs._hooked({"backend": "mla_backend", "worker_hooks": OPTIONS},
                                      tmp_path / "h")
    code = ("from sglang.srt.plugins import load_plugins; load_plugins(); "
            "from mla_backend import ops; from tests.e2e import hooks; "
            "print(ops.mla_decode is hooks._mla_decode, hooks.report()['options'])")
    env = dict(os.environ, **run_spec["env"])
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == f"True {OPTIONS}"


def test_check_fails_needs_perturbed_calls_and_a_broken_rule(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_E2E_OUT", str(tmp_path))
    peer = {"outputs": [_out(3, -0.5)]}
    far = {"outputs": [_out(3, -2.5)], "hooks": [{"perturbed_calls": 4}]}
    engine_runs.check_fails("far", far, peer, 0.1)
    with pytest.raises(AssertionError, match="no kernel call was perturbed"):
        engine_runs.check_fails("unhooked", dict(far, hooks=[]), peer, 0.1)
    close = {"outputs": [_out(3, -0.52)], "hooks": [{"perturbed_calls": 4}]}
    with pytest.raises(AssertionError, match="passed the closeness rule"):
        engine_runs.check_fails("close", close, peer, 0.1)
