"""The vLLM adapter against vLLM 0.25's real classes, on the CPU: CUSTOM resolves to our
router after registration, vLLM's selection step for a chosen backend accepts what we claim
and rejects the rest with our reasons, and the metadata builder maps
CommonAttentionMetadata to decode rows and a plan as worked out by hand below.

The planner and the workspace are GPU ops; here they are replaced by CPU stand-ins that
record their arguments and fill the plan metadata with the planner's reference twin."""

import json
import re
import types

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402
from vllm.v1.kv_cache_interface import MLAAttentionSpec  # noqa: E402

from mla_backend import _extension, ops  # noqa: E402
from mla_backend import reference as ref  # noqa: E402
from mla_backend.vllm import support  # noqa: E402
from mla_backend_entry import vllm_plugin  # noqa: E402

HOPPER = DeviceCapability(9, 0)
DENSE = "mla_backend.vllm.dense.MLADenseBackend"
SPARSE = "mla_backend.vllm.sparse.MLASparseBackend"


@pytest.fixture(autouse=True)
def _registered():
    vllm_plugin.register()


@pytest.fixture
def extension_present(monkeypatch):
    monkeypatch.setattr(_extension, "is_available", lambda: True)


def _select(monkeypatch, capability=HOPPER, **overrides):
    """What vLLM 0.25's CudaPlatform.get_attn_backend_cls does with a selected backend
    (platforms/cuda.py; that module needs libcuda to import, so its three steps are
    spelled out): validate the registered class, raise with the reasons, else return the
    path of the class it names."""
    fields = dict(head_size=576, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None,
                  use_mla=True, has_sink=False, use_sparse=False, use_mm_prefix=False,
                  use_per_head_quant_scales=False, attn_type="decoder")
    fields.update(overrides)
    selected = AttentionBackendEnum.CUSTOM
    backend_class = selected.get_class()
    reasons = backend_class.validate_configuration(
        device_capability=capability, **AttentionSelectorConfig(**fields)._asdict())
    if reasons:
        raise ValueError(f"Selected backend {selected} is not valid for this configuration. "
                         f"Reason: {reasons}")
    return ".".join(backend_class.full_cls_name())


def test_custom_resolves_to_the_router():
    from mla_backend.vllm.router import MLABackendRouter

    assert AttentionBackendEnum.CUSTOM.get_path() == vllm_plugin.ROUTER
    assert AttentionBackendEnum.CUSTOM.get_class() is MLABackendRouter


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv", ["auto", "fp8", "fp8_e4m3", None])
@pytest.mark.parametrize("block_size", [None, 64, 128])
def test_selection_accepts_what_we_claim(monkeypatch, extension_present, dtype, kv, block_size):
    path = _select(monkeypatch, dtype=dtype, kv_cache_dtype=kv, block_size=block_size)
    assert path == DENSE
    from mla_backend.vllm.dense import MLADenseBackend

    assert MLADenseBackend.get_name() == "MLA_BACKEND"
    assert MLADenseBackend.get_supported_kernel_block_sizes() == [64]
    assert MLADenseBackend.get_kv_cache_shape(10, 64, 1, 576) == (10, 64, 576)


def test_selection_accepts_matching_16_bit_cache_dtypes(monkeypatch, extension_present):
    assert _select(monkeypatch, dtype=torch.bfloat16, kv_cache_dtype="bfloat16") == DENSE
    assert _select(monkeypatch, dtype=torch.float16, kv_cache_dtype="float16") == DENSE


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
def test_selection_rejects_with_our_reason(monkeypatch, extension_present, overrides, capability,
                                           reason):
    with pytest.raises(ValueError, match=r"Selected backend AttentionBackendEnum.CUSTOM is not "
                                         r"valid for this configuration") as err:
        _select(monkeypatch, capability=capability, **overrides)
    assert re.search(reason, str(err.value)), str(err.value)


def test_selection_without_the_extension_says_how_to_build(monkeypatch):
    monkeypatch.setattr(_extension, "is_available", lambda: False)
    monkeypatch.setattr(_extension, "load_error", lambda: "no mla_backend/_C*.so")
    with pytest.raises(ValueError, match=r"CUDA extension is not available \(no mla_backend"
                                         r"/_C\*\.so; install: .*pip install --no-build"):
        _select(monkeypatch)


