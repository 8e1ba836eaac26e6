"""Dense paged MLA decode, ours vs the kernels vLLM 0.25 ships, same process, same inputs.

Run on the GPU machine from the repository root (vLLM's kernels come from /opt/vk/site):

    PYTHONPATH=/opt/vk/site python -m bench.dense_decode [--quick] [--out PATH]
                                                         [--no-flashinfer] [--peers ...]
                                                         [--fp8 | --fp8-only]
                                                         [--min-tokens-per-cta N]
                                                         [--mma-max-rows N]
                                                         [--mma-min-batch B]
                                                         [--equal-lengths] [--whole-extra N]
                                                         [--align-extra N] [--restart-pad N]
                                                         [--lpt-extra N]

Kernels (bf16 cache [num_blocks, 64, 576], int32 block table / seq lens, causal, varlen):
  ours            mla_backend.ops.plan_decode + mla_decode
  flashmla        vllm.v1.attention.ops.flashmla.flash_mla_with_kvcache (FLASHMLA)
  fa3_mla         vllm.vllm_flash_attn.flash_attn_varlen_func(fa_version=3, q=q_pe, q_v=q_nope,
                  k/v = rope/latent views of the same cache) + get_scheduler_metadata
                  (FLASH_ATTN_MLA), page 64 like ours (--fa3-page 16: vLLM's default block size)
  flashinfer_mla  flashinfer.mla.BatchMLAPagedAttentionWrapper(backend="fa3"), JIT-compiled on
                  first use (minutes; --no-flashinfer skips it)
  triton_mla      vllm.v1.attention.ops.triton_decode_attention.decode_attention_fwd
                  (TRITON_MLA); s_q = 1 only, as vLLM sends it nothing else
The calls follow /work/shared/reference/peers_probe.py (how vLLM's backends call them); each
kernel's adapter is in bench/peers/, the inputs and the correctness gate in bench/dense_inputs.py.

Two times per kernel and row (each a CUDA graph of many calls, see bench.common.time_graph):
  per call     the kernel's per-step metadata inside every timed call (Kernel.step): the
               conservative figure, `us` and `speedup_vs_best_peer` in the results file
  per layer    the headline: vLLM builds the metadata once per step for all of a model's
               layers (61 in DeepSeek-V3), so per layer = kernel only + (per call - kernel
               only) / 61, where kernel only times the call with the metadata built once
               outside (Kernel.step_premeta); `us_per_layer`, `speedup_vs_best_peer_per_layer`
               and `us_kernel_only` in the results file. A kernel with no per-step metadata
               timed has per layer = per call.
Per-step metadata, per kernel:
  ours            plan_decode (GPU planner, no host sync) before mla_decode.
  flashmla        a fresh FlashMLASchedMeta per call, so the tile-scheduler metadata kernel
                  that flash_mla_with_kvcache runs on first use of a schedule is in the call
                  (vLLM runs it once per step, in the first layer); kernel only: one schedule
                  per input set, filled by its first call.
  fa3_mla         get_scheduler_metadata before flash_attn_varlen_func.
  flashinfer_mla  none timed: its plan() is host-side (CPU scheduling + a synchronous copy to
                  the GPU), cannot be captured in a CUDA graph, and vLLM runs it once per step
                  outside the graph; it is NOT timed in either figure (run() only).
  triton_mla      none (num_kv_splits is host math).
If a step with its metadata cannot be captured, the kernel is timed with the metadata built
once outside the graph in both figures, and the row says so ('*' in the table).
Every kernel of a config is built and checked first; then the config times them in --rounds
rounds (default: one per kernel), each kernel first in turn (bench.common.round_orders); in
its turn a kernel is timed per call and kernel only, back to back, each first in every other
round. Each time is the median of its rounds (in the results file as us_rounds and
us_kernel_only_rounds). Timed once each and ours always first, a kernel after a pause can run
above the power cap's sustained clock. A kernel that fails in any round counts in neither
figure.
The per-layer glue vLLM adds around the calls (torch.cat of q, zero-filled outputs) is not
timed for anyone. Every kernel's time counts only if its output passed the correctness gate
(rel L2 < 1e-2 against mla_backend.reference.mla_decode on the first requests of set 0).

Inputs: random bf16 q and cache, lengths uniform in [0.5, 1.5] x mean (seeded, then scaled
so the batch holds exactly batch x mean tokens), blocks handed out by a random permutation;
several input sets (disjoint cache blocks, own q) rotate so that every rotation touches at
least 4x the 50 MB L2 (2 sets when one set alone is far above it).

FLOPs = 2 H s_q tokens (576 + 512); bytes = tokens 576 2 + Q + O bytes; tokens = sum(seq_lens).
Results: bench/results/dense_decode-<gpu-slug>-<date>.json (design.md's shape) and a table.

fp8 block (--fp8: after the bf16 matrix; --fp8-only: instead of it). Per-tensor fp8 e4m3 cache
[num_blocks, 64, 576] float8_e4m3fn = formats.quantize_fp8_per_tensor(random bf16 cache,
kv_scale), kv_scale = amax / 448 (one float32 for the whole pool); q stays bf16 for ours. Same
lengths, paging and rotation as above (sets sized on 576 bytes per token). Matrix H 16,64,128 x
s_q 1,2 x batch 1,32,128 x seq_len 4096 (--H / --s-q / --batch / --seq-len override it).
  ours            plan_decode(..., kv_cache_dtype=float8_e4m3fn) + mla_decode(..., kv_scale=
                  1-element float32 CUDA tensor); per call and per layer as above
  flashmla        get_mla_metadata_dense_fp8(seq_lens, s_q H, 1) + flash_mla_with_kvcache_fp8
                  (FLASHMLA with kv_cache_dtype "fp8"), metadata as for bf16 above. It takes
                  an fp8 q: vLLM's layer quantizes q per tensor to float8_e4m3fn with the
                  layer's q_scale before forward_mqa (here q_scale = amax|q| / 448 per input
                  set, done once outside the timing, like the other per-layer glue).
Gate: ours against mla_backend.reference.mla_decode on the fp8 cache (kv_scale); FlashMLA
against the same reference fed its own dequantized q (q_fp8 * q_scale), so q's quantization
is in the reference, not in a wider tolerance. FlashMLA's fp8 kernel also rounds the softmax
probabilities to e4m3 before its PV product (no reference models that): if it fails the gate
for that reason, its time shows as '!' and --fp8-peer-tol sets the peer's limit (printed).
bytes = tokens 576 + Q + O bytes (Q, O in bf16); FLOPs as above. Results:
bench/results/dense_decode_fp8-<gpu-slug>-<date>.json (job "dense_decode_fp8"), next to the
bf16 file (--out DIR: in DIR; --fp8-only --out FILE: FILE), with its own table and summary.

Bench only: --min-tokens-per-cta N plans ours with at least N keys per CTA instead of the
library's cost_model.MIN_TOKENS_PER_CTA (plan_decode's _min_tokens_per_cta), to sweep the split
minimum in one call; the results file records it as min_tokens_per_cta (null: the default).
--mma-max-rows N and --mma-min-batch B replace the library's rule for the kernel of few query
rows (cost_model: the mma.sync kernel up to MMA_MAX_ROWS = 16 rows, s_q * H, MMA_MAX_ROWS_FP8 = 8
on an fp8 cache, from MMA_MIN_BATCH_* requests on, per cache dtype; else the wgmma kernel); N
sets both row caps: 0 rows puts every step on the wgmma kernel,
batch 1 every step of <= N rows on the mma.sync kernel. Recorded as mma_max_rows, mma_min_batch
(null: the default). --equal-lengths gives every request exactly the mean length (as SGLang's
and FlashInfer's decode benchmarks do); --whole-extra N replaces the library's
DENSE_WHOLE_REQUEST_EXTRA_UNITS (whole requests per CTA for equal lengths; -1: never), and
--align-extra N its DENSE_ALIGN_EXTRA_UNITS (aligned plans: every request on CTAs of its own;
-1: never), --restart-pad N its DENSE_RESTART_PAD_UNITS (padded plans: N units of padding after
a request that ends inside a CTA; -1: never), --lpt-extra N its DENSE_LPT_EXTRA_UNITS (with
more requests than CTAs, whole requests longest first when the busiest CTA gets at most N units
above the balanced share; -1: never). Recorded as equal_lengths, whole_extra, align_extra,
restart_pad and lpt_extra.

Exit status: 0; 1 if ours failed the correctness gate in some row; 2 if the run stopped early.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import common, dense_inputs
from bench.common import BenchRow, Kernel, NotApplicable, log
from bench.dense_inputs import (
    D_QK,
    D_V,
    PAGE,
    REL_L2_TOL,
    Inputs,
    gate,
    kv_pool_plan,
    make_inputs,
    make_kv_pool,
    reference,
)
from bench.peers import fa3_mla, flashinfer_mla, flashmla, ours, triton_mla

JOB = "dense_decode"
JOB_FP8 = "dense_decode_fp8"
KV_LIMIT_BYTES = 40e9            # skip configs whose rotating KV pool would exceed this
SEED = 1234

OURS = "ours"
PEERS = ("flashmla", "fa3_mla", "flashinfer_mla", "triton_mla")
KERNELS = (OURS, *PEERS)

FULL_MATRIX = {"H": (16, 32, 64, 128), "s_q": (1, 2, 4), "batch": (1, 32, 128),
               "seq_len": (1024, 4096, 16384)}
QUICK_MATRIX = {"H": (16, 128), "s_q": (1, 2), "batch": (1, 32, 128), "seq_len": (4096,)}
FP8_MATRIX = {"H": (16, 64, 128), "s_q": (1, 2), "batch": (1, 32, 128), "seq_len": (4096,)}
FP8_PEERS = ("flashmla",)        # peers with a dense per-tensor fp8 path in the fp8 block
LAYERS_PER_STEP = 61             # DeepSeek-V3/R1's layers: one step's metadata serves them all

# What each kernel's per-step metadata is, and so what its per-layer time amortizes.
PER_STEP_METADATA = {
    OURS: "plan_decode (GPU planner), amortized per layer",
    "flashmla": "get_mla_metadata's tile-scheduler kernel (run by a call on a fresh "
                "schedule), amortized per layer",
    "fa3_mla": "get_scheduler_metadata, amortized per layer",
    "flashinfer_mla": "plan() is host-side and never timed (not capturable; vLLM runs it "
                      "once per step outside its graph): run() only, per layer = per call",
    "triton_mla": "none (num_kv_splits is host math): per layer = per call",
}
FP8_PER_STEP_METADATA = {
    OURS: "plan_decode(kv_cache_dtype=float8_e4m3fn), amortized per layer",
    "flashmla": "get_mla_metadata_dense_fp8, amortized per layer",
}


def per_layer_us(call_us: float, kernel_only_us: float,
                 layers: int = LAYERS_PER_STEP) -> float:
    """A call's time with its per-step metadata paid once per step of `layers` layers: the
    kernel alone plus 1/layers of what the metadata adds to a call."""
    return kernel_only_us + (call_us - kernel_only_us) / layers


@dataclass
class StepTimings:
    """One round's timings of one kernel: per call (Kernel.step: its per-step metadata in
    every call) and kernel only (Kernel.step_premeta: the metadata built once outside), or
    None where it has no per-step metadata timed."""

    call: common.Timing
    kernel_only: common.Timing | None


Builder = Callable[[Inputs, argparse.Namespace], Kernel]
BUILDERS: dict[str, Builder] = {
    OURS: ours.build_dense,
    "flashmla": flashmla.build_dense,
    "fa3_mla": fa3_mla.build,
    "flashinfer_mla": flashinfer_mla.build,
    "triton_mla": triton_mla.build,
}
FP8_BUILDERS: dict[str, Builder] = {
    OURS: ours.build_dense,
    "flashmla": flashmla.build_dense_fp8,
}


# --------------------------------------------------------------------------- one config


class CudaBroken(RuntimeError):
    """The CUDA context is unusable (every later call would fail): the run stops."""


def bench_config(x: Inputs, kernels: list[str], args: argparse.Namespace,
                 copy_bw: float | None,
                 builders: dict[str, Builder] = BUILDERS) -> tuple[BenchRow, bool]:
    """Builds and checks every kernel, then times them in args.rounds rounds, each kernel
    first in turn (common.round_orders). In its turn a kernel is timed per call (Kernel.step)
    and, where it has step_premeta, kernel only, back to back. Its per-call and kernel-only
    times are the medians of their rounds; its per-layer time comes from the two
    (per_layer_us), or is its per-call time where it has no kernel-only time. A kernel that
    fails in any round or misses the correctness gate counts in neither.
    Returns the row and whether ours failed the correctness gate."""
    cfg = {"H": x.H, "s_q": x.s_q, "batch": x.B, "seq_len": x.pool.seq_len,
           "dtype": x.pool.dtype_label}
    row = BenchRow(config=cfg, per_layer=True)
    lines: dict[str, str] = {}
    try:
        want = reference(x)
    except Exception as e:  # noqa: BLE001
        why = f"reference failed, nothing can be checked: {common.short_error(e)}"
        log(f"    {why}")
        row.skipped.update(dict.fromkeys(kernels, why))
        if not common.cuda_alive():
            raise CudaBroken(why) from e
        return row, False

    def failed(name: str, e: Exception) -> None:
        """A kernel that raised: reported in the row, never a made-up time."""
        row.skipped[name] = common.short_error(e)
        lines[name] = f"    {name:15s} FAILED: {row.skipped[name]}"
        if args.verbose:
            traceback.print_exc()
        if not common.cuda_alive():
            for line in lines.values():
                log(line)
            raise CudaBroken(f"CUDA context broken after {name} failed: "
                             f"{row.skipped[name]}") from e

    # (kernel, gate passed, gate message, limit, note) of every kernel that built
    built: dict[str, tuple[Kernel, bool, str, float, str]] = {}
    for name in kernels:
        try:
            kernel = builders[name](x, args)
            tol = REL_L2_TOL if kernel.tol is None else kernel.tol
            ok, msg = gate(kernel, want if kernel.want is None else kernel.want(), tol)
            note = (f"correctness limit rel L2 {tol:g} (--fp8-peer-tol), not {REL_L2_TOL:g}"
                    if tol != REL_L2_TOL else "")
            built[name] = (kernel, ok, msg, tol, note)
        except NotApplicable as e:
            row.skipped[name] = str(e)
            lines[name] = f"    {name:15s} skipped: {e}"
        except Exception as e:  # noqa: BLE001
            failed(name, e)
    capture_notes: dict[str, str] = {}  # kernels timed with metadata built outside the graph

    def timer(name: str, kernel: Kernel) -> Callable[[], StepTimings]:
        rounds_done = [0]

        def per_call() -> common.Timing:
            if name not in capture_notes:
                try:
                    return common.time_graph(kernel.step, x.nsets, budget_ms=args.budget_ms)
                except common.GraphCaptureError as e:
                    if kernel.step_premeta is None:
                        raise
                    capture_notes[name] = (f"metadata/plan built outside the graph (capture "
                                           f"with it failed: {e}); per layer = per call")
            return common.time_graph(kernel.step_premeta, x.nsets, budget_ms=args.budget_ms)

        def kernel_only() -> common.Timing | None:
            if kernel.step_premeta is None or name in capture_notes:
                return None
            return common.time_graph(kernel.step_premeta, x.nsets, budget_ms=args.budget_ms)

        def run() -> StepTimings:
            # both variants back to back, each first in every other round
            rounds_done[0] += 1
            if rounds_done[0] % 2:
                call = per_call()
                only = kernel_only()
            else:
                only = kernel_only()
                call = per_call()
            return StepTimings(call, None if name in capture_notes else only)
        return run

    timings = common.time_in_rounds({name: timer(name, b[0]) for name, b in built.items()},
                                    args.rounds or max(len(built), 1), failed)
    ours_bad = False
    for name, ts in timings.items():
        _, ok, msg, tol, note = built[name]
        note = "; ".join(filter(None, [note, capture_notes.get(name, "")]))
        us_list = [t.call.us for t in ts]
        us = statistics.median(us_list)
        row.us_rounds[name] = us_list
        only_list = ([] if name in capture_notes else
                     [t.kernel_only.us for t in ts if t.kernel_only is not None])
        only = statistics.median(only_list) if only_list else None
        pl = us if only is None else per_layer_us(us, only)
        if only_list:
            row.us_kernel_only_rounds[name] = only_list
        if ok:
            row.us[name] = us
            row.us_per_layer[name] = pl
            if only is not None:
                row.us_kernel_only[name] = only
            if note:
                row.notes[name] = note
        else:
            row.uncounted_us[name] = us
            if only is not None:
                row.uncounted_us_per_layer[name] = pl
            measured = (f"{us:.1f} us" if only is None else
                        f"{pl:.1f} us per layer, {us:.1f} per call")
            row.skipped[name] = (f"correctness gate failed ({msg}; limit {tol:g}); "
                                 f"measured {measured}, not counted")
            ours_bad |= name == OURS
        t = ts[-1].call
        flag = "" if ok else "  <-- CORRECTNESS GATE FAILED"
        times = (f"{pl:9.1f} us per layer, {us:9.1f} per call" if only is not None else
                 f"{us:9.1f} us per layer = per call")
        rounds = " ".join(f"{v:.1f}" for v in us_list)
        if only_list:
            rounds = f"per call {rounds}; kernel only " + " ".join(f"{v:.1f}" for v in only_list)
        lines[name] = (f"    {name:15s} {times}  [{msg}; {t.nsets} sets, {t.ncalls} "
                       f"calls/graph, {t.reps} replays; rounds {rounds}]{flag}"
                       + (f"  ({note})" if note else ""))
    built.clear()  # the kernels and their buffers go before the next config is built
    if OURS in kernels and OURS not in row.us and OURS not in row.skipped:
        row.skipped[OURS] = "not run"
    tokens = x.pool.tokens
    flops = 2.0 * x.H * x.s_q * tokens * (D_QK + D_V)
    nbytes = tokens * D_QK * x.pool.cache.element_size() + x.T * x.H * (D_QK + D_V) * 2.0
    row.finalize(flops, nbytes, copy_bw)
    for name in kernels:
        if name in lines:
            log(lines[name])
    return row, ours_bad


# --------------------------------------------------------------------------- driver


def run_matrix(matrix: dict[str, tuple[int, ...]], kernels: list[str],
               builders: dict[str, Builder],
               args: argparse.Namespace, copy_bw: float | None, rows: list[BenchRow],
               save: Callable[[], None], *, fp8: bool = False) -> tuple[bool, int]:
    """Every config of `matrix` (pools built per batch x seq_len, inputs per H x s_q), rows
    appended to `rows` and saved after each. Returns (ours failed a gate, status: 0, or 2 if
    it stopped early)."""
    t_start = time.perf_counter()
    ours_bad = False
    status = 0
    live = common.Table(["H", "s_q", "batch", "seq_len", "dtype"], kernels, per_layer=True)
    log("\nper-config lines below use these columns:\n    " + live.header())
    try:
        for seq_len in matrix["seq_len"]:
            for batch in matrix["batch"]:
                seed = args.seed + 1009 * batch + seq_len
                _, _, nsets, pool_bytes = kv_pool_plan(batch, seq_len, seed, fp8)
                if pool_bytes > KV_LIMIT_BYTES:
                    why = (f"KV pool of {nsets} sets would take {pool_bytes / 1e9:.1f} GB "
                           f"(> {KV_LIMIT_BYTES / 1e9:.0f} GB)")
                    log(f"\n[batch={batch} seq_len={seq_len}] skipped: {why}")
                    continue
                pool = make_kv_pool(batch, seq_len, seed, fp8)
                for H in matrix["H"]:
                    for s_q in matrix["s_q"]:
                        log(f"\n[H={H} s_q={s_q} batch={batch} seq_len={seq_len}"
                            + (f" fp8 kv_scale={pool.kv_scale:.3g}" if fp8 else "")
                            + f"] tokens {pool.tokens}, {pool.nsets} input sets, "
                            f"{(time.perf_counter() - t_start):.0f} s elapsed")
                        x = make_inputs(pool, H, s_q, seed + 7 * H + s_q)
                        row, bad = bench_config(x, kernels, args, copy_bw, builders)
                        ours_bad |= bad
                        rows.append(row)
                        log("    " + live.line(row))
                        del x
                        save()
                del pool
                torch.cuda.empty_cache()
    except CudaBroken as e:
        log(f"\nstopping early: {e}")
        status = 2
    except KeyboardInterrupt:
        log("\ninterrupted: writing the rows so far")
        status = 2
    return ours_bad, status


# the planner's cost_model knobs the bench can replace (bench only): (args field, option,
# cost_model name, what it is in the log, the values allowed (None: no upper bound), help)
PLAN_KNOBS = [
    ("whole_extra", "--whole-extra", "DENSE_WHOLE_REQUEST_EXTRA_UNITS", "whole-request margin",
     (-1, None), "whole requests per CTA for equal lengths when at most N units, or 1/32 of the "
                 "balanced share if more, above that share; -1: never"),
    ("align_extra", "--align-extra", "DENSE_ALIGN_EXTRA_UNITS", "aligned-plan margin",
     (-1, 1024), "an aligned plan, every request on CTAs of its own, when it needs at most N "
                 "units per CTA above the balanced share; -1: never"),
    ("restart_pad", "--restart-pad", "DENSE_RESTART_PAD_UNITS", "restart padding",
     (-1, 255), "a padded plan where no aligned one fits: N units of padding after each request "
                "that ends inside a CTA; -1: never"),
    ("lpt_extra", "--lpt-extra", "DENSE_LPT_EXTRA_UNITS", "longest-first margin", (-1, 1024),
     "with more requests than CTAs, whole requests longest first when the busiest CTA gets at "
     "most N units, or 1/32 of the balanced share if more, above that share; -1: never"),
    ("one_page_max", "--one-page-max", "DENSE_ONE_PAGE_MAX_PAGES", "small-step pages",
     (-1, None), "on the wgmma kernel with at most 4 row tiles, one page a CTA as the least work "
                 "when the step has at most N pages in all; -1: never")]


def results_extra(kernels: list[str], metadata: dict[str, str],
                  min_tokens_per_cta: int | None = None,
                  mma_max_rows: int | None = None,
                  mma_min_batch: int | None = None, equal_lengths: bool = False,
                  whole_extra: int | None = None,
                  align_extra: int | None = None,
                  restart_pad: int | None = None,
                  lpt_extra: int | None = None,
                  one_page_max: int | None = None) -> dict[str, object]:
    """The results file's top-level description of the per-layer figures, and ours' split
    minimum and kernel choice where --min-tokens-per-cta / --mma-max-rows / --mma-min-batch
    replaced the library's."""
    return {"layers_per_step": LAYERS_PER_STEP,
            "per_step_metadata": {k: metadata[k] for k in kernels if k in metadata},
            "min_tokens_per_cta": min_tokens_per_cta, "mma_max_rows": mma_max_rows,
            "mma_min_batch": mma_min_batch, "equal_lengths": equal_lengths,
            "whole_extra": whole_extra, "align_extra": align_extra, "restart_pad": restart_pad,
            "lpt_extra": lpt_extra, "one_page_max": one_page_max}


