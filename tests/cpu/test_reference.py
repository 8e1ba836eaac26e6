"""The float32 references against an independent float64 formulation, and the invariances
every correct attention implementation has."""

import pytest
import torch

from mla_backend import reference as ref
from tests.helpers import D_V, PAGE, naive_dense_decode, paged_case, rel_l2

SCALE = 576 ** -0.5


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("s_q,heads", [(1, 1), (1, 16), (2, 3), (4, 8), (8, 2)])
def test_dense_matches_naive_float64(s_q, heads, causal):
    lens = [0, 1, 3, 64, 65, 200, 7]
    q, cache, table, seq = paged_case(lens, s_q, heads, dtype=torch.float32, seed=s_q * 31 + heads)
    out, lse = ref.mla_decode(q, cache, table, seq, None, SCALE, causal=causal)
    want_out, want_lse = naive_dense_decode(q, cache, table, seq, SCALE, causal=causal)
    assert out.dtype == torch.float32 and out.shape == (len(lens), s_q, heads, D_V)
    assert not out.isnan().any()
    assert rel_l2(out, want_out) < 1e-5
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    finite = torch.isfinite(want_lse)
    assert torch.allclose(lse[finite].double(), want_lse[finite], atol=1e-4)


def test_rows_without_keys_give_zero_and_minus_inf():
    # request 0 has no keys; request 1 has 2 keys and 4 queries: causal rows 0 and 1 see none.
    q, cache, table, seq = paged_case([0, 2], 4, 2, dtype=torch.float32)
    out, lse = ref.mla_decode(q, cache, table, seq, None, SCALE)
    assert torch.all(out[0] == 0) and torch.all(lse[0] == float("-inf"))
    assert torch.all(out[1, :2] == 0) and torch.all(lse[1, :2] == float("-inf"))
    assert torch.all(torch.isfinite(lse[1, 2:])) and out[1, 2:].abs().sum() > 0


def test_nan_in_unused_pages_and_garbage_table_entries_are_ignored():
    q, cache, table, seq = paged_case([5, 130], 2, 4, dtype=torch.float32, nan_unused=True)
    assert cache.isnan().any() and (table > cache.shape[0]).any()
    out, lse = ref.mla_decode(q, cache, table, seq, None, SCALE)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_invariant_under_block_permutation():
    q, cache, table, seq = paged_case([100, 64, 1, 250], 2, 4, dtype=torch.float32, seed=3)
    out, lse = ref.mla_decode(q, cache, table, seq, None, SCALE)
    perm = torch.randperm(cache.shape[0], generator=torch.Generator().manual_seed(9))
    inverse = torch.argsort(perm)
    cache2 = cache[perm]                       # new block j holds old block perm[j]
    valid = table < cache.shape[0]
    table2 = torch.where(valid, inverse[table.clamp(max=cache.shape[0] - 1).long()].int(), table)
    out2, lse2 = ref.mla_decode(q, cache2, table2, seq, None, SCALE)
    assert torch.allclose(out, out2, atol=1e-6) and torch.allclose(lse, lse2, atol=1e-6)


def test_strided_cache_view_is_indexed_by_stride():
    q, cache, table, seq = paged_case([70, 3], 1, 2, dtype=torch.float32, nan_unused=False)
    layers = torch.randn(cache.shape[0], 3, PAGE, cache.shape[2])  # [blocks, layers, page, 576]
    layers[:, 1] = cache
    view = layers[:, 1]
    assert not view.is_contiguous()
    out, _ = ref.mla_decode(q, view, table, seq, None, SCALE)
    want, _ = ref.mla_decode(q, cache, table, seq, None, SCALE)
    assert torch.equal(out, want)


def test_split_kv_merged_by_lse_equals_whole():
    lens = [192, 130, 64]
    q, cache, table, seq = paged_case(lens, 1, 4, dtype=torch.float32, seed=5)
    whole_out, whole_lse = ref.mla_decode(q, cache, table, seq, None, SCALE, causal=False)
    head = torch.tensor([64, 64, 64], dtype=torch.int32)     # first page of every request
    out_a, lse_a = ref.mla_decode(q, cache, table[:, :1], torch.minimum(seq, head), None, SCALE,
                                  causal=False)
    out_b, lse_b = ref.mla_decode(q, cache, table[:, 1:], (seq - head).clamp_min(0), None, SCALE,
                                  causal=False)
    out, lse = ref.merge_by_lse(torch.stack([out_a, out_b]), torch.stack([lse_a, lse_b]))
    assert torch.allclose(out, whole_out, atol=1e-5) and torch.allclose(lse, whole_lse, atol=1e-5)


def test_merge_by_lse_all_empty_parts():
    out, lse = ref.merge_by_lse(torch.randn(3, 2, D_V),
                                torch.full((3, 2), float("-inf")))
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


