"""The tiny checkpoints of the demo and e2e tests: names and shapes as transformers' DeepSeek
models define them (per-expert MoE weights, the HF checkpoint layout vLLM loads), a config
vLLM reads as MLA, and attention that is far from uniform."""

import json

import pytest
import torch

from mla_backend.demo import tiny_model

safetensors = pytest.importorskip("safetensors.torch")
transformers = pytest.importorskip("transformers")


def _hf_shapes(cfg: dict) -> dict:
    """transformers' own parameter shapes for this config (fused experts split per expert)."""
    config_cls = {"deepseek_v3": transformers.DeepseekV3Config,
                  "deepseek_v2": transformers.DeepseekV2Config}[cfg["model_type"]]
    model_cls = {"deepseek_v3": transformers.DeepseekV3ForCausalLM,
                 "deepseek_v2": transformers.DeepseekV2ForCausalLM}[cfg["model_type"]]
    kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        model = model_cls(config_cls(**kwargs))
    shapes = {}
    for name, t in model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            experts, two_inter, hidden = t.shape
            for e in range(experts):
                for proj in ("gate_proj", "up_proj"):
                    shapes[f"{name[:-len('gate_up_proj')]}{e}.{proj}.weight"] = (
                        two_inter // 2, hidden)
        elif name.endswith("experts.down_proj"):
            experts, hidden, inter = t.shape
            for e in range(experts):
                shapes[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = (hidden, inter)
        else:
            shapes[name] = tuple(t.shape)
    return shapes


@pytest.mark.parametrize("arch", ["v3", "v2"])
def test_checkpoint_matches_transformers_layout(tmp_path, arch):
    path = tiny_model.write_checkpoint(str(tmp_path), arch=arch, heads=16, layers=2)
    cfg = json.loads((tmp_path / "config.json").read_text())
    tensors = safetensors.load_file(str(tmp_path / "model.safetensors"))
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    assert got == _hf_shapes(cfg)
    assert all(t.dtype == torch.bfloat16 and torch.isfinite(t.float()).all()
               for t in tensors.values())
    assert path == str(tmp_path)


def test_vllm_reads_the_config_as_mla(tmp_path):
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig

    tiny_model.write_config(str(tmp_path), heads=128)
    mc = ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, max_model_len=4096,
                     dtype="bfloat16")
    assert mc.use_mla and mc.get_head_size() == 576 and mc.get_num_attention_heads(
        type("P", (), {"tensor_parallel_size": 1})()) == 128


def _rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_attention_is_not_uniform(tmp_path):
    """Layer 0's attention logits (q.k * scale, RoPE left out) over 64 random tokens have a
    spread of about attention_gain, so softmax weights differ by orders of magnitude; with
    vLLM's U(+-1e-3) dummy weights they would be ~1e-9."""
    tiny_model.write_checkpoint(str(tmp_path), heads=16, layers=1, attention_gain=2.0)
    w = {k: v.float() for k, v in safetensors.load_file(str(tmp_path / "model.safetensors")).items()}
    a = "model.layers.0.self_attn."
    x = _rms(w["model.embed_tokens.weight"][torch.randint(0, 2048, (64,))])
    q = (_rms(x @ w[a + "q_a_proj.weight"].T) @ w[a + "q_b_proj.weight"].T).view(64, 16, 192)
    kv = x @ w[a + "kv_a_proj_with_mqa.weight"].T
    k_nope = (_rms(kv[:, :512]) @ w[a + "kv_b_proj.weight"].T).view(64, 16, 256)[..., :128]
    k = torch.cat([k_nope, kv[:, None, 512:].expand(64, 16, 64)], -1)
    logits = torch.einsum("qhd,khd->hqk", q, k) * 192 ** -0.5
    spread = logits.std(-1).mean().item()
    assert 1.0 < spread < 4.0, spread
    top = torch.softmax(logits, -1).amax(-1).mean().item()
    assert top > 5 / 64, top  # far above the uniform 1/64


def test_v32_checkpoint_has_the_indexer_vllm_loads(tmp_path):
    """DeepSeek-V3.2: the V3 tensors plus each layer's indexer under the names vLLM's loader
    maps (wq_b, wk + weights_proj fused into wk_weights_proj, k_norm with a bias), and a
    config vLLM reads as sparse MLA."""
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig

    tiny_model.write_checkpoint(str(tmp_path), arch="v32", heads=16, layers=2, index_topk=2048)
    tensors = safetensors.load_file(str(tmp_path / "model.safetensors"))
    v3 = tiny_model._shapes(tiny_model.make_config(arch="v3", heads=16, layers=2))
    extra = {k: tuple(v.shape) for k, v in tensors.items() if k not in v3}
    for i in range(2):
        ix = f"model.layers.{i}.self_attn.indexer."
        assert extra.pop(ix + "wq_b.weight") == (64 * 128, 256)
        assert extra.pop(ix + "wk.weight") == (128, 512)
        assert extra.pop(ix + "weights_proj.weight") == (64, 512)
        assert extra.pop(ix + "k_norm.weight") == (128,)
        assert torch.equal(tensors[ix + "k_norm.bias"], torch.zeros(128, dtype=torch.bfloat16))
        extra.pop(ix + "k_norm.bias")
    assert extra == {}
    mc = ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, max_model_len=4096,
                     dtype="bfloat16")
    assert mc.use_mla and mc.hf_config.index_topk == 2048
    assert mc.architecture == "DeepseekV32ForCausalLM"
