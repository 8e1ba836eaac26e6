"""Reusable parts of the side-by-side benchmarks (bench/*.py).

- CUDA-graph capture (capture_graph) and timing of one "step" callable rotating over
  several input sets (time_graph)
- the order of side-by-side timing rounds, each kernel first in turn (round_orders), and
  timing in those rounds (time_in_rounds)
- device copy bandwidth (copy_bandwidth_gbs)
- paged inputs: block tables over one pool of randomly ordered blocks (block_tables)
- kernel adapters and their correctness measure (Kernel, NotApplicable, rel_l2)
- rotating-set sizing against the L2 cache (rotating_sets)
- result rows, the results file in design.md's shape, and the printed table (BenchRow,
  write_results, print_table, print_summary); rows of a bench that also reports a per-layer
  time (dense decode: metadata amortized over a step's layers) carry and lead with it
- run metadata: GPU name and slug, date, git commit

Nothing here imports a peer library or the mla_backend extension: a bench script brings its
own kernels (bench/peers/) and calls these helpers. The tests use the same capture_graph,
block_tables and rel_l2 (through tests/helpers.py).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import statistics
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
# H100 / H200 L2: 50 MB. Rotating input sets keep the touched bytes well above it, so a
# kernel never re-reads a KV cache that the previous call left in L2.
L2_BYTES = 50 * 2**20
T = TypeVar("T")
R = TypeVar("R")


def log(*parts: object) -> None:
    print(*parts, flush=True)


# --------------------------------------------------------------------------- run metadata


def gpu_name(device: int = 0) -> str:
    return torch.cuda.get_device_name(device)


def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3' (for file names)."""
    name = re.sub(r"^nvidia\s+", "", name.strip(), flags=re.IGNORECASE)
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "unknown-gpu"


def today() -> str:
    return datetime.date.today().isoformat()


def git_commit(repo: Path = REPO_ROOT) -> str:
    """$MLA_BACKEND_COMMIT (the device machine's copy has no .git: pass the sha measured),
    else `git rev-parse HEAD` of the repository, else "unknown"."""
    if os.environ.get("MLA_BACKEND_COMMIT"):
        return os.environ["MLA_BACKEND_COMMIT"]
    try:
        res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True,
                             text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    sha = res.stdout.strip()
    return sha if res.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}", sha) else "unknown"


def cuda_alive() -> bool:
    """False once the CUDA context is broken (an illegal address poisons every later call)."""
    try:
        torch.cuda.synchronize()
        torch.empty(1, device="cuda").add_(1)
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001 - any failure here means the context is unusable
        return False


def short_error(e: BaseException, limit: int = 300) -> str:
    msg = " ".join(f"{type(e).__name__}: {e}".split())
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


# --------------------------------------------------------------------------- timing


