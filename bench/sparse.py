"""Sparse (DSA) attention side by side: ours vs FlashMLA as vLLM 0.25 ships it (`flashmla`)
and as SGLang 0.5.17 ships it in sgl-kernel (`flashmla_sgl`, where sgl_kernel imports), one
process, same inputs. Two jobs share this module (entry points bench/sparse_decode.py and
bench/sparse_prefill.py); inputs in bench/sparse_inputs.py, the kernels in bench/peers/:

decode   q [B, s_q, H, 576] bf16; fp8_ds_mla cache (656 B/token; --cache bf16 for the bf16
         cache) of B requests with `context` tokens each in randomly permuted 64-token pages;
         indices [B, s_q, topk] random distinct positions of the request's context mapped to
         global slots. FlashMLA: flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=)
         with a fresh FlashMLASchedMeta per step (vLLM builds one per step; its scheduling
         runs inside the timed call) for fp8, flash_mla_sparse_fwd over the cache viewed as
         rows for bf16 (what vLLM's FLASHMLA_SPARSE does for a bf16 cache); heads padded to
         64 / 128 as vLLM pads them (the padded q is prepared outside the timed call).
         flashmla_sgl: SGLang's `dsa` calls (bench/peers/flashmla_sgl.py): fp8 through
         get_mla_metadata(lengths) + flash_mla_with_kvcache, in the timed call; bf16 through
         flash_mla_sparse_fwd.
         Ours: plan_sparse_decode + sparse_mla_decode (the plan is in the timed call).
prefill  q [T, H, 576] bf16 against a flat bf16 kv [s_kv, 576], indices [T, topk] random in
         [0, s_kv). FlashMLA (both builds): flash_mla_sparse_fwd (heads padded to 64 / 128). Ours:
         sparse_mla_prefill with a plan made once per shape (outside the timed call).
FLASH_ATTN_MLA_SPARSE is not included (no standalone entry point in the kit).

Timing: common.time_graph (CUDA graphs, median of replays), input sets rotated so the
touched keys exceed L2, in --rounds rounds per row with each kernel first in turn
(common.round_orders); a row's time per kernel is the median of its rounds.
FLOPs = 2 * H * rows * topk * (576 + 512) with rows = B * s_q (or T); bytes = keys read
(topk per row, 656 or 1152 B) + q + out. Correctness gate: rel L2 of out vs the float32
reference on (a slice of) the first input set.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import traceback

import torch

from bench import common
from bench.common import BenchRow, Kernel, log
from bench.peers import flashmla, flashmla_sgl, ours
from bench.sparse_inputs import D_QK, D_V, Case, make_decode_case, make_prefill_case, reference_out

REL_L2_TOL = 1e-2
OURS = "ours"
BUILDERS = {OURS: ours.build_sparse, "flashmla": flashmla.build_sparse,
            "flashmla_sgl": flashmla_sgl.build_sparse}


def bench_case(c: Case, kernels, args, copy_bw) -> BenchRow:
    cfg = ({"H": c.H, "s_q": c.s_q, "batch": c.batch, "topk": c.topk,
            "cache": "fp8_ds_mla" if c.kv.dtype == torch.uint8 else "bf16"}
           if c.job == "decode" else
           {"H": c.H, "tokens": c.rows, "topk": c.topk, "s_kv": c.kv.shape[0]})
    row = BenchRow(config=cfg)
    want = reference_out(c)
    n = want.shape[0]
    built: dict[str, Kernel] = {}
    errors: dict[str, float] = {}

    def failed(name: str, e: Exception) -> None:
        row.skipped[name] = common.short_error(e)
        log(f"    {name:12s} FAILED: {row.skipped[name]}")
        if args.verbose:
            traceback.print_exc()
        if not common.cuda_alive():
            raise e

    for name in kernels:  # build and check every kernel before any is timed
        try:
            k = BUILDERS[name](c)
            errors[name] = common.rel_l2(k.check()[:n], want)
            built[name] = k
        except common.NotApplicable as e:
            row.skipped[name] = str(e)
            log(f"    {name:12s} skipped: {e}")
        except Exception as e:  # noqa: BLE001 - reported in the row
            failed(name, e)
    timers = {name: (lambda k=k: common.time_graph(k.step, c.nsets, budget_ms=args.budget_ms))
              for name, k in built.items()}
    for name, timings in common.time_in_rounds(timers, args.rounds, failed).items():
        us_list = [t.us for t in timings]
        us, err = statistics.median(us_list), errors[name]
        line = (f"    {name:12s} {us:9.1f} us  [rel L2 {err:.1e}; {c.nsets} sets; rounds "
                + " ".join(f"{v:.1f}" for v in us_list) + "]")
        row.us_rounds[name] = us_list
        if err < REL_L2_TOL:
            row.us[name] = us
        else:
            row.uncounted_us[name] = us
            row.skipped[name] = f"correctness gate failed (rel L2 {err:.1e})"
            line += "  <-- CORRECTNESS GATE FAILED"
        log(line)
    key_bytes = c.kv.shape[-1] * c.kv.element_size()
    flops = 2.0 * c.H * c.rows * c.topk * (D_QK + D_V)
    nbytes = c.rows * c.topk * key_bytes + c.rows * c.H * (D_QK + D_V) * 2.0
    row.finalize(flops, nbytes, copy_bw)
    return row


MATRICES = {
    "decode": {"H": (16, 32, 64, 128), "s_q": (1, 2), "batch": (1, 32, 128), "topk": (512, 2048)},
    "prefill": {"H": (16, 64, 128), "s_kv": (8192, 32768, 131072)},
}
QUICK = {
    "decode": {"H": (16, 128), "s_q": (1,), "batch": (32, 128), "topk": (2048,)},
    "prefill": {"H": (16, 128), "s_kv": (32768,)},
}


def main(job: str, argv=None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m bench.sparse_{job}")
    p.add_argument("--quick", action="store_true", help="a few rows only")
    p.add_argument("--kernels", nargs="+", default=list(BUILDERS), choices=list(BUILDERS))
    p.add_argument("--out", default=None, help="results file or directory")
    p.add_argument("--budget-ms", type=float, default=40.0)
    p.add_argument("--rounds", type=int, default=4,
                   help="timing rounds per row, each kernel first in turn; the median counts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true")
    if job == "decode":
        p.add_argument("--context", type=int, default=32768)
        p.add_argument("--cache", choices=["fp8_ds_mla", "bf16"], default="fp8_ds_mla")
    else:
        p.add_argument("--tokens", type=int, default=4096)
        p.add_argument("--topk", type=int, default=2048)
        p.add_argument("--s-kv", type=int, nargs="+", help="only these kv lengths")
    p.add_argument("--heads", type=int, nargs="+", help="only these head counts")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1; got {args.rounds}")
    matrix = dict((QUICK if args.quick else MATRICES)[job])
    if args.heads:
        matrix["H"] = tuple(args.heads)
    if job == "prefill" and args.s_kv:
        matrix["s_kv"] = tuple(args.s_kv)
    gpu, date, commit = common.gpu_name(), common.today(), common.git_commit()
    path = common.resolve_out(args.out, f"sparse_{job}", gpu, date)
    copy_bw = common.copy_bandwidth_gbs()
    log(f"{gpu}, {date}, commit {commit}; copy bandwidth {copy_bw:.0f} GB/s")
    rows: list[BenchRow] = []
    pool: dict = {}

    def save():
        common.write_results(path, job=f"sparse_{job}", gpu=gpu, date=date, commit=commit,
                             copy_bw_gbs=copy_bw, rows=rows)

    seed = args.seed
    if job == "decode":
        for batch in matrix["batch"]:
            for topk in matrix["topk"]:
                for s_q in matrix["s_q"]:
                    for H in matrix["H"]:
                        seed += 1
                        log(f"[H={H} s_q={s_q} batch={batch} topk={topk} {args.cache}]")
                        c = make_decode_case(H, s_q, batch, topk, args.context, args.cache,
                                             seed, pool)
                        rows.append(bench_case(c, args.kernels, args, copy_bw))
                        save()
    else:
        for s_kv in matrix["s_kv"]:
            for H in matrix["H"]:
                seed += 1
                log(f"[H={H} tokens={args.tokens} topk={args.topk} s_kv={s_kv}]")
                c = make_prefill_case(H, args.tokens, args.topk, s_kv, seed)
                rows.append(bench_case(c, args.kernels, args, copy_bw))
                save()
                torch.cuda.empty_cache()
    common.print_table(rows, args.kernels, copy_bw)
    common.print_summary(rows)
    log(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "decode", sys.argv[2:]))
