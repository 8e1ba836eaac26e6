"""Test tiers: unmarked tests are the cpu tier (CI); `gpu` needs a Hopper GPU and the built
extension; `e2e` needs a GPU and the vLLM engine. GPU tiers skip themselves elsewhere."""

import pytest
import torch


def _gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    from mla_backend import _extension

    if not _extension.is_available():
        return "mla_backend._C is not built (pip install --no-build-isolation .)"
    return None


def _e2e_skip_reason() -> str | None:
    reason = _gpu_skip_reason()
    if reason:
        return reason
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        return f"vLLM is not importable ({e}); on the GPU machine install the vLLM kit"
    return None


def pytest_collection_modifyitems(config, items):
    reasons: dict[str, str | None] = {}
    for item in items:
        tier = "e2e" if "e2e" in item.keywords else "gpu" if "gpu" in item.keywords else None
        if tier is None:
            continue
        if tier not in reasons:
            reasons[tier] = _e2e_skip_reason() if tier == "e2e" else _gpu_skip_reason()
        if reasons[tier]:
            item.add_marker(pytest.mark.skip(reason=f"{tier} tier: {reasons[tier]}"))
