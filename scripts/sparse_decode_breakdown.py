"""Sparse decode, ours alone: where one call's time goes. Per row (bench.sparse inputs),
CUDA-graph timings of the planner kernel alone, the attention kernel alone (its plan made
once), attention + merge, the whole call (plan + attention + merge, as the bench times it),
and, for uniform plans (no topk_length), the whole call with the same schedule from the
planner kernel instead of its closed form ("dev-plan").

    python3 scripts/sparse_decode_breakdown.py [--cache bf16] [--batch 1 32 128] \
        [--heads 16 64 128] [--s-q 1 2] [--topk 512 2048]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common, sparse  # noqa: E402
from mla_backend import _extension, ops  # noqa: E402


def breakdown(c, budget_ms: float) -> dict[str, float]:
    ws = ops.sparse_workspace(c.rows, c.H, device="cuda")

    def plan():
        return ops.plan_sparse_decode(c.batch, c.s_q, c.H, c.topk, workspace=ws, device="cuda",
                                      kv_cache_dtype=c.kv.dtype)

    fixed = plan()
    out = torch.empty(c.batch, c.s_q, c.H, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(c.batch, c.s_q, c.H, dtype=torch.float32, device="cuda")

    def attention(i, combine, uniform=True):
        torch.ops.mla_backend.sparse_mla_decode(
            c.qs[i], c.kv, c.idx[i], None, fixed.metadata, fixed.partial_out, fixed.partial_lse,
            out, lse, fixed.num_ctas, fixed.rows_per_cta, float(c.scale), combine,
            fixed.uniform_units if uniform else 0, fixed.units_per_cta if uniform else 0)

    def device_planned(i):
        torch.ops.mla_backend.plan_sparse_decode(None, fixed.metadata, c.s_q, c.topk,
                                                 fixed.num_ctas, fixed.units_per_cta, 64)
        attention(i, fixed.needs_combine, uniform=False)

    def whole(i):
        return ops.sparse_mla_decode(c.qs[i], c.kv, c.idx[i], plan(), c.scale, out=out)

    steps = {"plan": lambda i: plan(),  # a uniform plan launches nothing: timed as 0
             "attn": lambda i: attention(i, False),
             "attn+merge": lambda i: attention(i, fixed.needs_combine),
             "call": whole, "dev-plan": device_planned}
    if fixed.uniform_units:
        del steps["plan"]
    t = {k: common.time_graph(f, c.nsets, budget_ms=budget_ms).us for k, f in steps.items()}
    return {"plan": 0.0, **t}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cache", nargs="+", default=["bf16"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--heads", type=int, nargs="+", default=[16, 64, 128])
    p.add_argument("--s-q", type=int, nargs="+", default=[1, 2])
    p.add_argument("--topk", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--budget-ms", type=float, default=25.0)
    args = p.parse_args()
    _extension.require("sparse_mla_decode")  # the script calls the ops directly
    common.log(f"{'row':44s} {'plan':>7s} {'attn':>7s} {'+merge':>7s} {'call':>7s} "
               f"{'dev-plan':>8s}  merge?")
    for cache, c in sparse.decode_cases(args.cache, args.batch, args.topk, args.s_q, args.heads,
                                        args.context, seed=200):
        t = breakdown(c, args.budget_ms)
        merge = ops.plan_sparse_decode(c.batch, c.s_q, c.H, c.topk, device="cuda",
                                       kv_cache_dtype=c.kv.dtype).needs_combine
        row = f"{cache} H={c.H} s_q={c.s_q} b={c.batch} topk={c.topk}"
        common.log(f"{row:44s} {t['plan']:7.1f} {t['attn']:7.1f} {t['attn+merge']:7.1f} "
                   f"{t['call']:7.1f} {t['dev-plan']:8.1f}  {merge}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
