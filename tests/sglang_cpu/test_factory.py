"""The factory SGLang calls for `mla_backend`: every refused configuration gets its sentence
through SGLang's own backend construction path, and the DeepSeek-side policy is registered."""

import re
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.configs.model_config import AttentionArch
from sglang.srt.runtime_context import get_context, get_parallel

from mla_backend.demo.tiny_model import make_config
from mla_backend.sglang import factory, registration

NAME = "mla_backend"


def _runner(*, arch="v3", heads=16, mla=True, page_size=64, dtype=torch.bfloat16,
            kv_cache_dtype=None, kv_lora_rank=512):
    hf = make_config(arch=arch, heads=heads)
    config = SimpleNamespace(
        attention_arch=AttentionArch.MLA if mla else AttentionArch.MHA, hf_config=hf,
        kv_lora_rank=kv_lora_rank, qk_rope_head_dim=64, num_attention_heads=heads)
    return SimpleNamespace(model_config=config, page_size=page_size, dtype=dtype,
                           kv_cache_dtype=kv_cache_dtype or dtype, device="cpu")


@pytest.fixture
def gpu_ok(monkeypatch):
    """A Hopper GPU with the extension built, as seen by the factory."""
    monkeypatch.setattr(factory, "_device_capability", lambda runner: (9, 0))
    monkeypatch.setattr(factory, "_extension_error", lambda: None)


def _reason(runner, tp=1, dcp=1, draft=0, topk=1):
    with get_parallel().override(attn_tp_size=tp, attn_dcp_size=dcp), \
            get_context().override_server_args(speculative_num_draft_tokens=draft,
                                               speculative_eagle_topk=topk):
        return factory.config_reason(runner)


def test_supported_configurations(gpu_ok):
    assert _reason(_runner()) is None
    assert _reason(_runner(dtype=torch.float16)) is None
    assert _reason(_runner(kv_cache_dtype=torch.float8_e4m3fn)) is None
    assert _reason(_runner(heads=128)) is None
    assert _reason(_runner(heads=256), tp=2) is None
    assert _reason(_runner(), draft=8) is None


@pytest.mark.parametrize("runner, kwargs, message", [
    (dict(mla=False), {}, "implements MLA attention only"),
    (dict(kv_lora_rank=256), {}, "kv_lora_rank 512 and qk_rope_head_dim 64; this model has 256"),
    (dict(page_size=16), {}, "--page-size 16: .* pass --page-size 64"),
    (dict(dtype=torch.float32), {}, "model dtype torch.float32: .* pass --dtype bfloat16"),
    (dict(kv_cache_dtype=torch.float8_e5m2), {}, "pass --kv-cache-dtype fp8_e4m3 or auto"),
    (dict(dtype=torch.float16, kv_cache_dtype=torch.bfloat16), {},
     "keeps the cache in the model dtype or in fp8 e4m3"),
    (dict(heads=256), {}, "256 query heads per GPU .* at most 128; raise --tp-size"),
    (dict(), dict(dcp=2), "decode context parallelism \\(size 2\\)"),
    (dict(), dict(draft=9), "--speculative-num-draft-tokens 9: .* at most 8"),
    (dict(), dict(draft=4, topk=2), "--speculative-eagle-topk 2: .* use --speculative-eagle-topk 1"),
])
def test_refused_configurations(gpu_ok, runner, kwargs, message):
    reason = _reason(_runner(**runner), **kwargs)
    assert reason is not None
    assert re.search(message, reason), reason


def test_platform_messages(monkeypatch):
    monkeypatch.setattr(factory, "_device_capability", lambda runner: (10, 0))
    assert "run on Hopper GPUs (compute capability 9.x, sm_90a); this GPU is 10.0" in \
        _reason(_runner())
    monkeypatch.setattr(factory, "_device_capability", lambda runner: (9, 0))
    monkeypatch.setattr(factory, "_extension_error", lambda: " (no mla_backend/_C*.so)")
    assert _reason(_runner()) == ("mla_backend's CUDA extension is not available "
                                  "(no mla_backend/_C*.so)")


def test_extension_message_is_the_packages_own():
    # without a built extension (this tier's install), the real check names what to do
    from mla_backend import _extension

    if _extension.is_available():
        pytest.skip("the extension is built in this environment")
    assert factory._extension_error() == _extension.why_unavailable()
    assert "python -m pip install --no-build-isolation" in factory._extension_error()


def test_refusal_goes_through_sglangs_backend_construction(gpu_ok):
    # SGLang builds a backend with ATTENTION_BACKENDS[name](runner) in the scheduler; the
    # ValueError it raises there is what the user sees
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    registration.register()
    with get_parallel().override(attn_tp_size=1, attn_dcp_size=1), \
            get_context().override_server_args(speculative_num_draft_tokens=0,
                                               speculative_eagle_topk=1), \
            pytest.raises(ValueError, match="^--attention-backend mla_backend: model dtype "
                                            "torch.float32"):
        ATTENTION_BACKENDS[NAME](_runner(dtype=torch.float32))


def test_deepseek_policy_is_flashmlas():
    from sglang.srt.models.deepseek_common import attention_backend_handler as handler
    from sglang.srt.models.deepseek_common.utils import FORWARD_ABSORB_CORE_ATTENTION_BACKENDS

    assert handler.AttentionBackendRegistry.get_handler(NAME) is handler.handle_attention_triton
    factory.register_deepseek_policy()
    factory.register_deepseek_policy()
    assert handler.AttentionBackendRegistry.get_handler(NAME) is \
        handler.handle_attention_flashmla
    assert FORWARD_ABSORB_CORE_ATTENTION_BACKENDS.count(NAME) == 1