def report(rows: list[BenchRow], kernels: list[str], copy_bw: float | None, out_path: Path,
           seconds: float, ours_bad: bool, metadata: dict[str, str]) -> None:
    """The table, what each kernel's per-step metadata is, where the results went, the gate
    warning and the summary (worst rows and geometric means, per layer first, printed
    last)."""
    log("")
    common.print_table(rows, kernels, copy_bw)
    log(f"per layer = kernel only + (per call - kernel only) / {LAYERS_PER_STEP}: each "
        f"kernel's per-step metadata paid once per step of {LAYERS_PER_STEP} layers "
        f"(DeepSeek-V3); per call: in every call. Per-step metadata (in every call of the per-"
        f"call figure):")
    for k in kernels:
        if k in metadata:
            log(f"  {k}: {metadata[k]}")
    log(f"results written to {out_path} ({len(rows)} rows, {seconds:.0f} s)")
    if ours_bad:
        log("WARNING: ours failed the correctness gate in at least one row (see '!')")
    common.print_summary(rows)


def fp8_results_path(args: argparse.Namespace, gpu: str, date: str) -> Path:
    """--fp8-only: --out as for the bf16 file (a file, a directory, or the default); with the
    bf16 matrix: the default fp8 file name in the bf16 file's directory."""
    if args.fp8_only:
        return common.resolve_out(args.out, JOB_FP8, gpu, date)
    bf16_path = common.resolve_out(args.out, JOB, gpu, date)
    return bf16_path.parent / common.default_results_path(JOB_FP8, gpu, date).name


