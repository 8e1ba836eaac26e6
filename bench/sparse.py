"""Sparse (DSA) attention side by side: ours vs FlashMLA as vLLM 0.25 ships it, one process,
same inputs. Two jobs share this module (entry points bench/sparse_decode.py and
bench/sparse_prefill.py):

decode   q [B, s_q, H, 576] bf16; fp8_ds_mla cache (656 B/token; --cache bf16 for the bf16
         cache) of B requests with `context` tokens each in randomly permuted 64-token pages;
         indices [B, s_q, topk] random distinct positions of the request's context mapped to
         global slots. FlashMLA: flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=)
         with a fresh FlashMLASchedMeta per step (vLLM builds one per step; its scheduling
         runs inside the timed call) for fp8, flash_mla_sparse_fwd over the cache viewed as
         rows for bf16 (what vLLM's FLASHMLA_SPARSE does for a bf16 cache); heads padded to
         64 / 128 as vLLM pads them (the padded q is prepared outside the timed call).
         Ours: plan_sparse_decode + sparse_mla_decode (the plan is in the timed call).
prefill  q [T, H, 576] bf16 against a flat bf16 kv [s_kv, 576], indices [T, topk] random in
         [0, s_kv). FlashMLA: flash_mla_sparse_fwd (heads padded to 64 / 128). Ours:
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
import math
import statistics
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench import common
from bench.common import BenchRow, log

D_QK, D_V, PAGE = 576, 512, 64
REL_L2_TOL = 1e-2
OURS = "ours"
REF_ROWS = 256          # rows (query tokens) checked against the reference


class NotApplicable(RuntimeError):
    pass


@dataclass
class Case:
    """One config's inputs: nsets rotating sets of (q, indices)."""
    job: str
    H: int
    rows: int                   # B * s_q (decode) or T (prefill)
    batch: int
    s_q: int
    topk: int
    kv: torch.Tensor            # decode: paged cache; prefill: flat [S, 576]
    qs: list[torch.Tensor]      # [B, s_q, H, 576] / [T, H, 576]
    idx: list[torch.Tensor]     # [B, s_q, topk] / [T, topk]
    scale: float

    @property
    def nsets(self) -> int:
        return len(self.qs)


def _pad_heads(q: torch.Tensor, heads_dim: int) -> torch.Tensor:
    """Zero-pad the heads to 64 or 128, as vLLM's FlashMLA sparse backend does."""
    H = q.shape[heads_dim]
    target = 64 if H <= 64 else 128
    if H == target:
        return q
    shape = list(q.shape)
    shape[heads_dim] = target
    out = torch.zeros(shape, dtype=q.dtype, device=q.device)
    out.narrow(heads_dim, 0, H).copy_(q)
    return out


