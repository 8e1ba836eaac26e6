"""Backend selection against vLLM's real classes (0.25 or 0.33, whichever is installed), on
the CPU: CUSTOM resolves to our router after registration, vLLM's selection step for a
chosen backend accepts what we claim and rejects the rest with our reasons, the engine-wide
limits, and the refusal of a vLLM release outside the supported ones. Tests of an interface
one release lacks branch on tests.cpu.vllm_env.V033."""

import re

import pytest
import torch

pytest.importorskip("vllm")

from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402

from mla_backend import _extension  # noqa: E402
from mla_backend.vllm import support, version  # noqa: E402
from mla_backend_entry import vllm_plugin  # noqa: E402
from tests.cpu.vllm_env import (  # noqa: E402
    HOPPER,
    V033,
    V32,
    model_dir,
    select_backend,
    vllm_config,
)

DENSE = "mla_backend.vllm.dense.MLADenseBackend"
SPARSE = "mla_backend.vllm.sparse.MLASparseBackend"


@pytest.fixture(autouse=True)
def _registered():
    vllm_plugin.register()


@pytest.fixture
def extension_present(monkeypatch):
    monkeypatch.setattr(_extension, "is_available", lambda: True)


def test_custom_resolves_to_the_router():
    from mla_backend.vllm.router import MLABackendRouter

    assert AttentionBackendEnum.CUSTOM.get_path() == vllm_plugin.ROUTER
    assert AttentionBackendEnum.CUSTOM.get_class() is MLABackendRouter


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv", ["auto", "fp8", "fp8_e4m3", None])
@pytest.mark.parametrize("block_size", [None, 64, 128])
def test_selection_accepts_what_we_claim(extension_present, dtype, kv, block_size):
    assert select_backend(dtype=dtype, kv_cache_dtype=kv, block_size=block_size) == DENSE
    from mla_backend.vllm.dense import MLADenseBackend

    assert MLADenseBackend.get_name() == "MLA_BACKEND"
    assert MLADenseBackend.get_supported_kernel_block_sizes() == [64]
    # vLLM 0.33 passes the layer's KV-cache spec: 64-token pages whatever it says
    assert MLADenseBackend.get_supported_kernel_block_sizes(object()) == [64]
    if V033:  # vLLM 0.29 took the cache shape from the KV-cache spec instead
        assert not hasattr(MLADenseBackend, "get_kv_cache_shape")
    else:
        assert MLADenseBackend.get_kv_cache_shape(10, 64, 1, 576) == (10, 64, 576)


def test_selection_accepts_matching_16_bit_cache_dtypes(extension_present):
    assert select_backend(dtype=torch.bfloat16, kv_cache_dtype="bfloat16") == DENSE
    assert select_backend(dtype=torch.float16, kv_cache_dtype="float16") == DENSE


@pytest.mark.parametrize("overrides, capability, reason", [
    ({"use_mla": False, "head_size": 128}, HOPPER, "implements MLA attention only"),
    ({}, DeviceCapability(8, 0), r"run on Hopper GPUs .* this GPU is 8\.0"),
    ({}, DeviceCapability(10, 0), r"run on Hopper GPUs .* this GPU is 10\.0"),
    ({"dtype": torch.float32}, HOPPER, "model dtype torch.float32 is not supported"),
    ({"kv_cache_dtype": "fp8_ds_mla"}, HOPPER, "fp8_ds_mla is DeepSeek-V3.2's sparse"),
    ({"kv_cache_dtype": "fp8_e5m2"}, HOPPER, "kv_cache_dtype fp8_e5m2 is not supported"),
    ({"kv_cache_dtype": "bfloat16", "dtype": torch.float16}, HOPPER,
     "keeps a 16-bit cache in the model dtype"),
    ({"block_size": 16}, HOPPER, r"--block-size 16: MLA_BACKEND pages hold 64 tokens"),
    ({"head_size": 320}, HOPPER, "576-dim latent cache"),
])
def test_selection_rejects_with_our_reason(extension_present, overrides, capability, reason):
    with pytest.raises(ValueError, match=r"Selected backend AttentionBackendEnum.CUSTOM is not "
                                         r"valid for this configuration") as err:
        select_backend(capability=capability, **overrides)
    assert re.search(reason, str(err.value)), str(err.value)


