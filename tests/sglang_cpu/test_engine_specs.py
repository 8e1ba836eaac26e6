"""The gpu tier's engine configurations (tests/sglang_gpu/test_engine*.py, ENGINE_SPECS) checked
against SGLang 0.5.17 on CPU: every sgl.Engine argument is a ServerArgs field, and SGLang's own
ServerArgs (a Hopper's capability, our plugin registered) resolves each one to what its test
means: our name kept, page 64, the cache asked for, SGLang's DSA kernels as named (not its
FA3 default), TP 2, eager; the tiny V3.2 is a DSA model to SGLang with its index_topk (2048)."""

import dataclasses

import pytest
import torch

from mla_backend.demo import sglang_run, tiny_model
from mla_backend.sglang import registration
from tests.sglang_gpu import engine_runs, test_engine, test_engine_h128, test_engine_tp2
from tests.sglang_gpu import test_engine_v32 as v32

GROUPS = {"h16": (test_engine, "v3", 16), "v32": (v32, "v32", v32.HEADS),
          "h128": (test_engine_h128, "v3", test_engine_h128.HEADS),
          "tp2": (test_engine_tp2, "v3", test_engine_h128.HEADS)}
CASES = [(g, label) for g, (mod, _, _) in GROUPS.items() for label in mod.ENGINE_SPECS]


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """config.json of each group's model (ServerArgs reads only the config)."""
    out = {}
    for group, (_, arch, heads) in GROUPS.items():
        kwargs = {"index_topk": v32.INDEX_TOPK} if arch == "v32" else {}
        out[group] = tiny_model.write_config(str(tmp_path_factory.mktemp(group)), arch=arch,
                                             heads=heads, vocab=engine_runs.VOCAB,
                                             max_positions=8192, **kwargs)
    return out


def _engine_kwargs(monkeypatch, spec: dict) -> dict:
    import sglang

    seen = {}
    monkeypatch.setattr(sglang, "Engine", lambda **kw: seen.update(kw) or "engine")
    assert sglang_run._engine(spec) == "engine"
    return seen


def _server_args(monkeypatch, kwargs: dict):
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    registration.register()
    HookRegistry.apply_hooks()  # what SGLang's load_plugins() does after the plugins ran
    return ServerArgs(device="cpu", **kwargs)


@pytest.mark.parametrize("group, label", CASES, ids=[f"{g}-{lab}" for g, lab in CASES])
def test_engine_spec_resolves_in_sglang(monkeypatch, configs, group, label):
    from sglang.srt.server_args import ServerArgs

    module = GROUPS[group][0]
    overrides = module.ENGINE_SPECS[label]
    spec = engine_runs.full_spec(configs[group], [[5, 6]], overrides)
    kwargs = _engine_kwargs(monkeypatch, spec)
    assert set(kwargs) - {f.name for f in dataclasses.fields(ServerArgs)} == set()
    for key, value in overrides.get("engine_args", {}).items():
        assert kwargs[key] == value, key
    args = _server_args(monkeypatch, kwargs)
    assert args.attention_backend == overrides["backend"]
    # triton keeps SGLang's page size 1; the others read pages of 64
    assert args.page_size == (1 if overrides["backend"] == "triton" else 64)
    assert args.max_total_tokens == engine_runs.BASE["engine_args"]["max_total_tokens"]
    assert args.disable_cuda_graph == (not spec["graphs"])
    assert args.tp_size == overrides.get("engine_args", {}).get("tp_size", 1)
    asked = overrides.get("kv_cache_dtype", "auto")
    if group == "v32":
        # SGLang's DSA defaults keep an explicit cache and explicit kernels
        assert args.kv_cache_dtype == asked
        if overrides["backend"] == "dsa":
            assert (args.dsa_prefill_backend, args.dsa_decode_backend) == (
                overrides["engine_args"]["dsa_prefill_backend"],
                overrides["engine_args"]["dsa_decode_backend"])
            assert "fa3" not in (args.dsa_prefill_backend, args.dsa_decode_backend)
    else:
        assert args.kv_cache_dtype == asked


def test_tiny_v32_is_a_dsa_model_to_sglang(monkeypatch, configs):
    from sglang.srt.configs.model_config import get_dsa_index_topk, is_deepseek_dsa

    spec = engine_runs.full_spec(configs["v32"], [[5]], v32.ENGINE_SPECS["mla_backend-bf16"])
    hf_config = _server_args(monkeypatch, _engine_kwargs(monkeypatch, spec)) \
        .get_model_config().hf_config
    assert is_deepseek_dsa(hf_config)
    assert get_dsa_index_topk(hf_config) == v32.INDEX_TOPK
    assert hf_config.num_attention_heads == v32.HEADS


def test_sglang_dsa_engines_keep_prefill_off_fa3():
    # SGLang's dsa sends prefills whose keys fit in index_topk to FA3 unless the threshold
    # is 0; ours never takes that route and runs without it
    for label, spec in v32.ENGINE_SPECS.items():
        env = spec.get("env", {})
        if spec["backend"] == "dsa":
            assert env["SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD"] == "0", label
        else:
            assert "SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD" not in env, label


def test_tp2_engines_keep_nvlink_multicast_off(monkeypatch):
    from tests.e2e.harness import NO_MULTICAST

    for name in NO_MULTICAST:
        monkeypatch.delenv(name, raising=False)
    spec = test_engine_tp2._tp("flashmla")
    assert spec["env"] == NO_MULTICAST
    assert spec["engine_args"]["tp_size"] == 2
