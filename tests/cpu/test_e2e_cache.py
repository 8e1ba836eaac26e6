"""The e2e tier's result cache (tests/e2e/harness.py): a cached engine result is used only
under the same build (extension bytes, vLLM version, Python sources) and the same inputs
(spec, prompts, checkpoint files)."""

import hashlib
import json

import pytest

from mla_backend.demo import engines
from tests.e2e import harness

IDENTITY = {"extension_sha256": "e" * 64, "vllm": "0.25.0", "python_sources_sha256": "s" * 64}


def _spec(tmp_path, backend="CUSTOM"):
    m = tmp_path / "model"
    m.mkdir(exist_ok=True)
    (m / "model.safetensors").write_bytes(b"weights")
    (m / "config.json").write_text("{}")
    return dict(harness.BASE, prompts=[[2, 3], [4]], model=str(m), backend=backend)


def test_build_identity_hashes_the_extension_file(tmp_path, monkeypatch):
    so = tmp_path / "_C.abi3.so"
    so.write_bytes(b"kernel v1")
    monkeypatch.setenv("MLA_BACKEND_EXTENSION", str(so))
    harness.build_identity.cache_clear()
    try:
        first = harness.build_identity()
        so.write_bytes(b"kernel v2")
        harness.build_identity.cache_clear()
        second = harness.build_identity()
    finally:
        harness.build_identity.cache_clear()
    assert set(first) == {"extension_sha256", "vllm", "python_sources_sha256"}
    h = hashlib.sha256()
    h.update(so.name.encode() + b"\0" + b"kernel v1" + b"\0")
    assert first["extension_sha256"] == h.hexdigest()
    assert second["extension_sha256"] != first["extension_sha256"]
    assert first["python_sources_sha256"] == second["python_sources_sha256"]
    assert first["vllm"] == second["vllm"]


def test_python_sources_cover_the_adapters_and_the_hooks(monkeypatch):
    """Every Python file that changes what an engine computes is in the sources hash: a
    change to any of them changes the identity."""
    read = []
    real = harness._sha256_files

    def spy(paths, base=None):
        paths = list(paths)
        read.append([str(p) for p in paths])
        return real(paths, base)

    monkeypatch.setattr(harness, "_sha256_files", spy)
    harness.build_identity.cache_clear()
    try:
        harness.build_identity()
    finally:
        harness.build_identity.cache_clear()
    sources = max(read, key=len)
    for part in ("mla_backend/vllm/dense.py", "mla_backend/vllm/sparse.py",
                 "mla_backend/ops/dense.py", "mla_backend/demo/engine_run.py",
                 "mla_backend/demo/tiny_model.py", "plugin_entry/vllm_plugin.py",
                 "tests/e2e/hooks.py", "tests/e2e/worker_hooks.py"):
        assert any(p.endswith(part) for p in sources), part


@pytest.mark.parametrize("change", ["extension_sha256", "vllm", "python_sources_sha256"])
def test_key_changes_with_the_build(tmp_path, change):
    spec = _spec(tmp_path)
    other = dict(IDENTITY, **{change: "x"})
    assert harness.cache_key(spec, IDENTITY) != harness.cache_key(spec, other)


def test_key_changes_with_the_inputs(tmp_path):
    spec = _spec(tmp_path)
    key = harness.cache_key(spec, IDENTITY)
    assert harness.cache_key(dict(spec, prompts=[[2, 3], [5]]), IDENTITY) != key
    assert harness.cache_key(dict(spec, mode="eager"), IDENTITY) != key
    assert harness.cache_key(dict(spec, preload={harness.HOOKS: {"count": True}}),
                             IDENTITY) != key
    (tmp_path / "model" / "model.safetensors").write_bytes(b"other weights")
    assert harness.cache_key(spec, IDENTITY) != key


def test_peer_keys_leave_the_extension_out(tmp_path):
    """vLLM's own backends never load our extension: a kernel change does not rerun them."""
    peer = _spec(tmp_path, backend="FLASHMLA")
    assert harness.cache_key(peer, IDENTITY) == harness.cache_key(
        peer, dict(IDENTITY, extension_sha256="x"))


