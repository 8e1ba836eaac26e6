"""The dense backend's decode path on CPU, against attention computed straight from SGLang's
pools: MLADenseBackend's own methods (metadata, graph buffers, the forward) with SGLang's real
ReqToTokenPool and MLATokenToKVPool; only the three kernel calls are replaced, by the ops'
own argument checks followed by the float32 reference (mla_backend.reference.mla_decode).
What this checks: the page table, key lengths and query layout the backend hands the kernel
(decode, target-verify, draft-extend v2, a graph replay with padded rows), the KV write, and
that plan / workspace calls get the step's shapes. The kernels themselves: the gpu tiers."""

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.runtime_context import get_context, get_parallel

from mla_backend import reference
from mla_backend.ops import dense as ops_dense
from mla_backend.sglang import dense

H, PAGE, CTX = 4, 64, 256
SCALE = 576 ** -0.5
# pool slot 1: pages 3, 7, 5; pool slot 3: page 2 then 8 (page 0 holds SGLang's dummy slot 0)
PAGES = {1: [3, 7, 5], 3: [2, 8]}


class KernelCalls:
    """Stands in for mla_backend.ops inside the backend: the real argument checks (CUDA
    placement aside), then the float32 reference; records what it was given."""

    D_QK, D_V = 576, 512
    DecodePlan, DecodeWorkspace = ops_dense.DecodePlan, ops_dense.DecodeWorkspace

    def __init__(self):
        self.workspaces, self.plans, self.decodes, self.queries = [], [], [], []

    def decode_workspace(self, max_batch, max_q_tokens_per_req, num_heads, *, device,
                         kv_cache_dtype=None):
        ops_dense._check_plan_sizes(max_q_tokens_per_req, num_heads, kv_cache_dtype)
        self.workspaces.append((max_batch, max_q_tokens_per_req, num_heads, kv_cache_dtype))
        return SimpleNamespace(max_batch=max_batch)

    def plan_decode(self, seq_lens, s_q, num_heads, *, kv_cache_dtype=None, workspace=None):
        ops_dense._check_plan_args(seq_lens, s_q, num_heads, kv_cache_dtype)
        assert workspace is not None
        batch = seq_lens.shape[0]
        plan = ops_dense.DecodePlan(
            batch=batch, q_tokens_per_req=s_q, num_heads=num_heads,
            kv_fp8=kv_cache_dtype == torch.float8_e4m3fn, rows_per_cta=16, unit_tokens=32,
            num_ctas=1, metadata=torch.zeros(batch + 2, dtype=torch.int32),
            partial_out=torch.empty(0), partial_lse=torch.empty(0))
        self.plans.append((seq_lens, s_q))
        return plan

    def mla_decode(self, q, kv_cache, block_table, seq_lens, plan, softmax_scale, causal=True,
                   kv_scale=None):
        ops_dense._check_decode_args(q, kv_cache, block_table, seq_lens, plan, softmax_scale,
                                     kv_scale, None)
        self.decodes.append((block_table, seq_lens))
        self.queries.append(q)
        out, lse = reference.mla_decode(q, kv_cache, block_table, seq_lens, plan,
                                        softmax_scale, causal, kv_scale)
        return out.to((q[0] if isinstance(q, tuple) else q).dtype), lse


@pytest.fixture
def calls(monkeypatch):
    kernels = KernelCalls()
    monkeypatch.setattr(dense, "ops", kernels)
    monkeypatch.setattr(ops_dense, "_require_cuda", lambda tensors, device: None)
    return kernels


