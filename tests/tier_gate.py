"""Whether the gpu and e2e test tiers can run on this machine, and if not, why.

Without a CUDA device both tiers are skipped. With one, a tier that cannot run is a failure
with one message naming the cause, so a GPU machine never passes a tier by skipping it: the
extension is missing (or only an installed copy elsewhere has it), stale (built from other
sources than the tree's csrc/ and setup.py, so possibly not the code under test), built
against another torch, or fails to load for another reason; for e2e also: vLLM does not
import.
"""

from __future__ import annotations

import os
import re
from importlib import metadata
from pathlib import Path

import torch

from mla_backend import _extension
from mla_backend._sources import sources_sha256

PKG_DIR = Path(_extension.__file__).resolve().parent
BUILD = ("`python -m pip install --no-build-isolation -e .` in the repository root (on the GPU "
         "machine `bash scripts/gpu-check` does it)")
# in place and unconditional: setuptools alone would not see a changed header
REBUILD_IN_PLACE = "`python setup.py build_ext --inplace --force` in the repository root"
REINSTALL = "`python -m pip install --no-build-isolation --no-deps --force-reinstall .`"


def installed_extension(pkg_dir: Path = PKG_DIR) -> Path | None:
    """The _C*.so of an installed mla_backend distribution whose package is not pkg_dir."""
    try:
        dist = metadata.distribution("mla_backend")
    except metadata.PackageNotFoundError:
        return None
    for f in dist.files or []:
        if f.parts[0] == "mla_backend" and re.fullmatch(r"_C.*\.so", f.name):
            path = Path(str(dist.locate_file(f))).resolve()
            if path.parent != pkg_dir.resolve() and path.exists():
                return path
    return None


def running_torch() -> str:
    return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) from "
            f"{Path(torch.__file__).parent}")


def extension_problem(pkg_dir: Path, so_path: str | None, load_error: str | None, *,
                      installed_so: Path | None = None, build_record: str = "",
                      recorded_sources: str | None = None,
                      env_override: bool = False) -> str | None:
    """Why the extension at so_path (extension_path()) is not the one to test, or None.

    pkg_dir is the imported mla_backend package; when csrc/ sits beside it (a source tree)
    the package's own extension must have been built from exactly that tree's csrc/ and
    setup.py (recorded_sources: the fingerprint setup.py recorded; env_override: so_path came
    from $MLA_BACKEND_EXTENSION, a build chosen on purpose, not checked). load_error is
    load_error()."""
    csrc = pkg_dir.parent / "csrc"
    source_tree = csrc.is_dir()
    if so_path is None:
        if source_tree and installed_so is not None:
            return (f"extension not in the source tree: mla_backend was imported from {pkg_dir}, "
                    f"which has no _C*.so, while the installed copy has {installed_so}; the "
                    f"tests import the source tree, so build the extension in place: "
                    f"`python -m pip install --no-build-isolation -e .` in {pkg_dir.parent}")
        record = f" (install record: {build_record})" if build_record else ""
        return f"extension missing: no _C*.so in {pkg_dir}{record}; build it: {BUILD}"
    if not os.path.exists(so_path):
        return (f"extension missing: MLA_BACKEND_EXTENSION names {so_path}, which does not "
                f"exist; unset it or point it at a built _C*.so")
    if source_tree and not env_override:
        tree = sources_sha256(pkg_dir.parent)
        if recorded_sources != tree:
            what = ("has no record of the sources it was built from" if recorded_sources is None
                    else f"was built from other sources (fingerprint {recorded_sources[:12]}) "
                         f"than this tree's csrc/ + setup.py ({tree[:12]})")
            return (f"extension stale: {so_path} {what}, so it may not be the code under test; "
                    f"rebuild it: {REBUILD_IN_PLACE} (`bash scripts/gpu-check` does it)")
    if load_error is None:
        return None
    if "undefined symbol" in load_error or re.search(r"\bversion\b", load_error):
        how = REBUILD_IN_PLACE if source_tree else f"{REINSTALL} from the repository"
        return (f"extension built for another torch/ABI: {so_path} does not load into "
                f"{running_torch()} ({load_error}); rebuild it against this torch: {how}")
    return f"extension failed to load: {load_error}"


def vllm_problem() -> str | None:
    """Why vLLM cannot be imported here, or None."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # any import-time failure leaves the e2e tier unable to run
        return (f"vLLM cannot be imported ({type(e).__name__}: {e}); run the tier with "
                f"`bash scripts/gpu-e2e` (it puts the vLLM kit /opt/vk/site on PYTHONPATH) or "
                f"install vllm==0.25.0")
    return None


def check(tier: str) -> tuple[str, str] | None:
    """("skip", reason) without a CUDA device, ("fail", cause) when the tier cannot run on
    this CUDA machine, None when it can. tier is "gpu" or "e2e"."""
    if not torch.cuda.is_available():
        return ("skip", f"{tier} tier: no CUDA device")
    so_path = _extension.extension_path()
    installed = installed_extension(PKG_DIR) if so_path is None else None
    record = _extension.build_status()
    problem = extension_problem(PKG_DIR, so_path, _extension.load_error(), installed_so=installed,
                                build_record="" if record.startswith("no build record") else record,
                                recorded_sources=_extension.build_sources(),
                                env_override=bool(os.environ.get("MLA_BACKEND_EXTENSION")))
    if problem is None and tier == "e2e":
        problem = vllm_problem()
    return None if problem is None else ("fail", problem)


def failure_message(tiers: list[str], cause: str) -> str:
    names = " and ".join(f"the {t} tier" for t in tiers)
    return f"this machine has a CUDA device, but {names} cannot run: {cause}"
