"""The vllm.general_plugins entry point is declared, loads, and stays cheap."""

import subprocess
import sys
from importlib.metadata import entry_points


def test_entry_point_declared_and_loads():
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "mla_backend"]
    assert len(eps) == 1, "pip install the package (entry points come from its metadata)"
    register = eps[0].load()
    assert callable(register)
    register()
    register()  # idempotent


def test_register_imports_neither_cuda_nor_the_extension():
    code = ("import sys, plugin_entry.vllm_plugin as p; p.register(); "
            "bad = [m for m in ('mla_backend._C', 'mla_backend.ops', 'torch') if m in sys.modules]; "
            "print(bad)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"
