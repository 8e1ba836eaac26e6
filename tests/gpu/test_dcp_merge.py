"""The lse that mla_decode returns, used as vLLM's decode context parallelism (DCP) uses it: a
request's context split over two ranks, one decode per rank over its part, the two outputs
merged by their lse, must equal one decode over the whole context, per row, within the gpu
tier's tolerances (tests.helpers: DENSE_OUT_TOL per row of out, LSE_ATOL per element of lse).

Splits: as vLLM stores a context under DCP 2 -- token t on rank (t // I) % 2 at local
position t // (2 I) * I + t % I, for interleave sizes I = 1 (vLLM's default) and 64 -- and
in two halves. Each rank's part goes into a paged cache of its own (blocks in random order,
NaN in every unused slot, garbage in unused block-table entries), decoded with a plan for the
local lengths; a rank may hold no key of a request (lse -inf, out 0: its weight in the merge
is 0). s_q = 1 (vLLM sends DCP decodes one query token per request), H = 16 and 128 (DeepSeek-V3
at TP 2 with DCP 2 decodes 128 heads per GPU).

The merge: lse = ln(exp(lse_0) + exp(lse_1)), out = sum_r exp(lse_r - lse) out_r, in float64
from the definition; and, where vLLM imports, with vLLM's own DCP correction kernel
(vllm.v1.attention.ops.common.correct_attn_out: each rank's out scaled by exp(lse_r - lse)
in its dtype, then summed, as its reduce-scatter sums them). Negative control: rank 1's lse
shifted by 1 before the same merge must fail the same check.
"""

import pytest
import torch

from mla_backend import ops
from mla_backend import reference as ref
from tests.helpers import (
    DENSE_OUT_TOL,
    PAGE,
    assert_attention_close,
    assert_lse_close,
    assert_rows_close,
    block_tables,
    case_seed,
    nan_outputs,
    paged_case,
)

pytestmark = pytest.mark.gpu
SCALE = 576 ** -0.5
LENS = [1, 2, 63, 64, 65, 129, 700, 2049, 4100]
SPLITS = ["interleave1", "interleave64", "halves"]