def median_ms(fn: Callable[[], object], reps: int) -> tuple[float, list[float]]:
    """Run fn once (warm), then `reps` times, each bracketed by CUDA events on the current
    stream; returns (median ms, all samples in ms)."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples), samples


def capture_graph(body: Callable[[], T], *, warm: bool = True
                  ) -> tuple[torch.cuda.CUDAGraph, T]:
    """body() recorded into a new CUDA graph; returns the graph and what body returned during
    the capture (the tensors its replays write). warm: first run body once eagerly and wait
    for it, so that lazily built state (JIT modules, cached schedules) and the allocator's
    blocks exist before the capture."""
    if warm:
        body()
        torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            result = body()
    except BaseException:
        del graph  # its memory pool goes now, not when the traceback does
        raise
    return graph, result


class GraphCaptureError(RuntimeError):
    """A step could not be captured into a CUDA graph (host sync, unsupported op, ...)."""


@dataclass
class Timing:
    us: float          # median microseconds per call
    ncalls: int        # calls per captured graph
    reps: int          # timed graph replays
    nsets: int         # input sets the calls rotate over
    spread: float      # (max - min) / median over the replays


def rotating_sets(bytes_per_set: float, *, l2_multiple: float = 4.0, lo: int = 2,
                  hi: int = 128) -> int:
    """How many input sets to rotate over so that l2_multiple x L2 bytes are touched per
    rotation (at least `lo`: 2 already suffice when one set is far above L2)."""
    need = math.ceil(l2_multiple * L2_BYTES / max(bytes_per_set, 1.0))
    return int(min(hi, max(lo, need)))


def time_graph(step: Callable[[int], object], nsets: int, *, budget_ms: float = 60.0,
               min_graph_us: float = 2000.0, max_calls: int = 256, min_reps: int = 3,
               max_reps: int = 15) -> Timing:
    """Time step(i) (i = input set) with CUDA graphs.

    1. warm-up: every set once (JIT builds, lazily built schedules, allocator);
    2. estimate the per-call time from one eager rotation (an upper bound: it includes
       launch gaps) and choose whole rotations per graph (>= min_graph_us of work, at most
       max_calls calls) and replays (about budget_ms of GPU time, min_reps..max_reps);
    3. capture the calls step(0), step(1), ..., step(nsets - 1), step(0), ... in one graph;
    4. replay once (warm), then time `reps` replays with events: median / ncalls.

    Raises GraphCaptureError if the capture fails; other errors propagate.
    """
    for i in range(nsets):
        step(i)
    torch.cuda.synchronize()

    def rotation() -> None:
        for i in range(nsets):
            step(i)

    est_ms, _ = median_ms(rotation, 1)
    est_us = max(est_ms * 1e3 / nsets, 1.0)
    rotations = max(1, min(math.ceil(min_graph_us / (est_us * nsets)), max_calls // nsets))
    ncalls = nsets * rotations
    reps = int(min(max_reps, max(min_reps, budget_ms * 1e3 // (ncalls * est_us))))

    def calls() -> None:
        for c in range(ncalls):
            step(c % nsets)

    try:
        graph, _ = capture_graph(calls, warm=False)
    except Exception as e:  # noqa: BLE001 - reported to the caller as a capture failure
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001, S110
            pass
        raise GraphCaptureError(short_error(e)) from e
    try:
        med, samples = median_ms(graph.replay, reps)
    finally:
        torch.cuda.synchronize()
    del graph
    spread = (max(samples) - min(samples)) / med if med > 0 else 0.0
    return Timing(us=med * 1e3 / ncalls, ncalls=ncalls, reps=reps, nsets=nsets, spread=spread)


def round_orders(names: Sequence[str], rounds: int) -> list[list[str]]:
    """The order in which a row times its kernels, one list per round: round i starts at
    kernel i mod n and goes round. Where a call runs for milliseconds, a short burst after a
    pause (building the row, the reference) can run above the power cap's sustained clock, so
    a kernel always timed first, or always right after another, could be favoured or
    penalised; in turn, with rounds a multiple of n, each is first equally often."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1; got {rounds}")
    n = len(names)
    return [[names[(i + j) % n] for j in range(n)] for i in range(rounds)] if n else []


def time_in_rounds(timers: dict[str, Callable[[], R]], rounds: int,
                   failed: Callable[[str, Exception], None]) -> dict[str, list[R]]:
    """Call each kernel's timer once per round, in round_orders' order. A timer returns one
    round's timing(s) of its kernel (a Timing, or several where a bench times more than one
    variant of a call). A timer that raises is reported through failed(name, e) (which may
    raise in turn) and not called again: none of its timings count. Returns the timings,
    one per round, of the kernels that never failed."""
    timings: dict[str, list[R]] = {name: [] for name in timers}
    dead: set[str] = set()
    for order in round_orders(list(timers), rounds):
        for name in order:
            if name in dead:
                continue
            try:
                timings[name].append(timers[name]())
            except Exception as e:  # noqa: BLE001 - the caller reports it
                dead.add(name)
                failed(name, e)
    return {name: t for name, t in timings.items() if name not in dead}


