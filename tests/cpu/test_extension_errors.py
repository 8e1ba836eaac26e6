"""The missing-extension message when the imported mla_backend has no extension but an
installed copy has one (a source tree run from its root shadows the site-packages copy).
The installed distributions are faked."""

import json
import re
from importlib.metadata import PackagePath

import pytest

from mla_backend import _extension


class FakeDist:
    def __init__(self, root, files=(), direct_url=None):
        self.root, self._files, self.direct_url = root, files, direct_url

    @property
    def files(self):
        return [PackagePath(f) for f in self._files]

    def locate_file(self, f):
        return self.root / f

    def read_text(self, name):
        if name == "direct_url.json" and self.direct_url is not None:
            return json.dumps(self.direct_url)
        return None


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """The imported package: a source tree's mla_backend/ with no extension."""
    pkg = tmp_path / "clone" / "mla_backend"
    pkg.mkdir(parents=True)
    (tmp_path / "clone" / "setup.py").write_text("")
    monkeypatch.setattr(_extension, "_PKG_DIR", str(pkg))
    monkeypatch.delenv("MLA_BACKEND_EXTENSION", raising=False)
    for key in ("loaded", "error", "elsewhere"):
        monkeypatch.setitem(_extension._state, key, False if key == "loaded" else None)
    return pkg


def _installed(monkeypatch, *dists):
    monkeypatch.setattr(_extension, "_installed_distributions", lambda: list(dists))


def _so(folder):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "_C.abi3.so").write_bytes(b"")


def _error():
    with pytest.raises(_extension.ExtensionNotBuiltError) as e:
        _extension.require("mla_decode")
    return str(e.value)


def test_site_packages_copy_has_the_extension(tree, tmp_path, monkeypatch):
    site = tmp_path / "site-packages"
    _so(site / "mla_backend")
    _installed(monkeypatch, FakeDist(site, ["mla_backend/__init__.py", "mla_backend/_C.abi3.so",
                                            "mla_backend-0.1.0.dist-info/RECORD"]))
    msg = _error()
    assert msg.startswith("mla_backend.ops.mla_decode needs the CUDA extension mla_backend._C, "
                          "which is not available: ")
    assert (f"you are importing mla_backend from the source tree {tree}, which has no built "
            f"extension; the installed copy at {site / 'mla_backend'} has one: run from another "
            "folder, or install with `python -m pip install --no-build-isolation -e .` to build "
            "in place") in msg
    assert "build it on a machine" not in msg  # the generic build hint would mislead here
    assert _extension.why_unavailable().startswith(": you are importing mla_backend from")


def test_editable_install_of_another_tree_has_the_extension(tree, tmp_path, monkeypatch):
    other = tmp_path / "other clone"
    _so(other / "mla_backend")
    url = "file://" + str(other).replace(" ", "%20")
    _installed(monkeypatch, FakeDist(tmp_path / "site-packages",
                                     ["mla_backend-0.1.0.dist-info/direct_url.json"],
                                     {"url": url, "dir_info": {"editable": True}}))
    assert re.search(rf"the installed copy at {re.escape(str(other / 'mla_backend'))} has one",
                     _error())


@pytest.mark.parametrize("case", ["none installed", "editable of this tree", "file gone"])
def test_otherwise_the_plain_message(tree, tmp_path, monkeypatch, case):
    if case == "none installed":
        _installed(monkeypatch)
    elif case == "editable of this tree":
        _installed(monkeypatch, FakeDist(tmp_path / "site-packages", [],
                                         {"url": f"file://{tree.parent}",
                                          "dir_info": {"editable": True}}))
    else:  # the distribution lists an extension that is not there
        _installed(monkeypatch, FakeDist(tmp_path / "site-packages", ["mla_backend/_C.abi3.so"]))
    msg = _error()
    assert f"(no mla_backend/_C*.so next to {tree}; install: " in msg
    assert "pip install --no-build-isolation ." in msg and "you are importing" not in msg


def test_unreadable_metadata_gives_the_plain_message(tree, monkeypatch):
    def broken():
        raise OSError("unreadable")

    monkeypatch.setattr(_extension, "_installed_distributions", broken)
    assert f"no mla_backend/_C*.so next to {tree}" in _error()
