"""The DSA backend's attention path on CPU, against attention computed straight from SGLang's
pools: MLASparseBackend's own methods with SGLang's real ReqToTokenPool and DSATokenToKVPool
(bf16 and the 656-byte fp8 cache) and the parent's real metadata code (page_table_1); only
the kernel calls are replaced, by the ops' own argument checks followed by the float32
reference (mla_backend.reference.sparse_mla_decode), and SGLang's two Triton helpers on this
path (the KV-row scatter, verify's seqlens expansion) by torch twins. What this checks: the
slots each query token's top-k becomes (decode, extend with prefixes, target-verify, fused
and unfused top-k, padded tokens), the cache view, the query the kernel gets (any head count,
no padding), the plan, the KV write. The kernels themselves: the gpu tiers."""

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.attention import dsa_backend
from sglang.srt.layers.attention.dsa.dsa_topk_backend import DSATopKBackend, TopkTransformMethod
from sglang.srt.mem_cache import memory_pool
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.runtime_context import get_context, get_parallel

from mla_backend import formats, reference
from mla_backend.ops import sparse as ops_sparse
from mla_backend.sglang import dsa, sparse_index

PAGE, CTX, TOPK = 64, 256, 16
SCALE = 576 ** -0.5
# pool slot 1: pages 3, 7, 5; pool slot 3: page 2 then 8 (page 0 holds SGLang's dummy slot 0)
PAGES = {1: [3, 7, 5], 3: [2, 8]}


class KernelCalls:
    """Stands in for mla_backend.ops inside the backend: the real planner (host-only for the
    uniform plans the backend makes) and the real argument checks (CUDA placement aside),
    then the float32 reference; records what the kernel was given."""

    D_QK, D_V = 576, 512
    SparsePlan = ops_sparse.SparsePlan

    def __init__(self, max_groups=ops_sparse.MAX_SPARSE_GROUPS):
        self.MAX_SPARSE_GROUPS = max_groups
        self.workspaces, self.calls = [], []

    def sparse_workspace(self, max_groups, num_heads, *, device):
        ops_sparse._check_heads(num_heads)
        self.workspaces.append((max_groups, num_heads))
        return ops_sparse.SparseWorkspace(
            max_groups=max_groups, num_heads=num_heads, num_sms=132,
            metadata=torch.zeros(max_groups + 2, dtype=torch.int32),
            partial_out=torch.empty(2 * 132 * num_heads * 512),
            partial_lse=torch.empty(2 * 132 * num_heads))

    def plan_sparse_decode(self, *args, **kwargs):
        return ops_sparse.plan_sparse_decode(*args, **kwargs)

    def sparse_mla_decode(self, q, kv_cache, indices, plan, softmax_scale, topk_length=None,
                          out=None):
        ops_sparse._check_sparse_args(q, kv_cache, indices, plan, softmax_scale, topk_length,
                                      out, allow_flat=False)
        assert plan.topk_length is None and plan.uniform_units > 0
        self.calls.append(SimpleNamespace(q=q, kv=kv_cache, indices=indices, plan=plan))
        o, lse = reference.sparse_mla_decode(q, kv_cache, indices, plan, softmax_scale)
        out.copy_(o)
        return out, lse


@pytest.fixture
def calls(monkeypatch):
    kernels = KernelCalls()
    monkeypatch.setattr(dsa, "ops", kernels)
    monkeypatch.setattr(ops_sparse, "_require_cuda", lambda tensors, device: None)
    return kernels


@pytest.fixture(autouse=True)
def sglang_context():
    with get_parallel().override(attn_tp_size=1, attn_dcp_size=1, attn_cp_size=1), \
            get_context().override_server_args(enable_dsa_prefill_context_parallel=False):
        yield


