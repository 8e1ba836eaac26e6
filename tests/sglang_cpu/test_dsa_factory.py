"""The factory on DSA models (DeepSeek-V3.2): SGLang's backend construction gives the DSA
backend with the dsa policy for our name; every refused DSA configuration gets its sentence;
a defaulted speculative draft backend becomes dsa for a DSA model."""

import re
from types import MethodType, SimpleNamespace

import pytest
import torch
from sglang.srt.configs.model_config import AttentionArch
from sglang.srt.runtime_context import get_context, get_parallel

from mla_backend.demo.tiny_model import make_config
from mla_backend.sglang import dsa, factory, registration

NAME = "mla_backend"


def _backend_args(attention=NAME, prefill=None, decode=None):
    """The three backend fields, read by SGLang's own ServerArgs.get_attention_backends."""
    from sglang.srt.server_args import ServerArgs

    args = SimpleNamespace(attention_backend=attention, prefill_attention_backend=prefill,
                           decode_attention_backend=decode)
    args.get_attention_backends = MethodType(ServerArgs.get_attention_backends, args)
    return args


def _runner(*, heads=16, dtype=torch.bfloat16, kv_cache_dtype=None, page_size=64,
            cache_bytes=None, store_fp8=None, hisparse=False, arch="v32", with_arch=True,
            server_args=None, is_draft_worker=False):
    kv_cache_dtype = kv_cache_dtype or dtype
    fp8 = kv_cache_dtype == torch.float8_e4m3fn
    config = SimpleNamespace(hf_config=make_config(arch=arch, heads=heads), kv_lora_rank=512,
                             qk_rope_head_dim=64, num_attention_heads=heads)
    if with_arch:  # SGLang's ModelConfig has it; the attention kit's tiny DSA config has not
        config.attention_arch = AttentionArch.MLA
    pool = SimpleNamespace(kv_cache_dim=cache_bytes or (656 if fp8 else 576),
                           dsa_kv_cache_store_fp8=fp8 if store_fp8 is None else store_fp8)
    return SimpleNamespace(model_config=config, page_size=page_size, dtype=dtype,
                           kv_cache_dtype=kv_cache_dtype, device="cpu", token_to_kv_pool=pool,
                           hisparse_coordinator=object() if hisparse else None,
                           server_args=server_args or _backend_args(),
                           is_draft_worker=is_draft_worker)


@pytest.fixture
def gpu_ok(monkeypatch):
    monkeypatch.setattr(factory, "_device_capability", lambda runner: (9, 0))
    monkeypatch.setattr(factory, "_extension_error", lambda: None)


@pytest.fixture
def policy_registry(monkeypatch):
    """SGLang's DeepSeek policy registry and absorb list, restored after the test."""
    from sglang.srt.models.deepseek_common import attention_backend_handler as handler
    from sglang.srt.models.deepseek_common import utils

    monkeypatch.setattr(handler.AttentionBackendRegistry, "_handlers",
                        dict(handler.AttentionBackendRegistry._handlers))
    monkeypatch.setattr(utils, "FORWARD_ABSORB_CORE_ATTENTION_BACKENDS",
                        list(utils.FORWARD_ABSORB_CORE_ATTENTION_BACKENDS))
    return handler, utils


def _reason(runner, tp=1, dcp=1, cp=1, draft=0, topk=1):
    with get_parallel().override(attn_tp_size=tp, attn_dcp_size=dcp, attn_cp_size=cp), \
            get_context().override_server_args(speculative_num_draft_tokens=draft,
                                               speculative_eagle_topk=topk):
        return factory.config_reason(runner)


def test_supported_dsa_configurations(gpu_ok):
    assert factory.is_sparse_model(_runner())
    assert not factory.is_sparse_model(_runner(arch="v3"))
    assert _reason(_runner()) is None
    assert _reason(_runner(kv_cache_dtype=torch.float8_e4m3fn)) is None
    assert _reason(_runner(heads=128)) is None
    assert _reason(_runner(heads=1)) is None
    assert _reason(_runner(heads=256), tp=2) is None
    assert _reason(_runner(with_arch=False)) is None  # DSA is MLA
    # every token is its own request for the sparse kernel: no limit on draft tokens
    assert _reason(_runner(), draft=16) is None
    # both phases named ours is no split; a draft worker runs one backend for both
    assert _reason(_runner(server_args=_backend_args(None, NAME, NAME))) is None
    assert _reason(_runner(server_args=_backend_args(None, "dsa", NAME),
                           is_draft_worker=True)) is None


