"""What an e2e engine result depends on besides the test's own inputs: part of the key under
which the e2e tier may reuse a result, so that a result from another build is never reused."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from mla_backend import _extension

PKG_DIR = Path(_extension.__file__).resolve().parent
# the vLLM entry point's sources (plugin_entry/ beside the package in a source tree)
ENTRY_DIR = PKG_DIR.parent / "plugin_entry"
GENERATED = {"_build_info.py"}  # written by setup.py, not source


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def python_sources_sha256(dirs: tuple[Path, ...] = (PKG_DIR, ENTRY_DIR)) -> str:
    """sha256 over the .py files under dirs (the kernels' Python API and the vLLM adapter
    change results too): each file's path relative to its dir's parent, then its bytes."""
    h = hashlib.sha256()
    for root in dirs:
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*.py")):
            if path.name in GENERATED or "__pycache__" in path.parts:
                continue
            h.update(str(path.relative_to(root.parent).as_posix()).encode() + b"\0")
            h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def vllm_version() -> str | None:
    try:
        import vllm
    except Exception:
        return None
    return getattr(vllm, "__version__", None)


def build_identity() -> dict:
    """The extension file's sha256, the vLLM and torch versions and the Python sources' sha256.
    Values are None where there is nothing to hash (no extension, no vLLM)."""
    so = _extension.extension_path()
    return {
        "extension_sha256": file_sha256(so) if so and Path(so).is_file() else None,
        "vllm_version": vllm_version(),
        "torch_version": torch.__version__,
        "python_sources_sha256": python_sources_sha256(),
    }
