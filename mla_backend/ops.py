"""The public kernel API: validates arguments (ValueError / TypeError naming the argument,
its shape and dtype), allocates outputs, and calls torch.ops.mla_backend.*.

Shapes follow vLLM's MLA: one latent KV head, d_qk = 576 (512 latent + 64 rope),
d_v = 512, page (block) size 64. Float32 twins of every op: mla_backend.reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import _extension, formats

D_QK = 576
D_V = 512
PAGE_SIZE = 64
MAX_HEADS = 128
MAX_Q_TOKENS_PER_REQ = 8
# A CTA gets at least this many tokens of work: fewer splits (and partials to merge) for
# short contexts. Swept on the H200 (docs/kernels/dense_decode.md, v6): 64 helps batch 1 at
# 1k and hurts it at 16k; 256 hurts batch 1 everywhere.
MIN_TOKENS_PER_CTA = 128
_QUERY_DTYPES = (torch.bfloat16, torch.float16)


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)} dtype {t.dtype} device {t.device}"


def _require_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    return t


def _require(cond: bool, name: str, t: torch.Tensor, what: str) -> None:
    if not cond:
        raise ValueError(f"{name} {what}; got {_describe(t)}")


def _require_cuda(tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    for name, t in tensors.items():
        if t.device.type != "cuda":
            raise ValueError(f"{name} must be on a CUDA device; got {_describe(t)}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but q is on {device}")


def _require_hopper(op: str, device: torch.device) -> None:
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        raise RuntimeError(
            f"mla_backend.ops.{op} runs on Hopper GPUs (compute capability 9.x, sm_90a); "
            f"{torch.cuda.get_device_name(device)} is {major}.{minor}")


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def probe_scale(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha * x on the GPU (float32, contiguous): proves the extension builds and runs."""
    x = _require_tensor("x", x)
    _require(x.dtype == torch.float32 and x.is_contiguous(), "x", x,
             "must be a contiguous float32 tensor")
    _require_cuda({"x": x}, x.device)
    _extension.require("probe_scale")
    return torch.ops.mla_backend.probe_scale(x, float(alpha))


# --------------------------------------------------------------------------- dense decode


@dataclass
class DecodePlan:
    """Split-KV schedule of one decode step, shared by every layer of that step.

    metadata (int32 [batch + 2], on the GPU): unit prefix sums P[0..batch] (request b owns
    work units [P[b], P[b+1]), a unit = unit_tokens keys) and, at [batch + 1], the units
    per CTA. CTA c of a grid of num_ctas processes units [c * U, (c + 1) * U): the schedule
    is a closed form of P and U, so the planner is one small kernel with no host sync.
    partial_out / partial_lse hold the results of requests that span CTAs (two slots per
    CTA: its first and its last request) until the combine kernel merges them.
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


def _tile(rows: int) -> tuple[int, int, int]:
    """(rows per CTA, tokens per work unit, CTAs per SM) of the kernel serving `rows` query
    rows, for a 16-bit and a per-tensor fp8 cache alike (both kernels convert fp8 pages in
    shared memory). Up to 16 rows: the mma.sync kernel, so few heads (TP8 / TP16) pay for no
    padded rows (16-row tiles, two CTAs per SM); more: the wgmma kernel, 64-row tiles, one
    64-token page per unit. Must agree with the kernels' shared memory."""
    if rows <= 16:
        return 16, 32, 2
    return 64, 64, 1


