import os
import pathlib

import pytest


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    """The session's folder for tiny checkpoints and engine logs: $E2E_CACHE_DIR when set
    (cached results name their model dirs, so those stay in the cache too), else a temp dir."""
    cache = os.environ.get("E2E_CACHE_DIR")
    if cache:
        os.makedirs(cache, exist_ok=True)
        return pathlib.Path(cache)
    return tmp_path_factory.mktemp("e2e")