def test_selection_without_the_extension_says_how_to_build(monkeypatch):
    monkeypatch.setattr(_extension, "is_available", lambda: False)
    monkeypatch.setattr(_extension, "load_error", lambda: "no mla_backend/_C*.so")
    with pytest.raises(ValueError, match=r"CUDA extension is not available \(no mla_backend"
                                         r"/_C\*\.so; install: .*pip install --no-build"):
        select_backend()


@pytest.mark.parametrize("found", ["0.24.0", "0.30.0", "0.34.0", "1.0.0", "nightly"])
@pytest.mark.parametrize("use_sparse", [False, True])
def test_selection_refuses_an_unsupported_vllm_naming_both_versions(
        monkeypatch, extension_present, found, use_sparse):
    monkeypatch.setattr(version, "installed", lambda: found)
    with pytest.raises(ValueError) as err:
        select_backend(use_sparse=use_sparse)
    assert (f"vLLM {found} is installed; MLA_BACKEND supports vLLM 0.25.x and 0.33.x (tested on "
            f"0.25.0 and 0.33.0)") in str(err.value)


@pytest.mark.parametrize("found", ["0.25.0", "0.25.1", "0.33.0", "0.33.1rc1", "0.33.0+cu130"])
def test_supported_series_pass_the_version_check(found):
    assert version.unsupported_reason(found) is None


def test_an_unsupported_vllm_is_named_when_the_plugin_registers(monkeypatch, caplog):
    from mla_backend.vllm import registration

    monkeypatch.setattr(version, "installed", lambda: "0.29.0")
    monkeypatch.setattr(registration, "_registered", False)
    with caplog.at_level("WARNING", logger="mla_backend"):
        registration.register()
    assert "vLLM 0.29.0 is installed; MLA_BACKEND supports vLLM 0.25.x and 0.33.x" in caplog.text
    assert AttentionBackendEnum.CUSTOM.get_path() == vllm_plugin.ROUTER


# ----------------------------------------------- what vLLM 0.33's selector asks in addition


def test_context_parallel_and_adaptive_verification_claims(extension_present):
    from mla_backend.vllm.dense import MLADenseBackend
    from mla_backend.vllm.sparse import MLASparseBackend

    # dense: DCP merges shards by our lse; PCP untested; uniform decode rows need exact CPU
    # query lengths. Sparse: neither DCP nor PCP; every token is its own row.
    assert MLADenseBackend.get_impl_cls().supports_dcp is True
    assert MLADenseBackend.get_impl_cls().supports_pcp is False
    assert MLADenseBackend.supports_device_cpu_query_lens_mismatch() is False
    assert MLASparseBackend.supports_device_cpu_query_lens_mismatch() is V033
    if not V033:  # vLLM 0.25's selector asks none of these (the sparse config check refuses DCP)
        assert not {"use_dcp", "use_pcp", "use_adaptive_verification"} & set(
            AttentionSelectorConfig._fields)
        return
    assert MLASparseBackend.get_impl_cls().supports_dcp is False
    assert MLASparseBackend.get_impl_cls().supports_pcp is False
    assert select_backend(use_dcp=True) == DENSE
    with pytest.raises(ValueError, match="PCP not supported"):
        select_backend(use_pcp=True)
    with pytest.raises(ValueError, match="device-cpu query lens mismatch not supported"):
        select_backend(use_adaptive_verification=True)
    assert select_backend(use_sparse=True, use_adaptive_verification=True) == SPARSE
    with pytest.raises(ValueError, match="DCP not supported"):
        select_backend(use_sparse=True, use_dcp=True)
    with pytest.raises(ValueError, match="PCP not supported"):
        select_backend(use_sparse=True, use_pcp=True)


# ----------------------------------------------------------------------- engine config


def test_config_limits_heads_and_speculative_tokens(tmp_path):
    assert support.config_reason(vllm_config(model_dir(tmp_path))) is None
    assert support.config_reason(vllm_config(model_dir(tmp_path), spec_tokens=7)) is None
    too_many = support.config_reason(vllm_config(model_dir(tmp_path), spec_tokens=8))
    assert "sends 9 query tokens per request" in too_many
    assert "num_speculative_tokens <= 7" in too_many
    wide = support.config_reason(vllm_config(model_dir(tmp_path, heads=256)))
    assert "256 query heads per GPU" in wide and "at most 128" in wide