class _FakeEngines:
    def __init__(self):
        self.calls = 0

    def __call__(self, spec, log_path, label="", timeout_s=0, env=None):
        self.calls += 1
        with open(log_path, "w") as f:
            f.write("log\n")
        return {"spec": {k: v for k, v in spec.items() if k != "prompts"},
                "engine_start_s": 1.0, "outputs": [], "run": self.calls}


def test_run_uses_a_cached_result_only_under_its_key(tmp_path, monkeypatch):
    fake = _FakeEngines()
    monkeypatch.setattr(engines, "run_engine", fake)
    monkeypatch.setenv("E2E_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("E2E_REPORT", raising=False)
    identity = dict(IDENTITY)
    monkeypatch.setattr(harness, "build_identity", lambda: identity)
    monkeypatch.setattr(harness, "_report", {})
    model = _spec(tmp_path)["model"]

    def session():
        monkeypatch.setattr(harness, "_results", {})
        return harness.run(tmp_path, "case", model=model, backend="CUSTOM")

    assert session()["run"] == 1
    assert session()["run"] == 1 and fake.calls == 1  # same build and inputs: cached
    identity["extension_sha256"] = "f" * 64  # a kernel change
    assert session()["run"] == 2
    stored = json.loads((tmp_path / "cache" / "case.json").read_text())
    assert stored["cache_key"] == harness.cache_key(
        dict(harness.BASE, prompts=harness.prompts(), model=model, backend="CUSTOM"), identity)
    assert session()["run"] == 2 and fake.calls == 2


def test_run_passes_hooks_and_the_repository_root(tmp_path, monkeypatch):
    seen = {}

    def fake(spec, log_path, label="", timeout_s=0, env=None):
        seen.update(spec=spec, env=env)
        open(log_path, "w").close()
        return {"outputs": [], "preload": {harness.HOOKS: {"perturbed_calls": 3}}}

    monkeypatch.setattr(engines, "run_engine", fake)
    monkeypatch.setattr(harness, "_results", {})
    monkeypatch.setattr(harness, "_report", {})
    monkeypatch.delenv("E2E_CACHE_DIR", raising=False)
    monkeypatch.delenv("E2E_REPORT", raising=False)
    res = harness.run(tmp_path, "hooked", model=_spec(tmp_path)["model"], backend="CUSTOM",
                      hooks={"perturb": "rope_dropped"})
    assert seen["spec"]["preload"] == {"tests.e2e.hooks": {"perturb": "rope_dropped"}}
    assert str(harness.ROOT) in seen["env"]["PYTHONPATH"].split(":")
    assert res["hooks"] == {"perturbed_calls": 3}


def _cmp(diff, overlap=1.0, positions=100):
    return {"max_abs_logprob_diff": diff, "min_topk_overlap": overlap,
            "positions_compared": positions}


def test_the_closeness_rule_and_its_negative():
    assert harness.failures(_cmp(0.05), 0.06) == []
    assert harness.failures(_cmp(0.07), 0.06)[0].startswith("max_abs_logprob_diff")
    assert harness.failures(_cmp(0.01, overlap=0.4), 0.06)[0].startswith("min_topk_overlap")
    assert harness.failures(_cmp(0.01, positions=3), 0.06)[0].startswith("positions_compared")


def _outputs(shift):
    top = [[t, -1.0 * t - shift] for t in range(5)]
    return {"outputs": [{"token_ids": [0] * 3, "logprobs": [top] * 3}
                        for _ in harness.PROMPT_LENS]}


def test_check_fails_passes_only_when_the_rule_fails(monkeypatch):
    monkeypatch.setattr(harness, "_report", {})
    monkeypatch.delenv("E2E_REPORT", raising=False)
    harness.check_fails("wrong", _outputs(0.5), _outputs(0.0), 0.06)
    with pytest.raises(AssertionError, match="passed the closeness rule"):
        harness.check_fails("right", _outputs(0.01), _outputs(0.0), 0.06)
    with pytest.raises(AssertionError):
        harness.check_close("wrong", _outputs(0.5), _outputs(0.0), 0.06)