def rank_positions(length: int, split: str, rank: int) -> torch.Tensor:
    """The positions of a request's tokens that `rank` of two holds, in local order."""
    t = torch.arange(length)
    if split == "halves":
        first = -(-length // 2)
        return t[:first] if rank == 0 else t[first:]
    interleave = int(split.removeprefix("interleave"))
    return t[(t // interleave) % 2 == rank]  # in increasing t: local position order


def _keys(cache, table, length, b):
    t = torch.arange(length, device=cache.device)
    return cache[table[b, t // PAGE].long(), t % PAGE]


def _paged(keys: list[torch.Tensor], seed: int):
    """A paged cache holding keys[b] as request b's context: blocks in random order, NaN in
    unused slots, out-of-range garbage in unused block-table entries."""
    g = torch.Generator().manual_seed(seed)
    device, dtype = keys[0].device, keys[0].dtype
    blocks = [-(-k.shape[0] // PAGE) for k in keys]
    width = max(blocks + [1]) + 1
    num_blocks = sum(blocks) + 2
    perm = torch.randperm(num_blocks, generator=g)
    garbage = torch.randint(num_blocks + 1000, 2**30, (len(keys), width), generator=g,
                            dtype=torch.int32)
    table = block_tables(perm, blocks, width=width, unused=garbage)[0].to(device)
    cache = torch.full((num_blocks, PAGE, keys[0].shape[-1]), float("nan"), dtype=dtype,
                       device=device)
    for b, k in enumerate(keys):
        t = torch.arange(k.shape[0], device=device)
        cache[table[b, t // PAGE].long(), t % PAGE] = k
    lens = torch.tensor([k.shape[0] for k in keys], dtype=torch.int32, device=device)
    return cache, table, lens


def _decode(q, cache, table, lens):
    """ops.mla_decode into NaN-poisoned outputs, planned for these lengths."""
    out, lse = nan_outputs(q)
    plan = ops.plan_decode(lens, q.shape[1], q.shape[2])
    return ops.mla_decode(q, cache, table, lens, plan, SCALE, out=out, lse=lse)


def split_decode(q, cache, table, lens, split: str, seed: int):
    """Each of two ranks' decode over its part of every request: [(out_r, lse_r)]."""
    whole = [_keys(cache, table, int(n), b) for b, n in enumerate(lens.tolist())]
    parts = []
    for rank in (0, 1):
        keys = [k[rank_positions(k.shape[0], split, rank).to(k.device)] for k in whole]
        parts.append(_decode(q, *_paged(keys, seed + rank)))
    return parts


def merge(parts) -> tuple[torch.Tensor, torch.Tensor]:
    """The ranks' outputs merged by their lse, in float64 from the definition."""
    lses = torch.stack([lse.double() for _, lse in parts])
    lse = torch.logsumexp(lses, 0)
    weights = torch.exp(lses - lse).nan_to_num(0.0)  # a rank without keys: -inf - x -> 0
    out = sum(w.unsqueeze(-1) * o.double() for w, (o, _) in zip(weights, parts, strict=True))
    return out, lse


def merge_as_vllm(parts) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's DCP merge: correct_attn_out scales each rank's out [B, H, 512] by
    exp(lse_r - lse) in place (in out's dtype) given the all-gathered lses [N, B, H]; the
    reduce-scatter then sums the ranks' outputs."""
    pytest.importorskip("vllm", reason="vLLM is not importable here")
    try:  # vLLM 0.33 moved the DCP helpers from ops.common to ops.dcp
        from vllm.v1.attention.ops import dcp as common
    except ImportError:
        from vllm.v1.attention.ops import common
    lses = torch.stack([lse[:, 0] for _, lse in parts]).contiguous()
    outs, lse = [], None
    for rank, (out, _) in enumerate(parts):
        # a context per rank, as each rank's cp_lse_ag_out_rs makes one: a context reused
        # across calls relaunches its compiled kernel with fewer arguments than the GPU
        # machine's Triton takes ("function takes exactly 27 arguments (24 given)")
        corrected, lse = common.correct_attn_out(out[:, 0].clone(), lses, rank,
                                                 common.CPTritonContext(),
                                                 is_lse_base_on_e=True)
        outs.append(corrected.float())
    return sum(outs).unsqueeze(1), lse.unsqueeze(1)


def _case(split, heads):
    seed = case_seed("dcp", split, heads)
    q, cache, table, lens = paged_case(LENS, 1, heads, device="cuda", seed=seed)
    return q, cache, table, lens, seed


def _check(out, lse, want, want_lse, dtype, what):
    assert_attention_close(out, lse, want, want_lse, DENSE_OUT_TOL[dtype], what,
                           keys=lens_keys())


def lens_keys() -> torch.Tensor:
    return torch.tensor(LENS).view(-1, 1)


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("split", SPLITS)
def test_merged_halves_equal_the_whole(split, heads):
    q, cache, table, lens, seed = _case(split, heads)
    whole, whole_lse = _decode(q, cache, table, lens)
    want, want_lse = ref.mla_decode(q, cache, table, lens, None, SCALE)
    parts = split_decode(q, cache, table, lens, split, seed)
    out, lse = merge(parts)
    what = f"DCP 2 {split} H {heads}"
    _check(out, lse, whole, whole_lse, q.dtype, f"{what}: merged vs one decode")
    _check(out, lse, want, want_lse, q.dtype, f"{what}: merged vs the float32 reference")


@pytest.mark.parametrize("heads", [16, 128])
def test_vllms_dcp_merge_of_our_lse(heads):
    q, cache, table, lens, seed = _case("interleave1", heads)
    whole, whole_lse = _decode(q, cache, table, lens)
    parts = split_decode(q, cache, table, lens, "interleave1", seed)
    out, lse = merge_as_vllm(parts)
    _check(out, lse, whole, whole_lse, q.dtype, f"vLLM's DCP merge H {heads} vs one decode")


@pytest.mark.parametrize("heads", [16, 128])
def test_negative_control_lse_shifted_on_one_rank(heads):
    """The same check rejects a merge whose rank 1 lse is off by 1 (its keys weighted e
    times): out and lse both fail, on every request with keys on both ranks."""
    q, cache, table, lens, seed = _case("interleave1", heads)
    whole, whole_lse = _decode(q, cache, table, lens)
    parts = split_decode(q, cache, table, lens, "interleave1", seed)
    _check(*merge(parts), whole, whole_lse, q.dtype, "correct merge")  # the case is sound
    (out0, lse0), (out1, lse1) = parts
    out, lse = merge([(out0, lse0), (out1, lse1 + 1.0)])
    with pytest.raises(AssertionError, match="rows over rel L2"):
        assert_rows_close(out, whole, DENSE_OUT_TOL[q.dtype], keys=lens_keys())
    with pytest.raises(AssertionError, match="elements off by more than"):
        assert_lse_close(lse, whole_lse, keys=lens_keys())