def test_spec_decode_refusal_names_the_limit_that_applies(tmp_path, monkeypatch):
    # the decode kernel takes 8 query tokens per request: 1 + k (k <= 7), or 1 + 2k with
    # parallel drafting on model runner V1 (k <= 3)
    serial = support.config_reason(vllm_config(model_dir(tmp_path), spec_tokens=8))
    assert serial == ("speculative decoding sends 9 query tokens per request to the decode "
                      "kernel; MLA_BACKEND decodes at most 8 (use num_speculative_tokens <= 7)")
    cfg = vllm_config(model_dir(tmp_path), spec_tokens=3)
    cfg.speculative_config.parallel_drafting = True
    if V033:
        # vLLM 0.33's own threshold, which our limit must follow on either runner
        from vllm.v1.attention.backend import max_decode_query_len

        for v2 in ("0", "1"):
            monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", v2)
            assert cfg.use_v2_model_runner is (v2 == "1")
            assert support.max_decode_query_len(cfg) == max_decode_query_len(cfg) == (
                4 if v2 == "1" else 7)
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert support.max_decode_query_len(cfg) == 7 and support.config_reason(cfg) is None
    cfg.speculative_config.num_speculative_tokens = 4
    assert support.config_reason(cfg) == (
        "speculative decoding sends 9 query tokens per request to the decode kernel (1 + 2 x "
        "num_speculative_tokens with parallel drafting); MLA_BACKEND decodes at most 8 (use "
        "num_speculative_tokens <= 3)")


# ----------------------------------------------------------------------- sparse (V3.2)


@pytest.mark.parametrize("kv", ["auto", "bfloat16", "fp8_ds_mla", None])
@pytest.mark.parametrize("block_size", [None, 64])
def test_sparse_selection_accepts_what_we_claim(extension_present, kv, block_size):
    assert select_backend(use_sparse=True, kv_cache_dtype=kv, block_size=block_size) == SPARSE
    from mla_backend.vllm.sparse import MLASparseBackend

    assert MLASparseBackend.is_sparse() and MLASparseBackend.is_mla()
    # the same CUSTOM registration still gives the dense backend to a dense model
    assert select_backend() == DENSE


def test_sparse_backend_uses_the_path_of_the_installed_release():
    from mla_backend.vllm.sparse import MLASparseBackend

    path = "sparse_common_path" if V033 else "sparse_own_path"
    for cls in (MLASparseBackend.get_builder_cls(), MLASparseBackend.get_impl_cls()):
        assert cls.__module__ == f"mla_backend.vllm.{path}"
    if V033:
        from vllm.model_executor.layers.attention.sparse_mla_attention import (
            SparseMLACommonImpl,
            SparseMLACommonMetadataBuilder,
        )

        assert issubclass(MLASparseBackend.get_impl_cls(), SparseMLACommonImpl)
        assert issubclass(MLASparseBackend.get_builder_cls(), SparseMLACommonMetadataBuilder)
        # record_logical_topk_ready / prepare_for_batch: what vLLM 0.33's V3.2 layer calls
        assert callable(MLASparseBackend.get_impl_cls().record_logical_topk_ready)


@pytest.mark.parametrize("overrides, capability, reason", [
    ({"kv_cache_dtype": "fp8"}, HOPPER, "reads vLLM's fp8_ds_mla cache .* use --kv-cache-dtype "
                                        "fp8_ds_mla"),
    ({"kv_cache_dtype": "fp8_e4m3"}, HOPPER, "use --kv-cache-dtype fp8_ds_mla"),
    ({"kv_cache_dtype": "float16"}, HOPPER, "kv_cache_dtype float16 is not supported by "
                                           "MLA_BACKEND for DeepSeek-V3.2"),
    ({"dtype": torch.float16}, HOPPER, "sparse .* kernels run bfloat16"),
    ({}, DeviceCapability(10, 0), r"run on Hopper GPUs .* this GPU is 10\.0"),
    ({"block_size": 16}, HOPPER, r"--block-size 16: MLA_BACKEND pages hold 64 tokens"),
])
def test_sparse_selection_rejects_with_our_reason(extension_present, overrides, capability,
                                                  reason):
    with pytest.raises(ValueError, match="is not valid for this configuration") as err:
        select_backend(capability=capability, use_sparse=True, **overrides)
    assert re.search(reason, str(err.value)), str(err.value)


