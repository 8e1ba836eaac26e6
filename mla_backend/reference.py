"""Float32 (or float64) PyTorch references for every op in mla_backend.ops.

Each function has the signature of its kernel twin (the `plan` argument is accepted and
ignored), runs on any device, and is vectorised: one gather of the attended keys, one
batched QK^T, one masked softmax, one batched PV.

Conventions (shared with the kernels):
- d_qk = 576 (512 latent + 64 rope), d_v = 512: V is the first 512 columns of K.
- lse is the natural-log log-sum-exp of the *scaled* scores (vLLM's lse_base_on_e=True).
- A query row that attends to no key (zero-length request, causal row before the first
  key, all indices invalid) gets out = 0 and lse = -inf.
- Keys that are not attended never reach the arithmetic: NaN or garbage in unused pages,
  unused block-table entries or padded index slots cannot change the result.
- Dense causal rule: query i (0-based) of a request with s_q query tokens and seq_len
  keys sees keys k < seq_len - s_q + i + 1 (the query tokens are the last s_q keys).
"""

from __future__ import annotations

import torch

from . import formats

D_QK = 576
D_V = 512
PAGE_SIZE = 64
WHOLE_SHARE_DIVISOR = 32  # whole requests may cost 1/32 of the share (splitkv/planner.cu)
PAD_MAX_BATCH = 256  # padded plans up to this many requests (splitkv/planner.h kPadMaxBatch)
MAX_CTAS_PER_REQUEST = 88  # no request split over more CTAs (splitkv/planner.h kMaxCtasPerRequest)
LPT_MAX_BATCH = 1024  # longest-first plans up to this many requests (the planner's one block)
LPT_MAX_UNITS = 1 << 21  # ... and under this many units (a CTA's load and index share 32 bits)
LPT_MAX_CTAS = 256  # ... on at most this many CTAs (8 a lane of the planner's warp)


def _dequantize_rows(rows: torch.Tensor, kv_scale: torch.Tensor | float | None,
                     dtype: torch.dtype) -> torch.Tensor:
    """Cache rows ([..., 576] bf16/fp16/fp8 or [..., 656] uint8 fp8_ds_mla) -> [..., 576] dtype."""
    if rows.dtype == torch.uint8 and rows.shape[-1] == formats.FP8_DS_MLA_BYTES:
        return formats.dequantize_fp8_ds_mla(rows).to(dtype)
    if rows.dtype == torch.float8_e4m3fn:
        if kv_scale is None:
            raise ValueError("kv_scale is required for a float8_e4m3fn KV cache")
        return formats.dequantize_fp8_per_tensor(rows, kv_scale).to(dtype)
    if rows.dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        return rows.to(dtype)
    raise TypeError(f"unsupported KV cache rows: shape {tuple(rows.shape)} dtype {rows.dtype}")