@pytest.mark.parametrize("runner, kwargs, message", [
    (dict(dtype=torch.float16), {}, "model dtype torch.float16: mla_backend's sparse \\(DSA\\) "
     "kernels run bfloat16; pass --dtype bfloat16"),
    (dict(kv_cache_dtype=torch.float8_e5m2), {}, "pass --kv-cache-dtype bfloat16 or fp8_e4m3"),
    (dict(kv_cache_dtype=torch.float8_e4m3fn, cache_bytes=576, store_fp8=False), {},
     "holds 576 bytes per token; mla_backend reads the 656-byte layout .* \\(not trtllm\\)"),
    (dict(page_size=16), {}, "--page-size 16: .* pass --page-size 64"),
    (dict(heads=256), {}, "256 query heads per GPU .* at most 128; raise --tp-size"),
    (dict(), dict(dcp=2), "decode context parallelism \\(size 2\\)"),
    (dict(), dict(cp=2), "attention context parallelism \\(size 2\\) .* for DSA models"),
    (dict(hisparse=True), {}, "--enable-hisparse is not supported by mla_backend"),
    (dict(server_args=_backend_args(None, prefill="dsa", decode=NAME)), {},
     "--prefill-attention-backend dsa with --decode-attention-backend mla_backend: on a DSA "
     "model mla_backend runs prefill and decode both; pass --attention-backend mla_backend"),
    (dict(server_args=_backend_args("dsa", decode=NAME)), {},
     "--prefill-attention-backend dsa with --decode-attention-backend mla_backend"),
])
def test_refused_dsa_configurations(gpu_ok, runner, kwargs, message):
    reason = _reason(_runner(**runner), **kwargs)
    assert reason is not None
    assert re.search(message, reason), reason


def test_sglang_builds_our_dsa_backend(gpu_ok, policy_registry, monkeypatch):
    # SGLang's ATTENTION_BACKENDS[name](runner): a V3.2 model gets MLASparseBackend (its
    # constructor recorded here: the parent's asks CUDA for the device) and dsa's policy
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    handler, utils = policy_registry
    built = []
    monkeypatch.setattr(dsa, "MLASparseBackend", lambda runner: built.append(runner) or "dsa")
    registration.register()
    runner = _runner()
    with get_parallel().override(attn_tp_size=1, attn_dcp_size=1, attn_cp_size=1):
        assert ATTENTION_BACKENDS[NAME](runner) == "dsa"
    assert built == [runner]
    assert handler.AttentionBackendRegistry.get_handler(NAME) is handler.handle_attention_dsa
    assert utils.FORWARD_ABSORB_CORE_ATTENTION_BACKENDS.count(NAME) == 1


def test_dsa_refusal_goes_through_sglangs_backend_construction(gpu_ok, policy_registry):
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    registration.register()
    with get_parallel().override(attn_tp_size=1, attn_dcp_size=1, attn_cp_size=1), \
            pytest.raises(ValueError, match="^--attention-backend mla_backend: model dtype "
                                            "torch.float16: mla_backend's sparse"):
        ATTENTION_BACKENDS[NAME](_runner(dtype=torch.float16))


@pytest.fixture(scope="module")
def tiny_configs(tmp_path_factory):
    from mla_backend.demo.tiny_model import write_config

    return {arch: write_config(str(tmp_path_factory.mktemp(f"tiny-{arch}")), arch=arch)
            for arch in ("v3", "v32")}


def _server_args(monkeypatch, model, **kwargs):
    """SGLang's own ServerArgs with our hooks applied. Its DSA defaults ask CUDA for the
    device capability: a Hopper's (9, 0) here."""
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    registration.register()
    HookRegistry.apply_hooks()  # what SGLang's load_plugins() does after the plugins ran
    return ServerArgs(model_path=model, load_format="dummy", skip_tokenizer_init=True,
                      device="cpu", attention_backend=NAME, **kwargs)


def test_server_args_for_a_dsa_model(monkeypatch, tiny_configs):
    # SGLang's DSA overrides keep our name, page size 64 and (Hopper) a bf16 cache
    args = _server_args(monkeypatch, tiny_configs["v32"])
    assert (args.attention_backend, args.page_size, args.kv_cache_dtype) == \
        (NAME, 64, "bfloat16")
    # one backend for both phases: the split refusal stays quiet on a plain launch
    assert args.get_attention_backends() == (NAME, NAME)
    assert factory._phase_backends(SimpleNamespace(server_args=args)) == (NAME, NAME)
    args = _server_args(monkeypatch, tiny_configs["v32"], kv_cache_dtype="fp8_e4m3")
    assert args.kv_cache_dtype == "fp8_e4m3"


SPEC = dict(speculative_algorithm="EAGLE", speculative_num_steps=1, speculative_eagle_topk=1,
            speculative_num_draft_tokens=2)


@pytest.mark.parametrize("arch, draft", [("v32", "dsa"), ("v3", "flashmla")])
def test_defaulted_draft_backend_follows_the_model(monkeypatch, tiny_configs, arch, draft):
    # a DSA model's draft layers run an indexer: SGLang's dsa backend, not flashmla
    args = _server_args(monkeypatch, tiny_configs[arch], **SPEC)
    assert args.speculative_draft_attention_backend == draft


def test_explicit_draft_backend_is_kept(monkeypatch, tiny_configs):
    args = _server_args(monkeypatch, tiny_configs["v32"], **SPEC,
                        speculative_draft_attention_backend="triton")
    assert args.speculative_draft_attention_backend == "triton"


@pytest.mark.parametrize("fields", [(NAME, None, None), (None, "dsa", NAME), ("dsa", None, NAME),
                                    (NAME, "flashinfer", None), (None, NAME, NAME)])
def test_phase_backends_read_as_sglang_resolves_them(fields):
    args = _backend_args(*fields)
    assert factory._phase_backends(_runner(server_args=args)) == args.get_attention_backends()
