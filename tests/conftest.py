"""Test tiers: unmarked tests are the cpu tier (CI); `gpu` needs a Hopper GPU and the built
extension; `e2e` needs a GPU and the vLLM engine. Without a CUDA device the GPU tiers skip
themselves. With one, a selected tier that cannot run (tests/tier_gate.py says why) is
replaced by one failing item that names the cause: a GPU machine never passes it by skipping."""

from pathlib import Path

import pytest

from tests import tier_gate


class TierGate(pytest.Item):
    """Stands in for the tests of tiers that cannot run on this CUDA machine; fails with the
    cause, without a traceback."""

    def __init__(self, *, message: str, **kwargs):
        super().__init__(**kwargs)
        self.message = message

    def runtest(self):
        raise RuntimeError(self.message)

    def repr_failure(self, excinfo, style=None):
        return self.message

    def reportinfo(self):
        return self.path, None, self.name


def _tier(item) -> str | None:
    return "e2e" if "e2e" in item.keywords else "gpu" if "gpu" in item.keywords else None


# trylast: after -m / -k / --deselect, so only the tiers of the selected tests are checked
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    tiers = {t for t in map(_tier, items) if t is not None}
    causes: dict[str, list[str]] = {}  # cause -> the tiers it stops
    for tier in sorted(tiers, key=["gpu", "e2e"].index):
        verdict = tier_gate.check(tier)
        if verdict is None:
            continue
        kind, text = verdict
        if kind == "skip":
            for item in items:
                if _tier(item) == tier:
                    item.add_marker(pytest.mark.skip(reason=text))
        else:
            causes.setdefault(text, []).append(tier)
    if not causes:
        return
    stopped = {t for ts in causes.values() for t in ts}
    gates = []
    for cause, ts in causes.items():
        name = f"{'+'.join(ts)}-tier-gate"
        gates.append(TierGate.from_parent(session, name=name, path=Path(__file__),
                                          nodeid=f"tests/conftest.py::{name}",
                                          message=tier_gate.failure_message(ts, cause)))
    removed = [item for item in items if _tier(item) in stopped]
    items[:] = gates + [item for item in items if _tier(item) not in stopped]
    config.hook.pytest_deselected(items=removed)
