"""What the sparse decode saves by reading the query in two parts: per row, the query as
vLLM 0.25 hands it (ql_nope the [T, H, 512] transpose of a [H, T, 512] bmm output, q_pe the
rope columns of a [T, H, 192] projection) run as the adapters ran it before (torch.cat into
one [T, 1, H, 576] tensor, then the kernel) and as they run it now (the kernel on the two
parts), plus the cat alone. Ours only; plan in the timed call, as in bench/sparse_decode.py.
Timing: common.time_graph (CUDA graphs), input sets rotated past L2, --rounds rounds with
each variant first in turn, median of the rounds. Correctness gate: the two-part call's out
and lse equal the joined call's bit for bit.

    python -m bench.sparse_query_parts [--batch 64] [--heads 16 128] [--rounds 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from bench import common
from bench.common import log
from bench.sparse_inputs import D_QK, D_V, make_decode_case


def vllm_parts(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, 1, H, 576] as vLLM 0.25's forward_mqa gets it, viewed [B, 1, H, 512 | 64]."""
    tokens, heads = q.shape[0], q.shape[2]
    nope_buf = q[:, 0, :, :D_V].transpose(0, 1).contiguous()           # [H, T, 512]
    proj = torch.zeros(tokens, heads, 192, dtype=q.dtype, device=q.device)
    proj[..., 128:] = q[:, 0, :, D_V:]
    return nope_buf.transpose(0, 1).unsqueeze(1), proj[..., 128:].unsqueeze(1)


def bench_row(H: int, cache: str, args, pool) -> dict:
    from mla_backend import ops

    c = make_decode_case(H, 1, args.batch, args.topk, args.context, cache, args.seed, pool)
    pairs = [vllm_parts(q) for q in c.qs]
    ws = ops.sparse_workspace(c.rows, H, device="cuda")

    def plan():
        return ops.plan_sparse_decode(c.batch, 1, H, c.topk, workspace=ws,
                                      kv_cache_dtype=c.kv.dtype)

    steps = {
        "joined": lambda i: ops.sparse_mla_decode(torch.cat(pairs[i], dim=-1), c.kv, c.idx[i],
                                                  plan(), c.scale),
        "parts": lambda i: ops.sparse_mla_decode(pairs[i], c.kv, c.idx[i], plan(), c.scale),
        "cat": lambda i: torch.cat(pairs[i], dim=-1),
    }
    joined, parts = steps["joined"](0), steps["parts"](0)
    same = torch.equal(joined[0], parts[0]) and torch.equal(joined[1], parts[1])
    timers = {name: (lambda s=s: common.time_graph(s, c.nsets, budget_ms=args.budget_ms))
              for name, s in steps.items()}

    def failed(name, e):
        raise e

    us = {name: statistics.median(t.us for t in timings)
          for name, timings in common.time_in_rounds(timers, args.rounds, failed).items()}
    cat_bytes = 2 * c.rows * H * D_QK * 2  # read both parts, write the joined tensor
    row = {"H": H, "cache": cache, "batch": c.batch, "topk": c.topk, "same_bits": same,
           "cat_mb": cat_bytes / 1e6, **{f"{k}_us": v for k, v in us.items()}}
    log(f"  H {H:3d} {cache:10s} joined {us['joined']:8.1f}  parts {us['parts']:8.1f}  "
        f"saved {us['joined'] - us['parts']:6.1f} us ({1 - us['parts'] / us['joined']:+.1%})  "
        f"cat alone {us['cat']:6.1f} us ({cat_bytes / 1e6:.1f} MB)  bits equal {same}")
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sparse_query_parts")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    p.add_argument("--caches", nargs="+", default=["fp8_ds_mla", "bf16"],
                   choices=["fp8_ds_mla", "bf16"])
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--budget-ms", type=float, default=40.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    log(f"sparse decode, query as vLLM's two parts: joined by torch.cat vs read in place "
        f"({common.gpu_name()}, batch {args.batch}, s_q 1, topk {args.topk})")
    rows, pool = [], {}
    for cache in args.caches:
        for H in args.heads:
            rows.append(bench_row(H, cache, args, pool))
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
