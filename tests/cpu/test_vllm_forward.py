"""The impls' forward path against vLLM's real classes (0.25 or 0.33), on the CPU, with the
kernel call intercepted: what our impls hand mla_backend.ops — q assembled from vLLM's q
parts (in the layout each release passes them), the cache, block table, sequence lengths,
plan, scale and kv scale, the sparse indices as cache slots — and how the kernel's output
and lse go back to vLLM. vLLM's Triton top-k conversion is replaced by a CPU twin
(tests.cpu.vllm_env.physical_topk_twin) that computes what it computes."""

import types

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import set_current_vllm_config  # noqa: E402

from mla_backend import ops  # noqa: E402
from tests.cpu.vllm_env import (  # noqa: E402
    V033,
    V32,
    add_layer,
    common,
    host_without_gpu,
    model_dir,
    physical_topk_twin,
    sparse_planner_stand_in,
    token_to_req_indices_twin,
    vllm_config,
)

H = 16
MLA_ARGS = dict(q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                qk_head_dim=192, v_head_dim=128, kv_b_proj=None)


@pytest.fixture(autouse=True)
def _host(monkeypatch):
    host_without_gpu(monkeypatch)


def _q_parts(tokens, heads=H, seed=0):
    """(ql_nope [T, H, 512], q_pe [T, H, 64]) as vLLM's MLA layer passes them: q_pe a view
    of the projected q [T, H, 192]; ql_nope the W_UK product, written token-major by vLLM
    0.33 and head-major (then transposed) by 0.25."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, 192, generator=g).to(torch.bfloat16)
    q_pe = q[..., 128:]
    ql = torch.randn(tokens, heads, 512, generator=g).to(torch.bfloat16)
    ql_nope = ql if V033 else ql.transpose(0, 1).contiguous().transpose(0, 1)
    assert ql_nope.is_contiguous() is V033 and not q_pe.is_contiguous()
    return ql_nope, q_pe


def _kernel_spy(monkeypatch, op, heads=H):
    """Replace ops.<op> with a recorder returning out[b, s, h, :] = 64 b + 16 s + h and
    lse = -(64 b + 16 s + h) (exact in bfloat16 for the batches here), so the tests can read
    back where each row went."""
    calls = []

    def spy(q, kv_cache, *args, **kwargs):
        calls.append((q, kv_cache, args, kwargs))
        first = q[0] if isinstance(q, tuple) else q
        b, s, h = first.shape[:3]
        tag = (64 * torch.arange(b)[:, None, None] + 16 * torch.arange(s)[None, :, None]
               + torch.arange(h)[None, None, :]).float()
        return tag[..., None].expand(b, s, h, ops.D_V).to(first.dtype), -tag

    monkeypatch.setattr(ops, op, spy)
    return calls


def _mla_layer(impl, kv_cache_dtype: str, g: torch.Generator):
    """What MLAAttention.forward_impl reads of its layer: H heads with random up-projections
    drawn from g, vLLM's own _v_up_proj, and impl as the layer's backend impl."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    w_uk_t = (torch.randn(H, 128, 512, generator=g) / 16).to(torch.bfloat16)
    w_uv = (torch.randn(H, 512, 128, generator=g) / 16).to(torch.bfloat16)
    layer = types.SimpleNamespace(
        num_heads=H, v_head_dim=128, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, q_pad_num_heads=None, is_aiter_triton_fp4_bmm_enabled=False,
        is_aiter_triton_fp8_bmm_enabled=False, is_amx_bmm_enabled=False, impl=impl,
        kv_cache_dtype=kv_cache_dtype, use_pcp=False, W_UK_T=w_uk_t, W_UK_T_dcp_qrep=None,
        W_UV=w_uv, _k_scale=torch.tensor(1.0), prefill_backend=None, dcp_manager=None,
        chunked_prefill_workspace_size=64)
    layer._v_up_proj = types.MethodType(MLAAttention._v_up_proj, layer)
    if impl.dcp_world_size == -1:  # vLLM 0.25 asks the DCP group at the first forward
        impl.dcp_world_size = 1
    return layer


def _dense_impl(cfg, kv_cache_dtype="auto"):
    from mla_backend.vllm.dense import MLADenseBackend

    with set_current_vllm_config(cfg):
        return MLADenseBackend.get_impl_cls()(H, 576, 0.125, 1, None, None, kv_cache_dtype,
                                              None, "decoder", None, **MLA_ARGS)