def _dense_as_sparse_indices(table, seq, s_q, causal):
    """Global slots of every key each query row may see, -1 padded."""
    batch = table.shape[0]
    topk = int(seq.max())
    idx = torch.full((batch, s_q, topk), -1, dtype=torch.int32)
    for b in range(batch):
        for i in range(s_q):
            limit = int(seq[b]) - s_q + i + 1 if causal else int(seq[b])
            for t in range(max(limit, 0)):
                idx[b, i, t] = int(table[b, t // PAGE]) * PAGE + t % PAGE
    return idx


@pytest.mark.parametrize("causal", [True, False])
def test_sparse_with_all_positions_equals_dense(causal):
    q, cache, table, seq = paged_case([3, 130, 64, 0], 2, 4, dtype=torch.float32, seed=7)
    dense_out, dense_lse = ref.mla_decode(q, cache, table, seq, None, SCALE, causal=causal)
    idx = _dense_as_sparse_indices(table, seq, 2, causal)
    out, lse = ref.sparse_mla_decode(q, cache, idx, None, SCALE)
    assert torch.allclose(out, dense_out, atol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(dense_lse))
    assert torch.allclose(lse.nan_to_num(neginf=0), dense_lse.nan_to_num(neginf=0), atol=1e-5)


def test_sparse_topk_length_duplicates_and_invalid():
    g = torch.Generator().manual_seed(11)
    kv = torch.randn(40, 576, generator=g)
    q = torch.randn(3, 2, 576, generator=g)
    idx = torch.tensor([[5, 5, 7, -1], [-1, -1, -1, -1], [1, 2, 3, 4]], dtype=torch.int32)
    length = torch.tensor([4, 4, 2], dtype=torch.int32)
    out, lse = ref.sparse_mla_prefill(q, kv, idx, SCALE, length)
    # row 0: key 5 counts twice, key 7 once
    keys = kv[[5, 5, 7]].double()
    s = (keys @ q[0].double().T).T * SCALE
    assert torch.allclose(lse[0].double(), torch.logsumexp(s, -1), atol=1e-5)
    assert torch.allclose(out[0].double(), torch.softmax(s, -1) @ keys[:, :D_V], atol=1e-5)
    assert torch.all(out[1] == 0) and torch.all(lse[1] == float("-inf"))
    keys = kv[[1, 2]].double()                  # topk_length 2 drops indices 3 and 4
    s = (keys @ q[2].double().T).T * SCALE
    assert torch.allclose(out[2].double(), torch.softmax(s, -1) @ keys[:, :D_V], atol=1e-5)


def test_sparse_prefill_paged_equals_flat():
    g = torch.Generator().manual_seed(2)
    paged = torch.randn(3, PAGE, 576, generator=g)
    idx = torch.randint(-1, 3 * PAGE, (5, 16), generator=g, dtype=torch.int32)
    q = torch.randn(5, 4, 576, generator=g)
    a = ref.sparse_mla_prefill(q, paged, idx, SCALE)
    b = ref.sparse_mla_prefill(q, paged.reshape(-1, 576), idx, SCALE)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_sparse_query_as_a_pair_equals_the_joined_query():
    """(q_nope, q_pe) in any strides gives what the joined [.., 576] query gives, in decode
    and in prefill; the parts are not modified."""
    g = torch.Generator().manual_seed(5)
    paged = torch.randn(3, PAGE, 576, generator=g)
    idx = torch.randint(-1, 3 * PAGE, (4, 2, 16), generator=g, dtype=torch.int32)
    q = torch.randn(4, 2, 3, 576, generator=g)
    nope = q[..., :512].permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)  # heads outermost
    pe = torch.randn(4, 2, 3, 192, generator=g)
    pe[..., 128:] = q[..., 512:]
    pe = pe[..., 128:]
    kept = (nope.clone(), pe.clone())
    want = ref.sparse_mla_decode(q, paged, idx, None, SCALE)
    got = ref.sparse_mla_decode((nope, pe), paged, idx, None, SCALE)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    want = ref.sparse_mla_prefill(q[:, 0], paged, idx[:, 0], SCALE)
    got = ref.sparse_mla_prefill((nope[:, 0], pe[:, 0]), paged, idx[:, 0], SCALE)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(nope, kept[0]) and torch.equal(pe, kept[1])


def test_sparse_out_of_range_index_is_skipped_like_minus_one():
    g = torch.Generator().manual_seed(7)
    kv, q = torch.randn(64, 576, generator=g), torch.randn(2, 3, 576, generator=g)
    far = torch.tensor([[5, 64, 9, -7], [1000, 2, 3, 63]], dtype=torch.int32)
    pad = torch.where((far < 0) | (far >= 64), -1, far)
    a, la = ref.sparse_mla_prefill(q, kv, far, SCALE)
    b, lb = ref.sparse_mla_prefill(q, kv, pad, SCALE)
    assert torch.equal(a, b) and torch.equal(la, lb)
    only = ref.sparse_mla_prefill(q[:1], kv, torch.tensor([[5, 9]], dtype=torch.int32), SCALE)
    assert torch.allclose(a[:1], only[0], atol=1e-6)


def test_float64_and_float32_agree():
    q, cache, table, seq = paged_case([90, 33], 2, 3, dtype=torch.bfloat16, seed=4)
    a, la = ref.mla_decode(q, cache, table, seq, None, SCALE)
    b, lb = ref.mla_decode(q, cache, table, seq, None, SCALE, compute_dtype=torch.float64)
    assert b.dtype == torch.float64 and rel_l2(a, b) < 1e-6


def test_reference_is_fast_enough_for_thousands_of_tokens():
    import time
    q, cache, table, seq = paged_case([4000, 3000, 2500, 4096], 2, 16, seed=1)
    t0 = time.perf_counter()
    ref.mla_decode(q, cache, table, seq, None, SCALE)
    assert time.perf_counter() - t0 < 20.0