def _grid(rows: int, num_sms: int) -> tuple[int, int, int]:
    """(rows per CTA, tokens per unit, CTAs) of one step: one wave, every CTA the same number
    of units (the planner's closed form)."""
    rows_per_cta, unit_tokens, ctas_per_sm = _tile(rows)
    m_tiles = math.ceil(rows / rows_per_cta)
    return rows_per_cta, unit_tokens, max(1, num_sms * ctas_per_sm // m_tiles)


def _out_and_lse(q: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, s_q, H, 512] in q's dtype (the caller's, already checked, or new) and a new
    lse [B, s_q, H] float32, for q [B, s_q, H, 576]."""
    batch, s_q, heads, _ = q.shape
    if out is None:
        out = torch.empty(batch, s_q, heads, D_V, dtype=q.dtype, device=q.device)
    return out, torch.empty(batch, s_q, heads, dtype=torch.float32, device=q.device)


def _check_plan_args(seq_lens, num_q_tokens_per_req, num_heads, kv_cache_dtype) -> torch.Tensor:
    seq_lens = _require_tensor("seq_lens", seq_lens)
    _require(seq_lens.dim() == 1 and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous(),
             "seq_lens", seq_lens, "must be a contiguous 1-D int32 tensor [batch]")
    _check_plan_sizes(num_q_tokens_per_req, num_heads, kv_cache_dtype)
    _require_cuda({"seq_lens": seq_lens}, seq_lens.device)
    return seq_lens


def _check_heads(num_heads) -> None:
    if not (isinstance(num_heads, int) and 1 <= num_heads <= MAX_HEADS):
        raise ValueError(f"num_heads must be an int in [1, {MAX_HEADS}]; got {num_heads!r}")


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
            rows_per_cta, unit_tokens, num_ctas = _grid(rows, self.num_sms)
            plan = DecodePlan(
                batch=batch, q_tokens_per_req=s_q, num_heads=self.num_heads, kv_fp8=self.kv_fp8,
                rows_per_cta=rows_per_cta, unit_tokens=unit_tokens, num_ctas=num_ctas,
                metadata=self.metadata[:batch + 2],
                partial_out=self.partial_out[:2 * num_ctas * rows * D_V].view(
                    2 * num_ctas, rows, D_V),
                partial_lse=self.partial_lse[:2 * num_ctas * rows].view(2 * num_ctas, rows))
            self.plans[(batch, s_q)] = plan
        return plan


def _workspace(max_batch: int, q_tokens: range | list[int], num_heads: int, kv_fp8: bool,
               device: torch.device, num_sms: int) -> DecodeWorkspace:
    """Buffers for every plan with batch <= max_batch and s_q in q_tokens."""
    part_rows = max(2 * _grid(s_q * num_heads, num_sms)[2] * s_q * num_heads
                    for s_q in q_tokens)
    return DecodeWorkspace(
        max_batch=max_batch, max_q_tokens_per_req=max(q_tokens), num_heads=num_heads,
        kv_fp8=kv_fp8, num_sms=num_sms,
        metadata=torch.zeros(max_batch + 2, dtype=torch.int32, device=device),
        partial_out=torch.empty(part_rows * D_V, dtype=torch.float32, device=device),
        partial_lse=torch.empty(part_rows, dtype=torch.float32, device=device), plans={})


def decode_workspace(max_batch: int, max_q_tokens_per_req: int, num_heads: int, *,
                     device: torch.device | str, kv_cache_dtype: torch.dtype | None = None,
                     num_sms: int | None = None) -> DecodeWorkspace:
    """Allocate the buffers of every plan with batch <= max_batch, s_q <= max_q_tokens_per_req,
    num_heads heads and this cache dtype (None or 16-bit: the 16-bit kernels;
    torch.float8_e4m3fn: the fp8 kernel). Size: (max_batch + 2) int32 plus the split
    partials, at most about 35 MB (H = 128) on a 132-SM GPU."""
    if not (isinstance(max_batch, int) and max_batch >= 1):
        raise ValueError(f"max_batch must be a positive int; got {max_batch!r}")
    _check_plan_sizes(max_q_tokens_per_req, num_heads, kv_cache_dtype)
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device; got {device}")
    sms = num_sms if num_sms is not None else _num_sms(device)
    return _workspace(max_batch, range(1, max_q_tokens_per_req + 1), num_heads,
                      kv_cache_dtype == torch.float8_e4m3fn, device, sms)


def plan_decode(seq_lens: torch.Tensor, num_q_tokens_per_req: int, num_heads: int, *,
                kv_cache_dtype: torch.dtype | None = None, num_sms: int | None = None,
                out: DecodePlan | None = None,
                workspace: DecodeWorkspace | None = None) -> DecodePlan:
    """Plan one decode step: seq_lens int32 [B] on the GPU (no host sync); s_q query tokens
    per request; num_heads query heads; kv_cache_dtype the cache's dtype (None: q's;
    torch.float8_e4m3fn selects the fp8 kernel). Pass `out` (an earlier plan of the same
    B, s_q, H and cache dtype) to refill its buffers in place, or `workspace` (from
    decode_workspace) to plan into caller-owned buffers shared by all batch sizes."""
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
        plan = _workspace(batch, [num_q_tokens_per_req], num_heads, kv_fp8, device,
                          sms).plan_view(batch, num_q_tokens_per_req)
    _extension.require("plan_decode")
    min_units = -(-MIN_TOKENS_PER_CTA // plan.unit_tokens)
    torch.ops.mla_backend.plan_decode(seq_lens, plan.metadata, plan.num_ctas, min_units,
                                      plan.unit_tokens)
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


def _check_decode_args(q, kv_cache, block_table, seq_lens, plan, softmax_scale, kv_scale, out):
    q = _require_tensor("q", q)
    kv_cache = _require_tensor("kv_cache", kv_cache)
    block_table = _require_tensor("block_table", block_table)
    seq_lens = _require_tensor("seq_lens", seq_lens)
    _require(q.dim() == 4 and q.shape[3] == D_QK, "q", q, f"must be [batch, s_q, heads, {D_QK}]")
    if q.dtype not in _QUERY_DTYPES:
        raise TypeError(f"q must be bfloat16 or float16; got {_describe(q)}")
    batch, s_q, heads, _ = q.shape
    _require(1 <= s_q <= MAX_Q_TOKENS_PER_REQ, "q", q,
             f"must have s_q (dim 1) in [1, {MAX_Q_TOKENS_PER_REQ}]")
    _require(1 <= heads <= MAX_HEADS, "q", q, f"must have heads (dim 2) in [1, {MAX_HEADS}]")
    _require(q.stride(3) == 1 and all(q.stride(i) % 8 == 0 for i in range(3))
             and q.data_ptr() % 16 == 0, "q", q,
             "must be 16-byte aligned with a contiguous last dim and 16-byte aligned strides")
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
    _require(kv_cache.stride(2) == 1 and kv_cache.stride(1) % 8 == 0
             and kv_cache.stride(0) % 8 == 0 and kv_cache.data_ptr() % 16 == 0, "kv_cache",
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
    if not (isinstance(softmax_scale, (float, int)) and math.isfinite(softmax_scale)
            and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite float; got {softmax_scale!r}")
    if out is not None:
        out = _require_tensor("out", out)
        _require(out.shape == (batch, s_q, heads, D_V) and out.dtype == q.dtype
                 and out.is_contiguous(), "out", out,
                 f"must be contiguous {q.dtype} [{batch}, {s_q}, {heads}, {D_V}]")
    tensors = {"q": q, "kv_cache": kv_cache, "block_table": block_table, "seq_lens": seq_lens,
               "plan.metadata": plan.metadata}
    if isinstance(kv_scale, torch.Tensor):
        tensors["kv_scale"] = kv_scale
    if out is not None:
        tensors["out"] = out
    _require_cuda(tensors, q.device)


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, plan: DecodePlan, softmax_scale: float,
               causal: bool = True, kv_scale: torch.Tensor | float | None = None,
               out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense paged MLA decode.

    q [B, s_q, H, 576] bf16/fp16; kv_cache [num_blocks, 64, 576] of q's dtype, or
    float8_e4m3fn with kv_scale (float, or a 1-element float32 CUDA tensor read on the GPU:
    value = fp8 * kv_scale; the plan must come from plan_decode(..., kv_cache_dtype=
    torch.float8_e4m3fn)); a strided cache view is fine (blocks are indexed by stride(0));
    block_table int32 [B, max_blocks];
    seq_lens int32 [B] (keys per request, the s_q query tokens included; the caller keeps
    seq_lens[b] <= 64 * max_blocks). With causal, query i sees keys < seq_len - s_q + i + 1.
    Returns out [B, s_q, H, 512] (q's dtype) and lse [B, s_q, H] float32 (natural log);
    rows with no key get out = 0, lse = -inf.
    """
    _check_decode_args(q, kv_cache, block_table, seq_lens, plan, softmax_scale, kv_scale, out)
    _extension.require("mla_decode")
    _require_hopper("mla_decode", q.device)
    out, lse = _out_and_lse(q, out)
    torch.ops.mla_backend.mla_decode(
        q, kv_cache, block_table, seq_lens, plan.metadata, plan.partial_out, plan.partial_lse,
        out, lse, plan.num_ctas, plan.rows_per_cta, float(softmax_scale), bool(causal),
        kv_scale if isinstance(kv_scale, torch.Tensor) else None,
        float(kv_scale) if kv_scale is not None and not isinstance(kv_scale, torch.Tensor)
        else 1.0)
    return out, lse


