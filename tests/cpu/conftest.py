"""Fixtures the cpu tests of the e2e tier's machinery share."""

import importlib
import sys

import pytest

from mla_backend import ops


@pytest.fixture
def hooks(monkeypatch):
    """A fresh tests.e2e.hooks module; whatever it patches is put back after the test."""
    monkeypatch.setattr(ops, "mla_decode", ops.mla_decode)
    monkeypatch.setattr(ops, "sparse_mla_decode", ops.sparse_mla_decode)
    sys.modules.pop("tests.e2e.hooks", None)
    module = importlib.import_module("tests.e2e.hooks")
    yield module
    sys.modules.pop("tests.e2e.hooks", None)