# ----------------------------------------------------------------------- engine config


def _model_dir(tmp_path, heads=16, **extra):
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
           "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
           "moe_intermediate_size": 64, "num_hidden_layers": 2, "first_k_dense_replace": 1,
           "num_attention_heads": heads, "num_key_value_heads": heads, "n_routed_experts": 4,
           "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
           "q_lora_rank": 128, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
           "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 4096,
           "num_nextn_predict_layers": 0, "torch_dtype": "bfloat16"}
    cfg.update(extra)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def _vllm_config(model_dir, *, tp=1, dcp=1, spec_tokens=None, max_num_seqs=32,
                 cache_dtype="auto"):
    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=4096,
                        dtype="bfloat16")
    spec = None
    if spec_tokens is not None:
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=spec_tokens,
                                 prompt_lookup_max=3, prompt_lookup_min=1)
    return VllmConfig(
        model_config=model, cache_config=CacheConfig(block_size=64, cache_dtype=cache_dtype),
        parallel_config=ParallelConfig(tensor_parallel_size=tp,
                                       decode_context_parallel_size=dcp),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=4096,
                                         max_model_len=4096, is_encoder_decoder=False),
        speculative_config=spec, device_config=DeviceConfig("cpu"))


def test_config_limits_heads_and_speculative_tokens(tmp_path):
    assert support.config_reason(_vllm_config(_model_dir(tmp_path))) is None
    assert support.config_reason(_vllm_config(_model_dir(tmp_path), spec_tokens=7)) is None
    too_many = support.config_reason(_vllm_config(_model_dir(tmp_path), spec_tokens=8))
    assert "sends 9 query tokens per request" in too_many
    assert "num_speculative_tokens <= 7" in too_many
    wide = support.config_reason(_vllm_config(_model_dir(tmp_path, heads=256)))
    assert "256 query heads per GPU" in wide and "at most 128" in wide


def test_spec_decode_refusal_names_the_limit_that_applies(tmp_path):
    # the decode kernel takes 8 query tokens per request: 1 + k without parallel drafting
    # (k <= 7), 1 + 2k with it (k <= 3)
    serial = support.config_reason(_vllm_config(_model_dir(tmp_path), spec_tokens=8))
    assert serial == ("speculative decoding sends 9 query tokens per request to the decode "
                      "kernel; MLA_BACKEND decodes at most 8 (use num_speculative_tokens <= 7)")
    cfg = _vllm_config(_model_dir(tmp_path), spec_tokens=3)
    cfg.speculative_config.parallel_drafting = True
    assert support.max_decode_query_len(cfg) == 7 and support.config_reason(cfg) is None
    cfg.speculative_config.num_speculative_tokens = 4
    assert support.config_reason(cfg) == (
        "speculative decoding sends 9 query tokens per request to the decode kernel (1 + 2 x "
        "num_speculative_tokens with parallel drafting); MLA_BACKEND decodes at most 8 (use "
        "num_speculative_tokens <= 3)")


# ----------------------------------------------------------------------- builder mapping


class _FakeWorkspace:
    def __init__(self, max_batch, max_q_len, heads, device, kv_cache_dtype):
        self.args = (max_batch, max_q_len, heads, kv_cache_dtype)