def _pools(fp8: bool):
    req = ReqToTokenPool(size=4, max_context_len=CTX, device="cpu", enable_memory_saver=False)
    for slot, pages in PAGES.items():
        pos = torch.arange(PAGE * len(pages))
        req.req_to_token[slot, :len(pos)] = (torch.tensor(pages)[pos // PAGE] * PAGE
                                             + pos % PAGE).to(torch.int32)
    kv = DSATokenToKVPool(size=PAGE * 8, page_size=PAGE, kv_lora_rank=512,
                          dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
                          qk_rope_head_dim=64, layer_num=1, device="cpu", index_head_dim=128,
                          enable_memory_saver=False, kv_cache_dim=656 if fp8 else 576)
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(kv.kv_buffer[0].shape[0], 576, generator=gen).to(torch.bfloat16)
    if fp8:  # SGLang's fp8 writer is Triton-only: the bytes formats.py says it writes
        kv.kv_buffer[0].copy_(formats.quantize_fp8_ds_mla(rows[:, :512], rows[:, 512:])
                              .unsqueeze(1))
    else:
        kv.kv_buffer[0].copy_(rows.unsqueeze(1))
    return req, kv


def _backend(fp8=False, fused=False, heads=4, draft_tokens=0):
    """MLASparseBackend with the parent's state its metadata and forward read (the parent's
    __init__ asks CUDA for the device capability), then our own init_sparse_state."""
    req, kv = _pools(fp8)
    backend = dsa.MLASparseBackend.__new__(dsa.MLASparseBackend)
    backend.device, backend.real_page_size, backend.max_context_len = "cpu", PAGE, CTX
    backend.dsa_kv_cache_store_fp8 = kv.dsa_kv_cache_store_fp8
    backend.dsa_index_topk, backend.num_q_heads, backend.kv_cache_dim = TOPK, heads, \
        kv.kv_cache_dim
    backend.req_to_token_pool, backend.req_to_token = req, req.req_to_token
    backend.token_to_kv_pool, backend.hisparse_coordinator = kv, None
    backend.dsa_prefill_impl = backend.dsa_decode_impl = "flashmla_kv"  # replaced below
    backend.dsa_topk_backend = DSATopKBackend("torch")
    backend._arange_buf = torch.arange(1024, dtype=torch.int32)
    backend.speculative_num_draft_tokens, backend.topk = draft_tokens, 0
    backend.use_fused_topk = fused
    runner = SimpleNamespace(kv_cache_dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    backend.init_sparse_state(runner)
    return backend


def _layer(heads=4):
    return SimpleNamespace(layer_id=0, tp_q_head_num=heads, head_dim=576, v_head_dim=512,
                           scaling=SCALE, is_cross_attention=False)


def _batch(mode, slots, seq_lens, *, extend=None, prefix=None, loc=None):
    seq = torch.tensor(seq_lens)
    fb = SimpleNamespace(forward_mode=mode, batch_size=len(slots),
                         req_pool_indices=torch.tensor(slots), seq_lens=seq,
                         seq_lens_cpu=seq.clone(), seq_lens_sum=int(seq.sum()), spec_info=None,
                         global_num_tokens_cpu=None, out_cache_loc=loc)
    if extend is not None:
        fb.extend_seq_lens, fb.extend_seq_lens_cpu = torch.tensor(extend), list(extend)
        fb.extend_prefix_lens, fb.extend_prefix_lens_cpu = torch.tensor(prefix), list(prefix)
        fb.extend_num_tokens = sum(extend)
    return fb


def _query(tokens, heads=4, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, heads * 576, generator=gen).to(torch.bfloat16)


def _pool_keys(backend):
    """Every pool slot's key as float32 [slots, 576], read back from the pool's own bytes."""
    buf = backend.token_to_kv_pool.kv_buffer[0][:, 0]
    if backend.kv_fp8:
        return formats.dequantize_fp8_ds_mla(buf.view(torch.uint8))
    return buf.float()


def _expected(backend, slot_of_token, positions, q, heads=4):
    """Attention of each query token over the pool rows of its top-k positions, found
    position by position through req_to_token (no page table, no mapping code). Positions
    past the step's page_table_1 (as wide as its longest request) are none."""
    keys_all = _pool_keys(backend)
    width = backend.forward_metadata.page_table_1.shape[1]
    outs = []
    for t, (slot, pos) in enumerate(zip(slot_of_token, positions, strict=True)):
        chosen = [p for p in pos if 0 <= p < width]
        keys = keys_all[backend.req_to_token[slot, chosen].long()]
        scores = q.view(-1, heads, 576)[t].float() @ keys.T * SCALE
        outs.append(torch.softmax(scores, -1) @ keys[:, :512])
    return torch.stack(outs).reshape(len(positions), heads * 512)


def _close(actual, expected):
    torch.testing.assert_close(actual.float(), expected, atol=2e-2, rtol=2e-2)


def _topk(rows):
    return torch.tensor([r + [-1] * (TOPK - len(r)) for r in rows], dtype=torch.int32)


# decode: request at pool slot 1 with 150 keys, at slot 3 with 65 keys; -1 pads, an
# out-of-table position (300) is skipped
DECODE_POS = [[149, 0, 63, 64, 127, 128, 148], [64, 0, 63, 300, 10]]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_decode_positions_become_slots(calls, fp8):
    backend = _backend(fp8=fp8)
    fb = _batch(ForwardMode.DECODE, [1, 3], [150, 65])
    backend.init_forward_metadata(fb)
    q = _query(2)
    out = backend.forward_decode(q, None, None, _layer(), fb, save_kv_cache=False,
                                 topk_indices=_topk(DECODE_POS))
    _close(out, _expected(backend, [1, 3], DECODE_POS, q))
    call = calls.calls[-1]
    # slot = page * 64 + offset: position 149 of slot 1 is page 5, row 21
    assert call.indices[0, 0, :7].tolist() == [5 * 64 + 21, 3 * 64, 3 * 64 + 63, 7 * 64,
                                              7 * 64 + 63, 5 * 64, 5 * 64 + 20]
    assert call.indices[1, 0, :6].tolist() == [8 * 64, 2 * 64, 2 * 64 + 63, -1, 2 * 64 + 10, -1]
    assert call.kv.shape == (9, 64, 656 if fp8 else 576)
    assert call.kv.dtype == (torch.uint8 if fp8 else torch.bfloat16)
    assert (call.plan.batch, call.plan.q_tokens_per_req, call.plan.topk) == (2, 1, TOPK)


def test_fused_topk_slots_pass_through(calls):
    backend = _backend(fused=True)
    fb = _batch(ForwardMode.DECODE, [1, 3], [150, 65])
    backend.init_forward_metadata(fb)
    # what the fused top-k kernel writes: req_to_token values, -1 for none
    slots = _topk([[backend.req_to_token[s, p].item() if 0 <= p < 150 else -1 for p in row]
                   for s, row in zip([1, 3], DECODE_POS, strict=True)])
    q = _query(2)
    out = backend.forward_decode(q, None, None, _layer(), fb, save_kv_cache=False,
                                 topk_indices=slots)
    _close(out, _expected(backend, [1, 3], DECODE_POS, q))
    assert torch.equal(calls.calls[-1].indices.squeeze(1), slots)


def test_extend_with_prefix_maps_each_token_to_its_request(calls):
    # request at slot 1: prefix 127, 3 new tokens (positions 127-129); slot 3: prefix 64, 2
    backend = _backend()
    fb = _batch(ForwardMode.EXTEND, [1, 3], [130, 66], extend=[3, 2], prefix=[127, 64])
    backend.init_forward_metadata(fb)
    assert backend.use_mha is False
    positions = [[127, 0, 64], [128, 127, 1, 2], [129, 128, 127, 63, 64],
                 [64, 0, 1], [65, 64, 63]]
    q = _query(5)
    out = backend.forward_extend(q, None, None, _layer(), fb, save_kv_cache=False,
                                 topk_indices=_topk(positions))
    _close(out, _expected(backend, [1, 1, 1, 3, 3], positions, q))


@pytest.mark.parametrize("parts", [False, True], ids=["whole", "two parts"])
def test_extend_beyond_one_kernel_call_is_split(monkeypatch, parts):
    kernels = KernelCalls(max_groups=2)
    monkeypatch.setattr(dsa, "ops", kernels)
    monkeypatch.setattr(ops_sparse, "_require_cuda", lambda tensors, device: None)
    backend = _backend()
    fb = _batch(ForwardMode.EXTEND, [1, 3], [130, 66], extend=[3, 2], prefix=[127, 64])
    backend.init_forward_metadata(fb)
    positions = [[127, 0], [128, 5], [129, 64], [64, 1], [65, 2]]
    q = _query(5)
    query = dict(q=q)
    if parts:  # SGLang's latent and rope parts: each call gets its tokens' rows of both
        query = dict(q=q.view(5, 4, 576)[..., :512].reshape(5, 4 * 512),
                     q_rope=q.view(5, 4, 576)[..., 512:].reshape(5, 4 * 64))
    out = backend.forward_extend(query.pop("q"), None, None, _layer(), fb, save_kv_cache=False,
                                 topk_indices=_topk(positions), **query)
    _close(out, _expected(backend, [1, 1, 1, 3, 3], positions, q))
    assert [c.plan.batch for c in kernels.calls] == [2, 2, 1]
    assert all(isinstance(c.q, tuple) is parts for c in kernels.calls)


def _seqlens_expand(extend_seq_lens, seq_lens, total_len, max_q_len):
    """Torch twin of SGLang's Triton seqlens_expand (the indexer's lengths per query)."""
    return torch.cat([torch.arange(int(s) - int(e) + 1, int(s) + 1, dtype=torch.int32)
                      for e, s in zip(extend_seq_lens, seq_lens, strict=True)])


def test_target_verify_reads_the_expanded_table(calls, monkeypatch):
    monkeypatch.setattr(dsa_backend, "seqlens_expand_triton", _seqlens_expand)
    backend = _backend(draft_tokens=3)
    # prefixes 125 and 61 (SGLang's verify seq_lens exclude the 3 draft tokens)
    fb = _batch(ForwardMode.TARGET_VERIFY, [1, 3], [125, 61])
    backend.init_forward_metadata(fb)
    assert backend.forward_metadata.page_table_1.shape[0] == 6
    positions = [[125, 0], [126, 125, 64], [127, 126, 125, 128],
                 [61, 0], [62, 61], [63, 62, 61, 60]]
    q = _query(6)
    q_nope = q.view(6, 4, 576)[..., :512].reshape(6, 4 * 512)
    q_rope = q.view(6, 4, 576)[..., 512:].reshape(6, 4 * 64)
    out = backend.forward_extend(q_nope, None, None, _layer(), fb, save_kv_cache=False,
                                 q_rope=q_rope, topk_indices=_topk(positions))
    _close(out, _expected(backend, [1, 1, 1, 3, 3, 3], positions, q))
    # the two parts reach the kernel as views of SGLang's tensors (no copy joins them)
    kq_nope, kq_rope = calls.calls[-1].q
    assert kq_nope.shape == (6, 1, 4, 512) and kq_rope.shape == (6, 1, 4, 64)
    assert kq_nope.data_ptr() == q_nope.data_ptr() and kq_rope.data_ptr() == q_rope.data_ptr()
    # one table row per query token, as wide as the longest request (128 keys): position
    # 128 is outside it (none); position 60 of the second request is page 2, row 60
    assert calls.calls[-1].indices[2, 0, :4].tolist() == [7 * 64 + 63, 7 * 64 + 62,
                                                         7 * 64 + 61, -1]
    assert calls.calls[-1].indices[5, 0, 3].item() == 2 * 64 + 60


@pytest.mark.parametrize("heads", [1, 20, 128])
def test_any_head_count_reaches_the_kernel_unpadded(calls, heads):
    backend = _backend(heads=heads)
    fb = _batch(ForwardMode.DECODE, [1, 3], [150, 65])
    backend.init_forward_metadata(fb)
    q = _query(2, heads)
    out = backend.forward_decode(q, None, None, _layer(heads), fb, save_kv_cache=False,
                                 topk_indices=_topk(DECODE_POS))
    assert calls.calls[-1].q.shape == (2, 1, heads, 576)
    assert calls.workspaces[-1] == (ops_sparse.MAX_SPARSE_GROUPS, heads)
    _close(out, _expected(backend, [1, 3], DECODE_POS, q, heads))


def test_padded_query_tokens_get_no_keys(calls):
    # SGLang pads the query for data-parallel attention after the indexer ran: 2 rows of
    # indices for 3 query tokens; the third attends to nothing (output 0)
    backend = _backend()
    fb = _batch(ForwardMode.DECODE, [1, 3], [150, 65])
    backend.init_forward_metadata(fb)
    q = _query(3)
    out = backend.forward_decode(q, None, None, _layer(), fb, save_kv_cache=False,
                                 topk_indices=_topk(DECODE_POS))
    _close(out[:2], _expected(backend, [1, 3], DECODE_POS, q[:2]))
    assert calls.calls[-1].indices[2].eq(-1).all() and out[2].eq(0).all()


def _torch_row_scatter(kv_buffer, loc, cache_k_nope, cache_k_rope):
    """Torch twin of SGLang's Triton MLA row scatter: byte rows [nope | rope] at loc."""
    nope = cache_k_nope.reshape(loc.shape[0], -1).view(torch.uint8)
    rope = cache_k_rope.reshape(loc.shape[0], -1).view(torch.uint8)
    kv_buffer.view(torch.uint8)[loc.long(), 0] = torch.cat([nope, rope], dim=-1)


def test_decode_writes_the_new_token_first(calls, monkeypatch):
    monkeypatch.setattr(memory_pool, "set_mla_kv_buffer_triton", _torch_row_scatter)
    backend = _backend()
    fb = _batch(ForwardMode.DECODE, [1, 3], [150, 65])
    fb.out_cache_loc = torch.stack([backend.req_to_token[1, 149],
                                    backend.req_to_token[3, 64]]).long()
    backend.init_forward_metadata(fb)
    k_nope = torch.randn(2, 1, 512).to(torch.bfloat16)
    k_rope = torch.randn(2, 1, 64).to(torch.bfloat16)
    q = _query(2)
    out = backend.forward_decode(q, k_nope, k_nope, _layer(), fb, k_rope=k_rope,
                                 topk_indices=_topk(DECODE_POS))
    written = backend.token_to_kv_pool.kv_buffer[0][fb.out_cache_loc, 0]
    assert torch.equal(written, torch.cat([k_nope, k_rope], -1)[:, 0])
    _close(out, _expected(backend, [1, 3], DECODE_POS, q))


def test_off_by_one_mapping_fails_the_comparison(calls, monkeypatch):
    # negative control: a mapping that reads the next slot must not pass this tier's check
    real = sparse_index.slots_from_positions

    def shifted(page_table_1, positions, rows):
        slots = real(page_table_1, positions, rows)
        return torch.where(slots >= 0, slots + 1, slots)

    monkeypatch.setattr(sparse_index, "slots_from_positions", shifted)
    backend = _backend()
    fb = _batch(ForwardMode.DECODE, [1, 3], [150, 65])
    backend.init_forward_metadata(fb)
    q = _query(2)
    out = backend.forward_decode(q, None, None, _layer(), fb, save_kv_cache=False,
                                 topk_indices=_topk(DECODE_POS))
    with pytest.raises(AssertionError):
        _close(out, _expected(backend, [1, 3], DECODE_POS, q))


def test_every_batch_is_sparse_and_every_index_a_slot(calls):
    backend = _backend()
    backend.set_dsa_prefill_impl(None)
    assert backend.use_mha is False
    for mode in (ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
        assert backend.get_topk_transform_method(mode) == TopkTransformMethod.PAGED
    # the parent's metadata is steered off FlashMLA's tile schedule
    assert (backend.dsa_prefill_impl, backend.dsa_decode_impl) == ("flashmla_sparse",) * 2


def test_missing_topk_is_an_error(calls):
    backend = _backend()
    fb = _batch(ForwardMode.DECODE, [1, 3], [150, 65])
    backend.init_forward_metadata(fb)
    with pytest.raises(ValueError, match="got no top-k indices"):
        backend.forward_decode(_query(2), None, None, _layer(), fb, save_kv_cache=False)


def test_graph_replay_with_padded_rows(calls):
    # SGLang's decode graph: metadata out of the graph into the parent's static buffers
    # (capture, then every replay); padded rows come with seq_len 1 at pool slot 0 and
    # top-k -1
    backend = _backend()
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    capture = _batch(ForwardMode.DECODE, [0, 0, 0, 0], [1, 1, 1, 1])
    capture.seq_lens_cpu = None
    backend.init_forward_metadata_out_graph(capture, in_capture=True)
    captured_table = backend.forward_metadata.page_table_1
    q = _query(4)
    backend.forward_decode(q, None, None, _layer(), capture, save_kv_cache=False,
                           topk_indices=_topk([[0]] * 4))
    replay = _batch(ForwardMode.DECODE, [1, 3, 0, 0], [150, 65, 1, 1])
    replay.seq_lens_cpu = None
    backend.init_forward_metadata_out_graph(replay)
    table = backend.forward_metadata.page_table_1
    assert table.data_ptr() == captured_table.data_ptr()
    out = backend.forward_decode(q, None, None, _layer(), replay, save_kv_cache=False,
                                 topk_indices=_topk(DECODE_POS + [[], []]))
    _close(out[:2], _expected(backend, [1, 3], DECODE_POS, q[:2]))
    assert out[2:].eq(0).all()
    # one plan for the graph's 4 rows, made once (host-only, uniform: no planner kernel)
    assert calls.calls[0].plan is calls.calls[-1].plan and calls.calls[-1].plan.batch == 4
