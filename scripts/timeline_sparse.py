"""Where a CTA's time goes in the sparse kernel (bf16 source): needs a diagnostic build with
-DMLA_TIMELINE (`MLA_BACKEND_NVCC_FLAGS=-DMLA_TIMELINE python setup.py build_ext
--build-lib .build/tl`), which stamps %globaltimer at fixed points of each CTA into the
plan's partial buffer. Runs plans of whole requests only (the partial buffer is then
otherwise unused), one call per row after a warm-up, and prints per-CTA medians (µs from the
CTA's start): PDL wait done, the producer's first fills issued, Q landed, each unit pair's
start (consumer warpgroup 0), epilogue start, piece end.

    MLA_BACKEND_EXTENSION=.build/tl/mla_backend/_C.abi3.so \
        python3 scripts/timeline_sparse.py [decode|prefill]

prefill: 1056 tokens (whole tokens per CTA on 132 SMs), H 64 / 128, topk 2048 and 512; the
pair steps then cross piece boundaries (the longer steps).
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common, sparse  # noqa: E402
from mla_backend import ops  # noqa: E402

ROWS = [  # (H, s_q, batch, topk, units per CTA: whole requests)
    (64, 1, 1, 2048, 32), (64, 1, 32, 512, 8), (64, 1, 128, 512, 8), (64, 1, 128, 2048, 32),
    (128, 1, 32, 512, 8), (128, 1, 128, 2048, 64), (16, 1, 128, 512, 8),
]


PREFILL_ROWS = [(64, 2048), (128, 2048), (64, 512)]  # (H, topk); 1056 tokens, 8k keys
PREFILL_TOKENS = 1056  # whole tokens per CTA on 132 SMs: 8 at H = 64, 16 at H = 128


def report(plan, H: int, label: str) -> None:
    """Per-CTA medians of the stamps the last call left in plan.partial_out."""
    ctas = plan.num_ctas * math.ceil(H / 64)
    t = plan.partial_out.view(-1).view(torch.int64)[:ctas * 64].view(ctas, 64).cpu()
    used = t[:, 0] > 0
    t = t[used & (t[:, 58] > 0)]
    if t.shape[0] == 0:
        raise SystemExit("no timeline stamps: run on a build with -DMLA_TIMELINE "
                         "(MLA_BACKEND_EXTENSION=.../_C.abi3.so)")
    rel = (t - t[:, :1]).double() / 1e3
    start = (t[:, 0] - t[:, 0].min()).double() / 1e3
    end = sorted(((t[:, 58] - t[:, 0].min()).double() / 1e3).tolist())
    med = {k: statistics.median(rel[:, k].tolist()) for k in (1, 2, 3, 4, 5, 56, 57, 58)}
    pairs = [statistics.median(rel[:, k].tolist()) for k in range(8, 56)
             if bool((t[:, k] > 0).all())]
    steps = [b - a for a, b in zip(pairs, pairs[1:], strict=False)]
    common.log(f"{label}: {t.shape[0]} CTAs, start spread {start.max():.1f} us, last piece "
               f"ends min / median / max {end[0]:.1f} / {end[len(end) // 2]:.1f} / "
               f"{end[-1]:.1f} us after the first CTA's start")
    common.log(f"  pdl {med[1]:.2f}  fills issued {med[2]:.2f}->{med[3]:.2f}  Q landed "
               f"wg0 {med[4]:.2f} wg1 {med[5]:.2f}  first pair {pairs[0] if pairs else 0:.2f}"
               f"  epilogue {med[56]:.2f}/{med[57]:.2f}  end {med[58]:.2f}")
    common.log("  pair steps (us): " + " ".join(f"{x:.2f}" for x in steps[:40]))


def decode_rows() -> None:
    pool: dict = {}
    for H, s_q, batch, topk, U in ROWS:
        c = sparse.make_decode_case(H, s_q, batch, topk, 32768, "bf16", 7, pool)
        plan = ops.plan_sparse_decode(batch, s_q, H, topk, device="cuda", min_units_per_cta=U)
        assert not plan.needs_combine
        for i in range(3):
            plan.partial_out.zero_()
            ops.sparse_mla_decode(c.qs[i % c.nsets], c.kv, c.idx[i % c.nsets], plan, c.scale)
        torch.cuda.synchronize()
        report(plan, H, f"H={H} s_q={s_q} batch={batch} topk={topk} U={U}")
        del c
        torch.cuda.empty_cache()


def prefill_rows() -> None:
    for H, topk in PREFILL_ROWS:
        c = sparse.make_prefill_case(H, PREFILL_TOKENS, topk, 8192, seed=3)
        plan = ops.plan_sparse_decode(PREFILL_TOKENS, 1, H, topk, device="cuda")
        assert not plan.needs_combine, "the prefill timeline needs whole tokens per CTA"
        for i in range(3):
            plan.partial_out.zero_()
            ops.sparse_mla_prefill(c.qs[i % c.nsets], c.kv, c.idx[i % c.nsets], c.scale,
                                   plan=plan)
        torch.cuda.synchronize()
        report(plan, H, f"prefill H={H} tokens={PREFILL_TOKENS} topk={topk} "
                        f"({topk // 128} pairs per piece)")
        del c
        torch.cuda.empty_cache()


def main() -> int:
    job = sys.argv[1] if len(sys.argv) > 1 else "decode"
    if job not in ("decode", "prefill"):
        raise SystemExit(f"usage: timeline_sparse.py [decode|prefill]; got {job!r}")
    if job == "decode":
        decode_rows()
    else:
        prefill_rows()
    return 0


if __name__ == "__main__":
    sys.exit(main())