@pytest.fixture
def fake_planner(monkeypatch):
    """ops.decode_workspace / ops.plan_decode on the CPU: record the calls, fill the plan
    with the planner's reference twin (the GPU test tier checks the kernel against it)."""
    calls = []

    def decode_workspace(max_batch, max_q_len, heads, *, device, kv_cache_dtype=None):
        return _FakeWorkspace(max_batch, max_q_len, heads, device, kv_cache_dtype)

    def plan_decode(seq_lens, s_q, heads, *, kv_cache_dtype=None, workspace=None):
        assert isinstance(workspace, _FakeWorkspace)
        calls.append({"seq_lens": seq_lens.tolist(), "s_q": s_q, "heads": heads,
                      "kv_cache_dtype": kv_cache_dtype})
        rows_per_cta, unit_tokens, num_ctas = ops._grid(s_q * heads, 132)
        min_units = -(-ops.MIN_TOKENS_PER_CTA // unit_tokens)
        meta = ref.plan_decode_metadata(seq_lens, num_ctas, min_units, unit_tokens)
        return ops.DecodePlan(batch=seq_lens.shape[0], q_tokens_per_req=s_q, num_heads=heads,
                              kv_fp8=kv_cache_dtype is not None, rows_per_cta=rows_per_cta,
                              unit_tokens=unit_tokens, num_ctas=num_ctas, metadata=meta,
                              partial_out=torch.empty(0), partial_lse=torch.empty(0))

    monkeypatch.setattr(ops, "decode_workspace", decode_workspace)
    monkeypatch.setattr(ops, "plan_decode", plan_decode)
    return calls


def _builder(vllm_config, layer="model.layers.0.self_attn.attn"):
    from mla_backend.vllm.dense import MLADenseMetadataBuilder

    prefill = types.SimpleNamespace(prepare_metadata=lambda md: None)
    prefill.clone = lambda: prefill
    vllm_config.compilation_config.static_forward_context[layer] = types.SimpleNamespace(
        prefill_backend=prefill)
    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    return MLADenseMetadataBuilder(spec, [layer], vllm_config, torch.device("cpu"))


def _common(query_lens, seq_lens, num_tokens=None):
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0).tolist()), dtype=torch.int32)
    n = len(query_lens)
    tokens = int(qsl[-1]) if num_tokens is None else num_tokens
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    table = torch.arange(n * 8, dtype=torch.int32).view(n, 8).flip(1).contiguous()
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=n,
        num_actual_tokens=tokens, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        block_table_tensor=table, slot_mapping=torch.zeros(tokens, dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq, _seq_lens_cpu=seq,
        _num_computed_tokens_cpu=seq - torch.tensor(query_lens, dtype=torch.int32))


def test_builder_decode_first_batch_with_a_prefill(tmp_path, fake_planner):
    b = _builder(_vllm_config(_model_dir(tmp_path)))
    assert b.workspace.args == (32, 1, 16, None)
    # three decodes (q_len 1), then a new 5-token prompt
    m = b.build(0, _common([1, 1, 1, 5], [10, 70, 200, 5]))
    assert (m.num_decodes, m.num_decode_tokens, m.num_prefills) == (3, 3, 1)
    assert fake_planner == [{"seq_lens": [10, 70, 200], "s_q": 1, "heads": 16,
                             "kv_cache_dtype": None}]
    plan = m.decode.plan
    # H = 16 rows: 16-row tiles, 32-token units -> ceil(L / 32) units per request
    assert (plan.batch, plan.q_tokens_per_req, plan.unit_tokens) == (3, 1, 32)
    assert plan.metadata[:4].tolist() == [0, 1, 4, 11]
    assert m.decode.block_table.shape == (3, 8)
    assert m.decode.block_table[:, 0].tolist() == [7, 15, 23]
    assert m.decode.seq_lens.tolist() == [10, 70, 200]
    assert m.prefill is not None and m.prefill.max_query_len == 5


def test_builder_padded_cuda_graph_rows(tmp_path, fake_planner):
    b = _builder(_vllm_config(_model_dir(tmp_path)))
    # a FULL graph captured for 4 requests replayed with 2: padding rows have seq_len 0
    m = b.build(0, _common([1, 1, 0, 0], [100, 7, 0, 0], num_tokens=4))
    assert (m.num_decodes, m.num_decode_tokens, m.num_prefills) == (4, 4, 0)
    assert fake_planner[-1]["seq_lens"] == [100, 7, 0, 0]
    assert m.decode.plan.batch == 4 and m.decode.plan.metadata[:5].tolist() == [0, 4, 5, 5, 5]