def test_sparse_config_limits(tmp_path):
    assert support.sparse_config_reason(vllm_config(model_dir(tmp_path, **V32))) is None
    odd = support.sparse_config_reason(
        vllm_config(model_dir(tmp_path, **{**V32, "index_topk": 200})))
    assert "index_topk 200" in odd and "multiples of 128" in odd
    wide = support.sparse_config_reason(vllm_config(model_dir(tmp_path, heads=256, **V32)))
    assert "256 query heads per GPU" in wide
    big = vllm_config(model_dir(tmp_path, **V32))
    big.scheduler_config.max_num_batched_tokens = 70000
    assert "max_num_batched_tokens 70000" in support.sparse_config_reason(big)


def test_sparse_dcp_refusal_says_what_to_do_instead(tmp_path):
    cfg = vllm_config(model_dir(tmp_path, **V32), tp=2, dcp=2)
    if V033:  # vLLM 0.33's FLASHMLA_SPARSE runs DCP on Hopper
        assert support.sparse_config_reason(cfg) == (
            "decode context parallelism with DeepSeek-V3.2: MLA_BACKEND's sparse path does not "
            "run it; use --decode-context-parallel-size 1, or --attention-backend "
            "FLASHMLA_SPARSE")
    else:  # no vLLM 0.25 sparse MLA backend runs DCP on Hopper
        assert support.sparse_config_reason(cfg) == (
            "decode context parallelism with DeepSeek-V3.2: neither MLA_BACKEND's sparse path "
            "nor any vLLM 0.25 sparse MLA backend for Hopper runs it; use "
            "--decode-context-parallel-size 1")


def test_sparse_refuses_the_host_offloaded_cache(tmp_path):
    cfg = vllm_config(model_dir(tmp_path, **V32))
    if not V033:  # vLLM 0.25 has no host-offloaded sparse cache
        assert not hasattr(cfg.attention_config, "hisparse_config")
        return
    cfg.attention_config.hisparse_config = object()
    assert "hisparse_config (host-offloaded sparse KV cache)" in support.sparse_config_reason(cfg)


def test_sparse_cache_shape_follows_the_layers_fp8_ds_mla(monkeypatch):
    """vLLM 0.25 asks MLA backends for the cache shape with cache_dtype_str "auto" even for
    an fp8_ds_mla cache (pages sized 656 B/token): the shape follows the layers' dtype.
    vLLM 0.33 takes the shape from the KV-cache spec and asks for a block stride of whole
    64-row pages instead."""
    from mla_backend.vllm.sparse import MLASparseBackend
    from tests.cpu.vllm_env import mla_spec

    monkeypatch.setattr(MLASparseBackend, "layer_cache_dtype", None)
    assert MLASparseBackend.get_kv_cache_shape(8, 64, 1, 576, "auto") == (8, 64, 576)
    monkeypatch.setattr(MLASparseBackend, "layer_cache_dtype", "fp8_ds_mla")
    assert MLASparseBackend.get_kv_cache_shape(8, 64, 1, 576, "auto") == (8, 64, 656)
    assert MLASparseBackend.get_kv_cache_shape(8, 64, 1, 576, "fp8_ds_mla") == (8, 64, 656)
    monkeypatch.setattr(MLASparseBackend, "layer_cache_dtype", "bfloat16")
    assert MLASparseBackend.get_kv_cache_shape(8, 64, 1, 576, "auto") == (8, 64, 576)
    if V033:
        assert MLASparseBackend.customize_spec(mla_spec()).get_block_stride_alignment() == (
            64 * 576 * 2)
        from dataclasses import replace

        ds = replace(mla_spec("fp8_ds_mla"), state_content_bytes=656, dtype=torch.uint8)
        assert MLASparseBackend.customize_spec(ds).get_block_stride_alignment() == 64 * 656
