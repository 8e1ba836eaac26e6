"""What the demo, the SGLang bench and the gpu tier hand SGLang 0.5.17, checked against it on
CPU: every sgl.Engine argument sglang_run passes is a ServerArgs field, the gpu tier's
launch_server command parses with SGLang's own parser, and tiny_model's tokenizer loads with
SGLang's tokenizer loader."""

import argparse
import dataclasses

import pytest

from bench import e2e_sglang
from mla_backend.demo import __main__ as demo
from mla_backend.demo import sglang_run, tiny_model
from tests.sglang_gpu.test_engine import launch_command


def _engine_kwargs(monkeypatch, spec):
    import sglang

    seen = {}
    monkeypatch.setattr(sglang, "Engine", lambda **kw: seen.update(kw) or "engine")
    assert sglang_run._engine(spec) == "engine"
    return seen


def _specs():
    demo_args = demo._parse(["--engine", "sglang", "--tp", "2", "--kv-cache-dtype", "fp8"])
    yield "demo", dict(demo.engine_spec(demo_args, "/m", False, [[1]]), backend="mla_backend")
    yield "bench", e2e_sglang.engine_spec("/m", "flashmla", batch=64, context=8192, steps=128,
                                          repeats=5, log_interval=16)


@pytest.mark.parametrize("name, spec", list(_specs()), ids=[n for n, _ in _specs()])
def test_engine_arguments_are_server_args_fields(monkeypatch, name, spec):
    from sglang.srt.server_args import ServerArgs

    kwargs = _engine_kwargs(monkeypatch, spec)
    fields = {f.name for f in dataclasses.fields(ServerArgs)}
    assert set(kwargs) - fields == set()
    assert kwargs["attention_backend"] == spec["backend"]
    assert kwargs["cuda_graph_max_bs_decode"] == spec["max_running_requests"]
    if name == "bench":
        assert kwargs["load_format"] == "dummy" and kwargs["decode_log_interval"] == 16
        assert kwargs["mem_fraction_static"] == 0.6
    else:
        assert kwargs["kv_cache_dtype"] == "fp8_e4m3" and kwargs["tp_size"] == 2
        assert "decode_log_interval" in kwargs  # the demo times decode too


def test_launch_command_parses_with_sglang():
    from sglang.srt.server_args import ServerArgs

    from mla_backend.sglang import registration

    registration.register()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    cmd = launch_command("/m", 31234)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    args = parser.parse_args(cmd[3:])
    assert args.attention_backend == "mla_backend" and args.model_path == "/m"
    assert args.port == 31234 and args.cuda_graph_max_bs_decode == 4
    assert args.flashinfer_mla_disable_ragged and not args.skip_tokenizer_init


def test_tiny_model_tokenizer_loads_in_sglang(tmp_path):
    from sglang.srt.utils.hf_transformers_utils import get_tokenizer

    path = str(tmp_path)
    tiny_model.write_config(path, vocab=2048)
    tiny_model.write_tokenizer(path, 2048)
    tok = get_tokenizer(path)
    assert tok.encode("t5 t17 t2047 hello") == [5, 17, 2047, 2]
    assert tok.decode([5, 17, 1], skip_special_tokens=True) == "t5 t17"
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
