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


def pytest_collection_modifyitems(config, items):
    reason = None
    checked = False
    for item in items:
        if "gpu" in item.keywords or "e2e" in item.keywords:
            if not checked:
                reason, checked = _gpu_skip_reason(), True
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"GPU tier: {reason}"))
