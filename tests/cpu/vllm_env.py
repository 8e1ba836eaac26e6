"""What the cpu-tier vLLM adapter tests build with vLLM's real classes, for vLLM 0.25 and
0.33: engine configs of a tiny DeepSeek model, CommonAttentionMetadata of a hand-worked
batch, the MLA layer a metadata builder looks up, and CPU stand-ins for the GPU-only
pieces (our planner; vLLM's Triton token-to-request map and top-k conversion), each
computing what the GPU code computes so the tests can check the adapters' arithmetic; and
vLLM's selection step for the CUSTOM backend."""

import json
import types

import torch
import vllm
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.selector import AttentionSelectorConfig
from vllm.v1.kv_cache_interface import MLAAttentionSpec

from mla_backend import ops
from mla_backend import reference as ref
from mla_backend.vllm import version

# The interface the installed release has: tests that depend on it branch on this.
V033 = version.parse(vllm.__version__)[:2] == (0, 33)
V025 = version.parse(vllm.__version__)[:2] == (0, 25)
assert V033 or V025, f"the adapter tests know vLLM 0.25 and 0.33; installed {vllm.__version__}"

HOPPER = DeviceCapability(9, 0)

V32 = {"architectures": ["DeepseekV32ForCausalLM"], "index_topk": 256, "index_n_heads": 4,
       "index_head_dim": 128}


def model_dir(tmp_path, heads=16, **extra):
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


def vllm_config(model_dir, *, tp=1, dcp=1, spec_tokens=None, max_num_seqs=32,
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


def mla_spec(cache_dtype="auto"):
    return MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                            cache_dtype_str=cache_dtype)


class FakePrefillBackend:
    """vLLM's MLA prefill backend as the builders see it: cloned per builder, handed the
    prefill metadata (the prefill kernels themselves are not under test)."""

    def clone(self):
        return self

    def prepare_metadata(self, metadata):
        self.prepared = metadata

    def get_name(self):
        return "FAKE_PREFILL"


def add_layer(cfg, name="model.layers.0.self_attn.attn"):
    """The MLA layer vLLM registers in static_forward_context, with what the builders read:
    its prefill backend and latent dims, and (vLLM 0.33) its own routing of sparse prefills,
    vLLM's MLAAttention._use_sparse_mha bound to it."""
    layer = types.SimpleNamespace(prefill_backend=FakePrefillBackend(), q_lora_rank=128,
                                  kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                  v_head_dim=128, hisparse_cache=None, _vllm_config=cfg,
                                  impl=types.SimpleNamespace(masked_mha_available=False,
                                                             dcp_world_size=1))
    if V033:
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention

        layer._use_sparse_mha = types.MethodType(MLAAttention._use_sparse_mha, layer)
        layer.attn_backend = types.SimpleNamespace(get_name=lambda: "MLA_BACKEND")
    cfg.compilation_config.static_forward_context[name] = layer
    return name


def common(query_lens, seq_lens, num_tokens=None):
    """CommonAttentionMetadata of a batch: request r has query_lens[r] new tokens and
    seq_lens[r] tokens in all; its block table row r holds 8 * r + 7 .. 8 * r (reversed, so
    a mapping through the wrong row or column shows)."""
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0).tolist()), dtype=torch.int32)
    n = len(query_lens)
    tokens = int(qsl[-1]) if num_tokens is None else num_tokens
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    table = torch.arange(n * 8, dtype=torch.int32).view(n, 8).flip(1).contiguous()
    fields = dict(query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=n,
                  num_actual_tokens=tokens, max_query_len=max(query_lens),
                  max_seq_len=max(seq_lens), block_table_tensor=table,
                  slot_mapping=torch.zeros(tokens, dtype=torch.int64),
                  seq_lens_cpu_upper_bound=seq)
    if V025:  # vLLM 0.30 removed these deprecated CPU copies
        fields.update(_seq_lens_cpu=seq,
                      _num_computed_tokens_cpu=seq - torch.tensor(query_lens, dtype=torch.int32))
    return CommonAttentionMetadata(**fields)


def token_to_req_indices_twin(query_start_loc, out, num_mapped_tokens, num_tokens):
    """vLLM 0.33's compute_token_to_req_indices (a Triton kernel) on the CPU: token t maps to
    the request whose query range holds it; tokens from num_mapped_tokens on map to 0."""
    starts = query_start_loc.to(torch.int64)
    tokens = torch.arange(num_tokens)
    req = torch.searchsorted(starts[1:], tokens, right=True).to(out.dtype)
    req[num_mapped_tokens:] = 0
    out[:num_tokens] = req
    return out[:num_tokens]


