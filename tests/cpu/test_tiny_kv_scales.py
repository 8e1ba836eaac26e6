"""The tiny checkpoint with fp8 KV-cache scales (tiny_model.write_checkpoint(kv_scales=...)):
the same weights as without, scale tensors under ModelOpt's names, and a config that vLLM 0.25
reads as ModelOpt FP8 with every weight left unquantized and a KV-cache method for the MLA
layers, whose loader maps the names onto the MLA layer's k_scale / v_scale."""

import json

import pytest
import torch

from mla_backend.demo import tiny_model

safetensors = pytest.importorskip("safetensors.torch")
K_SCALE, V_SCALE = 1.5, 2.5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    plain = tmp_path_factory.mktemp("plain")
    scaled = tmp_path_factory.mktemp("scaled")
    tiny_model.write_checkpoint(str(plain), heads=16, layers=2)
    tiny_model.write_checkpoint(str(scaled), heads=16, layers=2, kv_scales=(K_SCALE, V_SCALE))
    return plain, scaled


def test_same_weights_plus_scales(checkpoints):
    plain, scaled = checkpoints
    a = safetensors.load_file(str(plain / "model.safetensors"))
    b = safetensors.load_file(str(scaled / "model.safetensors"))
    extra = {k: v for k, v in b.items() if k not in a}
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(extra) == [f"model.layers.{i}.self_attn.{p}"
                             for i in range(2) for p in ("k_proj.k_scale", "v_proj.v_scale")]
    for name, t in extra.items():
        assert t.dtype == torch.float32 and t.shape == ()
        assert t.item() == (K_SCALE if name.endswith("k_scale") else V_SCALE)
    cfg_a = json.loads((plain / "config.json").read_text())
    cfg_b = json.loads((scaled / "config.json").read_text())
    assert cfg_b.pop("quantization_config") == tiny_model.kv_scale_quantization_config()
    assert cfg_a == cfg_b


def test_vllm_reads_a_modelopt_kv_cache_config(checkpoints):
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
    from vllm.model_executor.layers.quantization.modelopt import ModelOptFp8Config
    from vllm.utils.torch_utils import resolve_kv_cache_dtype_string

    _, scaled = checkpoints
    mc = ModelConfig(model=str(scaled), skip_tokenizer_init=True, max_model_len=4096,
                     dtype="bfloat16")
    assert mc.quantization == "modelopt" and mc.use_mla
    assert resolve_kv_cache_dtype_string("auto", mc) == "fp8_e4m3"
    qc = ModelOptFp8Config.from_config(mc.hf_config.quantization_config)
    # the MLA layer gets the KV-cache method that creates and loads k_scale / v_scale
    mla = MLAAttention.__new__(MLAAttention)
    assert isinstance(qc.get_quant_method(mla, "model.layers.0.self_attn.mla_attn.mla_attn"),
                      BaseKVCacheMethod)
    # no weight is quantized
    linear = LinearBase.__new__(LinearBase)
    for prefix in ("model.layers.0.self_attn.fused_qkv_a_proj", "model.layers.0.mlp.gate_up_proj",
                   "model.layers.1.mlp.shared_experts.down_proj", "lm_head"):
        assert isinstance(qc.get_quant_method(linear, prefix), UnquantizedLinearMethod), prefix
    # None: the MoE layer falls back to its unquantized method
    experts = RoutedExperts.__new__(RoutedExperts)
    assert qc.get_quant_method(experts, "model.layers.1.mlp.experts") is None


def test_vllm_maps_the_scale_names_onto_the_mla_layer():
    pytest.importorskip("vllm")
    from vllm.model_executor.model_loader.weight_utils import maybe_remap_kv_scale_name

    cfg = tiny_model.make_config(heads=16, layers=2)
    params = {f"model.layers.{i}.self_attn.mla_attn.mla_attn.{s}": None
              for i in range(2) for s in ("k_scale", "v_scale")}
    names = tiny_model.kv_scale_tensors(cfg, K_SCALE, V_SCALE)
    assert sorted(maybe_remap_kv_scale_name(n, params) for n in names) == sorted(params)
