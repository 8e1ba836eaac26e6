"""engines.compare, the rule the e2e tests and the demo judge backends by, on hand-made
outputs: positions are compared up to and including the first where greedy tokens part."""

from mla_backend.demo import engines


def _out(tokens, logprobs):
    return {"prompt_len": 3, "token_ids": tokens, "logprobs": logprobs}


def test_identical_outputs():
    a = [_out([5, 6], [[[5, -0.5], [7, -1.0]], [[6, -0.2], [1, -2.0]]])]
    c = engines.compare(a, a)
    assert c == {"max_abs_logprob_diff": 0.0, "positions_compared": 2, "min_topk_overlap": 1.0,
                 "matching_tokens": 2, "total_tokens": 2, "divergences": []}


def test_stops_after_the_first_divergence_and_counts_it():
    a = [_out([5, 6, 9], [[[5, -0.5], [7, -1.0]], [[6, -0.70], [8, -0.75]], [[9, -0.1]]])]
    b = [_out([5, 8, 3], [[[5, -0.5], [7, -1.0]], [[8, -0.70], [6, -0.76]], [[3, -9.0]]])]
    c = engines.compare(a, b)
    # position 1 compared (same context, a near-tie): |−0.70 − (−0.76)| and |−0.75 − (−0.70)|
    assert abs(c["max_abs_logprob_diff"] - 0.06) < 1e-9
    assert c["positions_compared"] == 2 and c["matching_tokens"] == 1
    (d,) = c["divergences"]
    assert (d["prompt"], d["position"], d["tokens"]) == (0, 1, [6, 8])
    # a puts its 6 0.05 above 8; b puts its 8 0.06 above 6
    assert [round(m, 9) for m in d["margins"]] == [0.05, 0.06]
    assert c["total_tokens"] == 3  # position 2 is after the divergence: not compared


def test_topk_overlap_counts_shared_tokens():
    a = [_out([1], [[[1, -0.1], [2, -1.0], [3, -2.0], [4, -3.0], [5, -4.0]]])]
    b = [_out([1], [[[1, -0.1], [2, -1.0], [3, -2.0], [9, -3.0], [8, -4.0]]])]
    assert engines.compare(a, b)["min_topk_overlap"] == 0.6


def test_margin_is_none_where_the_other_token_is_outside_the_top_k():
    a = [_out([6], [[[6, -0.1], [2, -3.0]]])]
    b = [_out([8], [[[8, -0.2], [6, -1.2]]])]
    (d,) = engines.compare(a, b)["divergences"]
    assert d["margins"][0] is None and abs(d["margins"][1] - 1.0) < 1e-9
