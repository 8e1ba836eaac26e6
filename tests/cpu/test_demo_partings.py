"""What the demo prints where the two backends' greedy tokens part: the baseline's logprob
margin between the two tokens, a near-tie when within twice the backends' largest logprob
difference where they agree."""

from mla_backend.demo import engines
from mla_backend.demo.__main__ import _partings


def _out(tokens, logprobs):
    return {"prompt_len": 3, "token_ids": tokens, "logprobs": logprobs}


def _lines(ours, peer):
    return _partings(ours, peer, engines.compare(ours, peer), "FLASHMLA", None)


def test_a_near_tie():
    # where they agree (position 0) the logprobs differ by up to 0.04; at position 1 FLASHMLA
    # ranks its 8 above our 6 by 0.06
    ours = [_out([5, 6], [[[5, -0.50], [7, -1.0]], [[6, -0.70], [8, -0.75]]])]
    peer = [_out([5, 8], [[[5, -0.54], [7, -1.0]], [[8, -0.70], [6, -0.76]]])]
    assert _lines(ours, peer) == [
        "  prompt 0 parts at generated token 1: CUSTOM chose 6, FLASHMLA 8; FLASHMLA puts its "
        "token 0.0600 above ours in logprob: a near-tie (where they agree, the backends' "
        "logprobs differ by up to 0.0400)"]


def test_a_wide_margin_and_a_token_outside_the_top_k():
    ours = [_out([5, 6], [[[5, -0.50]], [[6, -0.1], [8, -3.0]]]), _out([4], [[[4, -0.1]]])]
    peer = [_out([5, 8], [[[5, -0.51]], [[8, -0.1], [6, -3.0]]]),
            _out([9], [[[9, -0.1], [2, -2.0]]])]
    wide, outside = _lines(ours, peer)
    assert wide.endswith("FLASHMLA puts its token 2.9000 above ours in logprob: not a near-tie "
                         "(where they agree, the backends' logprobs differ by up to 0.0100)")
    assert outside == ("  prompt 1 parts at generated token 0: CUSTOM chose 4, FLASHMLA 9; ours "
                       "is not in FLASHMLA's top 2 there")


def test_no_parting_no_lines():
    ours = [_out([5], [[[5, -0.5]]])]
    assert _lines(ours, ours) == []
