"""What the gpu tier's runs of SGLang's attention test kit share (test_attention_kit.py,
test_dsa_kit.py): the `testcase` handed to the kit, and the EAGLE-verify cases with the rule
the CUDA-graph ones must keep; importable without a GPU so the SGLang cpu tier checks the rule.

The kit's graph runner (runner_modes/speculative_cuda_graph_runner.py) first runs the case
eagerly on the graph fixture. That fixture stores each request's prefix KV on shuffled pages
(mla_attention.build_mla_attention_fixture, loc_layout "shuffled_pages"), and then the runner's
prepare_inputs (mla_attention.prepare_mla_runner_inputs) writes the same prefix again at the
contiguous slots (_token_loc): a prefix longer than one page overwrites keys that the shuffled
page table still points at, and the eager leg's expected output no longer matches the cache
(on the H100: prefix (60, 130) with 5 drafts failed identically for flashmla and ours). A
prefix of at most one page only ever lands on its own page or on slots the drafts rewrite.
"""

import unittest


class KitTestCase(unittest.TestCase):
    """The `testcase` the kit calls: its skipTest (taken when building the backend raises
    ImportError / AssertionError) fails here, so no case passes by skipping."""

    def runTest(self):
        pass

    def skipTest(self, reason):
        raise AssertionError(f"SGLang's kit would skip this case: {reason}")


# (prefix lens, draft lens): eager verify reads the fixture's cache as written
VERIFY = [((4, 7), (3, 3)), ((61, 63), (3, 3)), ((60, 130), (5, 5))]
VERIFY_IDS = ["chain", "page_boundary", "draft5"]
# in a graph, every prefix within one page (see above); 5 drafts crossing into page two
VERIFY_GRAPH = [((4, 7), (3, 3)), ((61, 63), (3, 3)), ((60, 64), (5, 5))]
VERIFY_GRAPH_IDS = ["chain", "page_boundary", "draft5"]
GRAPH_CASE_NAME = "runner_cuda_graph_eagle_verify_chain"  # the kit seeds its layout from it
PAGE, CONTEXT = 64, 256


def stale_keys(prefix_lens, draft_lens, name=GRAPH_CASE_NAME, page=PAGE, context=CONTEXT):
    """(request, position) of every key that the kit's eager leg on the graph fixture reads
    from a slot holding another position's key: the fixture's shuffled prefix write, the
    runner's contiguous rewrite, then the drafts at their shuffled out_cache_loc; read back
    through the shuffled page table."""
    from sglang.test.kits.attention_unittest.attention_methods.dense_attention import (
        make_loc_fn,
    )
    from sglang.test.kits.attention_unittest.attention_methods.mla_attention import _token_loc

    seq_lens = tuple(p + d for p, d in zip(prefix_lens, draft_lens, strict=True))
    loc = make_loc_fn("shuffled_pages", batch_size=len(prefix_lens), seq_lens=seq_lens,
                      prefix_lens=tuple(prefix_lens), page_size=page, max_context_len=context,
                      seed=3090 + len(name))
    slots = {}
    for r, n in enumerate(prefix_lens):
        slots.update({loc(r, i): (r, i) for i in range(n)})
    for r, n in enumerate(prefix_lens):
        slots.update({_token_loc(r, i, page_size=page, max_context_len=context): (r, i)
                      for i in range(n)})
    for r, (n, s) in enumerate(zip(prefix_lens, seq_lens, strict=True)):
        slots.update({loc(r, i): (r, i) for i in range(n, s)})
    return [(r, i) for r, s in enumerate(seq_lens) for i in range(s)
            if slots.get(loc(r, i)) != (r, i)]