def fp8_decode_block(args: argparse.Namespace, copy_bw: float | None = None) -> int:
    """The fp8 block (see the module docstring): ours vs FlashMLA's dense fp8 path over a
    per-tensor fp8 e4m3 cache, its own results file (job dense_decode_fp8), table and
    summary. Returns the exit status: 0; 1 if ours failed a gate; 2 if it stopped early."""
    gpu, date, commit = common.gpu_name(), common.today(), common.git_commit()
    out_path = fp8_results_path(args, gpu, date)
    kernels = args.fp8_kernels
    m = args.fp8_matrix
    log(f"\n===== fp8 block: per-tensor fp8 e4m3 cache (576 B/token), bf16 q =====\n"
        f"matrix: H {m['H']} x s_q {m['s_q']} x batch {m['batch']} x seq_len {m['seq_len']}; "
        f"kernels: {', '.join(kernels) or '(none)'}; results -> {out_path}")
    t_start = time.perf_counter()
    rows: list[BenchRow] = []

    def save() -> None:
        common.write_results(out_path, job=JOB_FP8, gpu=gpu, date=date, commit=commit,
                             copy_bw_gbs=copy_bw, rows=rows,
                             extra=results_extra(kernels, FP8_PER_STEP_METADATA,
                                                 args.min_tokens_per_cta, args.mma_max_rows,
                                                 args.mma_min_batch, args.equal_lengths,
                                                 args.whole_extra, args.align_extra,
                                                 args.restart_pad, args.lpt_extra,
                                                 args.one_page_max))

    ours_bad, status = run_matrix(m, kernels, FP8_BUILDERS, args, copy_bw, rows, save,
                                  fp8=True)
    save()
    report(rows, kernels, copy_bw, out_path, time.perf_counter() - t_start, ours_bad,
           FP8_PER_STEP_METADATA)
    if status == 0 and ours_bad:
        status = 1
    return status


