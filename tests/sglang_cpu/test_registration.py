"""The sglang.srt.plugins entry point: declared, loads, cheap; what it registers in SGLang
(the backend choice on all three flags, the factory, the page-size hooks on ServerArgs)."""

import argparse
import os
import subprocess
import sys
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest

NAME = "mla_backend"
# SGLang's launcher imports these before it loads plugins: register() may add only our light
# modules on top of them, never sgl_kernel (its import queries the GPU), our kernels, our
# backend class, or CUDA.
_PROBE = """
import sys
import sglang.srt.server_args, sglang.srt.layers.attention.attention_registry
import sglang.srt.plugins.hook_registry
before = set(sys.modules)
import mla_backend_entry.sglang_plugin as p
p.register(); p.register()
import torch
print(sorted(set(sys.modules) - before))
print('sgl_kernel' in sys.modules, torch.cuda.is_initialized())
"""
LIGHT = {"mla_backend", "mla_backend_entry", "mla_backend_entry.sglang_plugin",
         "mla_backend.sglang", "mla_backend.sglang.registration", "mla_backend.sglang.support"}


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


def test_entry_point_declared_and_loads():
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == NAME]
    assert len(eps) == 1, "pip install the package (entry points come from its metadata)"
    register = eps[0].load()
    from mla_backend.sglang.registration import register as ours

    assert register is ours


def test_register_imports_nothing_heavy():
    res = _run(_PROBE)
    assert res.returncode == 0, res.stderr
    added, flags = res.stdout.strip().splitlines()[-2:]
    assert set(eval(added)) <= LIGHT, added
    assert flags == "False False"


def test_choice_and_factory_registered_once():
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import (
        ATTENTION_BACKEND_CHOICES,
        CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS,
    )

    from mla_backend.sglang import registration

    registration.register()
    registration.register()
    assert ATTENTION_BACKEND_CHOICES.count(NAME) == 1
    assert CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS.count(NAME) == 1
    assert ATTENTION_BACKENDS[NAME] is registration.create_backend
    hooks = [h for _, h, _ in HookRegistry._hooks[registration._SERVER_ARGS_INIT]]
    assert hooks.count(registration.set_defaults) == 1
    assert hooks.count(registration.check_page_size) == 1


def _parser():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


@pytest.mark.parametrize("flag", ["--attention-backend", "--decode-attention-backend",
                                  "--prefill-attention-backend"])
def test_cli_accepts_our_name(flag):
    from mla_backend.sglang import registration

    registration.register()
    args = _parser().parse_args(["--model-path", "m", flag, NAME])
    assert getattr(args, flag[2:].replace("-", "_")) == NAME


def test_cli_refuses_our_name_without_the_plugin():
    # the same parse in a process where SGLang's plugin loading is limited to another name
    code = ("import argparse; from sglang.srt.plugins import load_plugins; load_plugins(); "
            "from sglang.srt.server_args import ServerArgs; p = argparse.ArgumentParser(); "
            "ServerArgs.add_cli_args(p); p.parse_args(['--model-path', 'm', "
            f"'--attention-backend', '{NAME}'])")
    res = _run(code, SGLANG_PLUGINS="none")
    assert res.returncode != 0 and f"invalid choice: '{NAME}'" in res.stderr
    res = _run(code)  # with the plugin loaded by SGLang itself
    assert res.returncode == 0, res.stderr


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory):
    from mla_backend.demo.tiny_model import write_config

    return write_config(str(tmp_path_factory.mktemp("tiny-v3")))


def _server_args(model, **kwargs):
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import ServerArgs

    from mla_backend.sglang import registration

    registration.register()
    HookRegistry.apply_hooks()  # what SGLang's load_plugins() does after the plugins ran
    return ServerArgs(model_path=model, load_format="dummy", skip_tokenizer_init=True,
                      device="cpu", **kwargs)


@pytest.mark.parametrize("roles", [dict(attention_backend=NAME),
                                   dict(decode_attention_backend=NAME,
                                        prefill_attention_backend="flashinfer"),
                                   dict(attention_backend=NAME, page_size=64)])
def test_server_args_page_size_set_to_64(tiny_v3, roles):
    args = _server_args(tiny_v3, **roles)
    assert args.page_size == 64
    for role, value in roles.items():
        assert getattr(args, role) == value


def test_server_args_other_backends_untouched(tiny_v3):
    assert _server_args(tiny_v3, attention_backend="triton").page_size == 1


def test_server_args_refuses_another_page_size(tiny_v3):
    with pytest.raises(ValueError, match="--page-size 16: mla_backend pages hold 64 tokens; "
                                         "pass --page-size 64"):
        _server_args(tiny_v3, attention_backend=NAME, page_size=16)


def _args(**kw):
    base = dict(attention_backend=None, prefill_attention_backend=None,
                decode_attention_backend=None, page_size=None, speculative_algorithm=None,
                speculative_draft_attention_backend=None)
    return SimpleNamespace(**{**base, **kw})


def test_speculative_draft_backend_defaults_to_flashmla():
    from mla_backend.sglang.registration import set_defaults

    args = _args(attention_backend=NAME, speculative_algorithm="EAGLE")
    set_defaults(args)
    assert (args.page_size, args.speculative_draft_attention_backend) == (64, "flashmla")
    args = _args(attention_backend=NAME, speculative_algorithm="EAGLE",
                 speculative_draft_attention_backend="triton")
    set_defaults(args)
    assert args.speculative_draft_attention_backend == "triton"
    args = _args(attention_backend=NAME)
    set_defaults(args)
    assert args.speculative_draft_attention_backend is None
    args = _args(attention_backend="fa3", speculative_algorithm="EAGLE")
    set_defaults(args)
    assert (args.page_size, args.speculative_draft_attention_backend) == (None, None)