def _attend(scores: torch.Tensor, valid: torch.Tensor, values: torch.Tensor,
            pv_equation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax over the last dim of `scores` and the PV product.

    scores [..., H, K] already scaled; valid broadcastable to scores; values hold zeros at
    invalid keys (so 0 * NaN cannot occur)."""
    scores = scores.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # rows with no valid key (lse -inf) give 0; a NaN among the keys or q gives a NaN row
    attended = lse != float("-inf")
    probs = torch.exp(scores - torch.where(attended, lse, 0.0).unsqueeze(-1))
    probs = torch.where(valid & attended.unsqueeze(-1), probs, 0.0)
    out = torch.einsum(pv_equation, probs, values)
    return out, lse


def _whole_query(q) -> torch.Tensor:
    """q [..., 576], or the pair (q_nope [..., 512], q_pe [..., 64]) joined into one."""
    if isinstance(q, (tuple, list)):
        return torch.cat(tuple(q), dim=-1)
    return q


def _finish(out: torch.Tensor, lse: torch.Tensor, out_buf: torch.Tensor | None):
    if out_buf is not None:
        out_buf.copy_(out)
        return out_buf, lse
    return out, lse


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, plan: object, softmax_scale: float,
               causal: bool = True, kv_scale: torch.Tensor | float | None = None,
               out: torch.Tensor | None = None, *,
               compute_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense paged decode. q [B, s_q, H, 576] or (q_nope [..., 512], q_pe [..., 64]);
    kv_cache [num_blocks, 64, 576]; block_table [B, max_blocks]; seq_lens [B]. Returns out
    [B, s_q, H, 512] and lse [B, s_q, H] in compute_dtype (out is copied into `out` when
    given)."""
    del plan
    q = _whole_query(q)
    B, s_q, H, _ = q.shape
    page = kv_cache.shape[1]
    seq_lens = seq_lens.to(torch.int64)
    max_len = int(seq_lens.max().item()) if B > 0 else 0
    if max_len > block_table.shape[1] * page:
        raise ValueError(f"seq_lens up to {max_len} need more than block_table's "
                         f"{block_table.shape[1]} blocks of {page}")
    pos = torch.arange(max_len, device=q.device)                          # [K]
    in_seq = pos.unsqueeze(0) < seq_lens.unsqueeze(1)                     # [B, K]
    blocks = block_table.to(torch.int64)[:, pos // page]                  # [B, K]
    blocks = torch.where(in_seq, blocks, 0)                               # garbage-proof
    rows = kv_cache[blocks, (pos % page).unsqueeze(0).expand_as(blocks)]  # [B, K, bytes]
    keys = _dequantize_rows(rows, kv_scale, compute_dtype)
    keys = torch.where(in_seq.unsqueeze(-1), keys, 0.0)                   # NaN-proof

    limit = seq_lens.view(B, 1)
    if causal:
        limit = limit - s_q + 1 + torch.arange(s_q, device=q.device).view(1, s_q)
    valid = pos.view(1, 1, -1) < limit.expand(B, s_q).unsqueeze(-1)       # [B, s_q, K]

    scores = torch.einsum("bqhd,bkd->bqhk", q.to(compute_dtype), keys) * softmax_scale
    o, lse = _attend(scores, valid.unsqueeze(2), keys[..., :D_V], "bqhk,bkd->bqhd")
    return _finish(o, lse, out)


def _gather_slots(kv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows of a flat [S, bytes] or paged [num_blocks, page, bytes] KV tensor at slots."""
    if kv.dim() == 2:
        return kv[slots]
    page = kv.shape[1]
    return kv[slots // page, slots % page]


def _sparse_attend(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                   softmax_scale: float, topk_length: torch.Tensor | None,
                   kv_scale, compute_dtype: torch.dtype):
    """q [N, s, H, 576], indices [N, s, topk] into kv's slots; topk_length [N] or None."""
    num_slots = kv.shape[0] if kv.dim() == 2 else kv.shape[0] * kv.shape[1]
    idx = indices.to(torch.int64)
    # -1 pads; any other slot outside the cache is skipped too (the kernels cannot raise
    # from the GPU without a host sync; FlashMLA's sparse prefill does the same)
    valid = (idx >= 0) & (idx < num_slots)
    if topk_length is not None:
        j = torch.arange(idx.shape[-1], device=idx.device)
        valid &= j.view(1, 1, -1) < topk_length.to(torch.int64).view(-1, 1, 1)
    rows = _gather_slots(kv, torch.where(valid, idx, 0))                  # [N, s, topk, bytes]
    keys = _dequantize_rows(rows, kv_scale, compute_dtype)
    keys = torch.where(valid.unsqueeze(-1), keys, 0.0)
    scores = torch.einsum("nshd,nskd->nshk", q.to(compute_dtype), keys) * softmax_scale
    return _attend(scores, valid.unsqueeze(2), keys[..., :D_V], "nshk,nskd->nshd")


def sparse_mla_decode(q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                      kv_cache: torch.Tensor, indices: torch.Tensor, plan: object,
                      softmax_scale: float,
                      topk_length: torch.Tensor | None = None,
                      out: torch.Tensor | None = None, *, kv_scale=None,
                      compute_dtype: torch.dtype = torch.float32):
    """Sparse (DSA) decode. q [B, s_q, H, 576] or (q_nope [..., 512], q_pe [..., 64]);
    kv_cache [num_blocks, 64, 576] bf16 or [num_blocks, 64, 656] uint8 fp8_ds_mla; indices
    [B, s_q, topk] global slots (block * 64 + offset; -1 or any slot outside the cache = none;
    duplicates count as often as they appear);
    topk_length [B]: only the first topk_length[b] indices of request b are read."""
    del plan
    o, lse = _sparse_attend(_whole_query(q), kv_cache, indices, softmax_scale, topk_length,
                            kv_scale, compute_dtype)
    return _finish(o, lse, out)


def sparse_mla_prefill(q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv: torch.Tensor,
                       indices: torch.Tensor, softmax_scale: float,
                       topk_length: torch.Tensor | None = None, *,
                       kv_scale=None, compute_dtype: torch.dtype = torch.float32):
    """Sparse prefill. q [T, H, 576] or (q_nope [T, H, 512], q_pe [T, H, 64]); kv [S, 576]
    (flat) or a paged cache; indices [T, topk] row / slot ids (-1 = none); topk_length [T].
    Returns out [T, H, 512], lse [T, H]."""
    o, lse = _sparse_attend(_whole_query(q).unsqueeze(1), kv, indices.unsqueeze(1),
                            softmax_scale, topk_length, kv_scale, compute_dtype)
    return o.squeeze(1), lse.squeeze(1)


def merge_by_lse(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over disjoint key sets: outs [P, ..., 512], lses [P, ...].
    Parts with lse = -inf contribute nothing; if all are -inf the result is (0, -inf)."""
    lse = torch.logsumexp(lses, dim=0)
    finite = torch.isfinite(lse)
    weights = torch.exp(lses - torch.where(finite, lse, 0.0).unsqueeze(0))
    weights = torch.where(torch.isfinite(lses) & finite.unsqueeze(0), weights, 0.0)
    return (weights.unsqueeze(-1) * outs).sum(0), lse


def _equal_whole_u(units: list[int], num_ctas: int, min_units: int, whole_extra: int) -> int | None:
    """The equal-lengths plan's U (whole requests per CTA) where plan_decode_metadata takes it:
    whole_extra >= 0, every request u > 0 units, and u * max(ceil(B / num_ctas),
    ceil(min_units / u)) at most max(whole_extra, balanced U // WHOLE_SHARE_DIVISOR) above the
    balanced U; else None."""
    if whole_extra < 0 or not units or min(units) != max(units) or units[0] <= 0:
        return None
    u, per_cta = units[0], max(-(-sum(units) // num_ctas), min_units)
    whole = u * max(-(-len(units) // num_ctas), -(-min_units // u))
    return whole if whole - per_cta <= max(whole_extra, per_cta // WHOLE_SHARE_DIVISOR) else None


def plan_decode_metadata(seq_lens: torch.Tensor, num_ctas: int, min_units: int,
                         unit_tokens: int = 32, whole_extra: int = -1,
                         align_extra: int = -1, restart_pad: int = -1,
                         lpt_extra: int = -1, one_unit_max: int = -1) -> torch.Tensor:
    """Twin of the GPU planner: int32 [B + 2] = unit prefix sums P[0..B] (request b owns
    units [P[b], P[b+1]), a unit being unit_tokens keys) and U, the units per CTA. With
    whole_extra >= 0 and every request of the same u > 0 units, U is a whole number of
    requests, u * max(ceil(B / num_ctas), ceil(min_units / u)), when that is at most
    max(whole_extra, balanced U // WHOLE_SHARE_DIVISOR) above the balanced U. Otherwise, with
    align_extra >= 0 and 2 <= B <= min(num_ctas, 1024): aligned, if some U at most align_extra above
    the balanced one has sum(ceil(units / U)) <= num_ctas; the smallest such U, and
    P[b + 1] = U * sum(ceil(units[:b + 1] / U)) (request b's units past its own are padding).
    Otherwise, with restart_pad >= 0 and 2 <= B <= PAD_MAX_BATCH: padded, for the smallest U of
    per_cta .. per_cta + 31 whose layout fits num_ctas * U units: each request but the last that
    ends inside a CTA's range is followed by restart_pad units of padding, or by the units left
    to that CTA's end where fewer remain.
    With lpt_extra >= 0 the result is int32 [2B + 2]: the plan over an order of the requests
    and, after U, that order (perm[v] = the request at position v; the identity unless chosen
    here): where B <= 1024, num_ctas <= 256, at least num_ctas requests have units and their
    total is under 2^21 units, whole requests longest first (whole_requests_longest_first)
    when their U is at most max(lpt_extra, balanced U // WHOLE_SHARE_DIVISOR) above the
    balanced U and no equal-lengths whole plan was taken; otherwise the plan above in the
    requests' own order.
    With one_unit_max >= 0 and at most one_unit_max units in all, min_units is 1 (a small
    step: more, shorter CTAs). Then min_units is at least ceil(the longest request's units /
    MAX_CTAS_PER_REQUEST): no request is split over more CTAs than that."""
    all_units = (seq_lens.to(torch.int64).clamp_min(0) + unit_tokens - 1) // unit_tokens
    if one_unit_max >= 0 and int(all_units.sum()) <= one_unit_max:
        min_units = 1
    if all_units.numel():
        min_units = max(min_units, -(-int(all_units.max()) // MAX_CTAS_PER_REQUEST))
    if lpt_extra >= 0:
        plain = plan_decode_metadata(seq_lens, num_ctas, min_units, unit_tokens, whole_extra,
                                     align_extra, restart_pad)
        batch = seq_lens.shape[0]
        units = [int(x) for x in ((seq_lens.to(torch.int64).clamp_min(0) + unit_tokens - 1)
                                  // unit_tokens).tolist()]
        per_cta = max(-(-sum(units) // num_ctas), min_units)
        if (_equal_whole_u(units, num_ctas, min_units, whole_extra) is None
                and batch <= LPT_MAX_BATCH and num_ctas <= LPT_MAX_CTAS
                and sum(u > 0 for u in units) >= num_ctas
                and sum(units) < LPT_MAX_UNITS):
            u_cta, perm, prefix = whole_requests_longest_first(units, num_ctas)
            if u_cta - per_cta <= max(lpt_extra, per_cta // WHOLE_SHARE_DIVISOR):
                return torch.tensor(prefix + [u_cta] + perm, dtype=torch.int32)
        return torch.cat([plain, torch.arange(batch, dtype=torch.int32)])
    units = (seq_lens.to(torch.int64).clamp_min(0) + unit_tokens - 1) // unit_tokens
    prefix = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int64)
    prefix[1:] = torch.cumsum(units.cpu(), 0)
    total = int(prefix[-1])
    per_cta = max(-(-total // num_ctas), min_units)
    batch = units.shape[0]
    whole = _equal_whole_u([int(x) for x in units.tolist()], num_ctas, min_units, whole_extra)
    if whole is not None:
        return torch.cat([prefix, torch.tensor([whole])]).to(torch.int32)
    if align_extra >= 0 and 2 <= batch <= min(num_ctas, 1024):
        for u_cta in range(per_cta, per_cta + align_extra + 1):
            ctas = (units.cpu() + u_cta - 1) // u_cta
            if int(ctas.sum()) <= num_ctas:
                prefix[1:] = torch.cumsum(ctas, 0) * u_cta
                return torch.cat([prefix, torch.tensor([u_cta])]).to(torch.int32)
    if restart_pad >= 0 and 2 <= batch <= PAD_MAX_BATCH:
        own = [int(x) for x in units.tolist()]
        for u_cta in range(per_cta, per_cta + 32):
            pos, starts = 0, [0]
            for b, u in enumerate(own):
                pos += u
                end = pos % u_cta  # the request's end, from its CTA's first unit
                if u > 0 and end != 0 and b < batch - 1:
                    pos += min(restart_pad, u_cta - end)
                starts.append(pos)
            if pos <= num_ctas * u_cta:
                return torch.tensor(starts + [u_cta], dtype=torch.int32)
    return torch.cat([prefix, torch.tensor([per_cta])]).to(torch.int32)


def whole_requests_longest_first(units: list[int],
                                 num_ctas: int) -> tuple[int, list[int], list[int]]:
    """Whole requests (none split) on num_ctas CTAs, longest first, dealt in rounds of
    num_ctas: in each round the i-th longest of the round's requests goes to the CTA i-th
    least loaded before the round (loads in units; ties: the lower CTA); requests of no units
    last. Returns U (the most units of one CTA), the order (perm[v] = the request at position
    v) and the prefix P over that order: CTA c's requests start at c * U, one after another,
    and the last of them is padded to (c + 1) * U; the requests of no units sit at the end
    (P = the last CTA's end)."""
    batch = len(units)
    order = sorted((b for b in range(batch) if units[b] > 0), key=lambda b: (-units[b], b))
    load = [0] * num_ctas
    members: list[list[int]] = [[] for _ in range(num_ctas)]
    for first in range(0, len(order), num_ctas):
        ctas = sorted(range(num_ctas), key=lambda i: (load[i], i))
        # the last round may have fewer requests than CTAs: the least loaded take them
        for b, c in zip(order[first:first + num_ctas], ctas, strict=False):
            load[c] += units[b]
            members[c].append(b)
    per_cta = max(load) if order else 0
    perm, prefix = [], [0]
    used = [c for c in range(num_ctas) if members[c]]
    for c in used:
        pos = c * per_cta
        for i, b in enumerate(members[c]):
            perm.append(b)
            pos += units[b]
            prefix.append((c + 1) * per_cta if i == len(members[c]) - 1 else pos)
    end = prefix[-1]
    for b in range(batch):
        if units[b] <= 0:
            perm.append(b)
            prefix.append(end)
    return per_cta, perm, prefix


def decode_schedule(metadata: torch.Tensor, num_ctas: int,
                    units: list[int] | None = None) -> list[list[tuple[int, int, int, int]]]:
    """The pieces each CTA computes under a plan: per CTA a list of
    (request, first_unit, end_unit, slot), slot = -1 when the request lies wholly inside
    the CTA (written straight to the output), else its partial slot (0: the CTA's first
    request, 1: its last). units (each request's own units; None: its whole plan range)
    clamps a piece as the dense kernels do (an aligned plan's padding is computed by no CTA;
    a CTA of the request whose range is all padding would keep an empty piece). Mirrors
    csrc/splitkv/schedule.cuh for the planner tests."""
    meta = [int(x) for x in metadata.tolist()]
    prefix, per_cta = meta[:-1], meta[-1]
    batch, total = len(prefix) - 1, prefix[-1]
    schedule = []
    for cta in range(num_ctas):
        begin, end = cta * per_cta, min((cta + 1) * per_cta, total)
        pieces = []
        for r in range(batch):
            lo, hi = max(prefix[r], begin), min(prefix[r + 1], end)
            if lo >= hi:
                continue
            if units is not None:
                hi = min(hi, prefix[r] + units[r])
            split = prefix[r] // per_cta != (prefix[r + 1] - 1) // per_cta
            slot = (0 if prefix[r] <= begin else 1) if split else -1
            pieces.append((r, lo - prefix[r], hi - prefix[r], slot))
        schedule.append(pieces)
    return schedule