def _pools():
    req = ReqToTokenPool(size=4, max_context_len=CTX, device="cpu", enable_memory_saver=False)
    for slot, pages in PAGES.items():
        pos = torch.arange(PAGE * len(pages))
        req.req_to_token[slot, :len(pos)] = (torch.tensor(pages)[pos // PAGE] * PAGE
                                             + pos % PAGE).to(torch.int32)
    kv = MLATokenToKVPool(size=PAGE * 8, page_size=PAGE, dtype=torch.bfloat16, kv_lora_rank=512,
                          qk_rope_head_dim=64, layer_num=1, device="cpu",
                          enable_memory_saver=False, start_layer=0)
    gen = torch.Generator().manual_seed(0)
    kv.kv_buffer[0].copy_(torch.randn(kv.kv_buffer[0].shape, generator=gen))
    return req, kv


def _backend(calls, draft_tokens=None):
    req, kv = _pools()
    runner = SimpleNamespace(model_config=SimpleNamespace(num_attention_heads=H),
                             req_to_token_pool=req, kv_cache_dtype=torch.bfloat16,
                             is_draft_worker=False)
    backend = dense.MLADenseBackend.__new__(dense.MLADenseBackend)
    # the parent's (FlashInfer) state that the decode path reads
    backend.device, backend.max_context_len, backend.skip_prefill = "cpu", CTX, False
    backend.token_to_kv_pool = kv
    with get_parallel().override(attn_tp_size=1, attn_dcp_size=1), \
            get_context().override_server_args(speculative_num_draft_tokens=draft_tokens or 0):
        backend.init_decode_state(runner)
    return backend


def _expected(backend, slots, key_lens, q, s_q):
    """Attention of each request's s_q queries over the pool rows of its keys, found through
    req_to_token position by position (no page table), causal within the query block."""
    cache = backend.token_to_kv_pool.kv_buffer[0][:, 0].float()
    outs = []
    for r, (slot, n) in enumerate(zip(slots, key_lens, strict=True)):
        keys = cache[backend.req_to_token[slot, :n].long()]  # [n, 576]
        for i in range(s_q):
            visible = keys[:n - s_q + i + 1]
            scores = q[r, i].float() @ visible.T * SCALE  # [H, keys]
            outs.append(torch.softmax(scores, -1) @ visible[:, :512])
    return torch.stack(outs).reshape(len(slots) * s_q, H * 512)


def _layer():
    return SimpleNamespace(layer_id=0, tp_q_head_num=H, head_dim=576, v_head_dim=512,
                           scaling=SCALE, k_scale=None)


def _batch(mode, slots, seq_lens, *, extend=None, cpu=True, loc=None):
    seq = torch.tensor(seq_lens)
    return SimpleNamespace(forward_mode=mode, batch_size=len(slots),
                           req_pool_indices=torch.tensor(slots), seq_lens=seq,
                           seq_lens_cpu=seq.clone() if cpu else None,
                           extend_seq_lens=None if extend is None else torch.tensor(extend),
                           out_cache_loc=loc)


def _query(tokens):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(tokens, H * 576, generator=gen).to(torch.bfloat16)


def _close(actual, expected):
    torch.testing.assert_close(actual.float(), expected, atol=2e-2, rtol=2e-2)


def test_decode_writes_the_new_token_and_attends_to_every_key(calls):
    backend = _backend(calls)
    slots, seq_lens = [1, 3], [150, 65]  # the new tokens at positions 149 and 64
    loc = torch.stack([backend.req_to_token[s, n - 1] for s, n in
                       zip(slots, seq_lens, strict=True)]).long()
    fb = _batch(ForwardMode.DECODE, slots, seq_lens, loc=loc)
    backend.init_forward_metadata(fb)
    k_new = torch.randn(2, 1, 576).to(torch.bfloat16)
    q = _query(2)
    out = backend.forward_decode(q, k_new, k_new[..., :512], _layer(), fb)
    assert torch.equal(backend.token_to_kv_pool.kv_buffer[0][loc], k_new)
    _close(out, _expected(backend, slots, seq_lens, q.view(2, 1, H, 576), 1))
    table, lens = calls.decodes[-1]
    assert lens.tolist() == seq_lens and table.tolist() == [[3, 7, 5], [2, 8, 0]]
    assert calls.workspaces == [(4, 1, H, None)]
    assert [(s.tolist(), q_len) for s, q_len in calls.plans] == [(seq_lens, 1)]


def test_target_verify_two_part_query(calls):
    backend = _backend(calls, draft_tokens=3)
    slots, prefix = [1, 3], [125, 61]  # 128 and 64 keys with the 3 draft tokens
    fb = _batch(ForwardMode.TARGET_VERIFY, slots, prefix)
    backend.init_forward_metadata(fb)
    q = _query(6)
    q_nope = q.view(6, H, 576)[..., :512].reshape(6, H * 512)
    q_rope = q.view(6, H, 576)[..., 512:].reshape(6, H * 64)
    out = backend.forward_extend(q_nope, None, None, _layer(), fb, save_kv_cache=False,
                                 q_rope=q_rope)
    _close(out, _expected(backend, slots, [128, 64], q.view(2, 3, H, 576), 3))
    table, lens = calls.decodes[-1]
    # the pages the kernel reads (64 keys: one page for the second request)
    assert lens.tolist() == [128, 64] and table[0].tolist() == [3, 7] and table[1, 0] == 2
    assert calls.workspaces == [(4, 3, H, None)]
    # the two parts reach the kernel as views of SGLang's tensors, not joined by a copy
    kq_nope, kq_rope = calls.queries[-1]
    assert kq_nope.shape == (2, 3, H, 512) and kq_rope.shape == (2, 3, H, 64)
    assert kq_nope.data_ptr() == q_nope.data_ptr() and kq_rope.data_ptr() == q_rope.data_ptr()


def test_unaligned_two_part_query_is_joined(calls):
    """A rope part whose rows the kernel cannot load in place (here 2 bytes off 16-byte
    alignment) reaches it joined with the latent part into one [B, s_q, H, 576] copy."""
    backend = _backend(calls, draft_tokens=3)
    slots, prefix = [1, 3], [125, 61]
    fb = _batch(ForwardMode.TARGET_VERIFY, slots, prefix)
    backend.init_forward_metadata(fb)
    q = _query(6)
    q_nope = q.view(6, H, 576)[..., :512].reshape(6, H * 512)
    spare = torch.empty(6 * H * 64 + 1, dtype=q.dtype)
    q_rope = spare[1:].view(6, H * 64)
    q_rope.copy_(q.view(6, H, 576)[..., 512:].reshape(6, H * 64))
    out = backend.forward_extend(q_nope, None, None, _layer(), fb, save_kv_cache=False,
                                 q_rope=q_rope)
    _close(out, _expected(backend, slots, [128, 64], q.view(2, 3, H, 576), 3))
    joined = calls.queries[-1]
    assert isinstance(joined, torch.Tensor) and joined.shape == (2, 3, H, 576)


def test_draft_extend_window(calls):
    backend = _backend(calls, draft_tokens=3)
    slots = [1, 3]
    # 2 and 3 accepted tokens: windows of 3 queries end at keys 131 and 66
    fb = _batch(ForwardMode.DRAFT_EXTEND_V2, slots, [130, 66], extend=[2, 3])
    backend.init_forward_metadata(fb)
    q = _query(6)
    out = backend.forward_extend(q, None, None, _layer(), fb, save_kv_cache=False)
    _close(out, _expected(backend, slots, [131, 66], q.view(2, 3, H, 576), 3))


def test_graph_replay_with_padded_rows(calls):
    backend = _backend(calls)
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    capture = _batch(ForwardMode.DECODE, [0, 0, 0, 0], [1, 1, 1, 1], cpu=False)
    backend.init_forward_metadata_out_graph(capture, in_capture=True)
    captured = backend.forward_metadata
    # replay: 2 real requests, 2 padded rows (seq_len 1, pool slot 0), no CPU mirror
    replay = _batch(ForwardMode.DECODE, [1, 3, 0, 0], [190, 128, 1, 1], cpu=False)
    backend.init_forward_metadata_out_graph(replay)
    meta = backend.forward_metadata
    # the captured launch reads the same memory, refreshed for this step
    assert meta.page_table.data_ptr() == captured.page_table.data_ptr()
    assert meta.page_table.shape == captured.page_table.shape == (4, 5)
    assert meta.cache_seqlens_int32.data_ptr() == captured.cache_seqlens_int32.data_ptr()
    assert meta.cache_seqlens_int32.tolist() == [190, 128, 1, 1]
    assert meta.page_table.tolist() == [[3, 7, 5, 0, 0], [2, 8, 0, 0, 0], [0] * 5, [0] * 5]
    q = _query(4)
    out = backend.forward_decode(q, None, None, _layer(), replay, save_kv_cache=False)
    _close(out[:2], _expected(backend, [1, 3], [190, 128], q[:2].view(2, 1, H, 576), 1))
    assert calls.plans[-1][0].data_ptr() == meta.cache_seqlens_int32.data_ptr()


def test_graph_state_grows_the_workspace(calls):
    backend = _backend(calls)
    backend.init_cuda_graph_state(max_bs=16, max_num_tokens=16)
    assert [w[0] for w in calls.workspaces] == [4, 16]


def test_idle_batch_runs_nothing(calls):
    backend = _backend(calls)
    backend.init_forward_metadata(_batch(ForwardMode.IDLE, [], []))
    assert backend.forward_metadata is None and calls.plans == []


@pytest.mark.parametrize("mode, ours", [
    (ForwardMode.DECODE, True), (ForwardMode.IDLE, True), (ForwardMode.TARGET_VERIFY, True),
    (ForwardMode.DRAFT_EXTEND_V2, True), (ForwardMode.EXTEND, False), (ForwardMode.MIXED, False),
    (ForwardMode.SPLIT_PREFILL, False)])
def test_which_modes_run_on_our_kernel(mode, ours):
    assert dense.on_decode_kernel(mode) is ours
