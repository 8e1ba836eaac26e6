"""tiny_model's checkpoints as SGLang 0.5.17 loads them: its own DeepseekV3ForCausalLM /
DeepseekV32ForCausalLM built on CPU (one rank, gloo), every parameter filled with NaN, then
the model's load_weights over the checkpoint's tensors: no parameter may keep a NaN (a name
SGLang does not find would leave its parameter unwritten, and the gpu tier would compare
engines on garbage). Negative control: a checkpoint without one indexer tensor leaves that
parameter NaN. Each load runs in a subprocess (SGLang's process-wide config and
distributed state stay out of the other tests).

On CPU SGLang keeps the indexer's wk and weights_proj apart (on CUDA it fuses them into one
matrix from the same checkpoint names); its rotary embedding on CPU needs vLLM's ops, so it
is replaced by an empty module (it holds no parameters)."""

import json
import os
import subprocess
import sys

import pytest

from mla_backend.demo import tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _unloaded(path: str, arch: str) -> list[str]:
    """The parameters of SGLang's model for the checkpoint at path that load_weights left
    unwritten."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT,
                                                                    os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, __file__, path, arch], capture_output=True,
                         text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("arch", ["v3", "v32"])
def test_sglang_loads_every_parameter_from_the_tiny_checkpoint(tmp_path, arch):
    path = tiny_model.write_checkpoint(str(tmp_path), arch=arch, heads=16, layers=2,
                                       index_topk=256)
    assert _unloaded(path, arch) == []


def test_a_missing_tensor_is_seen(tmp_path):
    from safetensors.torch import load_file, save_file

    path = tiny_model.write_checkpoint(str(tmp_path), arch="v32", heads=16, layers=2)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.1.self_attn.indexer.k_norm.bias"]
    save_file(tensors, file, metadata={"format": "pt"})
    assert _unloaded(path, "v32") == ["model.layers.1.self_attn.indexer.k_norm.bias"]


def _load(path: str, arch: str) -> list[str]:
    """In the subprocess: SGLang's model for path, loaded; the parameters still NaN."""
    import socket

    import torch
    from safetensors.torch import load_file
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import parallel_state
    from sglang.srt.layers import dp_attention
    from sglang.srt.layers.rotary_embedding import factory as rope
    from sglang.srt.models import deepseek_v2
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)  # SGLang's DSA defaults ask
    rope.get_rope_cpu = lambda *a, **k: torch.nn.Module()
    args = ServerArgs(model_path=path, skip_tokenizer_init=True, device="cpu",
                      attention_backend="triton")
    publish(args, role="test")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    parallel_state.init_distributed_environment(
        backend="gloo", world_size=1, rank=0, local_rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{port}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    config = ModelConfig.from_server_args(args)
    dp_attention.initialize_dp_attention(args, config)
    cls = {"v3": deepseek_v2.DeepseekV3ForCausalLM, "v32": deepseek_v2.DeepseekV32ForCausalLM}
    torch.set_default_dtype(torch.bfloat16)
    model = cls[arch](config.hf_config, quant_config=None)
    for param in model.parameters():
        param.data.fill_(float("nan"))
    model.load_weights(iter(load_file(os.path.join(path, "model.safetensors")).items()))
    return [name for name, param in model.named_parameters() if param.float().isnan().any()]


if __name__ == "__main__":
    print(json.dumps(_load(sys.argv[1], sys.argv[2])))
