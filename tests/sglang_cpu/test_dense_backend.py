"""The dense backend's decode path on CPU, against attention computed straight from SGLang's
pools: MLADenseBackend's own methods (metadata, graph buffers, the forward) with SGLang's real
ReqToTokenPool and MLATokenToKVPool; only the three kernel calls are replaced, by the ops'
own argument checks followed by the float32 reference (mla_backend.reference.mla_decode).
What this checks: the page table, key lengths and query layout the backend hands the kernel
(decode, target-verify, draft-extend v2, a graph replay with padded rows), the KV write, and
that plan / workspace calls get the step's shapes; under CUDA graphs, where the plan is made
(in-graph on the side stream, stood in for by SideLog, or by the step's first decode layer) and
that each fork is joined once, before the first decode. The kernels themselves: the gpu tiers.
"""

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
        self.log = []  # "plan" and "decode" in call order (SideLog adds its fork and joins)

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
        self.log.append("plan")
        return plan

    def mla_decode(self, q, kv_cache, block_table, seq_lens, plan, softmax_scale, causal=True,
                   kv_scale=None):
        ops_dense._check_decode_args(q, kv_cache, block_table, seq_lens, plan, softmax_scale,
                                     kv_scale, None)
        self.decodes.append((block_table, seq_lens))
        self.queries.append(q)
        self.log.append("decode")
        out, lse = reference.mla_decode(q, kv_cache, block_table, seq_lens, plan,
                                        softmax_scale, causal, kv_scale)
        return out.to((q[0] if isinstance(q, tuple) else q).dtype), lse


class SideLog:
    """Stands in for dense.SideStream (CPU has no streams): runs the block in place and logs
    the fork, the block's end and each join (with the event it waits on) into calls.log."""

    def __init__(self, log):
        self.log, self.forks = log, 0

    def run(self, fn):
        self.log.append("fork")
        result = fn()
        self.log.append("fork end")
        self.forks += 1
        return result, f"event {self.forks}"

    def join(self, done):
        self.log.append(("join", done))


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


def _graph_backend(calls):
    backend = _backend(calls)
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    assert backend._side is None  # no CUDA stream on CPU: in-graph plans on the stream
    backend._side = SideLog(calls.log)
    return backend


def _two_layers(backend, fb, tokens):
    q = _query(tokens)
    return q, [backend.forward_decode(q, None, None, _layer(), fb, save_kv_cache=False)
               for _ in range(2)]


def test_graph_plan_in_graph_on_the_side_stream(calls):
    """SGLang's decode graph runner: out-of-graph metadata once, then in-graph metadata and the
    forward per run (two warmups and the capture); each run forks the plan, made from the
    static key lengths, and its first decode layer (only) joins it before the kernel."""
    backend = _graph_backend(calls)
    fb = _batch(ForwardMode.DECODE, [1, 3, 0, 0], [190, 128, 1, 1], cpu=False)
    backend.init_forward_metadata_out_graph(fb, in_capture=True)
    # out of the graph: the key lengths and the page table, no plan
    assert calls.plans == [] and backend.forward_metadata.plan is None
    assert backend.forward_metadata.cache_seqlens_int32.tolist() == [190, 128, 1, 1]
    for _ in range(3):  # two warmups and the capture
        backend.init_forward_metadata_in_graph(fb)
        lens, s_q = calls.plans[-1]
        assert lens.data_ptr() == backend._graph_key_lens.data_ptr() and s_q == 1
        assert backend.forward_metadata.plan is not None
        q, (out, _) = _two_layers(backend, fb, 4)
        _close(out[:2], _expected(backend, [1, 3], [190, 128], q[:2].view(2, 1, H, 576), 1))
    step = ["fork", "plan", "fork end"]
    assert calls.log == [*step, ("join", "event 1"), "decode", "decode",
                         *step, ("join", "event 2"), "decode", "decode",
                         *step, ("join", "event 3"), "decode", "decode"]


def test_out_graph_alone_plans_at_the_first_decode_layer(calls):
    """A caller that runs the out-of-graph metadata and then the forward, with no in-graph
    call: the first decode layer plans this step's lengths (not the last in-graph plan's),
    on the stream, once."""
    backend = _graph_backend(calls)
    first = _batch(ForwardMode.DECODE, [1, 3], [190, 128], cpu=False)
    backend.init_forward_metadata_out_graph(first)
    backend.init_forward_metadata_in_graph(first)
    _two_layers(backend, first, 2)
    calls.log.clear()
    second = _batch(ForwardMode.DECODE, [3, 1], [70, 150], cpu=False)
    backend.init_forward_metadata_out_graph(second)
    assert backend.forward_metadata.plan is None
    q, (out, _) = _two_layers(backend, second, 2)
    assert calls.log == ["plan", "decode", "decode"]  # no fork, no join
    assert calls.plans[-1][0].tolist() == [70, 150]
    _close(out, _expected(backend, [3, 1], [70, 150], q.view(2, 1, H, 576), 1))


