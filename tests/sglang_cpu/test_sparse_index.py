"""Top-k positions -> cache slots, and the cache / query views (mla_backend.sglang.
sparse_index), on hand-worked cases with SGLang's own ForwardMode."""

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from mla_backend.sglang import sparse_index

# page_table_1 is req_to_token rows: request A (row 0) holds pages 7, 3 (positions 0-63 at
# slots 448-511, 64-127 at 192-255); request B (row 1) holds page 5 (positions 0-63 at
# slots 320-383). Width 128: the step's longest request.
A = [7 * 64 + p for p in range(64)] + [3 * 64 + p for p in range(64)]
B = [5 * 64 + p for p in range(64)] + [0] * 64
TABLE = torch.tensor([A, B], dtype=torch.int32)


def test_decode_rows_are_requests():
    rows = sparse_index.query_rows(ForwardMode.DECODE, 2, None, "cpu")
    positions = torch.tensor([[0, 63, 64, 127, -1], [0, 10, 63, -1, -1]])
    slots = sparse_index.slots_from_positions(TABLE, positions, rows)
    assert slots.dtype == torch.int32
    assert slots.tolist() == [[448, 511, 192, 255, -1], [320, 330, 383, -1, -1]]


def test_extend_rows_follow_the_ragged_lengths():
    # A extends by 3 tokens, B by 1 (host lengths, as SGLang keeps them for extends)
    rows = sparse_index.query_rows(ForwardMode.EXTEND, 2, [3, 1], "cpu")
    assert rows.tolist() == [0, 0, 0, 1]
    positions = torch.tensor([[125, 0], [126, 64], [127, 65], [3, -1]])
    slots = sparse_index.slots_from_positions(TABLE, positions, rows)
    assert slots.tolist() == [[192 + 61, 448], [192 + 62, 192], [192 + 63, 193], [323, -1]]


def test_extend_needs_the_host_lengths():
    with pytest.raises(ValueError, match="needs extend_seq_lens_cpu"):
        sparse_index.query_rows(ForwardMode.EXTEND, 2, None, "cpu")


@pytest.mark.parametrize("mode", [ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2])
def test_verify_rows_are_tokens_of_the_expanded_table(mode):
    # SGLang repeats each request's row once per draft token: 2 drafts, rows A A B B
    assert sparse_index.query_rows(mode, 2, None, "cpu") is None
    expanded = TABLE.repeat_interleave(2, dim=0)
    positions = torch.tensor([[64], [65], [1], [2]])
    slots = sparse_index.slots_from_positions(expanded, positions, None)
    assert slots.tolist() == [[192], [193], [321], [322]]
    with pytest.raises(ValueError, match="2 rows for 4 query tokens"):
        sparse_index.slots_from_positions(TABLE, positions, None)


def test_positions_outside_the_table_are_none():
    rows = torch.tensor([0, 1])
    positions = torch.tensor([[128, -5, 127], [1000, -1, 0]])
    assert sparse_index.slots_from_positions(TABLE, positions, rows).tolist() == \
        [[-1, -1, 255], [-1, -1, 320]]


def test_padded_tokens_read_row_zero_and_stay_empty():
    rows = torch.tensor([1])
    positions = sparse_index.pad_rows(torch.tensor([[0, 1]], dtype=torch.int32), 3)
    assert positions.tolist() == [[0, 1], [-1, -1], [-1, -1]]
    assert sparse_index.slots_from_positions(TABLE, positions, rows).tolist() == \
        [[320, 321], [-1, -1], [-1, -1]]
    with pytest.raises(ValueError, match="3 rows for 2 query tokens"):
        sparse_index.pad_rows(positions, 2)


def test_paged_cache_views_slots_as_pages():
    bf16 = torch.arange(128 * 576, dtype=torch.float32).to(torch.bfloat16).view(128, 1, 576)
    pages = sparse_index.paged_cache(bf16, fp8=False)
    assert pages.shape == (2, 64, 576) and pages.data_ptr() == bf16.data_ptr()
    assert torch.equal(pages[1, 5], bf16[64 + 5, 0])  # slot 69: page 1, row 5
    # the fp8 pool's buffer is a float8 view of 656-byte rows: read as bytes
    raw = torch.randint(0, 255, (128, 1, 656), dtype=torch.uint8)
    pages = sparse_index.paged_cache(raw.view(torch.float8_e4m3fn), fp8=True)
    assert pages.dtype == torch.uint8 and pages.shape == (2, 64, 656)
    assert torch.equal(pages[1, 63], raw[127, 0])
    with pytest.raises(ValueError, match="100 slots, not a whole number of 64-slot pages"):
        sparse_index.paged_cache(bf16[:100], fp8=False)


def test_two_part_query_is_viewed_in_place_and_whole_query_viewed():
    """SGLang's two parts become the pair ([T, H, 512], [T, H, 64]) of views of its own
    tensors (no copy); a whole [T, H*576] query becomes one [T, H, 576] view."""
    q = torch.randn(3, 2, 576).to(torch.bfloat16)
    nope = q[..., :512].reshape(3, 2 * 512)
    proj = torch.zeros(3, 2, 192, dtype=torch.bfloat16)  # the rope part: columns of a projection
    proj[..., 128:] = q[..., 512:]
    rope = proj[..., 128:]
    got_nope, got_rope = sparse_index.absorbed_query(nope, rope, 2, 576, 512)
    assert got_nope.shape == (3, 2, 512) and got_rope.shape == (3, 2, 64)
    assert got_nope.data_ptr() == nope.data_ptr() and got_rope.data_ptr() == rope.data_ptr()
    assert torch.equal(torch.cat((got_nope, got_rope), -1), q)
    whole = q.reshape(3, 2 * 576)
    view = sparse_index.absorbed_query(whole, None, 2, 576, 512)
    assert view.shape == (3, 2, 576) and view.data_ptr() == whole.data_ptr()


def test_query_tokens_are_requests_of_one_token():
    q = torch.randn(5, 2, 576).to(torch.bfloat16)
    pair = (q[..., :512], q[..., 512:])
    nope, rope = sparse_index.query_tokens(pair, 1, 4)
    assert nope.shape == (3, 1, 2, 512) and rope.shape == (3, 1, 2, 64)
    assert nope.data_ptr() == q[1].data_ptr() and torch.equal(rope[:, 0], q[1:4, :, 512:])
    one = sparse_index.query_tokens(q, 3, 5)
    assert one.shape == (2, 1, 2, 576) and one.data_ptr() == q[3].data_ptr()
