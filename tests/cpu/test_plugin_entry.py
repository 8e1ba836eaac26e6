"""The vllm.general_plugins entry point is declared, loads, and stays cheap."""

import subprocess
import sys
from importlib.metadata import entry_points


def test_entry_point_declared_and_loads(monkeypatch):
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "mla_backend"]
    assert len(eps) == 1, "pip install the package (entry points come from its metadata)"
    register = eps[0].load()
    assert callable(register)
    # idempotent: from a fresh start, two calls register CUSTOM once, as our router
    from vllm.v1.attention.backends import registry

    plugin, calls, real = sys.modules[register.__module__], [], registry.register_backend
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(registry, "register_backend",
                        lambda *args: calls.append(args[1]) or real(*args))
    register()
    register()
    assert calls == [plugin.ROUTER]
    assert registry.AttentionBackendEnum.CUSTOM.get_path() == plugin.ROUTER


def test_register_imports_neither_cuda_nor_our_backend():
    # vLLM's registry imports torch; our kernels, adapters and CUDA stay untouched until a
    # worker selects CUSTOM.
    code = ("import sys, mla_backend_entry.vllm_plugin as p; p.register(); p.register(); "
            "mods = ('mla_backend._C', 'mla_backend.ops', 'mla_backend.vllm.router', "
            "'mla_backend.vllm.dense'); "
            "import torch; print([m for m in mods if m in sys.modules], "
            "torch.cuda.is_initialized())")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip().splitlines()[-1] == "[] False"


def test_register_leaves_another_custom_backend_in_place():
    code = ("from vllm.v1.attention.backends.registry import AttentionBackendEnum as E, "
            "register_backend; register_backend(E.CUSTOM, 'other.pkg.Backend'); "
            "import mla_backend_entry.vllm_plugin as p; p.register(); print(E.CUSTOM.get_path())")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip().splitlines()[-1] == "other.pkg.Backend"
    assert "already registered as other.pkg.Backend" in res.stderr