def make_decode_case(H, s_q, batch, topk, context, cache_fmt, seed, pool) -> Case:
    from mla_backend import formats

    g = torch.Generator(device="cuda").manual_seed(seed)
    if pool.get("key") != (batch, context, cache_fmt):
        pool.clear()
        blocks = batch * math.ceil(context / PAGE)
        kv = (torch.randn(blocks, PAGE, D_QK, device="cuda", generator=g) * 2).to(torch.bfloat16)
        if cache_fmt == "fp8_ds_mla":
            kv = formats.quantize_fp8_ds_mla(kv[..., :D_V].contiguous(), kv[..., D_V:].contiguous())
        table = torch.randperm(blocks, device="cuda", generator=g).view(batch, -1).to(torch.int32)
        pool.update(key=(batch, context, cache_fmt), kv=kv, table=table)
    kv, table = pool["kv"], pool["table"]
    touched = batch * s_q * topk * kv.shape[-1] * kv.element_size()
    nsets = common.rotating_sets(touched, hi=32)
    qs, idxs = [], []
    for _ in range(nsets):
        qs.append(torch.randn(batch, s_q, H, D_QK, device="cuda", generator=g).to(torch.bfloat16))
        pos = torch.rand(batch, s_q, context, device="cuda", generator=g).argsort(-1)[..., :topk]
        blk = torch.gather(table.unsqueeze(1).expand(batch, s_q, -1), 2, pos // PAGE)
        idxs.append((blk * PAGE + pos % PAGE).to(torch.int32).contiguous())
    return Case("decode", H, batch * s_q, batch, s_q, topk, kv, qs, idxs, D_QK ** -0.5)


def decode_cases(caches, batches, topks, s_qs, heads, context, seed):
    """(cache format, Case) for every combination, seeds seed + 1, seed + 2, ...; one cache
    pool for the rows of a (batch, cache), freed between rows (the tuning scripts' matrix)."""
    pool: dict = {}
    for cache in caches:
        for batch in batches:
            for topk in topks:
                for s_q in s_qs:
                    for H in heads:
                        seed += 1
                        yield cache, make_decode_case(H, s_q, batch, topk, context, cache, seed,
                                                      pool)
                        torch.cuda.empty_cache()


def make_prefill_case(H, tokens, topk, s_kv, seed) -> Case:
    g = torch.Generator(device="cuda").manual_seed(seed)
    kv = torch.randn(s_kv, D_QK, device="cuda", generator=g).to(torch.bfloat16)
    nsets = 2
    qs = [torch.randn(tokens, H, D_QK, device="cuda", generator=g).to(torch.bfloat16)
          for _ in range(nsets)]
    idxs = [torch.randint(0, s_kv, (tokens, topk), device="cuda", generator=g, dtype=torch.int32)
            for _ in range(nsets)]
    return Case("prefill", H, tokens, tokens, 1, topk, kv, qs, idxs, D_QK ** -0.5)


@dataclass
class Kernel:
    step: Callable[[int], object]
    check: Callable[[], torch.Tensor]      # out of set 0, shaped like the reference's


def build_ours(c: Case) -> Kernel:
    from mla_backend import ops

    if c.job == "decode":
        ws = ops.sparse_workspace(c.rows, c.H, device="cuda")

        def step(i):
            plan = ops.plan_sparse_decode(c.batch, c.s_q, c.H, c.topk, workspace=ws,
                                          device="cuda", kv_cache_dtype=c.kv.dtype)
            return ops.sparse_mla_decode(c.qs[i], c.kv, c.idx[i], plan, c.scale)[0]
    else:
        plan = ops.plan_sparse_decode(c.rows, 1, c.H, c.topk, device="cuda",
                                      kv_cache_dtype=c.kv.dtype)

        def step(i):
            return ops.sparse_mla_prefill(c.qs[i], c.kv, c.idx[i], c.scale, plan=plan)[0]
    return Kernel(step=step, check=lambda: step(0))


def build_flashmla(c: Case) -> Kernel:
    from vllm.v1.attention.ops import flashmla

    ok, why = flashmla.is_flashmla_sparse_supported()
    if not ok:
        raise NotApplicable(f"FlashMLA sparse unavailable: {why}")
    if c.job == "decode" and c.kv.dtype == torch.uint8:
        qs = [_pad_heads(q, 2) for q in c.qs]
        k_cache = c.kv.unsqueeze(-2)
        dummy_table = torch.zeros(c.batch, 1, dtype=torch.int32, device="cuda")
        seqlens = torch.ones(c.batch, dtype=torch.int32, device="cuda")

        def step(i):
            sched, _ = flashmla.get_mla_metadata()
            return flashmla.flash_mla_with_kvcache(
                qs[i], k_cache, dummy_table, seqlens, D_V, sched, softmax_scale=c.scale,
                causal=False, is_fp8_kvcache=True, indices=c.idx[i])[0][..., :c.H, :]
    else:
        kv = c.kv.reshape(-1, 1, D_QK)
        qs = [_pad_heads(q.reshape(-1, c.H, D_QK), 1) for q in c.qs]
        idx = [i.reshape(-1, 1, c.topk) for i in c.idx]

        def step(i):
            out = flashmla.flash_mla_sparse_fwd(qs[i], kv, idx[i], c.scale, d_v=D_V)[0]
            out = out[:, :c.H]
            return out.view(c.batch, c.s_q, c.H, D_V) if c.job == "decode" else out
    return Kernel(step=step, check=lambda: step(0))


BUILDERS = {OURS: build_ours, "flashmla": build_flashmla}


def reference_out(c: Case) -> torch.Tensor:
    from mla_backend import reference as ref

    if c.job == "decode":
        b = max(1, min(c.batch, REF_ROWS // c.s_q))
        return ref.sparse_mla_decode(c.qs[0][:b], c.kv, c.idx[0][:b], None, c.scale)[0]
    n = min(c.rows, REF_ROWS)
    return ref.sparse_mla_prefill(c.qs[0][:n], c.kv, c.idx[0][:n], c.scale)[0]


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
        log(f"    {name:9s} FAILED: {row.skipped[name]}")
        if args.verbose:
            traceback.print_exc()
        if not common.cuda_alive():
            raise e

    for name in kernels:  # build and check every kernel before any is timed
        try:
            k = BUILDERS[name](c)
            errors[name] = common.rel_l2(k.check()[:n], want)
            built[name] = k
        except NotApplicable as e:
            row.skipped[name] = str(e)
            log(f"    {name:9s} skipped: {e}")
        except Exception as e:  # noqa: BLE001 - reported in the row
            failed(name, e)
    timers = {name: (lambda k=k: common.time_graph(k.step, c.nsets, budget_ms=args.budget_ms))
              for name, k in built.items()}
    for name, timings in common.time_in_rounds(timers, args.rounds, failed).items():
        us_list = [t.us for t in timings]
        us, err = statistics.median(us_list), errors[name]
        line = (f"    {name:9s} {us:9.1f} us  [rel L2 {err:.1e}; {c.nsets} sets; rounds "
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
