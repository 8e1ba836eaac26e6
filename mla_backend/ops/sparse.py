"""Sparse (DSA) attention: every query token attends to its own list of cache slots. The
planner (plan_sparse_decode, sparse_workspace) and the ops (sparse_mla_decode,
sparse_mla_prefill). Float32 twins: mla_backend.reference.sparse_mla_decode / _prefill."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import _extension, formats
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
    rows_in_place,
)
from .cost_model import _min_units, _whole_requests_floor

MAX_TOPK = 16384
FP8_DS_MLA_BYTES = formats.FP8_DS_MLA_BYTES
MAX_SPARSE_GROUPS = 65535  # query tokens (batch * s_q) per call: the combine grid's y-dim

# The sparse kernel's tile at every H: the wgmma kernel with a gathering producer warpgroup,
# 64-row tiles (one CTA per SM) and 64-entry units, so a gathered key serves up to 64 heads.
# H < 64 pads the tile: at H = 16 it still beat the mma.sync kernel's 16-row tiles on every
# bench row on the H100 (decode 3-36%, prefill 30%). Must agree with the wgmma kernel's
# kRows and kUnitWgmma.
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


def plan_sparse_decode(batch: int, num_q_tokens_per_req: int, num_heads: int, topk: int, *,
                       topk_length: torch.Tensor | None = None,
                       device: torch.device | str | None = None, num_sms: int | None = None,
                       workspace: SparseWorkspace | None = None,
                       kv_cache_dtype: torch.dtype = torch.bfloat16,
                       _min_units_per_cta: int | None = None) -> SparsePlan:
    """Plan sparse attention for q [batch, s_q, H, 576] and indices [batch, s_q, topk]:
    one request per (entry, query token) with min(topk_length[b], topk) keys (topk_length
    int32 [batch] on the GPU, read there: no host sync), or topk keys. Buffers from
    `workspace` (sparse_workspace) or fresh ones on `device` (default: topk_length's).
    kv_cache_dtype is the dtype of the cache the plan will run on (torch.bfloat16, or
    torch.uint8 for fp8_ds_mla): it tunes the schedule only, a plan is correct on either.
    _min_units_per_cta (64-entry units, for tests) replaces the schedule's floor on the work
    of one CTA, to force split or whole-request schedules."""
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
    if _min_units_per_cta is not None and not (isinstance(_min_units_per_cta, int)
                                               and _min_units_per_cta >= 1):
        raise ValueError(f"_min_units_per_cta must be a positive int; got "
                         f"{_min_units_per_cta!r}")
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
    if _min_units_per_cta is not None:
        min_units = _min_units_per_cta
    else:
        min_units = _min_units(unit_tokens)
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


def _query_names(q_pe: torch.Tensor | None) -> tuple[str, int]:
    """The name errors give the query's first tensor, and that tensor's width: the whole
    query q [.., 576], or the latent part of the pair (q_nope, q_pe) [.., 512]."""
    return ("q", D_QK) if q_pe is None else ("q_nope (q[0])", D_V)


def _query_tensors(q: torch.Tensor, q_pe: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The query's tensors by the names errors give them (for the device checks)."""
    name = _query_names(q_pe)[0]
    return {name: q} if q_pe is None else {name: q, "q_pe (q[1])": q_pe}


def _check_sparse_inputs(q, kv_cache, indices, *, allow_flat: bool,
                         kv_name: str = "kv_cache") -> None:
    """q [B, s_q, H, 576] bf16 or the pair (q_nope [B, s_q, H, 512], q_pe [B, s_q, H, 64]),
    the cache, indices int32 [B, s_q, topk]. One whole q must be 16-byte aligned with 16-byte
    multiple strides (the kernels read it by TMA); a pair may have any strides: parts the TMA
    cannot read in place are joined by one copy (_kernel_query)."""
    q, q_pe = _query_parts(q)
    qname, width = _query_names(q_pe)
    indices = _require_tensor("indices", indices)
    _require(q.dim() == 4 and q.shape[3] == width, qname, q,
             f"must be [batch, s_q, heads, {width}]")
    if q.dtype != torch.bfloat16:
        raise TypeError(f"{qname} must be bfloat16 for the sparse kernels; got {_describe(q)}")
    batch, s_q, heads, _ = q.shape
    _require(s_q >= 1 and 1 <= heads <= MAX_HEADS, qname, q,
             f"must have s_q >= 1 and heads in [1, {MAX_HEADS}]")
    if q_pe is None:
        _require_aligned_rows("q", q)
    _check_sparse_kv(kv_cache, kv_name, allow_flat)
    _require(indices.dim() == 3 and indices.shape[:2] == (batch, s_q)
             and indices.dtype == torch.int32 and indices.stride(2) == 1
             and 1 <= indices.shape[2] <= MAX_TOPK, "indices", indices,
             f"must be int32 [batch={batch}, s_q={s_q}, topk <= {MAX_TOPK}] with a contiguous "
             "last dim")


def _kernel_query(q) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The checked query as the kernels' TMA reads it: (q, None) for one whole q; the pair
    (q_nope, q_pe) as it lies when both parts' rows are 16-byte aligned with 16-byte multiple
    strides, else the two joined by one copy into a new [.., 576] tensor."""
    q, q_pe = _query_parts(q)
    if q_pe is not None and not (rows_in_place(q) and rows_in_place(q_pe)):
        return torch.cat((q, q_pe), dim=-1), None
    return q, q_pe


def _check_sparse_args(q, kv_cache, indices, plan, softmax_scale, topk_length, out, lse=None, *,
                       allow_flat: bool, kv_name: str = "kv_cache"):
    _check_sparse_inputs(q, kv_cache, indices, allow_flat=allow_flat, kv_name=kv_name)
    q, q_pe = _query_parts(q)
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
    _check_softmax_scale(softmax_scale)
    tensors = {**_query_tensors(q, q_pe), kv_name: kv_cache, "indices": indices,
               "plan.metadata": plan.metadata}
    if topk_length is not None:
        tensors["topk_length"] = topk_length
    if out is not None:
        out = _require_tensor("out", out)
        _require(out.shape == (batch, s_q, heads, D_V) and out.dtype == q.dtype
                 and out.is_contiguous(), "out", out,
                 f"must be contiguous {q.dtype} [{batch}, {s_q}, {heads}, {D_V}]")
        tensors["out"] = out
    if lse is not None:
        tensors["lse"] = _check_lse(lse, (batch, s_q, heads))
    _require_cuda(tensors, q.device)


def sparse_mla_decode(q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                      indices: torch.Tensor, plan: SparsePlan, softmax_scale: float,
                      topk_length: torch.Tensor | None = None,
                      out: torch.Tensor | None = None,
                      lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse (DSA) decode over a paged cache.

    q [B, s_q, H, 576] bf16 (any H from 1 to 128), or the pair (q_nope [B, s_q, H, 512],
    q_pe [B, s_q, H, 64]) read through their own strides (vLLM's and SGLang's absorbed query
    comes in two parts: no copy to join them; parts whose rows are not 16-byte aligned with
    16-byte multiple strides are joined by one copy); kv_cache [num_blocks, 64, 576] bf16 or
    [num_blocks, 64, 656] uint8 fp8_ds_mla (formats.py), strided views fine; indices int32
    [B, s_q, topk]: global slots block * 64 + offset, -1 (or any slot outside the cache) =
    skipped, duplicates count as often as they appear; topk_length int32 [B] (optional: only
    the first topk_length[b] entries of entry b are read) — the tensor given to
    plan_sparse_decode. No causal mask: the indices say what each query sees.
    Returns out [B, s_q, H, 512] bf16 and lse [B, s_q, H] float32 (natural log); a query
    with no valid index gets out = 0, lse = -inf. out / lse: caller-owned outputs to write
    (contiguous, [B, s_q, H, 512] bf16 / [B, s_q, H] float32), else new ones.
    """
    if topk_length is None and isinstance(plan, SparsePlan):
        topk_length = plan.topk_length
    _check_sparse_args(q, kv_cache, indices, plan, softmax_scale, topk_length, out, lse,
                       allow_flat=False)
    return _run_sparse(q, kv_cache, indices, plan, softmax_scale, topk_length, out, lse)


def _run_sparse(q, kv, indices, plan, softmax_scale, topk_length, out, lse=None):
    _extension.require("sparse_mla_decode")
    q, q_pe = _kernel_query(q)
    _require_hopper("sparse_mla_decode", q.device)
    out, lse = _out_and_lse(q, out, lse)
    torch.ops.mla_backend.sparse_mla_decode(
        q, q_pe, kv, indices, topk_length, plan.metadata, plan.partial_out, plan.partial_lse, out,
        lse, plan.num_ctas, plan.rows_per_cta, float(softmax_scale), bool(plan.needs_combine),
        plan.uniform_units, plan.units_per_cta)
    return out, lse


def sparse_mla_prefill(q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv: torch.Tensor,
                       indices: torch.Tensor, softmax_scale: float,
                       topk_length: torch.Tensor | None = None, *,
                       plan: SparsePlan | None = None, out: torch.Tensor | None = None,
                       lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse prefill: q [T, H, 576] bf16, or the pair (q_nope [T, H, 512], q_pe [T, H, 64])
    as in sparse_mla_decode; kv [S, 576] bf16 (rows = slots) or a paged cache as in
    sparse_mla_decode (bf16 or fp8_ds_mla; [S, 656] uint8 flat too); indices int32
    [T, topk] (-1 or out of range = skipped); topk_length int32 [T] (optional). Every token
    is its own request: `plan` (plan_sparse_decode(T, 1, H, topk, topk_length=...)) is made
    here when not given. Returns out [T, H, 512] bf16 and lse [T, H] float32 (the caller's
    out / lse when given: contiguous, those shapes and dtypes)."""
    q_main, q_pe = _query_parts(q)
    qname, width = _query_names(q_pe)
    indices = _require_tensor("indices", indices)
    _require(q_main.dim() == 3 and q_main.shape[2] == width, qname, q_main,
             f"must be [tokens, heads, {width}]")
    tokens, heads = q_main.shape[:2]
    _require(indices.dim() == 2 and indices.shape[0] == tokens, "indices", indices,
             f"must be int32 [tokens={tokens}, topk]")
    if out is not None:
        out = _require_tensor("out", out)
        _require(out.dim() == 3, "out", out, f"must be [tokens, heads, {D_V}]")
        out = out.unsqueeze(1)
    if lse is not None:
        lse = _check_lse(lse, (tokens, heads)).unsqueeze(1)
    # every token its own request of one query token
    q4 = q_main.unsqueeze(1) if q_pe is None else (q_main.unsqueeze(1), q_pe.unsqueeze(1))
    idx3 = indices.unsqueeze(1)
    if plan is None:
        _check_sparse_inputs(q4, kv, idx3, allow_flat=True, kv_name="kv")
        _require_cuda({**_query_tensors(q_main, q_pe), "kv": kv, "indices": indices},
                      q_main.device)
        plan = plan_sparse_decode(tokens, 1, heads, indices.shape[1],
                                  topk_length=topk_length, device=q_main.device,
                                  kv_cache_dtype=kv.dtype)
    elif topk_length is None:
        topk_length = plan.topk_length
    _check_sparse_args(q4, kv, idx3, plan, softmax_scale, topk_length, out, lse,
                       allow_flat=True, kv_name="kv")
    o, lse = _run_sparse(q4, kv, idx3, plan, softmax_scale, topk_length, out, lse)
    return o.squeeze(1), lse.squeeze(1)