def test_unjoined_fork_is_joined_before_the_next_metadata(calls):
    """A fork that no decode layer joined (its forward ran none) is joined before the next
    step's metadata rewrites the buffers it reads, out of the graph and eagerly; in-graph
    metadata after eager metadata changes nothing."""
    backend = _graph_backend(calls)
    fb = _batch(ForwardMode.DECODE, [1, 3], [190, 128], cpu=False)
    backend.init_forward_metadata_out_graph(fb)
    backend.init_forward_metadata_in_graph(fb)
    backend.init_forward_metadata_out_graph(fb)
    assert calls.log == ["fork", "plan", "fork end", ("join", "event 1")]
    backend.init_forward_metadata_in_graph(fb)
    backend.init_forward_metadata(_batch(ForwardMode.DECODE, [1, 3], [191, 129]))
    eager = backend.forward_metadata
    backend.init_forward_metadata_in_graph(fb)
    assert backend.forward_metadata is eager
    _two_layers(backend, fb, 2)
    assert calls.log[4:] == ["fork", "plan", "fork end", ("join", "event 2"), "plan",
                             "decode", "decode"]
    assert calls.decodes[-1][1].tolist() == [191, 129]


def test_graph_idle_batch_forks_nothing(calls):
    backend = _graph_backend(calls)
    idle = _batch(ForwardMode.IDLE, [], [], cpu=False)
    backend.init_forward_metadata_out_graph(idle)
    backend.init_forward_metadata_in_graph(idle)
    assert backend.forward_metadata is None and calls.log == []


def test_two_batch_overlap_parent_forks_nothing(calls):
    """A two-batch-overlap parent's attention runs on its children's backends: no fork that no
    decode layer would join; a layer that runs on the parent after all plans for itself."""
    backend = _graph_backend(calls)
    fb = _batch(ForwardMode.DECODE, [1, 3], [190, 128], cpu=False)
    fb.tbo_children = [SimpleNamespace(), SimpleNamespace()]
    backend.init_forward_metadata_out_graph(fb)
    backend.init_forward_metadata_in_graph(fb)
    assert calls.log == [] and backend.forward_metadata.plan is None
    _two_layers(backend, fb, 2)
    assert calls.log == ["plan", "decode", "decode"]


def test_breakable_graph_plans_out_of_the_graph(calls, monkeypatch):
    """SGLang's breakable graphs run attention eagerly between captured segments, reading the
    metadata of the replay: the out-of-graph call plans and the in-graph call adds nothing."""
    backend = _graph_backend(calls)
    monkeypatch.setattr(dense, "is_in_breakable_cuda_graph", lambda: True)
    fb = _batch(ForwardMode.TARGET_VERIFY, [1, 3], [125, 61], cpu=False)
    backend.num_draft_tokens = 3
    backend.init_forward_metadata_out_graph(fb)
    assert calls.log == ["plan"] and calls.plans[-1][1] == 3
    assert calls.plans[-1][0].data_ptr() == backend._graph_key_lens.data_ptr()
    backend.init_forward_metadata_in_graph(fb)
    assert calls.log == ["plan"]


def test_side_stream_forks_after_the_stream_and_joins_on_its_event(monkeypatch):
    """dense.SideStream against a stand-in torch.cuda that logs the calls: the side stream
    waits for the current one, the block runs on the side stream, then its event is recorded
    there; join waits on that event from the current stream."""
    log = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(f"{self.name} waits for {other.name}")

        def wait_event(self, event):
            log.append(f"{self.name} waits on {event.name}")

    class Event:
        name = "event"

        def record(self, stream):
            log.append(f"event recorded on {stream.name}")

    class StreamContext:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            log.append(f"enter {self.stream.name}")

        def __exit__(self, *exc):
            log.append(f"exit {self.stream.name}")

    main = Stream("main")
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: Stream("side"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: main)
    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    side = dense.SideStream("cuda")
    result, done = side.run(lambda: log.append("block") or "plan")
    side.join(done)
    assert result == "plan" and log == [
        "side waits for main", "enter side", "block", "event recorded on side", "exit side",
        "main waits on event"]
