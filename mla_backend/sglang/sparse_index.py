"""SGLang's DSA batch -> what ops.sparse_mla_decode reads: one row of cache slots per query
token, and the cache as 64-token pages.

Pure tensor code (any device): the cpu tier checks it on hand-worked cases, the backend runs it
on the GPU. Every query token is its own request for our kernel, so only the slots matter.

Top-k indices reach the backend in one of two forms (SGLang's DeepseekSparseAttnBackend
reads them the same way):
  fused top-k (SGLANG_DSA_FUSE_TOPK, the default): the indexer's top-k kernel already wrote
    cache slots (req_to_token values), -1 for none;
  unfused: token positions within the request, -1 for none; the slot of position p of the
    request a query token belongs to is page_table_1[row, p], page_table_1 being
    req_to_token rows (one per request, or one per query token when SGLang expanded them
    for target-verify and draft-extend v2).
The backend asks the indexer for cache-slot (PAGED) indices in every mode, never for
positions in a gathered ragged buffer.
"""

from __future__ import annotations

import torch

from .support import PAGE_SIZE


def query_rows(mode, batch_size: int, extend_seq_lens_cpu, device) -> torch.Tensor | None:
    """The page_table_1 row of each query token (int64 [tokens]), or None where row = token.

    decode: one token per request (row r). target-verify / draft-extend v2: SGLang repeats
    each request's row once per query token, so row = token. Other extends (prefill, chunked
    prefill, draft-extend): token t of request r reads row r, r repeated extend_seq_lens[r]
    times (the host list SGLang keeps for extends)."""
    if mode.is_decode_or_idle():
        return torch.arange(batch_size, device=device)
    if mode.is_target_verify() or mode.is_draft_extend_v2():
        return None  # expanded table: row = token, see slots_from_positions
    if extend_seq_lens_cpu is None:
        raise ValueError(f"{mode} needs extend_seq_lens_cpu to map top-k positions to slots")
    lens = torch.as_tensor(list(extend_seq_lens_cpu), dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(lens.shape[0]), lens)
    return rows.to(device, non_blocking=True)


def slots_from_positions(page_table_1: torch.Tensor, positions: torch.Tensor,
                         rows: torch.Tensor | None) -> torch.Tensor:
    """Cache slots (int32 [tokens, topk]) of top-k positions (int [tokens, topk], -1 = none):
    page_table_1[rows[t], positions[t, i]]; rows None: row t (an expanded table). A position
    outside the table (< 0 or >= its width) gives -1, which the kernel skips. Query tokens
    beyond rows' length (SGLang's padded tokens, whose positions are all -1) read row 0."""
    tokens = positions.shape[0]
    width = page_table_1.shape[1]
    if rows is None:
        if page_table_1.shape[0] < tokens:
            raise ValueError(f"page_table_1 has {page_table_1.shape[0]} rows for {tokens} query "
                             f"tokens (an expanded table has one per token)")
        row_ids = torch.arange(tokens, device=positions.device)
    elif rows.shape[0] >= tokens:
        row_ids = rows[:tokens]
    else:
        row_ids = torch.cat([rows, rows.new_zeros(tokens - rows.shape[0])])
    pos = positions.to(torch.int64)
    valid = (pos >= 0) & (pos < width)
    gathered = page_table_1[row_ids.unsqueeze(1), torch.where(valid, pos, 0)]
    return torch.where(valid, gathered, -1).to(torch.int32)


def pad_rows(indices: torch.Tensor, tokens: int) -> torch.Tensor:
    """indices with -1 rows appended up to `tokens` (SGLang pads the query for data-parallel
    attention after the indexer ran on the unpadded tokens)."""
    have = indices.shape[0]
    if have == tokens:
        return indices
    if have > tokens:
        raise ValueError(f"top-k indices have {have} rows for {tokens} query tokens")
    return torch.cat([indices, indices.new_full((tokens - have, indices.shape[1]), -1)])


def paged_cache(buffer: torch.Tensor, fp8: bool) -> torch.Tensor:
    """SGLang's DSA pool buffer of one layer ([slots, 1, width]) as the kernel's pages:
    [slots / 64, 64, 576] bf16, or [slots / 64, 64, 656] uint8 for the fp8 cache (SGLang's
    buffer is a float8 view of those bytes). Slot s lies at page s // 64, row s % 64."""
    rows = buffer.reshape(buffer.shape[0], -1)
    if fp8:
        rows = rows.view(torch.uint8)
    if rows.shape[0] % PAGE_SIZE:
        raise ValueError(f"the KV pool holds {rows.shape[0]} slots, not a whole number of "
                         f"{PAGE_SIZE}-slot pages")
    return rows.view(-1, PAGE_SIZE, rows.shape[1])


def absorbed_query(q: torch.Tensor, q_rope: torch.Tensor | None, heads: int, head_dim: int,
                   latent: int) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The query as the sparse kernel reads it: a whole [T, H*576] query viewed [tokens,
    heads, 576]; or, when SGLang hands the absorbed latent part [T, H*512] and the rope part
    [T, H*64] apart (our name is in FORWARD_ABSORB_CORE_ATTENTION_BACKENDS), the pair of views
    ([T, H, 512], [T, H, 64]) read where they lie, no copy (ops.sparse_mla_decode joins them
    by one copy only where a part's rows are not 16-byte aligned)."""
    if q_rope is None:
        return q.reshape(-1, heads, head_dim)
    nope = q.reshape(-1, heads, latent)
    return nope, q_rope.reshape(nope.shape[0], heads, head_dim - latent)


def query_tokens(query: torch.Tensor | tuple[torch.Tensor, torch.Tensor], start: int,
                 end: int) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Tokens [start, end) of a query from absorbed_query (one tensor or the pair) as
    ops.sparse_mla_decode takes them: each token its own request of one query token,
    [n, 1, H, width] views."""
    if isinstance(query, tuple):
        return tuple(part[start:end].unsqueeze(1) for part in query)
    return query[start:end].unsqueeze(1)
