"""The gpu tier's EAGLE-verify cases against the kit's own slot layout (its loc functions,
on CPU): what the kit's CUDA-graph runner writes before its eager leg must leave every key
the page table points at in place (tests/sglang_gpu/kit_cases.py says why)."""

import pytest

from tests.sglang_gpu import kit_cases


@pytest.mark.parametrize("prefix, drafts", kit_cases.VERIFY_GRAPH, ids=kit_cases.VERIFY_GRAPH_IDS)
def test_graph_cases_keep_every_key(prefix, drafts):
    assert max(prefix) <= kit_cases.PAGE
    assert kit_cases.stale_keys(prefix, drafts) == []


def test_graph_cases_have_five_drafts_across_a_page():
    assert any(d == 5 and p < kit_cases.PAGE < p + d
               for prefix, drafts in kit_cases.VERIFY_GRAPH
               for p, d in zip(prefix, drafts, strict=True))


def test_longer_prefix_is_overwritten_in_the_graph_runner():
    # the case that failed on the H100 for flashmla and ours alike: request 1 (prefix 130)
    # reads 4 keys of other positions; it stays in the eager verify cases, which read the
    # fixture's cache as written
    assert kit_cases.stale_keys((60, 130), (5, 5)) == [(1, 64), (1, 65), (1, 128), (1, 129)]
    assert ((60, 130), (5, 5)) in kit_cases.VERIFY
