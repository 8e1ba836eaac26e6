"""The fingerprint of the sources an extension build comes from: csrc/ (every file, any
depth) and setup.py. setup.py records it with the build (mla_backend/_build_info.py); the
test tiers compare it with the tree they test, so a .so built from other sources is caught
by content, not by file times (which copies between machines do not keep reliably)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sources_sha256(root: str | Path) -> str | None:
    """sha256 over csrc/** and setup.py under root (path, then bytes, in sorted order);
    None when root has no csrc/ (an installed copy)."""
    root = Path(root)
    csrc = root / "csrc"
    if not csrc.is_dir():
        return None
    files = sorted(p for p in csrc.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    if (root / "setup.py").is_file():
        files.append(root / "setup.py")
    h = hashlib.sha256()
    for path in files:
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()