def _int_list(s: str) -> tuple[int, ...]:
    return tuple(int(v) for v in s.split(",") if v.strip())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.dense_decode",
        description="Dense MLA decode: ours vs vLLM 0.25's FlashMLA, FA3 MLA, FlashInfer MLA "
                    "and Triton MLA, side by side on the same inputs (CUDA graphs, rotating "
                    "inputs > L2), two times per kernel: per layer (its per-step metadata "
                    f"amortized over {LAYERS_PER_STEP} layers, the headline) and per call (the "
                    "metadata in every call). Writes design.md's results JSON and prints a "
                    "table. "
                    "--fp8 / --fp8-only: ours vs FlashMLA's dense fp8 path over a per-tensor "
                    "fp8 e4m3 cache, in its own results file (dense_decode_fp8-...).",
        epilog="Run from the repository root: PYTHONPATH=/opt/vk/site python -m "
               "bench.dense_decode --quick; fp8 only: PYTHONPATH=/opt/vk/site:$PWD python -m "
               "bench.dense_decode --fp8-only --out DIR")
    ap.add_argument("--quick", action="store_true",
                    help="small subset (H 16,128 x s_q 1,2 x batch 1,32,128 x seq 4096), a few "
                         "minutes")
    ap.add_argument("--out", default="",
                    help="results JSON path, or a directory for the default file name "
                         "(default: bench/results/dense_decode-<gpu-slug>-<date>.json); the "
                         "fp8 block writes dense_decode_fp8-<gpu-slug>-<date>.json next to it "
                         "(with --fp8-only a file path here is the fp8 file)")
    ap.add_argument("--no-flashinfer", action="store_true",
                    help="leave FlashInfer out (its first use JIT-compiles for minutes)")
    ap.add_argument("--peers", default=",".join(PEERS),
                    help=f"comma list of peers to run (default: {','.join(PEERS)}; the fp8 "
                         f"block runs those of {','.join(FP8_PEERS)})")
    ap.add_argument("--no-ours", action="store_true", help="peers only")
    ap.add_argument("--H", type=_int_list, default=None, help="override heads, e.g. 16,128")
    ap.add_argument("--s-q", type=_int_list, default=None, help="override s_q, e.g. 1,2")
    ap.add_argument("--batch", type=_int_list, default=None, help="override batch sizes")
    ap.add_argument("--seq-len", type=_int_list, default=None, help="override mean seq lens")
    ap.add_argument("--fa3-page", type=int, default=PAGE, choices=(16, 32, 64),
                    help="page size FA3 sees the cache with (64: like ours; 16: vLLM's "
                         "default FLASH_ATTN_MLA block size)")
    ap.add_argument("--budget-ms", type=float, default=None,
                    help="GPU time per kernel timing (default 60, --quick 40)")
    ap.add_argument("--rounds", type=int, default=0,
                    help="timing rounds per config, each kernel first in turn; the median "
                         "counts (default: one per kernel, so each is first once)")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--fp8", action="store_true",
                    help="after the bf16 matrix, the fp8 block: per-tensor fp8 e4m3 cache, ours "
                         "vs FlashMLA dense fp8 (H 16,64,128 x s_q 1,2 x batch 1,32,128 x "
                         "seq 4096 unless --H/--s-q/--batch/--seq-len), a few minutes")
    ap.add_argument("--fp8-only", action="store_true",
                    help="the fp8 block only (skips the bf16 matrix)")
    ap.add_argument("--fp8-peer-tol", type=float, default=REL_L2_TOL,
                    help=f"rel L2 limit for FlashMLA's fp8 output (default {REL_L2_TOL:g}, the "
                         "same gate as everyone; its kernel also rounds the softmax "
                         "probabilities to e4m3, which no reference models)")
    ap.add_argument("--min-tokens-per-cta", type=int, default=None, metavar="N",
                    help="bench only: plan ours with at least N keys per CTA instead of the "
                         "library's MIN_TOKENS_PER_CTA (to sweep the split minimum)")
    ap.add_argument("--mma-max-rows", type=int, default=None, metavar="N",
                    help="bench only: ours on the mma.sync kernel up to N query rows (s_q * H), "
                         "the wgmma kernel above, for either cache dtype, instead of the "
                         "library's MMA_MAX_ROWS (16) / MMA_MAX_ROWS_FP8 (8); 0: the wgmma "
                         "kernel for every row")
    ap.add_argument("--mma-min-batch", type=int, default=None, metavar="B",
                    help="bench only: ours on the mma.sync kernel (up to MMA_MAX_ROWS rows) from "
                         "B requests on, for either cache dtype, instead of the library's "
                         "MMA_MIN_BATCH_16BIT / _FP8; 1: every batch")
    ap.add_argument("--equal-lengths", action="store_true",
                    help="every request exactly the mean seq_len (default: uniform in "
                         "[0.5, 1.5] x the mean)")
    for _, option, name, _, _, what in PLAN_KNOBS:
        ap.add_argument(option, type=int, default=None, metavar="N",
                        help=f"bench only: ours' {name} ({what})")
    ap.add_argument("--verbose", action="store_true", help="tracebacks for failures")
    args = ap.parse_args(argv)
    if args.rounds < 0:
        ap.error(f"--rounds must be >= 1 (or 0: one per kernel); got {args.rounds}")
    if args.min_tokens_per_cta is not None and args.min_tokens_per_cta < 1:
        ap.error(f"--min-tokens-per-cta must be >= 1; got {args.min_tokens_per_cta}")
    if args.mma_max_rows is not None and not 0 <= args.mma_max_rows <= 16:
        ap.error(f"--mma-max-rows must be in [0, 16] (the mma.sync kernel's tile is 16 rows); "
                 f"got {args.mma_max_rows}")
    if args.mma_min_batch is not None and args.mma_min_batch < 1:
        ap.error(f"--mma-min-batch must be >= 1; got {args.mma_min_batch}")
    for field, option, _, _, (lo, hi), _ in PLAN_KNOBS:
        value = getattr(args, field)
        if value is not None and (value < lo or (hi is not None and value > hi)):
            allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            ap.error(f"{option} must be {allowed}; got {value}")
    peers = [p for p in args.peers.split(",") if p]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        ap.error(f"unknown peers {unknown}; choose from {list(PEERS)}")
    if args.no_flashinfer:
        peers = [p for p in peers if p != "flashinfer_mla"]
    ours = [] if args.no_ours else [OURS]
    args.kernels = ours + [p for p in PEERS if p in peers]
    args.fp8_kernels = ours + [p for p in FP8_PEERS if p in peers]
    args.fp8 = args.fp8 or args.fp8_only
    matrix = dict(QUICK_MATRIX if args.quick else FULL_MATRIX)
    fp8_matrix = dict(FP8_MATRIX)
    for key, attr in (("H", "H"), ("s_q", "s_q"), ("batch", "batch"), ("seq_len", "seq_len")):
        if getattr(args, attr):
            matrix[key] = getattr(args, attr)
            fp8_matrix[key] = getattr(args, attr)
    args.matrix = matrix
    args.fp8_matrix = fp8_matrix
    if args.budget_ms is None:
        args.budget_ms = 40.0 if args.quick else 60.0
    return args