# --------------------------------------------------------------------------- sparse (DSA)

MAX_TOPK = 16384
FP8_DS_MLA_BYTES = formats.FP8_DS_MLA_BYTES
MAX_SPARSE_GROUPS = 65535  # query tokens (batch * s_q) per call: the combine grid's y-dim


# The sparse kernel's tile at every H: the wgmma kernel with a gathering producer warpgroup,
# 64-row tiles (one CTA per SM) and 64-entry units, so a gathered key serves up to 64 heads.
# H < 64 pads the tile: at H = 16 it still beat the mma.sync kernel's 16-row tiles on every
# bench row (decode 3-36%, prefill 30%: docs/kernels/sparse_decode.md, v4). Must agree with
# csrc/decode_wgmma.cu (kRows, kUnitWgmma).
SPARSE_ROWS_PER_CTA = 64
SPARSE_UNIT_TOKENS = 64


def _sparse_grid(num_heads: int, num_sms: int) -> tuple[int, int, int]:
    """(rows per CTA, entries per unit, CTAs) of one call: one wave of CTAs over the SMs,
    shared by the H / 64 row tiles."""
    m_tiles = math.ceil(num_heads / SPARSE_ROWS_PER_CTA)
    return SPARSE_ROWS_PER_CTA, SPARSE_UNIT_TOKENS, max(1, num_sms // m_tiles)


@dataclass
class SparsePlan:
    """Split-KV schedule of sparse attention: every (batch entry, query token) is one
    request whose keys are its index list (topk entries, or the first topk_length[b]).
    metadata / partial_out / partial_lse as in DecodePlan (partials [2 * num_ctas, H, 512]).
    The plan remembers the topk_length tensor it was made from; the attention call must use
    the same one."""

    batch: int
    q_tokens_per_req: int
    num_heads: int
    topk: int
    topk_length: torch.Tensor | None
    rows_per_cta: int
    unit_tokens: int
    num_ctas: int
    metadata: torch.Tensor
    partial_out: torch.Tensor
    partial_lse: torch.Tensor
    # False when the plan proves on the host that every output is written by the attention
    # kernel itself (no topk_length, and each CTA's unit range holds whole requests: no
    # request spans CTAs, none is empty), so the merge kernel is not launched
    needs_combine: bool = True
    # Uniform plans (no topk_length: every request has ceil(topk / 64) units): the schedule is
    # the closed form request r = units [r * uniform_units, (r + 1) * uniform_units), CTA c =
    # units [c * units_per_cta, ...), so no planner kernel runs and metadata is not used.
    # 0: the planner wrote the schedule into metadata on the GPU.
    uniform_units: int = 0
    units_per_cta: int = 0


@dataclass
class SparseWorkspace:
    """Caller-owned buffers for every sparse plan of up to max_groups query tokens
    (batch * s_q) with num_heads heads; addresses never change (CUDA graphs)."""

    max_groups: int
    num_heads: int
    num_sms: int
    metadata: torch.Tensor
    partial_out: torch.Tensor
    partial_lse: torch.Tensor


def sparse_workspace(max_groups: int, num_heads: int, *, device: torch.device | str,
                     num_sms: int | None = None) -> SparseWorkspace:
    """Buffers for plan_sparse_decode(..., workspace=) with batch * s_q <= max_groups and H
    heads: (max_groups + 2) int32 plus 2 * CTAs * H float32 rows of 512 partials (about
    35 MB at H = 128 on a 132-SM GPU)."""
    if not (isinstance(max_groups, int) and max_groups >= 1):
        raise ValueError(f"max_groups must be a positive int; got {max_groups!r}")
    _check_heads(num_heads)
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device; got {device}")
    sms = num_sms if num_sms is not None else _num_sms(device)
    ctas = _sparse_grid(num_heads, sms)[2]
    return SparseWorkspace(
        max_groups=max_groups, num_heads=num_heads, num_sms=sms,
        metadata=torch.zeros(max_groups + 2, dtype=torch.int32, device=device),
        partial_out=torch.empty(2 * ctas * num_heads * D_V, dtype=torch.float32, device=device),
        partial_lse=torch.empty(2 * ctas * num_heads, dtype=torch.float32, device=device))


def _device_of(device: torch.device | str) -> torch.device:
    """torch.device with its index ("cuda" -> the current CUDA device), for comparisons."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


# A request split over CTAs costs each of them a partial write (H x 512 float32) and the
# merge kernel a launch and a read; measured on the H100 (docs/kernels/sparse_decode.md,
# v28) that is worth about 4 units (64 index entries) of one CTA's time on a bf16 cache and
# at H >= 64, 3 on an fp8_ds_mla cache below 64 heads (its units take longer and its
# partials are smaller).
WHOLE_REQUEST_EXTRA_UNITS = 4
WHOLE_REQUEST_EXTRA_UNITS_FP8_SMALL_H = 3
# On a bf16 cache the split's cost grows with the partials it writes and the merge reads:
# about 4.6 us plus 0.69 us per MB of float32 partials, against ~2.0 us per unit of one CTA
# (H100, bf16 H = 32 and 64 at batch 32, docs/kernels/sparse_decode.md, v50). So where the
# partials are large, whole requests pay even when they add more than 4 units.
SPLIT_FIXED_US = 4.6
SPLIT_US_PER_MB = 0.69
BF16_UNIT_US = 2.0


def _whole_requests_floor(groups: int, units_per_req: int, num_ctas: int, min_units: int,
                          num_heads: int, kv_fp8: bool) -> int:
    """The planner's floor on units per CTA: raised to whole requests per CTA (no request
    split, no merge kernel) when that adds few units to the balanced share, or (bf16 cache)
    fewer than the split's partials and merge would cost."""
    balanced = max(-(-groups * units_per_req // num_ctas), min_units)
    whole = -(-balanced // units_per_req) * units_per_req
    if kv_fp8:
        limit = (WHOLE_REQUEST_EXTRA_UNITS_FP8_SMALL_H if num_heads < 64
                 else WHOLE_REQUEST_EXTRA_UNITS)
    else:
        ctas_used = -(-groups * units_per_req // balanced)
        partial_mb = ctas_used * num_heads * D_V * 4 / 1e6
        split_units = (SPLIT_FIXED_US + SPLIT_US_PER_MB * partial_mb) / BF16_UNIT_US
        limit = max(WHOLE_REQUEST_EXTRA_UNITS, split_units)
    return whole if whole - balanced <= limit else min_units


def plan_sparse_decode(batch: int, num_q_tokens_per_req: int, num_heads: int, topk: int, *,
                       topk_length: torch.Tensor | None = None,
                       device: torch.device | str | None = None, num_sms: int | None = None,
                       workspace: SparseWorkspace | None = None,
                       kv_cache_dtype: torch.dtype = torch.bfloat16,
                       min_units_per_cta: int | None = None) -> SparsePlan:
    """Plan sparse attention for q [batch, s_q, H, 576] and indices [batch, s_q, topk]:
    one request per (entry, query token) with min(topk_length[b], topk) keys (topk_length
    int32 [batch] on the GPU, read there: no host sync), or topk keys. Buffers from
    `workspace` (sparse_workspace) or fresh ones on `device` (default: topk_length's).
    kv_cache_dtype is the dtype of the cache the plan will run on (torch.bfloat16, or
    torch.uint8 for fp8_ds_mla): it tunes the schedule only, a plan is correct on either.
    min_units_per_cta (64-entry units) overrides the schedule's floor on the work of one
    CTA (tuning: scripts/sweep_sparse_units.py)."""
    if not (isinstance(batch, int) and batch >= 0):
        raise ValueError(f"batch must be a non-negative int; got {batch!r}")
    if not (isinstance(num_q_tokens_per_req, int) and num_q_tokens_per_req >= 1):
        raise ValueError(f"num_q_tokens_per_req must be a positive int; got "
                         f"{num_q_tokens_per_req!r}")
    _check_heads(num_heads)
    if not (isinstance(topk, int) and 1 <= topk <= MAX_TOPK):
        raise ValueError(f"topk must be an int in [1, {MAX_TOPK}]; got {topk!r}")
    if kv_cache_dtype not in (torch.bfloat16, torch.uint8):
        raise ValueError(f"kv_cache_dtype must be torch.bfloat16 or torch.uint8 (fp8_ds_mla); "
                         f"got {kv_cache_dtype!r}")
    if min_units_per_cta is not None and not (isinstance(min_units_per_cta, int)
                                              and min_units_per_cta >= 1):
        raise ValueError(f"min_units_per_cta must be a positive int; got {min_units_per_cta!r}")
    if topk_length is not None:
        topk_length = _require_tensor("topk_length", topk_length)
        _require(topk_length.shape == (batch,) and topk_length.dtype == torch.int32
                 and topk_length.is_contiguous(), "topk_length", topk_length,
                 f"must be contiguous int32 [batch={batch}]")
        _require_cuda({"topk_length": topk_length}, topk_length.device)
        if device is not None and _device_of(device) != topk_length.device:
            raise ValueError(f"topk_length is on {topk_length.device}, not on device {device}")
        device = topk_length.device
    groups = batch * num_q_tokens_per_req
    if groups > MAX_SPARSE_GROUPS:
        raise ValueError(f"batch * num_q_tokens_per_req = {groups} query tokens; one sparse call "
                         f"takes at most {MAX_SPARSE_GROUPS} (split the batch)")
    if workspace is not None:
        ws = workspace
        if not isinstance(ws, SparseWorkspace):
            raise TypeError(f"workspace must be a SparseWorkspace from sparse_workspace; got "
                            f"{type(ws).__name__}")
        if groups > ws.max_groups or num_heads != ws.num_heads:
            raise ValueError(f"workspace holds plans of batch * s_q <= {ws.max_groups} and H "
                             f"{ws.num_heads}; this plan has batch * s_q = {groups}, H {num_heads}")
        if device is not None and _device_of(device) != ws.metadata.device:
            raise ValueError(f"workspace is on {ws.metadata.device} but the plan is for {device}")
    else:
        if device is None:
            raise ValueError("pass device (or topk_length, or workspace) to plan_sparse_decode")
        ws = sparse_workspace(max(groups, 1), num_heads, device=device, num_sms=num_sms)
    rows_per_cta, unit_tokens, num_ctas = _sparse_grid(num_heads, ws.num_sms)
    units_per_req = -(-topk // unit_tokens)
    uniform = topk_length is None  # every request has units_per_req units
    if min_units_per_cta is not None:
        min_units = min_units_per_cta
    else:
        min_units = -(-MIN_TOKENS_PER_CTA // unit_tokens)
        if uniform:
            min_units = _whole_requests_floor(groups, units_per_req, num_ctas, min_units,
                                              num_heads, kv_cache_dtype == torch.uint8)
    # units per CTA when every request has topk keys (what the device planner computes)
    units_per_cta = max(-(-groups * units_per_req // num_ctas), min_units)
    plan = SparsePlan(
        batch=batch, q_tokens_per_req=num_q_tokens_per_req, num_heads=num_heads, topk=topk,
        topk_length=topk_length, rows_per_cta=rows_per_cta, unit_tokens=unit_tokens,
        num_ctas=num_ctas,
        metadata=ws.metadata[:groups + 2],
        partial_out=ws.partial_out[:2 * num_ctas * num_heads * D_V].view(
            2 * num_ctas, num_heads, D_V),
        partial_lse=ws.partial_lse[:2 * num_ctas * num_heads].view(2 * num_ctas, num_heads),
        needs_combine=not uniform or units_per_cta % units_per_req != 0,
        uniform_units=units_per_req if uniform else 0,
        units_per_cta=units_per_cta if uniform else 0)
    if not uniform:  # lengths known on the GPU only: the planner kernel reads them there
        _extension.require("plan_sparse_decode")
        torch.ops.mla_backend.plan_sparse_decode(topk_length, plan.metadata,
                                                 num_q_tokens_per_req, topk, num_ctas, min_units,
                                                 unit_tokens)
    return plan


def _check_sparse_kv(kv: torch.Tensor, name: str, allow_flat: bool) -> None:
    kv = _require_tensor(name, kv)
    if kv.dtype == torch.float8_e4m3fn:
        raise TypeError(f"{name}: the sparse kernels read a bfloat16 cache or the 656-byte "
                        f"fp8_ds_mla cache (uint8), not a per-tensor float8_e4m3fn cache; got "
                        f"{_describe(kv)}")
    if kv.dtype not in (torch.bfloat16, torch.uint8):
        raise TypeError(f"{name} must be bfloat16 [.., {D_QK}] or uint8 fp8_ds_mla "
                        f"[.., {FP8_DS_MLA_BYTES}]; got {_describe(kv)}")
    width = D_QK if kv.dtype == torch.bfloat16 else FP8_DS_MLA_BYTES
    shapes = f"[num_blocks, {PAGE_SIZE}, {width}]" + (f" or [S, {width}]" if allow_flat else "")
    paged = kv.dim() == 3 and kv.shape[1:] == (PAGE_SIZE, width)
    flat = allow_flat and kv.dim() == 2 and kv.shape[1] == width
    _require(paged or flat, name, kv, f"must be {shapes} for dtype {kv.dtype}")
    item = kv.element_size()
    _require(kv.stride(-1) == 1 and kv.data_ptr() % 16 == 0
             and all((kv.stride(i) * item) % 16 == 0 for i in range(kv.dim() - 1)), name, kv,
             "must be 16-byte aligned with a contiguous last dim and 16-byte aligned strides")
    if kv.dtype == torch.bfloat16:
        # the bf16 producer addresses a row by a 32-bit offset in 16-byte units
        dims = zip(kv.shape[:-1], kv.stride()[:-1], strict=True)
        last_row = sum((n - 1) * st for n, st in dims) * item
        _require(last_row < 1 << 36, name, kv,
                 "must have its rows within 64 GiB of its first (the bf16 kernels address "
                 "rows by 32-bit offsets of 16 bytes); split the cache")


def _check_sparse_inputs(q, kv_cache, indices, *, allow_flat: bool,
                         kv_name: str = "kv_cache") -> None:
    """q [B, s_q, H, 576] bf16, the cache, indices int32 [B, s_q, topk]."""
    q = _require_tensor("q", q)
    indices = _require_tensor("indices", indices)
    _require(q.dim() == 4 and q.shape[3] == D_QK, "q", q,
             f"must be [batch, s_q, heads, {D_QK}]")
    if q.dtype != torch.bfloat16:
        raise TypeError(f"q must be bfloat16 for the sparse kernels; got {_describe(q)}")
    batch, s_q, heads, _ = q.shape
    _require(s_q >= 1 and 1 <= heads <= MAX_HEADS, "q", q,
             f"must have s_q >= 1 and heads in [1, {MAX_HEADS}]")
    _require(q.stride(3) == 1 and all(q.stride(i) % 8 == 0 for i in range(3))
             and q.data_ptr() % 16 == 0, "q", q,
             "must be 16-byte aligned with a contiguous last dim and 16-byte aligned strides")
    _check_sparse_kv(kv_cache, kv_name, allow_flat)
    _require(indices.dim() == 3 and indices.shape[:2] == (batch, s_q)
             and indices.dtype == torch.int32 and indices.stride(2) == 1
             and 1 <= indices.shape[2] <= MAX_TOPK, "indices", indices,
             f"must be int32 [batch={batch}, s_q={s_q}, topk <= {MAX_TOPK}] with a contiguous "
             "last dim")


def _check_sparse_args(q, kv_cache, indices, plan, softmax_scale, topk_length, out, *,
                       allow_flat: bool, kv_name: str = "kv_cache"):
    _check_sparse_inputs(q, kv_cache, indices, allow_flat=allow_flat, kv_name=kv_name)
    batch, s_q, heads, _ = q.shape
    if not isinstance(plan, SparsePlan):
        raise TypeError(f"plan must be a SparsePlan from plan_sparse_decode; got "
                        f"{type(plan).__name__}")
    topk = indices.shape[2]
    if (plan.batch, plan.q_tokens_per_req, plan.num_heads, plan.topk) != (batch, s_q, heads, topk):
        raise ValueError(f"plan is for batch {plan.batch}, s_q {plan.q_tokens_per_req}, H "
                         f"{plan.num_heads}, topk {plan.topk}; q / indices have batch {batch}, "
                         f"s_q {s_q}, H {heads}, topk {topk}")
    if topk_length is not plan.topk_length:
        raise ValueError("topk_length must be the tensor the plan was made with "
                         "(plan_sparse_decode(..., topk_length=...)); the plan's units cover "
                         "its lengths")
    if not (isinstance(softmax_scale, (float, int)) and math.isfinite(softmax_scale)
            and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite float; got {softmax_scale!r}")
    tensors = {"q": q, kv_name: kv_cache, "indices": indices, "plan.metadata": plan.metadata}
    if topk_length is not None:
        tensors["topk_length"] = topk_length
    if out is not None:
        out = _require_tensor("out", out)
        _require(out.shape == (batch, s_q, heads, D_V) and out.dtype == q.dtype
                 and out.is_contiguous(), "out", out,
                 f"must be contiguous {q.dtype} [{batch}, {s_q}, {heads}, {D_V}]")
        tensors["out"] = out
    _require_cuda(tensors, q.device)


def sparse_mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor,
                      plan: SparsePlan, softmax_scale: float,
                      topk_length: torch.Tensor | None = None,
                      out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse (DSA) decode over a paged cache.

    q [B, s_q, H, 576] bf16 (any H from 1 to 128); kv_cache [num_blocks, 64, 576] bf16 or
    [num_blocks, 64, 656] uint8 fp8_ds_mla (formats.py), strided views fine; indices int32
    [B, s_q, topk]: global slots block * 64 + offset, -1 (or any slot outside the cache) =
    skipped, duplicates count as often as they appear; topk_length int32 [B] (optional: only
    the first topk_length[b] entries of entry b are read) — the tensor given to
    plan_sparse_decode. No causal mask: the indices say what each query sees.
    Returns out [B, s_q, H, 512] bf16 and lse [B, s_q, H] float32 (natural log); a query
    with no valid index gets out = 0, lse = -inf.
    """
    if topk_length is None and isinstance(plan, SparsePlan):
        topk_length = plan.topk_length
    _check_sparse_args(q, kv_cache, indices, plan, softmax_scale, topk_length, out,
                       allow_flat=False)
    return _run_sparse(q, kv_cache, indices, plan, softmax_scale, topk_length, out)


def _run_sparse(q, kv, indices, plan, softmax_scale, topk_length, out):
    _extension.require("sparse_mla_decode")
    _require_hopper("sparse_mla_decode", q.device)
    out, lse = _out_and_lse(q, out)
    torch.ops.mla_backend.sparse_mla_decode(
        q, kv, indices, topk_length, plan.metadata, plan.partial_out, plan.partial_lse, out,
        lse, plan.num_ctas, plan.rows_per_cta, float(softmax_scale), bool(plan.needs_combine),
        plan.uniform_units, plan.units_per_cta)
    return out, lse


def sparse_mla_prefill(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                       softmax_scale: float, topk_length: torch.Tensor | None = None, *,
                       plan: SparsePlan | None = None,
                       out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse prefill: q [T, H, 576] bf16; kv [S, 576] bf16 (rows = slots) or a paged cache
    as in sparse_mla_decode (bf16 or fp8_ds_mla; [S, 656] uint8 flat too); indices int32
    [T, topk] (-1 or out of range = skipped); topk_length int32 [T] (optional). Every token
    is its own request: `plan` (plan_sparse_decode(T, 1, H, topk, topk_length=...)) is made
    here when not given. Returns out [T, H, 512] bf16 and lse [T, H] float32."""
    q = _require_tensor("q", q)
    indices = _require_tensor("indices", indices)
    _require(q.dim() == 3 and q.shape[2] == D_QK, "q", q, f"must be [tokens, heads, {D_QK}]")
    _require(indices.dim() == 2 and indices.shape[0] == q.shape[0], "indices", indices,
             f"must be int32 [tokens={q.shape[0]}, topk]")
    if out is not None:
        out = _require_tensor("out", out)
        _require(out.dim() == 3, "out", out, f"must be [tokens, heads, {D_V}]")
        out = out.unsqueeze(1)
    q4, idx3 = q.unsqueeze(1), indices.unsqueeze(1)
    if plan is None:
        _check_sparse_inputs(q4, kv, idx3, allow_flat=True, kv_name="kv")
        _require_cuda({"q": q, "kv": kv, "indices": indices}, q.device)
        plan = plan_sparse_decode(q.shape[0], 1, q.shape[1], indices.shape[1],
                                  topk_length=topk_length, device=q.device,
                                  kv_cache_dtype=kv.dtype)
    elif topk_length is None:
        topk_length = plan.topk_length
    _check_sparse_args(q4, kv, idx3, plan, softmax_scale, topk_length, out, allow_flat=True,
                       kv_name="kv")
    o, lse = _run_sparse(q4, kv, idx3, plan, softmax_scale, topk_length, out)
    return o.squeeze(1), lse.squeeze(1)
