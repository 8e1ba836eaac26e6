"""Fixtures of the gpu tier."""

import pytest

from tests.helpers import force_dense_kernel


@pytest.fixture(params=["rule", "mma.sync"])
def few_rows_kernel(request, monkeypatch):
    """Dense steps of <= 16 query rows on the library's kernel choice, then on the mma.sync
    kernel at every batch (which the library takes only for an fp8 cache from 16 requests
    on), so both kernels meet every case of a module that uses it
    (`pytest.mark.usefixtures("few_rows_kernel")`)."""
    force_dense_kernel(monkeypatch, request.param)
    return request.param