@pytest.mark.parametrize("s_q, kv", [(1, "auto"), (3, "auto"), (2, "fp8")])
def test_dense_forward_hands_the_kernel_the_decode_rows(tmp_path, monkeypatch, s_q, kv):
    from mla_backend.vllm.dense import MLADenseBackend
    from tests.cpu.vllm_env import mla_spec, planner_stand_in

    planner_stand_in(monkeypatch)
    calls = _kernel_spy(monkeypatch, "mla_decode")
    cfg = vllm_config(model_dir(tmp_path), spec_tokens=s_q - 1 if s_q > 1 else None,
                      cache_dtype=kv)
    builder = MLADenseBackend.get_builder_cls()(mla_spec(), [add_layer(cfg)], cfg,
                                                torch.device("cpu"))
    # three decode requests of s_q tokens, then a prefill the MLA prefill backend takes
    md = builder.build(0, common([s_q] * 3 + [9], [40, 130, 7, 9]))
    impl = _dense_impl(cfg, kv)
    ql_nope, q_pe = _q_parts(3 * s_q)
    cache = torch.zeros(6, 64, 576, dtype=torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16)
    layer = types.SimpleNamespace(_k_scale=torch.tensor(1.5))
    out, lse = impl.forward_mqa((ql_nope, q_pe), cache, md, layer)

    (q, kv_cache, args, kwargs), = calls
    block_table, seq_lens, plan, scale = args
    # q: the two parts as vLLM passed them, viewed [batch, s_q, H, 512 | 64], never copied
    q_nope, q_rope = q
    assert q_nope.shape == (3, s_q, H, 512) and q_rope.shape == (3, s_q, H, 64)
    assert q_nope.data_ptr() == ql_nope.data_ptr() and q_rope.data_ptr() == q_pe.data_ptr()
    assert torch.equal(q_nope.reshape(-1, H, 512), ql_nope)
    assert torch.equal(q_rope.reshape(-1, H, 64), q_pe)
    assert kv_cache is cache
    assert block_table is md.decode.block_table and seq_lens is md.decode.seq_lens
    assert seq_lens.tolist() == [40, 130, 7] and block_table[:, 0].tolist() == [7, 15, 23]
    assert plan is md.decode.plan and (plan.batch, plan.q_tokens_per_req) == (3, s_q)
    assert scale == 0.125 and kwargs["causal"] is True
    assert kwargs["kv_scale"] is (layer._k_scale if kv == "fp8" else None)
    # back to vLLM: token t of request b is row b * s_q + t
    assert out.shape == (3 * s_q, H, 512) and lse.shape == (3 * s_q, H)
    row = 3 * s_q - 1
    assert out[row, 5, 0].item() == 64 * 2 + 16 * (s_q - 1) + 5 == -lse[row, 5].item()
    assert torch.equal(out[row], out[row, :, :1].expand(H, 512))


