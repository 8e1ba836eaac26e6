"""Dense paged MLA decode: the split-KV planner (plan_decode, decode_workspace) and the
attention op (mla_decode). Float32 twin: mla_backend.reference.mla_decode."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import _extension
from . import cost_model
from ._common import (
    D_QK,
    D_V,
    MAX_HEADS,
    PAGE_SIZE,
    _check_heads,
    _check_lse,
    _check_softmax_scale,
    _describe,
    _num_sms,
    _out_and_lse,
    _query_parts,
    _require,
    _require_aligned_rows,
    _require_cuda,
    _require_hopper,
    _require_tensor,
)
from .cost_model import _min_units

MAX_Q_TOKENS_PER_REQ = 8
_QUERY_DTYPES = (torch.bfloat16, torch.float16)


@dataclass
class DecodePlan:
    """Split-KV schedule of one decode step, shared by every layer of that step.

    metadata (int32 [batch + 2], on the GPU): unit prefix sums P[0..batch] (request b owns
    work units [P[b], P[b+1]), a unit = unit_tokens keys) and, at [batch + 1], the units
    per CTA. CTA c of a grid of num_ctas processes units [c * U, (c + 1) * U): the schedule
    is a closed form of P and U, so the planner is one small kernel with no host sync.
    Plans of the wgmma kernel with more requests than CTAs (_ordered) hold [2 * batch + 2]:
    P and U over an order of the requests, then that order (position v is request
    metadata[batch + 2 + v]), which the planner makes longest first where whole requests
    (none split) cost few units more than the balanced share (cost_model.DENSE_LPT_EXTRA_UNITS),
    else the identity.
    partial_out / partial_lse hold the results of requests that span CTAs (two slots per
    CTA: its first and its last request) until the combine kernel merges them; partial_out
    is float32, or bfloat16 where the extension writes 16-bit partials (_partial_dtype),
    partial_lse float32.
    All tensors can be kept across steps: plan_decode(..., out=plan) refills them in place
    (what a CUDA graph needs).
    """

    batch: int
    q_tokens_per_req: int
    num_heads: int
    kv_fp8: bool
    rows_per_cta: int
    unit_tokens: int
    num_ctas: int
    metadata: torch.Tensor
    partial_out: torch.Tensor
    partial_lse: torch.Tensor

    @property
    def rows(self) -> int:
        return self.q_tokens_per_req * self.num_heads


def _uses_mma(rows: int, batch: int, kv_fp8: bool) -> bool:
    """Whether a step of `batch` requests with `rows` query rows (s_q * H) runs on the mma.sync
    kernel rather than the wgmma kernel: the rule of cost_model (MMA_MAX_ROWS, and on an fp8
    cache MMA_MAX_ROWS_FP8; MMA_MIN_BATCH_*), read at each call."""
    min_batch = cost_model.MMA_MIN_BATCH_FP8 if kv_fp8 else cost_model.MMA_MIN_BATCH_16BIT
    max_rows = min(cost_model.MMA_MAX_ROWS, cost_model.MMA_MAX_ROWS_FP8 if kv_fp8 else 16, 16)
    return rows <= max_rows and min_batch is not None and batch >= min_batch


def _fp16_operands(plan: DecodePlan) -> bool:
    """Whether the wgmma kernel on a per-tensor fp8 cache converts the pages to fp16 (a bf16 q
    converted once per request piece) rather than to q's type: cost_model's
    FP8_FP16_OPERANDS_MIN_BATCH, read at each call. The mma.sync kernel and an fp16 q ignore it."""
    min_batch = cost_model.FP8_FP16_OPERANDS_MIN_BATCH
    return plan.kv_fp8 and min_batch is not None and plan.batch >= min_batch


def _tile(mma: bool) -> tuple[int, int, int]:
    """(rows per CTA, tokens per work unit, CTAs per SM) of a kernel, for a 16-bit and a
    per-tensor fp8 cache alike (both kernels convert fp8 pages in shared memory). The mma.sync
    kernel: 16-row tiles with no padded rows for few heads (TP8 / TP16), 32-token units, two
    CTAs per SM; the wgmma kernel: 64-row tiles, one 64-token page per unit. Must agree with
    the kernels' shared memory."""
    return (16, 32, 2) if mma else (64, 64, 1)


