"""ForwardBatch -> key lengths and page table (mla_backend.sglang.metadata), on hand-worked
cases with SGLang's own ForwardMode."""

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from mla_backend.sglang import metadata

# Two requests in a 4-slot request table of width 256 (4 pages of 64 tokens):
#   pool slot 2 holds physical pages 7, 3, 9 (positions 0-63, 64-127, 128-191);
#   pool slot 0 holds page 5 (positions 0-63) and page 11 (64-127).
PAGES = {2: [7, 3, 9], 0: [5, 11]}


def _req_to_token() -> torch.Tensor:
    table = torch.zeros(4, 256, dtype=torch.int32)
    for slot, pages in PAGES.items():
        for pos in range(64 * len(pages)):
            table[slot, pos] = pages[pos // 64] * 64 + pos % 64
    return table


def _table(req_pool_indices, key_lens, columns):
    """The page table's columns that the kernels read (those holding a request's keys);
    None in a column they never read."""
    out = torch.full((len(req_pool_indices), columns), -7, dtype=torch.int32)
    metadata.fill_page_table(_req_to_token(), torch.tensor(req_pool_indices), out)
    return [[page if 64 * j < n else None for j, page in enumerate(row)]
            for row, n in zip(out.tolist(), key_lens, strict=True)]


def test_decode_lengths_and_pages():
    seq_lens = torch.tensor([130, 64])
    lens = metadata.key_lengths(ForwardMode.DECODE, seq_lens, None)
    assert lens.dtype == torch.int32 and lens.tolist() == [130, 64]
    assert metadata.query_tokens(ForwardMode.DECODE, None) == 1
    # 130 keys: three pages; 64 keys: exactly one page (the second is not read)
    assert _table([2, 0], lens.tolist(), 3) == [[7, 3, 9], [5, None, None]]


def test_target_verify_adds_the_draft_tokens():
    # SGLang's verify seq_lens exclude the 3 draft tokens: 126 + 3 = 129 keys cross into the
    # third page, 61 + 3 = 64 fill the first page exactly
    lens = metadata.key_lengths(ForwardMode.TARGET_VERIFY, torch.tensor([126, 61]), 3)
    assert lens.tolist() == [129, 64]
    assert metadata.query_tokens(ForwardMode.TARGET_VERIFY, 3) == 3
    assert _table([2, 0], lens.tolist(), 3) == [[7, 3, 9], [5, None, None]]
    # one more key: the second page of pool slot 0 appears
    assert _table([2, 0], [129, 65], 3) == [[7, 3, 9], [5, 11, None]]


def test_draft_extend_window():
    mode = ForwardMode.DRAFT_EXTEND_V2
    seq_lens, accepted = torch.tensor([130, 64]), torch.tensor([2, 3])
    # eager: the window of 3 queries ends at the last accepted token + padding
    assert metadata.key_lengths(mode, seq_lens, 3, accepted).tolist() == [131, 64]
    # graph batches already carry the window in seq_lens
    assert metadata.key_lengths(mode, seq_lens, 3, window_in_seq_lens=True).tolist() == [130, 64]
    with pytest.raises(ValueError, match="extend_seq_lens"):
        metadata.key_lengths(mode, seq_lens, 3)


def test_padded_graph_rows():
    # A graph captured for 4 requests replays 2: the padded rows come with seq_len 1 (the
    # backend's fill value) and pool slot 0; they read one valid page and nothing else.
    lens = metadata.key_lengths(ForwardMode.DECODE, torch.tensor([130, 64, 1, 1]), None)
    assert _table([2, 0, 0, 0], lens.tolist(), 3) == [
        [7, 3, 9], [5, None, None], [5, None, None], [5, None, None]]


def test_columns_past_the_request_table():
    # the graph buffer holds pages_for(context + draft) columns, one more than the request
    # table's 256 positions: that column is never read, never indexed and not written
    assert metadata.pages_for(256 + 8) == 5
    assert _table([2], [192], 5) == [[7, 3, 9, None, None]]
    out = torch.full((1, 5), -7, dtype=torch.int32)
    metadata.fill_page_table(_req_to_token(), torch.tensor([2]), out)
    assert out[0, 4] == -7


def test_only_the_requested_rows_and_columns_are_written():
    # the graph path refreshes table[:, :columns] of a wider static buffer
    static = torch.full((3, 4), -7, dtype=torch.int32)
    metadata.fill_page_table(_req_to_token(), torch.tensor([2, 0]), static[:2, :3])
    assert static[:, 3].tolist() == [-7, -7, -7] and static[2].tolist() == [-7] * 4
    assert static[0, :3].tolist() == [7, 3, 9] and static[1, 0] == 5


def test_matches_the_page_rule_on_a_random_paged_allocation():
    # any page-aligned allocation: column j of a request is the page of its position 64 j
    gen = torch.Generator().manual_seed(0)
    slots, width = 6, 64 * 8
    perm = torch.randperm(slots * 8, generator=gen)
    table = torch.zeros(slots, width, dtype=torch.int32)
    for s in range(slots):
        for j in range(8):
            table[s, 64 * j:64 * (j + 1)] = perm[s * 8 + j] * 64 + torch.arange(64)
    req = torch.tensor([4, 1, 5, 0])
    lens = torch.tensor([1, 64, 65, 512], dtype=torch.int32)
    out = metadata.fill_page_table(table, req, torch.empty(4, 8, dtype=torch.int32))
    for r in range(4):
        used = -(-int(lens[r]) // 64)
        want = [int(perm[int(req[r]) * 8 + j]) for j in range(used)]
        assert out[r, :used].tolist() == want


def test_graph_metadata_is_three_kernels():
    # the decode graph's metadata runs before every replay: the key lengths into the static
    # buffer (one copy with the cast) and the page table (a gather and a division)
    from torch.utils._python_dispatch import TorchDispatchMode

    VIEWS = {"aten::slice", "aten::view", "aten::as_strided", "aten::alias", "aten::select"}

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name not in VIEWS:  # views launch nothing
                self.names.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    req_to_token, req, seq_lens = _req_to_token(), torch.tensor([2, 0]), torch.tensor([130, 64])
    static_lens = torch.zeros(4, dtype=torch.int32)
    table = torch.zeros(4, 5, dtype=torch.int32)
    with Ops() as ops:
        lens = metadata.key_lengths(ForwardMode.DECODE, seq_lens, None, out=static_lens[:2])
        metadata.fill_page_table(req_to_token, req, table[:2, :4])
    assert lens.data_ptr() == static_lens.data_ptr() and lens.tolist() == [130, 64]
    assert table[0, :3].tolist() == [7, 3, 9]
    assert ops.names == ["aten::copy_", "aten::index", "aten::floor_divide"], ops.names


def test_modes_outside_the_decode_kernel_are_refused():
    with pytest.raises(ValueError, match="does not run on the decode kernel"):
        metadata.query_tokens(ForwardMode.EXTEND, 3)
    with pytest.raises(ValueError, match="does not run on the decode kernel"):
        metadata.key_lengths(ForwardMode.EXTEND, torch.tensor([4]), None)
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        metadata.query_tokens(ForwardMode.TARGET_VERIFY, None)
