"""Sparse decode, ours alone: time the schedule at several floors on the units (64 index
entries) of one CTA, to tune the planner's rule. Each row's inputs are bench.sparse's.

    python3 scripts/sweep_sparse_units.py [--cache bf16 fp8_ds_mla] [--batch 32 128] \
        [--heads ...] [--s-q 1 2] [--topk 512 2048] [--rounds 2] [--out FILE.json]

Prints, per row, the time at the default floor and at each candidate (see candidates()),
marking with * the candidates whose plan needs no merge kernel.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common, sparse  # noqa: E402
from mla_backend import ops  # noqa: E402


def candidates(groups: int, units_per_req: int, num_ctas: int) -> list[int]:
    """The default U, whole requests (the smallest multiple of units_per_req >= U, and one
    request more), half and quarter requests when above U, and 2 U below whole requests."""
    base = max(math.ceil(groups * units_per_req / num_ctas), 2)
    whole = math.ceil(base / units_per_req) * units_per_req
    out = {base, whole, whole + units_per_req}
    out.update(x for x in (units_per_req // 2, units_per_req // 4, 2 * base)
               if base < x < whole)
    return sorted(x for x in out if x <= groups * units_per_req)


def sweep_row(c, cache: str, rounds: int, budget_ms: float) -> dict:
    """Median µs of ours at the default floor and at each candidate, rounds interleaved."""
    ws = ops.sparse_workspace(c.rows, c.H, device="cuda")
    groups, upr = c.batch * c.s_q, math.ceil(c.topk / ops.SPARSE_UNIT_TOKENS)
    num_ctas = ops._sparse_grid(c.H, ws.num_sms)[2]
    want = sparse.reference_out(c)
    times: dict[str, list[float]] = {}
    combine: dict[str, bool] = {}

    def plan(u):
        return ops.plan_sparse_decode(c.batch, c.s_q, c.H, c.topk, workspace=ws,
                                      device="cuda", kv_cache_dtype=c.kv.dtype,
                                      min_units_per_cta=u)

    for _ in range(rounds):
        for u in [None, *candidates(groups, upr, num_ctas)]:
            def step(i, u=u):
                return ops.sparse_mla_decode(c.qs[i], c.kv, c.idx[i], plan(u), c.scale)[0]
            key = "default" if u is None else str(u)
            if key not in times:
                err = common.rel_l2(step(0)[:want.shape[0]], want)
                assert err < sparse.REL_L2_TOL, (key, err)
                combine[key] = plan(u).needs_combine
                times[key] = []
            times[key].append(common.time_graph(step, c.nsets, budget_ms=budget_ms).us)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = min(med, key=med.get)
    return {"cache": cache, "H": c.H, "s_q": c.s_q, "batch": c.batch, "topk": c.topk,
            "units_per_req": upr, "num_ctas": num_ctas, "us": med, "combine": combine,
            "best": best}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cache", nargs="+", default=["bf16", "fp8_ds_mla"])
    p.add_argument("--batch", type=int, nargs="+", default=[32, 128])
    p.add_argument("--heads", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--s-q", type=int, nargs="+", default=[1, 2])
    p.add_argument("--topk", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--budget-ms", type=float, default=25.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    results = []
    for cache, c in sparse.decode_cases(args.cache, args.batch, args.topk, args.s_q, args.heads,
                                        args.context, seed=100):
        row = sweep_row(c, cache, args.rounds, args.budget_ms)
        results.append(row)
        med, best = row["us"], row["best"]
        cells = " ".join(f"{k}{'' if row['combine'][k] else '*'}:{v:.1f}" for k, v in med.items())
        common.log(f"{cache:10s} H={c.H:3d} s_q={c.s_q} b={c.batch:3d} topk={c.topk:4d}"
                   f"  best {best} {med[best] / med['default']:.3f}x | {cells}")
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": common.gpu_name(), "date": common.today(),
                                              "commit": common.git_commit(),
                                              "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
