"""Locating and loading the compiled extension (mla_backend/_C*.so).

The extension is a limited-API module with no PyInit function, so it is loaded with
torch.ops.load_library, which registers torch.ops.mla_backend.*. It registers through torch's
stable ABI, so one build loads under every torch from 2.11 on.
"""

from __future__ import annotations

import glob
import json
import os
from importlib import metadata
from urllib.parse import unquote, urlparse

import torch

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
# error: why loading failed; elsewhere: that error when the imported copy has no extension
# but an installed copy has one
_state: dict[str, object] = {"loaded": False, "error": None, "elsewhere": None}
INSTALL_IN_PLACE = "python -m pip install --no-build-isolation -e ."

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
    _state["elsewhere"] = None
    if path is None:
        try:
            elsewhere = _installed_extension_elsewhere()
        except Exception:  # unreadable package metadata: report the plain error below
            elsewhere = None
        if elsewhere is not None:
            _state["error"] = _state["elsewhere"] = _imported_copy_lacks_it(elsewhere)
        else:
            _state["error"] = f"no mla_backend/_C*.so next to {_PKG_DIR}"
        return False
    try:
        torch.ops.load_library(path)
    except (OSError, RuntimeError) as e:
        # torch wraps the loader's error (e.g. an undefined symbol) as the cause
        cause = f" ({e.__cause__})" if e.__cause__ is not None else ""
        _state["error"] = f"loading {path} failed: {e}{cause}"
        return False
    _state["loaded"] = True
    return True


def _installed_distributions() -> list:
    """Every installed mla_backend distribution on sys.path (a source tree run from its root
    can shadow the one in site-packages)."""
    return list(metadata.distributions(name="mla_backend"))


def _editable_source(dist) -> str | None:
    """The source tree of an editable install (pip's direct_url.json), else None."""
    try:
        info = json.loads(dist.read_text("direct_url.json") or "null")
    except (OSError, ValueError):
        return None
    if not (isinstance(info, dict) and info.get("dir_info", {}).get("editable")):
        return None
    url = urlparse(info.get("url", ""))
    return unquote(url.path) if url.scheme == "file" else None


def _installed_extension_elsewhere() -> str | None:
    """An extension file of an installed mla_backend (in its site-packages copy, or in the
    source tree of an editable install) outside the package directory being imported."""
    for dist in _installed_distributions():
        found = [str(dist.locate_file(f)) for f in dist.files or ()
                 if f.name.startswith("_C") and f.name.endswith(".so")
                 and f.parent.name == "mla_backend"]
        source = _editable_source(dist)
        if source is not None:
            found += sorted(glob.glob(os.path.join(source, "mla_backend", "_C*.so")))
        for path in found:
            if os.path.isfile(path) and not _same_dir(os.path.dirname(path), _PKG_DIR):
                return path
    return None


def _same_dir(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _imported_copy_lacks_it(elsewhere: str) -> str:
    parent = os.path.dirname(_PKG_DIR)
    tree = ("the source tree " if os.path.exists(os.path.join(parent, "setup.py"))
            else "")
    return (f"you are importing mla_backend from {tree}{_PKG_DIR}, which has no built "
            f"extension; the installed copy at {os.path.dirname(elsewhere)} has one: run from "
            f"another folder, or install with `{INSTALL_IN_PLACE}` to build in place")


def why_unavailable() -> str:
    """Why the extension is not available and what to do, for error messages that read
    "... is not available<this>"."""
    error = load_error()
    if error is not None and error == _state["elsewhere"]:  # it says what to do
        return f": {error}"
    return f" ({error}; install: {build_status()}); {BUILD_HINT}"


def build_status() -> str:
    """What setup.py decided about the extension when this copy was installed."""
    try:
        from . import _build_info
    except ImportError:
        return "no build record (not installed with pip / setup.py)"
    return _build_info.CUDA_EXTENSION


def build_sources() -> str | None:
    """The fingerprint (_sources.sources_sha256) of the sources setup.py last built this
    package's extension from, or None if it recorded none."""
    try:
        from . import _build_info
    except ImportError:
        return None
    return getattr(_build_info, "SOURCES_SHA256", None)


def require(op_name: str) -> None:
    """Raise ExtensionNotBuiltError naming `op_name` unless the extension is loaded."""
    if not load():
        raise ExtensionNotBuiltError(
            f"mla_backend.ops.{op_name} needs the CUDA extension mla_backend._C, which is not "
            f"available{why_unavailable()}")


def is_available() -> bool:
    return load()


def registered_schemas() -> dict[str, str]:
    """{op name: schema} of every op registered in torch.ops.mla_backend (empty until the
    extension is loaded)."""
    prefix = "mla_backend::"
    names = sorted(n[len(prefix):] for n in torch._C._dispatch_get_all_op_names()
                   if n.startswith(prefix))
    return {n: str(getattr(torch.ops.mla_backend, n).default._schema) for n in names}


def load_error() -> str | None:
    """Why the extension did not load (None if it did)."""
    load()
    return None if _state["loaded"] else str(_state["error"])