def test_dense_forward_joins_parts_the_kernel_cannot_read_in_place(tmp_path, monkeypatch):
    """A rope part 2 bytes off 16-byte alignment reaches the kernel joined with the latent
    part into one [batch, s_q, H, 576] tensor (one copy), never as an argument error."""
    from mla_backend.vllm.dense import MLADenseBackend
    from tests.cpu.vllm_env import mla_spec, planner_stand_in

    planner_stand_in(monkeypatch)
    calls = _kernel_spy(monkeypatch, "mla_decode")
    cfg = vllm_config(model_dir(tmp_path))
    builder = MLADenseBackend.get_builder_cls()(mla_spec(), [add_layer(cfg)], cfg,
                                                torch.device("cpu"))
    md = builder.build(0, common([1, 1], [40, 130]))
    ql_nope, q_pe = _q_parts(2)
    spare = torch.empty(q_pe.numel() + 1, dtype=q_pe.dtype)
    shifted = spare[1:].view(q_pe.shape)
    shifted.copy_(q_pe)
    cache = torch.zeros(6, 64, 576, dtype=torch.bfloat16)
    _dense_impl(cfg).forward_mqa((ql_nope, shifted), cache, md, types.SimpleNamespace())
    (q, *_), = calls
    assert isinstance(q, torch.Tensor) and q.shape == (2, 1, H, 576)
    assert torch.equal(q[:, 0, :, :512], ql_nope) and torch.equal(q[:, 0, :, 512:], q_pe)


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_dense_layer_forward_through_vllm(tmp_path, monkeypatch, kv):
    """vLLM's own MLAAttention.forward_impl (the layer's decode path, run here on a layer
    holding just what it reads) with our impl: the kernel gets q = [q_nope W_UK | q_pe] of
    the decode tokens only, and its output, up-projected by W_UV, is the layer's output."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    from mla_backend.vllm.dense import MLADenseBackend
    from tests.cpu.vllm_env import mla_spec, planner_stand_in

    planner_stand_in(monkeypatch)
    calls = _kernel_spy(monkeypatch, "mla_decode")
    cfg = vllm_config(model_dir(tmp_path), cache_dtype=kv)
    builder = MLADenseBackend.get_builder_cls()(mla_spec(), [add_layer(cfg)], cfg,
                                                torch.device("cpu"))
    md = builder.build(0, common([1, 1, 1], [40, 130, 7]))
    g = torch.Generator().manual_seed(1)
    layer = _mla_layer(_dense_impl(cfg, kv), kv, g)
    q = torch.randn(3, H, 192, generator=g).to(torch.bfloat16)
    cache = torch.zeros(24, 64, 576, dtype=torch.uint8 if kv == "fp8" else torch.bfloat16)
    output = torch.full((3, H * 128), float("nan"), dtype=torch.bfloat16)
    MLAAttention.forward_impl(layer, q, torch.zeros(3, 512), torch.zeros(3, 1, 64), cache, md,
                              output)

    (kq, kv_cache, args, kwargs), = calls
    kq_nope, kq_pe = kq  # the two parts, as the layer made them (no copy joins them)
    assert kq_nope.shape == (3, 1, H, 512) and kq_pe.shape == (3, 1, H, 64)
    ql_nope = torch.bmm(q[..., :128].transpose(0, 1), layer.W_UK_T).transpose(0, 1)
    assert torch.equal(kq_nope[:, 0], ql_nope)
    assert torch.equal(kq_pe[:, 0], q[..., 128:])
    assert kq_pe.data_ptr() == q[..., 128:].data_ptr()
    # the fp8 cache reaches the kernel as float8_e4m3fn (vLLM views the uint8 storage)
    assert kv_cache.dtype == (torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16)
    assert kv_cache.data_ptr() == cache.data_ptr()
    tag = 64 * torch.arange(3)[:, None] + torch.arange(H)[None, :]
    attn = tag[..., None].expand(3, H, 512).to(torch.bfloat16)
    expect = torch.bmm(attn.transpose(0, 1), layer.W_UV).transpose(0, 1).reshape(3, H * 128)
    assert torch.equal(output, expect)


def test_dense_impl_claims(tmp_path):
    impl = _dense_impl(vllm_config(model_dir(tmp_path)))
    assert impl.can_return_lse_for_decode and impl.lse_base_on_e
    assert impl.supports_quant_query_input is False  # the fp8 kernel reads bf16 q
    if V033:
        assert impl.is_sparse is False and impl.supports_dcp and not impl.supports_pcp


# ----------------------------------------------------------------------- sparse (V3.2)


def _sparse_setup(tmp_path, monkeypatch, tokens):
    from mla_backend.vllm.sparse import MLASparseBackend
    from tests.cpu.vllm_env import mla_spec

    sparse_planner_stand_in(monkeypatch)
    if V033:
        from vllm.model_executor.layers.attention import sparse_mla_attention
        from vllm.v1.attention.ops import metadata

        monkeypatch.setattr(metadata, "compute_token_to_req_indices", token_to_req_indices_twin)
        # one GPU: no tensor-parallel group to ask here
        monkeypatch.setattr(sparse_mla_attention, "get_tensor_model_parallel_world_size",
                            lambda: 1)
    cfg = vllm_config(model_dir(tmp_path, **V32))
    topk = torch.full((tokens, 256), -1, dtype=torch.int32)
    with set_current_vllm_config(cfg):
        impl = MLASparseBackend.get_impl_cls()(H, 576, 0.125, 1, None, None, "auto", None,
                                               "decoder", None, topk_indices_buffer=topk,
                                               indexer=None, **MLA_ARGS)
        builder = MLASparseBackend.get_builder_cls()(mla_spec(), [add_layer(cfg)], cfg,
                                                     torch.device("cpu"))
    return impl, builder, topk


def _intercept_conversion(monkeypatch, impl):
    if V033:  # vLLM 0.33 converts once per step for the layers of an index group
        def convert(logical, metadata, *, block_stride_rows, return_valid_counts):
            rows = physical_topk_twin(metadata.req_id_per_token[:logical.shape[0]],
                                      metadata.block_table, logical, metadata.block_size,
                                      block_stride_rows)
            return rows, (rows >= 0).sum(1).to(torch.int32)

        monkeypatch.setattr(impl, "_convert_logical_to_physical_topk", convert)
    else:
        from mla_backend.vllm import sparse_own_path

        def convert(req_id, block_table, positions, BLOCK_SIZE, NUM_TOPK_TOKENS):
            assert NUM_TOPK_TOKENS == positions.shape[1]
            return physical_topk_twin(req_id, block_table, positions, BLOCK_SIZE, BLOCK_SIZE)

        monkeypatch.setattr(sparse_own_path, "triton_convert_req_index_to_global_index", convert)


def test_sparse_forward_hands_the_kernel_cache_slots(tmp_path, monkeypatch):
    """Two decode tokens attend to their own top-k positions; the kernel must get indices
    that address, in the cache it is given, the rows vLLM wrote those positions to — here
    in a cache whose blocks lie 128 rows apart (another layer's pages in between)."""
    impl, builder, topk = _sparse_setup(tmp_path, monkeypatch, tokens=2)
    _intercept_conversion(monkeypatch, impl)
    calls = _kernel_spy(monkeypatch, "sparse_mla_decode")
    md = builder.build(0, common([1, 1], [130, 70]))
    # request 0 (130 tokens): positions 0, 64, 129; request 1 (70 tokens): 5, 69
    topk[0, :3] = torch.tensor([0, 64, 129])
    topk[1, :2] = torch.tensor([5, 69])
    blocks = 24  # block tables hold 7..0 and 15..8 (tests.cpu.vllm_env.common)
    shared = torch.zeros(blocks, 128, 576, dtype=torch.bfloat16)
    cache = shared[:, :64] if V033 else shared[:, :64].contiguous()
    ql_nope, q_pe = _q_parts(2)
    if V033:  # what vLLM 0.33's V3.2 layer calls on the impl around the indexer
        impl.prepare_for_batch(md)
        impl.record_logical_topk_ready()
    out, lse = impl.forward_mqa((ql_nope, q_pe), cache, md, layer=None)

    (q, pages, args, kwargs), = calls
    indices, plan, scale = args
    # q: the two parts as vLLM passed them, viewed [tokens, 1, H, 512 | 64], never copied
    q_nope, q_rope = q
    assert q_nope.shape == (2, 1, H, 512) and q_rope.shape == (2, 1, H, 64)
    assert q_nope.data_ptr() == ql_nope.data_ptr() and q_rope.data_ptr() == q_pe.data_ptr()
    assert torch.equal(q_nope[:, 0], ql_nope) and torch.equal(q_rope[:, 0], q_pe)
    assert indices.shape == (2, 1, 256) and indices.dtype == torch.int32
    assert plan is md.plan and plan.batch == 2 and scale == 0.125
    assert pages.shape[1:] == (64, 576) and pages.stride()[1:] == (576, 1)
    table = md.block_table
    for token, positions in ((0, [0, 64, 129]), (1, [5, 69])):
        slots = indices[token, 0]
        assert slots[len(positions):].eq(-1).all()
        for slot, pos in zip(slots.tolist(), positions, strict=False):
            block = table[token, pos // 64].item()
            assert pages[slot // 64, slot % 64].data_ptr() == cache[block, pos % 64].data_ptr()
    assert out.shape == (2, H, 512) and out[1, 3, 0].item() == 64 + 3 == -lse[1, 3].item()


def test_sparse_forward_refuses_a_cache_our_pages_cannot_view(tmp_path, monkeypatch):
    if not V033:  # vLLM 0.25 converts with 64-token blocks and no block stride of its own
        from mla_backend.vllm import sparse_own_path

        assert not hasattr(sparse_own_path, "kv_cache_pages")
        return
    from mla_backend.vllm.sparse_common_path import kv_cache_pages

    shared = torch.zeros(4, 96, 576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="block stride 55296 is not a whole number of 64-row"):
        kv_cache_pages(shared[:, :64], 64)
    ds = torch.zeros(4, 128, 656, dtype=torch.uint8)[:, :64]
    pages = kv_cache_pages(ds, 64)
    assert pages.shape == (7, 64, 656) and pages[6, 63].data_ptr() == ds[3, 63].data_ptr()


def test_sparse_forward_with_a_long_prefill(tmp_path, monkeypatch):
    """A decode token (400 tokens) and the last 3 tokens of a 300-token prefill: every token is its own row of
    one query token, mapped through its own request's block table row."""
    impl, builder, topk = _sparse_setup(tmp_path, monkeypatch, tokens=4)
    _intercept_conversion(monkeypatch, impl)
    calls = _kernel_spy(monkeypatch, "sparse_mla_decode")
    md = builder.build(0, common([1, 3], [400, 300]))
    topk[:, 0] = torch.tensor([399, 297, 298, 299])
    cache = torch.zeros(16, 64, 576, dtype=torch.bfloat16)
    impl.forward_mqa(_q_parts(4), cache, md, layer=None)
    (q, pages, (indices, plan, _), _), = calls
    assert [t.shape for t in q] == [(4, 1, H, 512), (4, 1, H, 64)] and plan.batch == 4
    expect = [(0, 399), (1, 297), (1, 298), (1, 299)]
    for token, (req, pos) in enumerate(expect):
        slot = indices[token, 0, 0].item()
        block = md.block_table[req, pos // 64].item()
        assert pages[slot // 64, slot % 64].data_ptr() == cache[block, pos % 64].data_ptr()


def test_sparse_forward_hands_on_parts_the_kernel_cannot_read_in_place(tmp_path, monkeypatch):
    """A rope part 2 bytes off 16-byte alignment, or one whole [T, H, 576] query (vLLM joins
    the parts itself under DCP), reaches ops.sparse_mla_decode as it came, viewed one query
    token per request: the op, not the adapter, decides on a copy."""
    impl, builder, topk = _sparse_setup(tmp_path, monkeypatch, tokens=2)
    _intercept_conversion(monkeypatch, impl)
    calls = _kernel_spy(monkeypatch, "sparse_mla_decode")
    md = builder.build(0, common([1, 1], [130, 70]))
    topk[:, 0] = torch.tensor([3, 5])
    ql_nope, q_pe = _q_parts(2)
    spare = torch.empty(q_pe.numel() + 1, dtype=q_pe.dtype)
    shifted = spare[1:].view(q_pe.shape)
    shifted.copy_(q_pe)
    whole = torch.cat((ql_nope, q_pe), dim=-1)
    cache = torch.zeros(24, 64, 576, dtype=torch.bfloat16)
    for q in ((ql_nope, shifted), whole):
        if V033:
            impl.prepare_for_batch(md)
            impl.record_logical_topk_ready()
        impl.forward_mqa(q, cache, md, layer=None)
    (pair, *_), (one, *_) = calls
    assert pair[0].data_ptr() == ql_nope.data_ptr() and pair[1].data_ptr() == shifted.data_ptr()
    assert pair[1].shape == (2, 1, H, 64) and torch.equal(pair[1][:, 0], q_pe)
    assert isinstance(one, torch.Tensor) and one.shape == (2, 1, H, 576)
    assert one.data_ptr() == whole.data_ptr()


def test_sparse_layer_forward_through_vllm(tmp_path, monkeypatch):
    """vLLM's own MLAAttention.forward_impl (the layer's decode path, run here on a layer
    holding just what it reads) with our sparse impl: the kernel gets the layer's two query
    parts, q_nope W_UK and the rope columns of the projected q, as views (no copy joins
    them), and its output, up-projected by W_UV, is the layer's output."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    impl, builder, topk = _sparse_setup(tmp_path, monkeypatch, tokens=2)
    _intercept_conversion(monkeypatch, impl)
    calls = _kernel_spy(monkeypatch, "sparse_mla_decode")
    md = builder.build(0, common([1, 1], [130, 70]))
    topk[:, 0] = torch.tensor([3, 5])
    if V033:
        impl.prepare_for_batch(md)
        impl.record_logical_topk_ready()
    g = torch.Generator().manual_seed(2)
    layer = _mla_layer(impl, "auto", g)
    q = torch.randn(2, H, 192, generator=g).to(torch.bfloat16)
    cache = torch.zeros(24, 64, 576, dtype=torch.bfloat16)
    output = torch.full((2, H * 128), float("nan"), dtype=torch.bfloat16)
    MLAAttention.forward_impl(layer, q, torch.zeros(2, 512), torch.zeros(2, 1, 64), cache, md,
                              output)

    (kq, *_), = calls
    kq_nope, kq_pe = kq
    assert kq_nope.shape == (2, 1, H, 512) and kq_pe.shape == (2, 1, H, 64)
    ql_nope = torch.bmm(q[..., :128].transpose(0, 1), layer.W_UK_T).transpose(0, 1)
    assert torch.equal(kq_nope[:, 0], ql_nope)
    assert torch.equal(kq_pe[:, 0], q[..., 128:])
    assert kq_pe.data_ptr() == q[..., 128:].data_ptr()
    tag = 64 * torch.arange(2)[:, None] + torch.arange(H)[None, :]
    attn = tag[..., None].expand(2, H, 512).to(torch.bfloat16)
    expect = torch.bmm(attn.transpose(0, 1), layer.W_UV).transpose(0, 1).reshape(2, H * 128)
    assert torch.equal(output, expect)