def physical_topk_twin(req_id, block_table, positions, block_size, block_stride_rows):
    """vLLM's top-k conversion (triton_convert_req_index_to_global_index) on the CPU: the
    cache row of request-local position p of token t is
    block_table[req_id[t], p // block_size] * block_stride_rows + p % block_size; -1 stays."""
    rows = block_table[req_id.long()[:, None], (positions.clamp(min=0) // block_size).long()]
    out = rows * block_stride_rows + positions % block_size
    return torch.where(positions < 0, -1, out).to(torch.int32)


def planner_stand_in(monkeypatch):
    """ops.decode_workspace / ops.plan_decode on the CPU: record the calls and fill the plan
    with the planner's reference twin (the GPU test tier checks the kernel against it)."""
    calls = []

    class Workspace:
        def __init__(self, max_batch, max_q_len, heads, kv_cache_dtype):
            self.args = (max_batch, max_q_len, heads, kv_cache_dtype)

    def decode_workspace(max_batch, max_q_len, heads, *, device, kv_cache_dtype=None):
        return Workspace(max_batch, max_q_len, heads, kv_cache_dtype)

    def plan_decode(seq_lens, s_q, heads, *, kv_cache_dtype=None, workspace=None):
        assert isinstance(workspace, Workspace)
        calls.append({"seq_lens": seq_lens.tolist(), "s_q": s_q, "heads": heads,
                      "kv_cache_dtype": kv_cache_dtype})
        kv_fp8 = kv_cache_dtype == torch.float8_e4m3fn
        rows_per_cta, unit_tokens, num_ctas = ops._grid(
            s_q * heads, 132, ops._uses_mma(s_q * heads, seq_lens.shape[0], kv_fp8))
        ordered = ops.dense._ordered(seq_lens.shape[0], unit_tokens, num_ctas)
        meta = ref.plan_decode_metadata(
            seq_lens, num_ctas,
            **ops.dense._planner_knobs(s_q * heads, rows_per_cta, unit_tokens, kv_fp8, ordered))
        return ops.DecodePlan(batch=seq_lens.shape[0], q_tokens_per_req=s_q, num_heads=heads,
                              kv_fp8=kv_cache_dtype is not None, rows_per_cta=rows_per_cta,
                              unit_tokens=unit_tokens, num_ctas=num_ctas, metadata=meta,
                              partial_out=torch.empty(0), partial_lse=torch.empty(0))

    monkeypatch.setattr(ops, "decode_workspace", decode_workspace)
    monkeypatch.setattr(ops, "plan_decode", plan_decode)
    return calls


def sparse_planner_stand_in(monkeypatch):
    """ops.sparse_workspace / ops.plan_sparse_decode on the CPU: record the calls; the plan
    is a record of its arguments (its arithmetic is the planner tests' subject)."""
    calls = []
    monkeypatch.setattr(ops, "sparse_workspace",
                        lambda max_groups, heads, *, device: ("ws", max_groups, heads))

    def plan_sparse_decode(batch, s_q, heads, topk, *, workspace, kv_cache_dtype):
        calls.append((batch, s_q, heads, topk, workspace, kv_cache_dtype))
        return types.SimpleNamespace(batch=batch, q_tokens_per_req=s_q, num_heads=heads,
                                     topk=topk)

    monkeypatch.setattr(ops, "plan_sparse_decode", plan_sparse_decode)
    return calls


def host_without_gpu(monkeypatch):
    """vLLM's builders pin their host buffers where PIN_MEMORY says so (decided when vLLM is
    imported: True with a CUDA build of torch); this machine has no driver to pin with."""
    import sys

    from vllm.model_executor.layers.attention import mla_attention  # noqa: F401

    if V033:
        from vllm.model_executor.layers.attention import sparse_mla_attention  # noqa: F401
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm") and getattr(module, "PIN_MEMORY", None) is True:
            monkeypatch.setattr(module, "PIN_MEMORY", False)


def select_backend(capability=HOPPER, **overrides):
    """What CudaPlatform.get_attn_backend_cls does with a selected backend in vLLM 0.25 and
    0.33 alike (platforms/cuda.py; that module needs libcuda to import, so its three steps
    are spelled out): validate the registered class, raise with the reasons, else return
    the path of the class it names."""
    fields = dict(head_size=576, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None,
                  use_mla=True, has_sink=False, use_sparse=False, use_mm_prefix=False,
                  use_per_head_quant_scales=False, attn_type="decoder")
    fields.update(overrides)
    unknown = set(fields) - set(AttentionSelectorConfig._fields)
    assert not unknown, f"this vLLM's selector has no {unknown}: branch the test on V033"
    selected = AttentionBackendEnum.CUSTOM
    backend_class = selected.get_class()
    reasons = backend_class.validate_configuration(
        device_capability=capability, **AttentionSelectorConfig(**fields)._asdict())
    if reasons:
        raise ValueError(f"Selected backend {selected} is not valid for this configuration. "
                         f"Reason: {reasons}")
    return ".".join(backend_class.full_cls_name())
