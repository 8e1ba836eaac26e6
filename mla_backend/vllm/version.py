"""The installed vLLM release, and whether these adapters serve it.

One adapter serves every supported release; where vLLM's interface changed, the code
branches on `at_least(...)`, each branch saying which release changed what. Reads only
vLLM's version string, so the router can refuse an unsupported release before any adapter
module (whose imports would fail there) is loaded.
"""

from __future__ import annotations

import re

# Release series the adapters are written and tested for. The releases between change the
# sparse interface twice (0.26 drops the sparse impl base 0.25 has; 0.33 adds the sparse
# common path's kernel hook) and are not tested: they are refused rather than guessed at.
SUPPORTED_SERIES = ((0, 25), (0, 33))
SUPPORTED = "vLLM 0.25.x and 0.33.x"
# The releases the test tiers ran on (docs/vllm.md says which tier ran where).
TESTED = ("0.25.0", "0.33.0")


def parse(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a version string such as 0.33.0, 0.33.1rc2 or
    0.33.0+cu130; ValueError for one without three leading numbers."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"vLLM version {version!r} is not of the form MAJOR.MINOR.PATCH")
    return tuple(int(part) for part in match.groups())


def installed() -> str:
    import vllm

    return vllm.__version__


def unsupported_reason(version: str | None = None) -> str | None:
    """Why the installed (or the given) vLLM release is outside the supported range, or
    None inside it."""
    version = installed() if version is None else version
    try:
        parsed = parse(version)
    except ValueError:
        parsed = None
    if parsed is not None and parsed[:2] in SUPPORTED_SERIES:
        return None
    from .support import NAME

    return (f"vLLM {version} is installed; {NAME} supports {SUPPORTED} (tested on "
            f"{' and '.join(TESTED)}); install one of those, e.g. pip install vllm==0.33.0")


def at_least(release: tuple[int, int, int], version: str | None = None) -> bool:
    """Whether the installed (or the given) vLLM is `release` or newer."""
    return parse(installed() if version is None else version) >= release