def _grid(rows: int, num_sms: int, mma: bool) -> tuple[int, int, int]:
    """(rows per CTA, tokens per unit, CTAs) of one step on the kernel `mma` names: one wave,
    every CTA the same number of units (the planner's closed form)."""
    rows_per_cta, unit_tokens, ctas_per_sm = _tile(mma)
    m_tiles = math.ceil(rows / rows_per_cta)
    return rows_per_cta, unit_tokens, max(1, num_sms * ctas_per_sm // m_tiles)


def _dense_min_units(unit_tokens: int, rows: int, rows_per_cta: int, kv_fp8: bool,
                     min_tokens: int | None = None) -> int:
    """The least work of one CTA of a dense plan, in units: cost_model.MIN_TOKENS_PER_CTA keys,
    or MIN_TOKENS_PER_CTA_FP8_ONE_TILE on an fp8 cache where the wgmma kernel (64-key units)
    holds all `rows` query rows in one tile; min_tokens (benchmarks, tests) replaces both."""
    if min_tokens is None and kv_fp8 and unit_tokens == 64 and rows <= rows_per_cta:
        min_tokens = cost_model.MIN_TOKENS_PER_CTA_FP8_ONE_TILE
    return _min_units(unit_tokens, min_tokens)


def _ordered(batch: int, unit_tokens: int, num_ctas: int) -> bool:
    """Whether a plan carries an order of its requests (DecodePlan.metadata): the wgmma kernel
    (64-key units), more requests than CTAs, at most 1024 of them (the planner's one block),
    and cost_model.DENSE_LPT_EXTRA_UNITS >= 0."""
    return (unit_tokens == 64 and num_ctas < batch <= 1024
            and cost_model.DENSE_LPT_EXTRA_UNITS >= 0)


def _align_extra(unit_tokens: int) -> int:
    """The planner's align_extra for a plan of unit_tokens-key units: cost_model's
    DENSE_ALIGN_EXTRA_UNITS on the wgmma kernel (64-key pages), whose pieces stop at a
    request's keys; -1 on the mma.sync kernel, which would compute an aligned plan's padding."""
    return cost_model.DENSE_ALIGN_EXTRA_UNITS if unit_tokens == 64 else -1


def _restart_pad(unit_tokens: int) -> int:
    """The planner's restart_pad for a plan of unit_tokens-key units: cost_model's
    DENSE_RESTART_PAD_UNITS on the wgmma kernel, -1 on the mma.sync kernel (as _align_extra)."""
    return cost_model.DENSE_RESTART_PAD_UNITS if unit_tokens == 64 else -1


def _planner_knobs(rows: int, rows_per_cta: int, unit_tokens: int, kv_fp8: bool, ordered: bool,
                   min_tokens: int | None = None) -> dict[str, int]:
    """The GPU planner's arguments after seq_lens, metadata and num_ctas, by name (the op's
    schema and reference.plan_decode_metadata's keywords), for a plan of `rows` query rows on
    the kernel of rows_per_cta / unit_tokens; ordered: the plan carries an order of its
    requests (2B + 2 ints). min_tokens (benchmarks, tests) replaces the least work of one CTA
    everywhere, small steps included."""
    one_page = (unit_tokens == 64 and min_tokens is None
                and -(-rows // rows_per_cta) <= cost_model.DENSE_ONE_PAGE_MAX_TILES)
    return {"min_units": _dense_min_units(unit_tokens, rows, rows_per_cta, kv_fp8, min_tokens),
            "unit_tokens": unit_tokens,
            "whole_extra": cost_model.DENSE_WHOLE_REQUEST_EXTRA_UNITS,
            "align_extra": _align_extra(unit_tokens),
            "restart_pad": _restart_pad(unit_tokens),
            "lpt_extra": max(cost_model.DENSE_LPT_EXTRA_UNITS, 0) if ordered else -1,
            "one_unit_max": cost_model.DENSE_ONE_PAGE_MAX_PAGES if one_page else -1}


def _check_plan_args(seq_lens, num_q_tokens_per_req, num_heads, kv_cache_dtype) -> torch.Tensor:
    seq_lens = _require_tensor("seq_lens", seq_lens)
    _require(seq_lens.dim() == 1 and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous(),
             "seq_lens", seq_lens, "must be a contiguous 1-D int32 tensor [batch]")
    _check_plan_sizes(num_q_tokens_per_req, num_heads, kv_cache_dtype)
    _require_cuda({"seq_lens": seq_lens}, seq_lens.device)
    return seq_lens


def _check_plan_sizes(num_q_tokens_per_req, num_heads, kv_cache_dtype) -> None:
    if not (isinstance(num_q_tokens_per_req, int)
            and 1 <= num_q_tokens_per_req <= MAX_Q_TOKENS_PER_REQ):
        raise ValueError(f"num_q_tokens_per_req must be an int in [1, {MAX_Q_TOKENS_PER_REQ}]; "
                         f"got {num_q_tokens_per_req!r}")
    _check_heads(num_heads)
    if kv_cache_dtype not in (None, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        raise TypeError(f"kv_cache_dtype must be None, bfloat16, float16 or float8_e4m3fn; "
                        f"got {kv_cache_dtype}")


@dataclass
class DecodeWorkspace:
    """Caller-owned buffers from which plan_decode(..., workspace=ws) makes every plan of a
    model's decode steps: any batch up to max_batch and any s_q up to max_q_tokens_per_req,
    for num_heads heads and one cache dtype. Allocate it once (e.g. in vLLM's metadata
    builder); its addresses never change, so CUDA graphs captured for any batch size replay
    against the plan of the current step. Plans made from one workspace share its memory:
    a plan is valid until the next plan_decode on the same workspace (one plan per step,
    used by every layer of that step, is the intended use)."""

    max_batch: int
    max_q_tokens_per_req: int
    num_heads: int
    kv_fp8: bool
    num_sms: int
    metadata: torch.Tensor
    partial_out: torch.Tensor
    partial_lse: torch.Tensor
    plans: dict

    def plan_view(self, batch: int, s_q: int) -> DecodePlan:
        """The plan object of (batch, s_q) over this workspace's memory (cached)."""
        plan = self.plans.get((batch, s_q))
        if plan is None:
            rows = s_q * self.num_heads
            rows_per_cta, unit_tokens, num_ctas = _grid(
                rows, self.num_sms, _uses_mma(rows, batch, self.kv_fp8))
            plan = DecodePlan(
                batch=batch, q_tokens_per_req=s_q, num_heads=self.num_heads, kv_fp8=self.kv_fp8,
                rows_per_cta=rows_per_cta, unit_tokens=unit_tokens, num_ctas=num_ctas,
                metadata=self.metadata[:(2 * batch if _ordered(batch, unit_tokens, num_ctas)
                                         else batch) + 2],
                partial_out=self.partial_out[:2 * num_ctas * rows * D_V].view(
                    2 * num_ctas, rows, D_V),
                partial_lse=self.partial_lse[:2 * num_ctas * rows].view(2 * num_ctas, rows))
            self.plans[(batch, s_q)] = plan
        return plan


_partial_bytes: list[int] = []  # the loaded extension's dense_partial_bytes(), once read


def _partial_dtype(op: str) -> torch.dtype:
    """The dtype of a workspace's partial_out: a 16-bit buffer where the loaded extension's
    dense kernels write split partials in q's dtype (the default build; bfloat16, which
    mla_decode views as q's dtype), float32 for a build with -DMLA_BACKEND_16BIT_PARTIALS=0.
    The kernel entry refuses any other, so a plan and a build cannot disagree. op: the public
    op asking, named if the extension is missing."""
    _extension.require(op)
    if not _partial_bytes:
        _partial_bytes.append(int(torch.ops.mla_backend.dense_partial_bytes()))
    return torch.bfloat16 if _partial_bytes[0] == 2 else torch.float32


def _partials_as(partial_out: torch.Tensor, q_dtype: torch.dtype) -> torch.Tensor:
    """partial_out as the kernels take it: float32 as it is, 16-bit viewed as q's dtype."""
    if partial_out.dtype in (torch.float32, q_dtype):
        return partial_out
    return partial_out.view(q_dtype)


def _workspace(max_batch: int, q_tokens: range | list[int], num_heads: int, kv_fp8: bool,
               device: torch.device, num_sms: int, op: str) -> DecodeWorkspace:
    """Buffers for every plan with batch <= max_batch and s_q in q_tokens (op: the public op
    allocating them, named if the extension is missing)."""
    part_dtype = _partial_dtype(op)
    # the wgmma kernel at every batch; the mma.sync kernel too where the rule takes it for some
    # batch <= max_batch (the rule's batch bound is a minimum)
    part_rows = max(2 * _grid(s_q * num_heads, num_sms, mma)[2] * s_q * num_heads
                    for s_q in q_tokens
                    for mma in {False, _uses_mma(s_q * num_heads, max_batch, kv_fp8)})
    return DecodeWorkspace(
        max_batch=max_batch, max_q_tokens_per_req=max(q_tokens), num_heads=num_heads,
        kv_fp8=kv_fp8, num_sms=num_sms,
        metadata=torch.zeros(2 * max_batch + 2, dtype=torch.int32, device=device),
        partial_out=torch.empty(part_rows * D_V, dtype=part_dtype, device=device),
        partial_lse=torch.empty(part_rows, dtype=torch.float32, device=device), plans={})


def decode_workspace(max_batch: int, max_q_tokens_per_req: int, num_heads: int, *,
                     device: torch.device | str, kv_cache_dtype: torch.dtype | None = None,
                     num_sms: int | None = None) -> DecodeWorkspace:
    """Allocate the buffers of every plan with batch <= max_batch, s_q <= max_q_tokens_per_req,
    num_heads heads and this cache dtype (None or 16-bit: the 16-bit kernels;
    torch.float8_e4m3fn: the fp8 kernel). Size: (2 * max_batch + 2) int32 plus the split
    partials, at most about 35 MB (H = 128) on a 132-SM GPU (half with 16-bit partials).
    Needs the CUDA extension (its build decides the partials' dtype)."""
    if not (isinstance(max_batch, int) and max_batch >= 1):
        raise ValueError(f"max_batch must be a positive int; got {max_batch!r}")
    _check_plan_sizes(max_q_tokens_per_req, num_heads, kv_cache_dtype)
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device; got {device}")
    sms = num_sms if num_sms is not None else _num_sms(device)
    return _workspace(max_batch, range(1, max_q_tokens_per_req + 1), num_heads,
                      kv_cache_dtype == torch.float8_e4m3fn, device, sms, "decode_workspace")


def plan_decode(seq_lens: torch.Tensor, num_q_tokens_per_req: int, num_heads: int, *,
                kv_cache_dtype: torch.dtype | None = None, num_sms: int | None = None,
                out: DecodePlan | None = None,
                workspace: DecodeWorkspace | None = None,
                _min_tokens_per_cta: int | None = None) -> DecodePlan:
    """Plan one decode step: seq_lens int32 [B] on the GPU (no host sync); s_q query tokens
    per request; num_heads query heads; kv_cache_dtype the cache's dtype (None: q's;
    torch.float8_e4m3fn selects the fp8 kernel). Pass `out` (an earlier plan of the same
    B, s_q, H and cache dtype) to refill its buffers in place, or `workspace` (from
    decode_workspace) to plan into caller-owned buffers shared by all batch sizes.
    _min_tokens_per_cta (benchmarks and tests only) replaces the least work of one CTA
    (_dense_min_units) for this plan."""
    if _min_tokens_per_cta is not None and not (isinstance(_min_tokens_per_cta, int)
                                                and _min_tokens_per_cta >= 1):
        raise ValueError(f"_min_tokens_per_cta must be a positive int; got "
                         f"{_min_tokens_per_cta!r}")
    seq_lens = _check_plan_args(seq_lens, num_q_tokens_per_req, num_heads, kv_cache_dtype)
    if out is not None and workspace is not None:
        raise ValueError("pass at most one of out and workspace")
    device = seq_lens.device
    batch = seq_lens.shape[0]
    kv_fp8 = kv_cache_dtype == torch.float8_e4m3fn
    if out is not None:
        if (out.batch, out.q_tokens_per_req, out.num_heads, out.kv_fp8) != (
                batch, num_q_tokens_per_req, num_heads, kv_fp8):
            raise ValueError(
                f"out plan is for batch {out.batch}, s_q {out.q_tokens_per_req}, "
                f"H {out.num_heads}, fp8 cache {out.kv_fp8}; this step has batch {batch}, "
                f"s_q {num_q_tokens_per_req}, H {num_heads}, fp8 cache {kv_fp8}")
        plan = out
    elif workspace is not None:
        ws = workspace
        if not isinstance(ws, DecodeWorkspace):
            raise TypeError(f"workspace must be a DecodeWorkspace from decode_workspace; got "
                            f"{type(ws).__name__}")
        if (batch > ws.max_batch or num_q_tokens_per_req > ws.max_q_tokens_per_req
                or num_heads != ws.num_heads or kv_fp8 != ws.kv_fp8):
            raise ValueError(
                f"workspace holds plans of batch <= {ws.max_batch}, s_q <= "
                f"{ws.max_q_tokens_per_req}, H {ws.num_heads}, fp8 cache {ws.kv_fp8}; this step "
                f"has batch {batch}, s_q {num_q_tokens_per_req}, H {num_heads}, fp8 cache {kv_fp8}")
        if ws.metadata.device != device:
            raise ValueError(f"workspace is on {ws.metadata.device} but seq_lens is on {device}")
        plan = ws.plan_view(batch, num_q_tokens_per_req)
    else:  # a plan with buffers of its own: a workspace for exactly this step
        sms = num_sms if num_sms is not None else _num_sms(device)
        plan = _workspace(batch, [num_q_tokens_per_req], num_heads, kv_fp8, device, sms,
                          "plan_decode").plan_view(batch, num_q_tokens_per_req)
    _extension.require("plan_decode")
    ordered = plan.metadata.numel() == 2 * batch + 2
    torch.ops.mla_backend.plan_decode(seq_lens, plan.metadata, plan.num_ctas,
                                      **_planner_knobs(plan.rows, plan.rows_per_cta,
                                                       plan.unit_tokens, kv_fp8, ordered,
                                                       _min_tokens_per_cta))
    return plan


def _check_kv_scale(kv_scale) -> None:
    if kv_scale is None:
        raise ValueError("kv_scale is required with a float8_e4m3fn kv_cache (the per-tensor "
                         "dequantization scale: value = fp8 * kv_scale)")
    if isinstance(kv_scale, torch.Tensor):
        _require(kv_scale.numel() == 1 and kv_scale.dtype == torch.float32, "kv_scale",
                 kv_scale, "must be a 1-element float32 tensor (or a Python float)")
    elif not (isinstance(kv_scale, (float, int)) and math.isfinite(kv_scale) and kv_scale > 0):
        raise ValueError(f"kv_scale must be a positive finite float or a 1-element float32 "
                         f"tensor; got {kv_scale!r}")


def _check_decode_args(q, kv_cache, block_table, seq_lens, plan, softmax_scale, kv_scale, out,
                       lse=None):
    q, q_pe = _query_parts(q)
    kv_cache = _require_tensor("kv_cache", kv_cache)
    block_table = _require_tensor("block_table", block_table)
    seq_lens = _require_tensor("seq_lens", seq_lens)
    qname = "q" if q_pe is None else "q_nope (q[0])"
    width = D_QK if q_pe is None else D_V
    _require(q.dim() == 4 and q.shape[3] == width, qname, q,
             f"must be [batch, s_q, heads, {width}]")
    if q.dtype not in _QUERY_DTYPES:
        raise TypeError(f"{qname} must be bfloat16 or float16; got {_describe(q)}")
    batch, s_q, heads, _ = q.shape
    _require(1 <= s_q <= MAX_Q_TOKENS_PER_REQ, qname, q,
             f"must have s_q (dim 1) in [1, {MAX_Q_TOKENS_PER_REQ}]")
    _require(1 <= heads <= MAX_HEADS, qname, q, f"must have heads (dim 2) in [1, {MAX_HEADS}]")
    _require_aligned_rows(qname, q)
    if q_pe is not None:
        _require_aligned_rows("q_pe (q[1])", q_pe)
    _require(kv_cache.dim() == 3 and kv_cache.shape[1:] == (PAGE_SIZE, D_QK), "kv_cache",
             kv_cache, f"must be [num_blocks, {PAGE_SIZE}, {D_QK}]")
    kv_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if kv_cache.dtype == torch.uint8:
        raise TypeError(f"kv_cache is uint8: view a per-tensor fp8 cache as torch.float8_e4m3fn "
                        f"(kv_cache.view(torch.float8_e4m3fn)); got {_describe(kv_cache)}")
    if not kv_fp8 and kv_cache.dtype != q.dtype:
        raise TypeError(f"kv_cache must have q's dtype {q.dtype} or be float8_e4m3fn; got "
                        f"{_describe(kv_cache)}")
    if kv_fp8:
        _check_kv_scale(kv_scale)
    elif kv_scale is not None:
        raise ValueError(f"kv_scale applies only to an fp8 kv_cache; kv_cache is {kv_cache.dtype}")
    per16 = 16 // kv_cache.element_size()  # elements per 16 bytes: 8 (16-bit), 16 (fp8)
    _require(kv_cache.stride(2) == 1 and kv_cache.stride(1) % per16 == 0
             and kv_cache.stride(0) % per16 == 0 and kv_cache.data_ptr() % 16 == 0, "kv_cache",
             kv_cache, "must be 16-byte aligned with a contiguous last dim and 16-byte aligned "
             "block/token strides")
    _require(block_table.dim() == 2 and block_table.dtype == torch.int32
             and block_table.shape[0] == batch and block_table.stride(1) == 1, "block_table",
             block_table, f"must be int32 [batch={batch}, max_blocks] with a contiguous last dim")
    _require(seq_lens.dim() == 1 and seq_lens.dtype == torch.int32
             and seq_lens.shape[0] == batch and seq_lens.is_contiguous(), "seq_lens", seq_lens,
             f"must be contiguous int32 [batch={batch}]")
    if not isinstance(plan, DecodePlan):
        raise TypeError(f"plan must be a DecodePlan from plan_decode; got {type(plan).__name__}")
    if (plan.batch, plan.q_tokens_per_req, plan.num_heads) != (batch, s_q, heads):
        raise ValueError(f"plan is for batch {plan.batch}, s_q {plan.q_tokens_per_req}, "
                         f"H {plan.num_heads}; q has batch {batch}, s_q {s_q}, H {heads}")
    if plan.kv_fp8 != kv_fp8:
        raise ValueError(f"plan was made for {'an fp8' if plan.kv_fp8 else 'a 16-bit'} cache "
                         f"but kv_cache is {kv_cache.dtype}: pass kv_cache_dtype to plan_decode")
    _check_softmax_scale(softmax_scale)
    if out is not None:
        out = _require_tensor("out", out)
        _require(out.shape == (batch, s_q, heads, D_V) and out.dtype == q.dtype
                 and out.is_contiguous(), "out", out,
                 f"must be contiguous {q.dtype} [{batch}, {s_q}, {heads}, {D_V}]")
    if lse is not None:
        lse = _check_lse(lse, (batch, s_q, heads))
    tensors = {qname: q, "kv_cache": kv_cache, "block_table": block_table, "seq_lens": seq_lens,
               "plan.metadata": plan.metadata}
    if q_pe is not None:
        tensors["q_pe (q[1])"] = q_pe
    if isinstance(kv_scale, torch.Tensor):
        tensors["kv_scale"] = kv_scale
    if out is not None:
        tensors["out"] = out
    if lse is not None:
        tensors["lse"] = lse
    _require_cuda(tensors, q.device)


def mla_decode(q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
               block_table: torch.Tensor, seq_lens: torch.Tensor, plan: DecodePlan,
               softmax_scale: float,
               causal: bool = True, kv_scale: torch.Tensor | float | None = None,
               out: torch.Tensor | None = None,
               lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense paged MLA decode.

    q [B, s_q, H, 576] bf16/fp16, or the pair (q_nope [B, s_q, H, 512], q_pe [B, s_q, H, 64])
    read through their own strides (vLLM's absorbed query comes in two parts: no copy to
    join them); kv_cache [num_blocks, 64, 576] of q's dtype, or
    float8_e4m3fn with kv_scale (float, or a 1-element float32 CUDA tensor read on the GPU:
    value = fp8 * kv_scale; the plan must come from plan_decode(..., kv_cache_dtype=
    torch.float8_e4m3fn)); a strided cache view is fine (blocks are indexed by stride(0));
    block_table int32 [B, max_blocks];
    seq_lens int32 [B] (keys per request, the s_q query tokens included; the caller keeps
    seq_lens[b] <= 64 * max_blocks). With causal, query i sees keys < seq_len - s_q + i + 1.
    Returns out [B, s_q, H, 512] (q's dtype) and lse [B, s_q, H] float32 (natural log);
    rows with no key get out = 0, lse = -inf. out / lse: caller-owned outputs to write
    (contiguous, [B, s_q, H, 512] in q's dtype / [B, s_q, H] float32), else new ones.
    """
    _check_decode_args(q, kv_cache, block_table, seq_lens, plan, softmax_scale, kv_scale, out,
                       lse)
    q, q_pe = _query_parts(q)
    _extension.require("mla_decode")
    _require_hopper("mla_decode", q.device)
    out, lse = _out_and_lse(q, out, lse)
    torch.ops.mla_backend.mla_decode(
        q, q_pe, kv_cache, block_table, seq_lens, plan.metadata,
        _partials_as(plan.partial_out, q.dtype), plan.partial_lse, out, lse, plan.num_ctas,
        plan.rows_per_cta, float(softmax_scale), bool(causal),
        kv_scale if isinstance(kv_scale, torch.Tensor) else None,
        float(kv_scale) if kv_scale is not None and not isinstance(kv_scale, torch.Tensor)
        else 1.0, _fp16_operands(plan))
    return out, lse