def test_builder_spec_decode_rows_take_the_decode_kernel(tmp_path, fake_planner):
    b = _builder(_vllm_config(_model_dir(tmp_path), spec_tokens=3))
    assert b.reorder_batch_threshold == 4 and b.workspace.args == (32, 4, 16, None)
    # two verification rows (1 + 3 drafts each), then a 7-token prefill
    m = b.build(0, _common([4, 4, 7], [50, 300, 7]))
    assert (m.num_decodes, m.num_decode_tokens, m.num_prefills) == (2, 8, 1)
    plan = m.decode.plan
    # 4 x 16 = 64 rows: the wgmma kernel, one 64-token page per unit
    assert (plan.batch, plan.q_tokens_per_req, plan.unit_tokens) == (2, 4, 64)
    assert plan.metadata[:3].tolist() == [0, 1, 6]
    # padded uniform batch during graph replay: the zero-length row is a decode too
    m = b.build(0, _common([4, 4, 0], [50, 300, 0], num_tokens=12))
    assert (m.num_decodes, m.decode.plan.batch, m.decode.plan.q_tokens_per_req) == (3, 3, 4)


def test_builder_fp8_cache_plans_for_the_fp8_kernel(tmp_path, fake_planner):
    cfg = _vllm_config(_model_dir(tmp_path))
    cfg.cache_config.cache_dtype = "fp8"
    b = _builder(cfg)
    assert b.workspace.args == (32, 1, 16, torch.float8_e4m3fn)
    m = b.build(0, _common([1], [33]))
    assert fake_planner[-1]["kv_cache_dtype"] == torch.float8_e4m3fn
    assert m.decode.plan.kv_fp8


def test_builder_refuses_more_query_tokens_than_the_kernel_takes(tmp_path, fake_planner):
    with pytest.raises(ValueError, match="sends 9 query tokens per request"):
        _builder(_vllm_config(_model_dir(tmp_path), spec_tokens=8))


def test_decode_shape_rejects_non_uniform_rows():
    from mla_backend.vllm.dense import decode_shape

    assert decode_shape(4, 12) == (4, 3)
    with pytest.raises(RuntimeError, match="13 decode tokens over 4 requests"):
        decode_shape(4, 13)


# ----------------------------------------------------------------------- sparse (V3.2)


@pytest.mark.parametrize("kv", ["auto", "bfloat16", "fp8_ds_mla", None])
@pytest.mark.parametrize("block_size", [None, 64])
def test_sparse_selection_accepts_what_we_claim(monkeypatch, extension_present, kv, block_size):
    assert _select(monkeypatch, use_sparse=True, kv_cache_dtype=kv,
                   block_size=block_size) == SPARSE
    from mla_backend.vllm.sparse import MLASparseBackend

    assert MLASparseBackend.is_sparse() and MLASparseBackend.is_mla()
    assert MLASparseBackend.get_kv_cache_shape(10, 64, 1, 576, "fp8_ds_mla") == (10, 64, 656)
    assert MLASparseBackend.get_kv_cache_shape(10, 64, 1, 576, "auto") == (10, 64, 576)
    # the same CUSTOM registration still gives the dense backend to a dense model
    assert _select(monkeypatch) == DENSE


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
def test_sparse_selection_rejects_with_our_reason(monkeypatch, extension_present, overrides,
                                                  capability, reason):
    with pytest.raises(ValueError, match="is not valid for this configuration") as err:
        _select(monkeypatch, capability=capability, use_sparse=True, **overrides)
    assert re.search(reason, str(err.value)), str(err.value)


def test_sparse_config_limits(tmp_path):
    v32 = {"architectures": ["DeepseekV32ForCausalLM"], "index_topk": 256,
           "index_n_heads": 4, "index_head_dim": 128}
    assert support.sparse_config_reason(_vllm_config(_model_dir(tmp_path, **v32))) is None
    odd = support.sparse_config_reason(
        _vllm_config(_model_dir(tmp_path, **{**v32, "index_topk": 200})))
    assert "index_topk 200" in odd and "multiples of 128" in odd
    wide = support.sparse_config_reason(_vllm_config(_model_dir(tmp_path, heads=256, **v32)))
    assert "256 query heads per GPU" in wide
    big = _vllm_config(_model_dir(tmp_path, **v32))
    big.scheduler_config.max_num_batched_tokens = 70000
    assert "max_num_batched_tokens 70000" in support.sparse_config_reason(big)