def environment_report(kernels: list[str]) -> None:
    import importlib

    log(f"torch {torch.__version__}, {common.gpu_name()}, "
        f"{torch.cuda.get_device_properties(0).multi_processor_count} SMs, "
        f"capability {torch.cuda.get_device_capability()}")
    probes: list[tuple[str, Callable[[], object]]] = []
    if any(k != OURS for k in kernels):  # importing vLLM takes seconds; ours alone needs none
        probes.append(("vllm", lambda: importlib.import_module("vllm").__version__))
    if "flashinfer_mla" in kernels:
        probes.append(("flashinfer", lambda: importlib.import_module("flashinfer").__version__))
    if OURS in kernels:
        def extension() -> str:
            ext = importlib.import_module("mla_backend._extension")
            if not ext.load():
                return f"NOT available: {ext._state['error']}"
            bits = 8 * int(torch.ops.mla_backend.dense_partial_bytes())
            return f"loaded from {ext.extension_path()}, {bits}-bit dense split partials"
        probes.append(("mla_backend extension", extension))
    for what, fn in probes:
        try:
            log(f"{what}: {fn()}")
        except Exception as e:  # noqa: BLE001
            log(f"{what}: unavailable ({common.short_error(e, 200)})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        log("no CUDA device: this benchmark runs on the GPU machine")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False       # the float32 reference stays float32
    torch.backends.cudnn.allow_tf32 = False
    gpu, date, commit = common.gpu_name(), common.today(), common.git_commit()
    out_path = common.resolve_out(args.out, JOB, gpu, date)
    environment_report(args.fp8_kernels if args.fp8_only else args.kernels)
    m = args.matrix
    if args.min_tokens_per_cta is not None:
        from mla_backend.ops.cost_model import MIN_TOKENS_PER_CTA

        log(f"ours planned with at least {args.min_tokens_per_cta} keys per CTA "
            f"(--min-tokens-per-cta; the library's minimum is {MIN_TOKENS_PER_CTA})")
    if args.mma_max_rows is not None:
        from mla_backend.ops import cost_model

        log(f"ours on the mma.sync kernel up to {args.mma_max_rows} query rows, the wgmma "
            f"kernel above (--mma-max-rows; the library's: {cost_model.MMA_MAX_ROWS}, "
            f"{cost_model.MMA_MAX_ROWS_FP8} on an fp8 cache)")
        # read by every plan made after this
        cost_model.MMA_MAX_ROWS = cost_model.MMA_MAX_ROWS_FP8 = args.mma_max_rows
    if args.mma_min_batch is not None:
        from mla_backend.ops import cost_model

        log(f"ours on the mma.sync kernel from {args.mma_min_batch} requests on (--mma-min-batch; "
            f"the library's: {cost_model.MMA_MIN_BATCH_16BIT} for a 16-bit cache, "
            f"{cost_model.MMA_MIN_BATCH_FP8} for fp8)")
        cost_model.MMA_MIN_BATCH_16BIT = cost_model.MMA_MIN_BATCH_FP8 = args.mma_min_batch
    for field, option, name, what, _, _ in PLAN_KNOBS:
        if getattr(args, field) is not None:
            from mla_backend.ops import cost_model

            log(f"ours' {what} {getattr(args, field)} units ({option}; the library's is "
                f"{getattr(cost_model, name)})")
            setattr(cost_model, name, getattr(args, field))
    if args.equal_lengths:
        dense_inputs.EQUAL_LENGTHS = True
        log("every request exactly the mean seq_len (--equal-lengths)")
    if not args.fp8_only:
        log(f"matrix: H {m['H']} x s_q {m['s_q']} x batch {m['batch']} x seq_len "
            f"{m['seq_len']}; kernels: {', '.join(args.kernels)}; results -> {out_path}")
    t_start = time.perf_counter()
    copy_bw: float | None = None
    try:
        copy_bw = common.copy_bandwidth_gbs()
        log(f"device copy bandwidth (read + write): {copy_bw:.0f} GB/s")
    except Exception as e:  # noqa: BLE001
        log(f"copy bandwidth measurement failed: {common.short_error(e)}")

    status = 0
    if not args.fp8_only:
        rows: list[BenchRow] = []

        def save() -> None:
            common.write_results(out_path, job=JOB, gpu=gpu, date=date, commit=commit,
                                 copy_bw_gbs=copy_bw, rows=rows,
                                 extra=results_extra(args.kernels, PER_STEP_METADATA,
                                                     args.min_tokens_per_cta,
                                                     args.mma_max_rows, args.mma_min_batch,
                                                     args.equal_lengths, args.whole_extra,
                                                     args.align_extra, args.restart_pad,
                                                     args.lpt_extra, args.one_page_max))

        ours_bad, status = run_matrix(m, args.kernels, BUILDERS, args, copy_bw, rows, save)
        save()
        report(rows, args.kernels, copy_bw, out_path, time.perf_counter() - t_start, ours_bad,
               PER_STEP_METADATA)
        if status == 0 and ours_bad:
            status = 1

    if args.fp8:
        if status == 2:
            log("\nfp8 block: not run (the bf16 matrix stopped early)")
        else:
            status = max(status, fp8_decode_block(args, copy_bw))
    return status


if __name__ == "__main__":
    sys.exit(main())
