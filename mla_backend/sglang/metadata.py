"""SGLang's batch description -> what ops.mla_decode reads: key lengths and a page table.

Pure tensor code (any device), no host sync: the cpu tier checks it on hand-worked cases, the
backend runs it on the GPU outside CUDA graphs, writing into static buffers.

SGLang keeps a request's token slots in `req_to_token[req, pos]` (int32). Its paged allocator
keeps the 64 tokens of a page contiguous and page-aligned, so the page of positions
[64j, 64j + 64) is `req_to_token[req, 64j] // 64`, and the KV pool viewed as
[pages, 64, 576] is indexed by that page id.
"""

from __future__ import annotations

import torch

from .support import PAGE_SIZE


def query_tokens(mode, num_draft_tokens: int | None) -> int:
    """Query tokens per request that `mode` (a ForwardMode) sends to the decode kernel."""
    if mode.is_decode_or_idle():
        return 1
    if mode.is_target_verify() or mode.is_draft_extend_v2():
        if not num_draft_tokens:
            raise ValueError(f"{mode} needs speculative_num_draft_tokens; got "
                             f"{num_draft_tokens!r}")
        return num_draft_tokens
    raise ValueError(f"{mode} does not run on the decode kernel")


def key_lengths(mode, seq_lens: torch.Tensor, num_draft_tokens: int | None,
                extend_seq_lens: torch.Tensor | None = None,
                window_in_seq_lens: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """Keys each request attends to (int32 [bs]), its query tokens included; written into
    `out` (int32 [bs]) when given, by one kernel on the decode path.

    decode: seq_lens. target-verify: seq_lens + num_draft_tokens (SGLang's seq_lens exclude
    the draft tokens). draft-extend v2: every request's query is a fixed window of
    num_draft_tokens tokens ending its keys: seq_lens - extend_seq_lens + window eagerly;
    graph batches already carry the window in seq_lens (window_in_seq_lens)."""
    if mode.is_decode_or_idle():
        lens = seq_lens
    elif mode.is_target_verify():
        lens = seq_lens + num_draft_tokens
    elif mode.is_draft_extend_v2():
        if window_in_seq_lens:
            lens = seq_lens
        else:
            if extend_seq_lens is None:
                raise ValueError("draft-extend needs extend_seq_lens")
            lens = seq_lens - extend_seq_lens + num_draft_tokens
    else:
        raise ValueError(f"{mode} does not run on the decode kernel")
    if out is not None:
        return out.copy_(lens)  # the cast to int32 included
    return lens.to(torch.int32)


def pages_for(max_keys: int) -> int:
    """Page-table columns that hold max_keys keys."""
    return max(1, -(-max_keys // PAGE_SIZE))


def fill_page_table(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                    out: torch.Tensor) -> torch.Tensor:
    """Write the page ids of each request's table row into out (int32 [bs, columns]): column j
    of row r is req_to_token[req_pool_indices[r], 64 j] // 64. Past a request's keys that is
    whatever its table row holds there, and columns past the table's width are not written:
    the decode kernels read no page past a request's keys. Two kernels a step (the gather and
    the division), as few as the decode graph's metadata can take. Returns out."""
    bs, columns = out.shape
    width = min(columns, -(-req_to_token.shape[1] // PAGE_SIZE))
    firsts = req_to_token[:, :width * PAGE_SIZE:PAGE_SIZE]  # each page's first token: a view
    torch.floor_divide(firsts[req_pool_indices[:bs]], PAGE_SIZE, out=out[:, :width])
    return out
