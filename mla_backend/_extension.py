"""Locating and loading the compiled extension (mla_backend/_C*.so).

The extension is a limited-API module with no PyInit function, so it is loaded with
torch.ops.load_library, which registers torch.ops.mla_backend.*.
"""

from __future__ import annotations

import glob
import os

import torch

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_state: dict[str, object] = {"loaded": False, "error": None}

BUILD_HINT = (
    "build it on a machine with torch (CUDA build), nvcc >= 12.3 and nvidia-cutlass: "
    "`python -m pip install --no-build-isolation .` in the repository (see README)"
)


class ExtensionNotBuiltError(RuntimeError):
    """The CUDA extension mla_backend._C is not installed or failed to load."""


def extension_path() -> str | None:
    """The extension file to load: $MLA_BACKEND_EXTENSION if set, else mla_backend/_C*.so."""
    env = os.environ.get("MLA_BACKEND_EXTENSION")
    if env:
        return env
    found = sorted(glob.glob(os.path.join(_PKG_DIR, "_C*.so")))
    return found[0] if found else None


def load() -> bool:
    """Load the extension once; return whether torch.ops.mla_backend is available."""
    if _state["loaded"]:
        return True
    if _state["error"] is not None:
        return False
    path = extension_path()
    if path is None:
        _state["error"] = f"no mla_backend/_C*.so next to {_PKG_DIR}"
        return False
    try:
        torch.ops.load_library(path)
    except (OSError, RuntimeError) as e:
        _state["error"] = f"loading {path} failed: {e}"
        return False
    _state["loaded"] = True
    return True


def build_status() -> str:
    """What setup.py decided about the extension when this copy was installed."""
    try:
        from . import _build_info
    except ImportError:
        return "no build record (not installed with pip / setup.py)"
    return _build_info.CUDA_EXTENSION


def require(op_name: str) -> None:
    """Raise ExtensionNotBuiltError naming `op_name` unless the extension is loaded."""
    if not load():
        raise ExtensionNotBuiltError(
            f"mla_backend.ops.{op_name} needs the CUDA extension mla_backend._C, which is not "
            f"available ({_state['error']}; install: {build_status()}); {BUILD_HINT}"
        )


def is_available() -> bool:
    return load()


def load_error() -> str | None:
    """Why the extension did not load (None if it did)."""
    load()
    return None if _state["loaded"] else str(_state["error"])
