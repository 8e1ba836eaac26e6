"""Where a CTA's time goes in the sparse kernel (bf16 source): needs a diagnostic build with
-DMLA_TIMELINE (`MLA_BACKEND_NVCC_FLAGS=-DMLA_TIMELINE python setup.py build_ext
--build-lib .build/tl`), which stamps %globaltimer at fixed points of each CTA into the
plan's partial buffer. Runs plans of whole requests only (the partial buffer is then
otherwise unused), one call per row after a warm-up, and prints per-CTA medians (µs from the
CTA's start): PDL wait done, the producer's first fills issued, Q landed, each unit pair's
start (consumer warpgroup 0), epilogue start, piece end.

    MLA_BACKEND_EXTENSION=.build/tl/mla_backend/_C.abi3.so python3 scripts/timeline_sparse.py
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


def main() -> int:
    pool: dict = {}
    for H, s_q, batch, topk, U in ROWS:
        c = sparse.make_decode_case(H, s_q, batch, topk, 32768, "bf16", 7, pool)
        plan = ops.plan_sparse_decode(batch, s_q, H, topk, device="cuda", min_units_per_cta=U)
        assert not plan.needs_combine
        for i in range(3):
            plan.partial_out.zero_()
            ops.sparse_mla_decode(c.qs[i % c.nsets], c.kv, c.idx[i % c.nsets], plan, c.scale)
        torch.cuda.synchronize()
        ctas = plan.num_ctas * math.ceil(H / 64)
        t = plan.partial_out.view(-1).view(torch.int64)[:ctas * 64].view(ctas, 64).cpu()
        used = t[:, 0] > 0
        t = t[used & (t[:, 58] > 0)]
        rel = (t - t[:, :1]).double() / 1e3
        start = (t[:, 0] - t[:, 0].min()).double() / 1e3
        med = {k: statistics.median(rel[:, k].tolist()) for k in (1, 2, 3, 4, 5, 56, 57, 58)}
        pairs = [statistics.median(rel[:, k].tolist()) for k in range(8, 56)
                 if bool((t[:, k] > 0).all())]
        steps = [b - a for a, b in zip(pairs, pairs[1:], strict=False)]
        common.log(f"H={H} s_q={s_q} batch={batch} topk={topk} U={U}: {t.shape[0]} CTAs, start "
                   f"spread {start.max():.1f} us")
        common.log(f"  pdl {med[1]:.2f}  fills issued {med[2]:.2f}->{med[3]:.2f}  Q landed "
                   f"wg0 {med[4]:.2f} wg1 {med[5]:.2f}  first pair {pairs[0] if pairs else 0:.2f}"
                   f"  epilogue {med[56]:.2f}/{med[57]:.2f}  end {med[58]:.2f}")
        common.log("  pair steps (us): " + " ".join(f"{x:.2f}" for x in steps[:24]))
        del c
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
