"""The gpu and e2e tiers skip without a CUDA device and fail, once and naming the cause, on a
CUDA machine that cannot run them (tests/tier_gate.py, tests/conftest.py). The CUDA device,
the extension and vLLM are faked."""

import os
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest
import torch

from mla_backend import _extension
from mla_backend._sources import sources_sha256
from tests import tier_gate

ROOT = Path(__file__).resolve().parents[2]


def _touch(path: Path, mtime: float, text: str = "x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.utime(path, (mtime, mtime))
    return path


@pytest.fixture
def source_tree(tmp_path):
    """A clone: mla_backend/ beside csrc/ (a source file in a subfolder, an hour old)."""
    pkg = tmp_path / "clone" / "mla_backend"
    pkg.mkdir(parents=True)
    _touch(tmp_path / "clone" / "csrc" / "wgmma" / "decode.cu", 1_000_000 - 3600)
    return pkg


@pytest.fixture
def fake_machine(monkeypatch):
    """A CUDA device and an extension whose path, load error and build record the test sets."""
    facts = {"path": None, "error": None, "record": "no build record (not installed)"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_extension, "extension_path", lambda: facts["path"])
    monkeypatch.setattr(_extension, "load_error", lambda: facts["error"])
    monkeypatch.setattr(_extension, "build_status", lambda: facts["record"])
    monkeypatch.setattr(tier_gate, "installed_extension", lambda pkg_dir=None: None)
    return facts


def test_no_cuda_device_skips_both_tiers(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(_extension, "extension_path", lambda: None)
    assert tier_gate.check("gpu") == ("skip", "gpu tier: no CUDA device")
    assert tier_gate.check("e2e") == ("skip", "e2e tier: no CUDA device")


def test_missing_extension_fails_the_gpu_tier(fake_machine):
    fake_machine["error"] = "no mla_backend/_C*.so next to ..."
    kind, cause = tier_gate.check("gpu")
    assert kind == "fail"
    assert cause == (f"extension missing: no _C*.so in {tier_gate.PKG_DIR}; build it: `python -m "
                     f"pip install --no-build-isolation -e .` in the repository root (on the GPU "
                     f"machine `bash scripts/gpu-check` does it)")
    # setup.py's reason for not building it, when there is one
    fake_machine["record"] = "skipped at build time: nvcc not found"
    assert "(install record: skipped at build time: nvcc not found)" in tier_gate.check("gpu")[1]


def test_missing_extension_named_by_the_environment(tmp_path):
    cause = tier_gate.extension_problem(tmp_path / "mla_backend", str(tmp_path / "gone.so"),
                                        "loading failed")
    assert cause.startswith(f"extension missing: MLA_BACKEND_EXTENSION names {tmp_path}/gone.so,"
                            f" which does not exist")


def test_source_tree_without_so_while_an_installed_copy_has_one(source_tree, tmp_path):
    installed = _touch(tmp_path / "site" / "mla_backend" / "_C.abi3.so", 1_000_000)
    cause = tier_gate.extension_problem(source_tree, None, "no .so", installed_so=installed)
    assert cause == (f"extension not in the source tree: mla_backend was imported from "
                     f"{source_tree}, which has no _C*.so, while the installed copy has "
                     f"{installed}; the tests import the source tree, so build the extension in "
                     f"place: `python -m pip install --no-build-isolation -e .` in "
                     f"{source_tree.parent}")


def test_installed_extension_found_through_the_distribution(monkeypatch, source_tree, tmp_path):
    site = tmp_path / "site"
    _touch(site / "mla_backend" / "_C.abi3.so", 1_000_000)

    class Dist:
        files = [metadata.PackagePath("mla_backend/ops.py"),
                 metadata.PackagePath("mla_backend/_C.abi3.so")]

        @staticmethod
        def locate_file(f):
            return site / f

    monkeypatch.setattr(metadata, "distribution", lambda name: Dist)
    assert tier_gate.installed_extension(source_tree) == site / "mla_backend" / "_C.abi3.so"
    # an editable install's package is the source tree itself: no other copy
    assert tier_gate.installed_extension(site / "mla_backend") is None


def test_stale_extension_fails_even_when_it_loads(source_tree):
    so = _touch(source_tree / "_C.abi3.so", 1_000_000)
    built_from = sources_sha256(source_tree.parent)
    assert tier_gate.extension_problem(source_tree, str(so), None,
                                       recorded_sources=built_from) is None
    # a source changes after the build; file times say nothing (the .so is the newer file)
    _touch(source_tree.parent / "csrc" / "sparse" / "kernel.cuh", 1)
    cause = tier_gate.extension_problem(source_tree, str(so), None, recorded_sources=built_from)
    tree = sources_sha256(source_tree.parent)
    assert cause == (f"extension stale: {so} was built from other sources (fingerprint "
                     f"{built_from[:12]}) than this tree's csrc/ + setup.py ({tree[:12]}), so it "
                     f"may not be the code under test; rebuild it: `python setup.py build_ext "
                     f"--inplace --force` in the repository root (`bash scripts/gpu-check` does "
                     f"it)")
    # no record of its sources: it cannot be shown to be the code under test
    assert tier_gate.extension_problem(source_tree, str(so), None).startswith(
        f"extension stale: {so} has no record of the sources it was built from")
    # stale wins over a load error: rebuilding fixes both
    assert tier_gate.extension_problem(source_tree, str(so), "undefined symbol: x").startswith(
        "extension stale")
    # a build chosen with $MLA_BACKEND_EXTENSION is taken as it is
    assert tier_gate.extension_problem(source_tree, str(so), None, env_override=True) is None
    # an installed copy has no csrc/ beside it: staleness cannot be decided, a loading .so runs
    installed = _touch(source_tree.parent.parent / "site" / "mla_backend" / "_C.abi3.so", 1)
    assert tier_gate.extension_problem(installed.parent, str(installed), None) is None


def test_sources_fingerprint_covers_csrc_at_any_depth_and_setup_py(tmp_path):
    _touch(tmp_path / "csrc" / "a.cu", 1, "A")
    first = sources_sha256(tmp_path)
    assert first == sources_sha256(tmp_path)  # deterministic
    _touch(tmp_path / "csrc" / "a.cu", 5, "A")
    assert sources_sha256(tmp_path) == first  # content, not times
    _touch(tmp_path / "csrc" / "deep" / "b.cuh", 1, "B")
    second = sources_sha256(tmp_path)
    assert second != first
    _touch(tmp_path / "setup.py", 1, "S")
    assert sources_sha256(tmp_path) not in (first, second)
    assert sources_sha256(tmp_path / "nowhere") is None


@pytest.mark.parametrize("error", [
    "loading /x/_C.abi3.so failed: /x/_C.abi3.so: undefined symbol: _ZN3c104cuda9SetDeviceEa",
    "loading /x/_C.abi3.so failed: /lib/libstdc++.so.6: version `GLIBCXX_3.4.32' not found",
])
def test_abi_mismatch_names_the_running_torch(source_tree, tmp_path, error):
    running = (f"torch {torch.__version__} (CUDA {torch.version.cuda}) from "
               f"{Path(torch.__file__).parent}")
    so = _touch(tmp_path / "site" / "mla_backend" / "_C.abi3.so", 1_000_000)
    assert tier_gate.extension_problem(so.parent, str(so), error) == (
        f"extension built for another torch/ABI: {so} does not load into {running} ({error}); "
        f"rebuild it against this torch: `python -m pip install --no-build-isolation --no-deps "
        f"--force-reinstall .` from the repository")
    # in a source tree (built from its sources): rebuilt in place
    so = _touch(source_tree / "_C.abi3.so", 1_000_000)
    assert tier_gate.extension_problem(
        source_tree, str(so), error,
        recorded_sources=sources_sha256(source_tree.parent)).endswith(
        "rebuild it against this torch: `python setup.py build_ext --inplace --force` in the "
        "repository root")


def test_other_load_failure_is_reported_as_is(tmp_path):
    so = _touch(tmp_path / "mla_backend" / "_C.abi3.so", 1_000_000)
    error = f"loading {so} failed: libcudart.so.13: cannot open shared object file"
    assert (tier_gate.extension_problem(so.parent, str(so), error)
            == f"extension failed to load: {error}")


def test_e2e_tier_fails_without_vllm(fake_machine, monkeypatch, tmp_path):
    fake_machine["path"] = str(_touch(tmp_path / "mla_backend" / "_C.abi3.so", 1_000_000))
    monkeypatch.setattr(tier_gate, "PKG_DIR", tmp_path / "mla_backend")
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    assert tier_gate.check("gpu") is None
    kind, cause = tier_gate.check("e2e")
    assert kind == "fail" and cause.startswith("vLLM cannot be imported (ModuleNotFoundError: ")
    assert cause.endswith("; run the tier with `bash scripts/gpu-e2e` (it puts the vLLM kit "
                          "/opt/vk/site on PYTHONPATH) or install vllm==0.25.0")


def test_failure_message_names_the_tiers():
    assert (tier_gate.failure_message(["gpu", "e2e"], "extension missing: ...")
            == "this machine has a CUDA device, but the gpu tier and the e2e tier cannot run: "
               "extension missing: ...")


_FAKE_CUDA = textwrap.dedent("""
    import os, torch
    from mla_backend import _extension
    from tests import tier_gate
    torch.cuda.is_available = lambda: os.environ["FAKE_CUDA"] == "1"
    _extension.extension_path = lambda: None
    _extension.load_error = lambda: "no mla_backend/_C*.so"
    _extension.build_status = lambda: "no build record"
    tier_gate.installed_extension = lambda pkg_dir=None: None
""")


@pytest.mark.parametrize("cuda", ["1", "0"])
def test_pytest_run_fails_once_with_a_gpu_skips_without(tmp_path, cuda):
    # `pytest` over the gpu tests and one cpu test, as a plain `python -m pytest` would select
    (tmp_path / "fake_cuda.py").write_text(_FAKE_CUDA)
    env = dict(os.environ, FAKE_CUDA=cuda,
               PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    for var in ("CI", "BUILD_NUMBER"):  # under CI pytest prints the summary line untruncated
        env.pop(var, None)
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "fake_cuda", "-p", "no:cacheprovider", "-q",
         "tests/gpu",
         "tests/cpu/test_planner.py::test_units_per_cta_balances_and_respects_minimum"],
        cwd=ROOT, env=env, capture_output=True, text=True)
    out = res.stdout + res.stderr
    if cuda == "1":
        assert res.returncode == 1, out
        # one failing item with the whole message in place of the gpu tests; the cpu test runs
        assert out.count("FAILED tests/conftest.py::gpu-tier-gate") == 1
        assert out.count("this machine has a CUDA device, but the gpu tier cannot run: "
                         "extension missing: no _C*.so in") == 1
        assert "1 failed, 1 passed" in out and " deselected" in out
    else:
        assert res.returncode == 0, out
        assert "1 passed" in out and "skipped" in out and "gpu tier: no CUDA device" in out