def copy_bandwidth_gbs(nbytes: int = 2**30, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in GB/s (1e9 B/s), counting bytes read + written,
    median of `reps` copies of `nbytes`."""
    def measure() -> float:
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        src.fill_(1)
        return median_ms(lambda: dst.copy_(src), reps)[0]

    med = measure()
    torch.cuda.empty_cache()                               # give the 2 x nbytes back
    return 2 * nbytes / (med * 1e-3) / 1e9




# --------------------------------------------------------------------------- inputs, kernels


def block_tables(perm: torch.Tensor, nblk: Sequence[int], *, nsets: int = 1,
                 width: int | None = None, unused: torch.Tensor | int = 0
                 ) -> list[torch.Tensor]:
    """Block tables [batch, width] int32 (width default: max(nblk)) of `nsets` input sets
    over one pool of blocks handed out in the order `perm`: set s takes the s-th run of
    sum(nblk) blocks of perm, request b of it the next nblk[b] blocks in turn, so sets never
    share a block. The entries past a request's blocks hold `unused` (a number, or a
    [batch, width] tensor)."""
    dev = perm.device
    per_set = sum(nblk)
    counts = torch.tensor(list(nblk), device=dev, dtype=torch.int64)
    col = torch.arange(max(nblk) if width is None else width, device=dev)
    used = col[None, :] < counts[:, None]
    pos = (torch.cumsum(counts, 0) - counts)[:, None] + col[None, :]
    pos = pos.clamp(max=per_set)                          # past the run: the pad entry
    tables = []
    for s in range(nsets):
        run = torch.cat([perm[s * per_set:(s + 1) * per_set], perm.new_zeros(1)])
        tables.append(torch.where(used, run[pos], unused).to(torch.int32).contiguous())
    return tables


class NotApplicable(Exception):
    """The kernel does not serve this config (the reason is the message)."""


@dataclass
class Kernel:
    """One kernel on one config's inputs. step(i): one timed call on input set i (metadata /
    plan included where the bench says so); check(): its output on input set 0 in the
    reference's shape (dense: (out, lse or None); sparse: out); step_premeta: the same call
    with its per-step metadata built once outside (dense: timed as the kernel-only time
    behind the per-layer figure, and in place of step where the metadata cannot be captured
    in a CUDA graph), or None where the kernel has no per-step metadata timed; want: the
    kernel's own reference when the config's does not fit it (a peer that quantizes q), or
    None; tol: its rel L2 limit when not the bench's (shown as a note on the row)."""

    step: Callable[[int], object]
    check: Callable[[], Any]
    step_premeta: Callable[[int], object] | None = None
    want: Callable[[], Any] | None = None
    tol: float | None = None


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 (NaN anywhere gives NaN)."""
    got, want = got.double(), want.double()
    return float(torch.linalg.vector_norm(got - want) /
                 torch.linalg.vector_norm(want).clamp_min(1e-30))


def geomean(values: Sequence[float]) -> float | None:
    vals = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    if not vals:
        return None
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


# --------------------------------------------------------------------------- rows


@dataclass
class BenchRow:
    """One config of a bench: the JSON part (config, us, metrics, skipped) plus display-only
    information for the printed table (times measured but not counted, notes).

    per_layer rows (dense decode) also carry, per counted kernel, the time with its per-step
    metadata amortized over a step's layers (us_per_layer; = us where the kernel has no
    per-step metadata timed) and, where it has, the kernel-only time (metadata built once
    outside the timed calls) it comes from."""

    config: dict[str, Any]
    us: dict[str, float] = field(default_factory=dict)        # counted kernels only
    skipped: dict[str, str] = field(default_factory=dict)     # kernel -> why it is not in us
    uncounted_us: dict[str, float] = field(default_factory=dict)  # measured, not counted
    notes: dict[str, str] = field(default_factory=dict)       # kernel -> how it was timed
    us_rounds: dict[str, list[float]] = field(default_factory=dict)  # per timing round, if rounds
    tflops_ours: float | None = None
    gbs_ours: float | None = None
    speedup_vs_best_peer: float | None = None
    pct_copy: float | None = None                             # display only
    per_layer: bool = False                                   # the fields below are reported
    us_per_layer: dict[str, float] = field(default_factory=dict)      # counted kernels only
    us_kernel_only: dict[str, float] = field(default_factory=dict)    # counted, where timed
    us_kernel_only_rounds: dict[str, list[float]] = field(default_factory=dict)
    uncounted_us_per_layer: dict[str, float] = field(default_factory=dict)  # display only
    tflops_ours_per_layer: float | None = None
    gbs_ours_per_layer: float | None = None
    speedup_vs_best_peer_per_layer: float | None = None
    pct_copy_per_layer: float | None = None                   # display only

    def finalize(self, flops: float, nbytes: float, copy_bw_gbs: float | None,
                 ours: str = "ours") -> None:
        """Fill the metrics from `us` (and `us_per_layer`): TFLOP/s and GB/s of ours,
        speedup = best peer us / ours us (> 1: ours is faster)."""
        def metrics(us: dict[str, float]) -> tuple[float | None, ...]:
            t = us.get(ours)
            if t is None or t <= 0:
                return None, None, None, None
            peers = [v for k, v in us.items() if k != ours]
            gbs = nbytes / t / 1e3
            return (flops / t / 1e6, gbs, 100.0 * gbs / copy_bw_gbs if copy_bw_gbs else None,
                    min(peers) / t if peers else None)

        (self.tflops_ours, self.gbs_ours, self.pct_copy,
         self.speedup_vs_best_peer) = metrics(self.us)
        if self.per_layer:
            (self.tflops_ours_per_layer, self.gbs_ours_per_layer, self.pct_copy_per_layer,
             self.speedup_vs_best_peer_per_layer) = metrics(self.us_per_layer)

    def to_json(self) -> dict[str, Any]:
        def rnd(v: float | None, nd: int) -> float | None:
            return None if v is None else round(v, nd)

        def rounds(d: dict[str, list[float]]) -> dict[str, list[float]]:
            return {k: [round(v, 2) for v in vs] for k, vs in d.items()}

        doc = {
            "config": dict(self.config),
            "us": {k: round(v, 2) for k, v in self.us.items()},
            "tflops_ours": rnd(self.tflops_ours, 1),
            "gbs_ours": rnd(self.gbs_ours, 1),
            "speedup_vs_best_peer": rnd(self.speedup_vs_best_peer, 4),
            "skipped": dict(self.skipped),
        }
        if self.us_rounds:  # benches that time in rounds: `us` is the median of these
            doc["us_rounds"] = rounds(self.us_rounds)
        if self.per_layer:
            doc.update({
                "us_per_layer": {k: round(v, 2) for k, v in self.us_per_layer.items()},
                "tflops_ours_per_layer": rnd(self.tflops_ours_per_layer, 1),
                "gbs_ours_per_layer": rnd(self.gbs_ours_per_layer, 1),
                "speedup_vs_best_peer_per_layer": rnd(self.speedup_vs_best_peer_per_layer, 4),
                "us_kernel_only": {k: round(v, 2) for k, v in self.us_kernel_only.items()},
            })
            if self.us_kernel_only_rounds:
                doc["us_kernel_only_rounds"] = rounds(self.us_kernel_only_rounds)
        return doc


def default_results_path(job: str, gpu: str, date: str) -> Path:
    return RESULTS_DIR / f"{job}-{gpu_slug(gpu)}-{date}.json"


def resolve_out(out: str | None, job: str, gpu: str, date: str) -> Path:
    """--out: a file path, or an existing directory (the default file name goes in it);
    none: bench/results/<job>-<gpu-slug>-<date>.json."""
    if not out:
        return default_results_path(job, gpu, date)
    p = Path(out)
    if p.is_dir() or out.endswith(os.sep):
        return p / default_results_path(job, gpu, date).name
    return p


def write_results(path: Path, *, job: str, gpu: str, date: str, commit: str,
                  copy_bw_gbs: float | None, rows: Sequence[BenchRow],
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write design.md's results shape (every bench writes the same): job, gpu, date,
    commit, copy_bandwidth_gbs, rows[config, us, tflops_ours, gbs_ours,
    speedup_vs_best_peer, skipped, us_rounds where a bench times in rounds, and the per-layer
    fields of per_layer rows], plus a bench's own top-level `extra` keys (before "rows").
    Written atomically (tmp file + rename)."""
    doc = {
        "job": job,
        "gpu": gpu,
        "date": date,
        "commit": commit,
        "copy_bandwidth_gbs": None if copy_bw_gbs is None else round(copy_bw_gbs, 1),
        **(extra or {}),
        "rows": [r.to_json() for r in rows],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return doc


# --------------------------------------------------------------------------- table


def _config_label_keys(rows: Sequence[BenchRow]) -> list[str]:
    keys: list[str] = []
    for r in rows:
        for k in r.config:
            if k not in keys:
                keys.append(k)
    return keys


class Table:
    """Fixed-width table: config columns, one us column per kernel, ours TF/s, GB/s,
    %copy, speedup. Cells: '12.3' counted, '12.3!' measured but not counted (failed the
    correctness gate), '12.3*' counted with a note, '-' skipped.

    per_layer (dense decode): a kernel's cell is 'per layer/per call' where it has per-step
    metadata timed (one number where it has none: both are the same), TF/s, GB/s and %copy
    are ours per layer, and two speedups follow, per layer then per call."""

    def __init__(self, config_keys: Sequence[str], kernels: Sequence[str],
                 kernel_width: int = 9, *, per_layer: bool = False) -> None:
        self.config_keys = list(config_keys)
        self.kernels = list(kernels)
        self.per_layer = per_layer
        if per_layer:
            kernel_width = max(kernel_width, 14)   # '1174.5/1180.2!'
        self.cw = {k: max(len(k), 6) for k in self.config_keys}
        self.kw = {k: max(kernel_width, len(k)) for k in self.kernels}

    def header(self) -> str:
        cfg = " ".join(f"{k:>{self.cw[k]}}" for k in self.config_keys)
        ker = " ".join(f"{k:>{self.kw[k]}}" for k in self.kernels)
        tail = (f"{'sp/layer':>8} {'sp/call':>8}" if self.per_layer else f"{'speedup':>7}")
        return f"{cfg} | {ker} | {'TF/s':>6} {'GB/s':>6} {'%copy':>6} {tail}"

    def _cell(self, r: BenchRow, k: str) -> str:
        counted = k in r.us
        us = r.us.get(k, r.uncounted_us.get(k))
        if us is None:
            return "-"
        cell = f"{us:.1f}"
        per_layer = r.us_per_layer.get(k) if counted else r.uncounted_us_per_layer.get(k)
        if self.per_layer and per_layer is not None and (not counted or k in r.us_kernel_only):
            cell = f"{per_layer:.1f}/{cell}"
        if not counted:
            return cell + "!"
        return cell + ("*" if k in r.notes else "")

    def line(self, r: BenchRow) -> str:
        cfg = " ".join(f"{str(r.config.get(k, '')):>{self.cw[k]}}" for k in self.config_keys)
        cells = " ".join(f"{self._cell(r, k):>{self.kw[k]}}" for k in self.kernels)
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        if self.per_layer:
            metrics = (r.tflops_ours_per_layer, r.gbs_ours_per_layer, r.pct_copy_per_layer)
            tail = (f"{fmt(r.speedup_vs_best_peer_per_layer, '.3f'):>8} "
                    f"{fmt(r.speedup_vs_best_peer, '.3f'):>8}")
        else:
            metrics = (r.tflops_ours, r.gbs_ours, r.pct_copy)
            tail = f"{fmt(r.speedup_vs_best_peer, '.3f'):>7}"
        tf, gb, pc = fmt(metrics[0], ".1f"), fmt(metrics[1], ".0f"), fmt(metrics[2], ".1f")
        pc = pc if pc == "-" else pc + "%"
        return f"{cfg} | {cells} | {tf:>6} {gb:>6} {pc:>6} {tail}"


def print_table(rows: Sequence[BenchRow], kernels: Sequence[str],
                copy_bw_gbs: float | None) -> None:
    if not rows:
        log("(no rows)")
        return
    per_layer = any(r.per_layer for r in rows)
    table = Table(_config_label_keys(rows), kernels, per_layer=per_layer)
    hdr = table.header()
    log("=" * len(hdr))
    log("copy bandwidth (read+write): " +
        ("n/a" if copy_bw_gbs is None else f"{copy_bw_gbs:.0f} GB/s"))
    if per_layer:
        log("us 'per layer/per call': per call with the kernel's per-step metadata in every"
            " call, per layer with it amortized over a step's layers; one number: no per-step"
            " metadata timed (the two are the same)")
        log("TF/s, GB/s, %copy: ours per layer; sp/layer, sp/call = best peer us / ours us,"
            " per layer and per call; '!' failed the correctness gate (not counted), '*' see"
            " notes, '-' skipped")
    else:
        log("us per call; TF/s, GB/s, %copy: ours; speedup = best peer us / ours us;"
            " '!' failed the correctness gate (not counted), '*' see notes, '-' skipped")
    log(hdr)
    log("-" * len(hdr))
    for r in rows:
        log(table.line(r))
    log("-" * len(hdr))
    reasons: dict[tuple[str, str], int] = {}
    for r in rows:
        for k, why in r.skipped.items():
            reasons[(k, why)] = reasons.get((k, why), 0) + 1
        for k, why in r.notes.items():
            reasons[(k, "note: " + why)] = reasons.get((k, "note: " + why), 0) + 1
    if reasons:
        log("skipped / notes:")
        for (k, why), n in sorted(reasons.items()):
            log(f"  {k}: {why}  [{n} row{'s' if n != 1 else ''}]")


def config_label(config: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in config.items())


def _summary(rows: Sequence[BenchRow], us_field: str, speedup_field: str, what: str
             ) -> float | None:
    """Logs the rows below 1.0x and the worst row of one speedup field of `rows`; returns
    the geometric mean (None where no row has that speedup)."""
    with_sp = [(getattr(r, speedup_field), r) for r in rows
               if getattr(r, speedup_field) is not None]
    if not with_sp:
        return None
    worst_sp, worst = min(with_sp, key=lambda t: t[0])
    us = getattr(worst, us_field)
    below = sum(1 for sp, _ in with_sp if sp < 1.0)
    best_peer = min((k for k in us if k != "ours"), key=lambda k: us[k], default="?")
    log(f"{what + ': ' if what else ''}rows below 1.0x: {below}/{len(with_sp)}; worst row: "
        f"{config_label(worst.config)}: {worst_sp:.3f}x (ours {us.get('ours', float('nan')):.1f}"
        f" us vs {best_peer} {us.get(best_peer, float('nan')):.1f} us)")
    return geomean([sp for sp, _ in with_sp])


def print_summary(rows: Sequence[BenchRow]) -> None:
    """Geometric mean of speedup_vs_best_peer over the rows that have one, and the worst
    row (printed last); for per_layer rows the per-layer figures first, then per call."""
    n_sp = sum(1 for r in rows if r.speedup_vs_best_peer is not None)
    if not n_sp:
        log("speedup vs best peer: no row has both ours and a peer")
        return
    missing = len(rows) - n_sp
    log(f"rows with a speedup: {n_sp}/{len(rows)}"
        + (f" ({missing} without ours or without any peer)" if missing else ""))
    if not any(r.per_layer for r in rows):
        gm = _summary(rows, "us", "speedup_vs_best_peer", "")
        log(f"geometric mean speedup_vs_best_peer: {gm:.3f}x" if gm is not None else
            "geometric mean speedup_vs_best_peer: n/a")
        return
    gm_layer = _summary(rows, "us_per_layer", "speedup_vs_best_peer_per_layer", "per layer")
    gm_call = _summary(rows, "us", "speedup_vs_best_peer", "per call")
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}x"  # noqa: E731
    log(f"geometric mean speedup vs best peer: per layer {fmt(gm_layer)} "
        f"(speedup_vs_best_peer_per_layer), per call {fmt(gm_call)} (speedup_vs_best_peer)")