def test_sparse_dcp_refusal_says_to_turn_dcp_off(tmp_path):
    # no vLLM 0.25 sparse MLA backend runs DCP on Hopper: switching backends is no way out
    v32 = {"architectures": ["DeepseekV32ForCausalLM"], "index_topk": 256,
           "index_n_heads": 4, "index_head_dim": 128}
    cfg = _vllm_config(_model_dir(tmp_path, **v32), tp=2, dcp=2)
    assert support.sparse_config_reason(cfg) == (
        "decode context parallelism with DeepSeek-V3.2: neither MLA_BACKEND's sparse path nor "
        "any vLLM 0.25 sparse MLA backend for Hopper runs it; use "
        "--decode-context-parallel-size 1")


def test_request_of_token_maps_mixed_batches():
    from mla_backend.vllm.sparse import request_of_token

    # two decodes, a 3-token prefill, a 1-token prefill; then graph padding (empty requests)
    qsl = torch.tensor([0, 1, 2, 5, 6, 6, 6], dtype=torch.int32)
    assert request_of_token(qsl).tolist() == [0, 1, 2, 2, 2, 3]


def test_sparse_builder_plans_every_token(tmp_path, monkeypatch):
    from mla_backend.vllm import sparse

    calls = []
    monkeypatch.setattr(ops, "sparse_workspace",
                        lambda max_groups, heads, *, device: ("ws", max_groups, heads))
    monkeypatch.setattr(ops, "plan_sparse_decode",
                        lambda batch, s_q, heads, topk, *, workspace, kv_cache_dtype: calls.append(
                            (batch, s_q, heads, topk, workspace, kv_cache_dtype)) or "plan")
    v32 = {"architectures": ["DeepseekV32ForCausalLM"], "index_topk": 256,
           "index_n_heads": 4, "index_head_dim": 128}
    cfg = _vllm_config(_model_dir(tmp_path, **v32))
    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    b = sparse.MLASparseMetadataBuilder(spec, ["l0"], cfg, torch.device("cpu"))
    assert b.workspace == ("ws", 4096, 16) and b.reorder_batch_threshold == 1
    m = b.build(0, _common([1, 1, 5], [10, 70, 5]))
    assert calls == [(7, 1, 16, 256, ("ws", 4096, 16), torch.bfloat16)] and m.plan == "plan"
    assert m.num_actual_tokens == 7
    assert m.req_id_per_token.tolist() == [0, 1, 2, 2, 2, 2, 2]
    assert b.req_id_per_token[7:].eq(0).all()
    assert m.block_table[:, 0].tolist() == [7, 15, 23]
    # the plan is tuned for the cache format
    cfg8 = _vllm_config(_model_dir(tmp_path, **v32), cache_dtype="fp8_ds_mla")
    sparse.MLASparseMetadataBuilder(spec, ["l0"], cfg8, torch.device("cpu")).build(
        0, _common([1], [10]))
    assert calls[-1] == (1, 1, 16, 256, ("ws", 4096, 16), torch.uint8)


def test_sparse_cache_shape_follows_the_layers_fp8_ds_mla(monkeypatch):
    """vLLM 0.25 asks MLA backends for the cache shape with cache_dtype_str "auto" even for
    an fp8_ds_mla cache (pages sized 656 B/token): the shape follows the layers' dtype."""
    from mla_backend.vllm.sparse import MLASparseBackend

    monkeypatch.setattr(MLASparseBackend, "layer_cache_dtype", None)
    assert MLASparseBackend.get_kv_cache_shape(8, 64, 1, 576, "auto") == (8, 64, 576)
    monkeypatch.setattr(MLASparseBackend, "layer_cache_dtype", "fp8_ds_mla")
    assert MLASparseBackend.get_kv_cache_shape(8, 64, 1, 576, "auto") == (8, 64, 656)
    assert MLASparseBackend.get_kv_cache_shape(8, 64, 1, 576, "fp8_ds_mla") == (8, 64, 656)
    monkeypatch.setattr(MLASparseBackend, "layer_cache_dtype", "bfloat16")
    assert MLASparseBackend.get_kv_cache_shape(8, 64, 1, 576, "auto") == (8, 64, 576)
