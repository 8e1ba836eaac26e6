"""Dense MLA (DeepSeek-V2/V3/R1) on mla_backend's decode kernel, for SGLang 0.5.17.

What runs where: plain extends (prefill, chunked prefill, mixed batches) stay
on SGLang's FlashInfer MLA code, the parent class, exactly as SGLang's `flashmla` backend does
it. Decode, target-verify (EAGLE chain verify, s_q = num_draft_tokens <= 8) and draft-extend
v2 (a fixed window of num_draft_tokens queries) run on `ops.mla_decode`, with one
`ops.plan_decode` per step shared by every layer (no host sync).

CUDA graphs (SGLang's out-of-graph / in-graph metadata API): `init_forward_metadata_out_graph`
runs on the stream before capture and before every replay, outside the graph. It writes the
key lengths and the page table into buffers whose addresses never change (`init_cuda_graph_state`
allocates them); the page table stays out of the graph because it reads req_to_token, whose
reads SGLang's decode runner declares done before the replay. `init_forward_metadata_in_graph`,
captured in the graph, makes the step's plan into a DecodeWorkspace on a side stream forked at
the start of the graph, so the planner kernel runs beside the model's first layer; the step's
first decode layer waits for it (the graph's fork and join). Where no in-graph call follows the
out-of-graph one before a forward, the first decode layer makes the plan, on the stream. Under
SGLang's breakable graphs, whose attention runs eagerly between captured segments, the
out-of-graph call makes the plan itself.
Padded graph rows arrive with seq_len 1 (get_cuda_graph_seq_len_fill_value) and attend to one
key of their (valid) request slot; their output is discarded by SGLang.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import partial

import torch
from sglang.srt.layers.attention.flashinfer_mla_backend import FlashInferMLAAttnBackend
from sglang.srt.layers.attention.verify_mask import maybe_create_verify_mask
from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import (
    is_in_breakable_cuda_graph,
)
from sglang.srt.runtime_context import get_parallel, get_spec

from .. import ops
from ..ops import rows_in_place
from . import metadata
from .support import FP8_CACHE, NAME, PAGE_SIZE

logger = logging.getLogger("sglang.mla_backend")


def on_decode_kernel(mode) -> bool:
    """Whether a ForwardMode runs on our decode kernel (the rest goes to FlashInfer MLA)."""
    return mode.is_decode_or_idle() or mode.is_target_verify() or mode.is_draft_extend_v2()


@dataclass
class DecodeMetadata:
    plan: ops.DecodePlan | None  # None: not made yet (the step's first decode layer makes it)
    page_table: torch.Tensor  # int32 [bs, pages]: page ids of each request's keys
    cache_seqlens_int32: torch.Tensor  # int32 [bs]: keys per request, queries included
    q_tokens: int  # query tokens per request (s_q)


class SideStream:
    """A CUDA stream beside the current one: run() forks work onto it, join() waits for it."""

    def __init__(self, device):
        self.stream = torch.cuda.Stream(device=device)

    def run(self, fn):
        """fn() on this stream after the work enqueued so far on the current stream (in a
        capture, a branch of the graph); returns fn's result and the event join() waits on."""
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            result = fn()
            done = torch.cuda.Event()
            done.record(self.stream)
        return result, done

    @staticmethod
    def join(done) -> None:
        """The current stream waits for run()'s work (in a capture, the graph's join)."""
        torch.cuda.current_stream().wait_event(done)


def decode_query(q: torch.Tensor, q_rope: torch.Tensor | None, batch: int, s_q: int,
                 heads: int):
    """The query as ops.mla_decode takes it: [batch, s_q, H, 576], or, when SGLang hands it in
    two parts (absorbed latent [T, H*512] and rope [T, H*64]: our name is in
    FORWARD_ABSORB_CORE_ATTENTION_BACKENDS), the pair of views read where they lie, no copy.
    A part whose rows the kernel cannot load in place (16-byte aligned rows and strides) is
    joined by a copy instead."""
    if q_rope is None:
        return q.view(batch, s_q, heads, ops.D_QK)
    parts = (q.view(batch, s_q, heads, ops.D_V),
             q_rope.view(batch, s_q, heads, ops.D_QK - ops.D_V))
    if all(rows_in_place(t) for t in parts):
        return parts
    return torch.cat(parts, dim=-1)


class MLADenseBackend(FlashInferMLAAttnBackend):
    # Decode metadata is built on the GPU from seq_lens; only the parent's extend reads the
    # CPU mirror, which extend batches always carry.
    needs_cpu_seq_lens: bool = False

    def __init__(self, model_runner, skip_prefill: bool = False, kv_indptr_buf=None,
                 q_indptr_decode_buf=None):
        super().__init__(model_runner, skip_prefill, kv_indptr_buf, q_indptr_decode_buf)
        self.init_decode_state(model_runner)

    def init_decode_state(self, model_runner) -> None:
        """What our decode path keeps, beside the parent's (FlashInfer) state: heads, cache
        dtype, draft tokens, the plan workspace, the page-table buffers."""
        config = model_runner.model_config
        self.num_q_heads = config.num_attention_heads // get_parallel().attn_tp_size
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.kv_fp8 = model_runner.kv_cache_dtype == FP8_CACHE
        self.num_draft_tokens = get_spec().speculative_num_draft_tokens or None
        self.max_q_tokens = self.num_draft_tokens or 1
        self.is_draft_runner = model_runner.is_draft_worker
        self.workspace = self._workspace(model_runner.req_to_token_pool.size)
        self._eager_page_table = None
        self._graph_page_table = None
        self._graph_key_lens = None
        self._graph_step = None  # the out-of-graph metadata that in-graph plans for
        self._side = None  # SideStream of the in-graph plan (CUDA only)
        self._pending_plan = None  # its event, until a decode layer waits on it
        self._verify_mask = None
        logger.info("%s: dense MLA decode on %s kernels (%d query heads, cache %s, up to %d "
                    "query tokens per request)", NAME, NAME, self.num_q_heads,
                    model_runner.kv_cache_dtype, self.max_q_tokens)

    def _workspace(self, max_batch: int) -> ops.DecodeWorkspace:
        return ops.decode_workspace(max(1, max_batch), self.max_q_tokens, self.num_q_heads,
                                    device=self.device,
                                    kv_cache_dtype=FP8_CACHE if self.kv_fp8 else None)

    # ---- metadata ------------------------------------------------------------------------

    def _plan(self, key_lens: torch.Tensor, s_q: int) -> ops.DecodePlan:
        return ops.plan_decode(key_lens, s_q, self.num_q_heads,
                               kv_cache_dtype=FP8_CACHE if self.kv_fp8 else None,
                               workspace=self.workspace)

    def _max_keys(self, seq_lens_cpu, bs: int, s_q: int, mode) -> int:
        """Host bound on the keys of this step (sizes the page table): the CPU mirror when
        SGLang publishes it, else the context length (no device-to-host copy)."""
        extra = 0 if mode.is_decode_or_idle() else s_q
        if seq_lens_cpu is not None and bs > 0:
            return int(seq_lens_cpu[:bs].max()) + extra
        return self.max_context_len + extra

    def _eager_table(self, bs: int, columns: int) -> torch.Tensor:
        buf = self._eager_page_table
        if buf is None or buf.shape[0] < bs or buf.shape[1] < columns:
            rows = bs if buf is None else max(bs, buf.shape[0])
            cols = columns if buf is None else max(columns, buf.shape[1])
            buf = torch.zeros((rows, cols), dtype=torch.int32, device=self.device)
            self._eager_page_table = buf
        return buf[:bs, :columns]

    def _join_plan(self) -> None:
        """The stream waits for the in-graph plan on the side stream, if one is pending."""
        if self._pending_plan is not None:
            done, self._pending_plan = self._pending_plan, None
            self._side.join(done)

    def init_forward_metadata(self, forward_batch):
        mode = forward_batch.forward_mode
        if not on_decode_kernel(mode):
            return super().init_forward_metadata(forward_batch)
        self._join_plan()  # a side-stream plan no layer waited for still writes the workspace
        self._graph_step = None
        bs = forward_batch.batch_size
        if bs == 0:  # an idle batch runs no attention
            self.forward_metadata = None
            return None
        s_q = metadata.query_tokens(mode, self.num_draft_tokens)
        key_lens = metadata.key_lengths(mode, forward_batch.seq_lens[:bs], self.num_draft_tokens,
                                        forward_batch.extend_seq_lens)
        columns = metadata.pages_for(self._max_keys(forward_batch.seq_lens_cpu, bs, s_q, mode))
        table = metadata.fill_page_table(self.req_to_token, forward_batch.req_pool_indices,
                                         self._eager_table(bs, columns))
        self.forward_metadata = DecodeMetadata(self._plan(key_lens, s_q), table, key_lens, s_q)
        return None

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, kv_indices_buf=None):
        # The parent's FlashInfer decode/verify graph buffers are not needed: every graph
        # SGLang captures for an MLA model (decode, target-verify, draft-extend v2) runs here.
        columns = metadata.pages_for(self.max_context_len + self.max_q_tokens)
        self._graph_page_table = torch.zeros((max_bs, columns), dtype=torch.int32,
                                             device=self.device)
        self._graph_key_lens = torch.ones(max_bs, dtype=torch.int32, device=self.device)
        if max_bs > self.workspace.max_batch:
            self.workspace = self._workspace(max_bs)
        if self._side is None and torch.device(self.device).type == "cuda":
            self._side = SideStream(self.device)
        self._verify_mask = maybe_create_verify_mask(
            is_draft_runner=self.is_draft_runner, skip_prefill=self.skip_prefill,
            max_bs=max_bs, max_context_len=self.max_context_len,
            num_draft_tokens=self.num_draft_tokens, device=self.device, is_read=False)

    @property
    def verify_mask(self):
        return self._verify_mask

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        mode = forward_batch.forward_mode
        if not on_decode_kernel(mode):
            return super().init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
        if self._graph_page_table is None:
            raise RuntimeError(f"{NAME}: init_cuda_graph_state must run before a graph's "
                               f"metadata")
        self._join_plan()  # a side-stream plan no layer waited for still reads the key lengths
        self._graph_step = None
        bs = forward_batch.batch_size
        if bs == 0:  # an idle batch runs no attention
            self.forward_metadata = None
            return None
        s_q = metadata.query_tokens(mode, self.num_draft_tokens)
        # graph batches of draft-extend v2 carry the padded query window in seq_lens
        static_lens = metadata.key_lengths(mode, forward_batch.seq_lens[:bs],
                                           self.num_draft_tokens, window_in_seq_lens=True,
                                           out=self._graph_key_lens[:bs])
        # The kernel sees the full-width table (a graph keeps the shape it was captured with);
        # only the columns this step can read are refreshed.
        table = self._graph_page_table[:bs]
        seq_lens_cpu = getattr(forward_batch, "seq_lens_cpu", None)
        columns = min(table.shape[1], metadata.pages_for(
            self._max_keys(seq_lens_cpu, bs, s_q, mode)))
        metadata.fill_page_table(self.req_to_token, forward_batch.req_pool_indices,
                                 table[:, :columns])
        if is_in_breakable_cuda_graph():  # attention runs eagerly, between captured segments
            self.forward_metadata = DecodeMetadata(self._plan(static_lens, s_q), table,
                                                   static_lens, s_q)
            return None
        # the plan: init_forward_metadata_in_graph, else the step's first decode layer
        self.forward_metadata = self._graph_step = DecodeMetadata(None, table, static_lens, s_q)
        return None

    def init_forward_metadata_in_graph(self, forward_batch):
        if not on_decode_kernel(forward_batch.forward_mode):
            return super().init_forward_metadata_in_graph(forward_batch)
        step = self._graph_step
        # None: eager metadata, an idle batch or a breakable graph (planned out of the graph).
        # A two-batch-overlap parent runs its attention on the children's backends: no fork,
        # which no decode layer would join (a layer that does run here plans for itself).
        if step is None or getattr(forward_batch, "tbo_children", None):
            return None
        plan_step = partial(self._plan, step.cache_seqlens_int32, step.q_tokens)
        if self._side is None:
            plan = plan_step()
        else:  # beside the model's first layer; the first decode layer waits (_join_plan)
            plan, self._pending_plan = self._side.run(plan_step)
        self.forward_metadata = replace(step, plan=plan)
        return None

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    # ---- forward -------------------------------------------------------------------------

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                       q_rope=None, k_rope=None, **kwargs):
        return self._decode_kernel(q, k, v, layer, forward_batch, save_kv_cache, q_rope, k_rope)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                       q_rope=None, k_rope=None, **kwargs):
        if not on_decode_kernel(forward_batch.forward_mode):
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache,
                                          q_rope=q_rope, k_rope=k_rope)
        return self._decode_kernel(q, k, v, layer, forward_batch, save_kv_cache, q_rope, k_rope)

    def _decode_kernel(self, q, k, v, layer, forward_batch, save_kv_cache, q_rope, k_rope):
        if k is not None and save_kv_cache:
            if k_rope is not None:  # the two-part form: k is the latent part
                self.token_to_kv_pool.set_mla_kv_buffer(layer, forward_batch.out_cache_loc, k,
                                                        k_rope)
            else:
                self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        self._join_plan()  # the plan is read from here on (the KV write above needs none)
        meta = self.forward_metadata
        if meta.plan is None:  # out-of-graph metadata that no in-graph call planned
            meta = self.forward_metadata = replace(
                meta, plan=self._plan(meta.cache_seqlens_int32, meta.q_tokens))
        plan = meta.plan
        heads = layer.tp_q_head_num
        query = decode_query(q, q_rope, plan.batch, plan.q_tokens_per_req, heads)
        cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).view(-1, PAGE_SIZE,
                                                                           ops.D_QK)
        kv_scale = None
        if self.kv_fp8:  # dequantized as fp8 * k_scale, the reading SGLang's flashmla uses
            kv_scale = layer.k_scale if layer.k_scale is not None else 1.0
        out, _ = ops.mla_decode(query, cache, meta.page_table, meta.cache_seqlens_int32, plan,
                                layer.scaling, causal=True, kv_scale=kv_scale)
        return out.view(-1, heads * layer.v_head_dim)
