"""Decode throughput of a DeepSeek-shaped model in vLLM: CUSTOM (mla_backend) vs FLASHMLA vs
FLASH_ATTN_MLA (vLLM's default on Hopper), in one run on one GPU; with --engine sglang, the
same model in SGLang: mla_backend vs flashmla (bench/e2e_sglang.py says what is timed there).

The model has DeepSeek-V3's attention dims (hidden 7168, q_lora 1536, latent 512 + rope 64,
H = 128 at TP1 or H = 16 as at TP8), a few layers (the last one MoE with a few experts) and
the engine's dummy weights (speed does not depend on them). vLLM: each engine runs in its own
process (mla_backend.engine_run), decode steps in FULL CUDA graphs without torch.compile (the
same for every backend). Time per decode step: `batch` requests whose `context`-token prompts
are in vLLM's prefix cache are driven through the engine's step loop; once all of them decode,
the span of the whole-batch steps over their number (prefill excluded), `repeats` times per
engine. Engines are interleaved as for SGLang (bench/e2e_spread.py): `rounds` engine processes
per backend, started in turn; a backend's `us` is the median of all its repeats, `us_rounds`
all of them, `spread_pct` their (max - min) / median, and each row prints whether ours vs the
best peer differs by more than the spreads. (Repeats of one engine spread 18-42% on the H200,
2026-11-21, and 30-50% on the H100, 2026-11-26: more than the backends differed.)

--arch v32: DeepSeek-V3.2 (sparse attention, DSA): the same dims plus its lightning indexer
(64 heads of 128) keeping index_topk = 2048 keys per query token, so at the default 8k
context the top-k selects a quarter of the keys. vLLM: CUSTOM vs FLASHMLA_SPARSE (and
FLASH_ATTN_MLA_SPARSE with --backends, bf16 cache only), cache `auto` (bf16) or `fp8_ds_mla`;
SGLang: mla_backend vs its `dsa` with the kernels named (bench/e2e_sglang.py), cache
`bfloat16` or `fp8_e4m3`.
Writes bench/results/<job>-<gpu>-<date>.json (results_job: e2e_decode, e2e_decode_sglang,
with _v32 and a non-bf16 cache appended for V3.2) in design.md's shape plus "engine": `us` =
us per decode step; tokens/s in the printed table; each row's config names arch and cache.

    python -m bench.e2e_decode [--heads 128 16] [--batch 64] [--context 8192] [--rounds 2]
        [--out DIR]
    python -m bench.e2e_decode --engine sglang [--backends ours flashmla triton] [--rounds 2]
    python -m bench.e2e_decode --arch v32 [--kv-cache-dtype fp8_ds_mla] [--engine sglang
        --kv-cache-dtype fp8_e4m3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from importlib import metadata

from bench import common, e2e_sglang, e2e_spread
from mla_backend.demo import engines, tiny_model
from mla_backend.vllm import version

# key in the results -> vLLM's attention backend
BACKENDS = {"ours": "CUSTOM", "flashmla": "FLASHMLA", "fa3_mla": "FLASH_ATTN_MLA"}
SPARSE_BACKENDS = {"ours": "CUSTOM", "flashmla_sparse": "FLASHMLA_SPARSE",
                   "fa3_mla_sparse": "FLASH_ATTN_MLA_SPARSE"}
V32_INDEX_TOPK = 2048  # DeepSeek-V3.2's own
# (engine, arch) -> the --kv-cache-dtype values each engine takes, its default first
KV_CACHE_DTYPES = {("vllm", "v3"): ["auto"], ("vllm", "v32"): ["auto", "fp8_ds_mla"],
                   ("sglang", "v3"): ["auto"], ("sglang", "v32"): list(e2e_sglang.DSA_BACKENDS)}
BF16_CACHES = ("auto", "bfloat16")


def backend_table(engine: str, arch: str, cache: str) -> tuple[dict[str, str], list[str]]:
    """key -> what runs it, and the keys run without --backends, for one engine, model and
    cache."""
    if engine == "sglang":
        names = e2e_sglang.backend_names(arch, cache)
        return names, e2e_sglang.DEFAULT_BACKENDS if arch == "v3" else list(names)
    if arch == "v3":
        return dict(BACKENDS), list(BACKENDS)
    names = dict(SPARSE_BACKENDS)
    if cache not in BF16_CACHES:  # FLASH_ATTN_MLA_SPARSE reads 16-bit caches only
        del names["fa3_mla_sparse"]
    return names, ["ours", "flashmla_sparse"]


def vllm_refuses(backend: str, cache: str, vllm_version: str | None) -> str | None:
    """Why vLLM cannot start `backend` on `cache` (None: it may), known before starting it."""
    if (backend == "FLASHMLA_SPARSE" and cache == "fp8_ds_mla" and vllm_version
            and version.parse(vllm_version)[:2] == (0, 25)):
        return (f"vLLM {vllm_version}: FLASHMLA_SPARSE does not start with fp8_ds_mla (its "
                "model runner views the 656-byte pages as 576-wide, docs/vllm.md); vLLM 0.33 "
                "runs it")
    return None


def _vllm_version() -> str | None:
    return _version("vllm")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench.e2e_decode")
    p.add_argument("--engine", default="vllm", choices=["vllm", "sglang"])
    p.add_argument("--arch", default="v3", choices=["v3", "v32"],
                   help="v3: DeepSeek-V3 (dense MLA); v32: DeepSeek-V3.2 (DSA, index_topk "
                        f"{V32_INDEX_TOPK})")
    p.add_argument("--kv-cache-dtype", default=None,
                   help="v32 on vllm: auto (bf16) or fp8_ds_mla; v32 on sglang: bfloat16 or "
                        "fp8_e4m3; v3: auto only (default: the first)")
    p.add_argument("--heads", type=int, nargs="+", default=[128, 16])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--backends", nargs="+", default=None,
                   help=f"vllm: {' '.join(BACKENDS)} (default: all); sglang: "
                        f"{' '.join(e2e_sglang.BACKENDS)} (default: "
                        f"{' '.join(e2e_sglang.DEFAULT_BACKENDS)}); v32 on vllm: "
                        f"{' '.join(SPARSE_BACKENDS)} (default: ours flashmla_sparse; "
                        "fa3_mla_sparse on a bf16 cache only); v32 on sglang: ours and "
                        "flashmla_sparse (bfloat16) or flashmla_kv (fp8_e4m3)")
    p.add_argument("--rounds", type=int, default=None,
                   help="engine processes per backend, started in turn (default "
                        f"{e2e_spread.DEFAULT_ROUNDS})")
    p.add_argument("--log-interval", type=int, default=None,
                   help="sglang: decode steps per step-time record (default 16)")
    p.add_argument("--gpu-busy", action="store_true",
                   help="time the GPU's busy µs per decode step (torch's profiler over the "
                        "timed steps: kernels, copies and memsets, overlaps once; vllm: the "
                        "engine core in the engine's process; sglang: SGLang's own profiler in "
                        "its scheduler, steps - 2 decode steps a call) instead of the wall "
                        "time; the wall times go to the row's wall_us_rounds")
    p.add_argument("--out", default=None, help="results file or directory")
    p.add_argument("--logs", default=None, help="directory for the engines' logs")
    args = p.parse_args(argv)
    caches = KV_CACHE_DTYPES[args.engine, args.arch]
    what = f"--engine {args.engine}" + (" --arch v32" if args.arch == "v32" else "")
    if args.kv_cache_dtype is None:
        args.kv_cache_dtype = caches[0]
    elif args.kv_cache_dtype not in caches:
        p.error(f"--kv-cache-dtype {args.kv_cache_dtype}: not a cache of --engine "
                f"{args.engine} --arch {args.arch}; choose from {', '.join(caches)}")
    if args.arch == "v32":
        what += f" --kv-cache-dtype {args.kv_cache_dtype}"
        if args.context - args.steps - 1 <= V32_INDEX_TOPK:
            p.error(f"--context {args.context} --steps {args.steps}: with --arch v32 the "
                    f"prompts (context - steps - 1 tokens) must be longer than index_topk "
                    f"{V32_INDEX_TOPK}, or the top-k keeps every key and selects nothing")
    known, default = backend_table(args.engine, args.arch, args.kv_cache_dtype)
    if args.backends is None:
        args.backends = list(default)
    for key in args.backends:
        if key not in known:
            p.error(f"--backends {key}: not a backend of {what}; choose from "
                    f"{', '.join(known)}")
    args.rounds = e2e_spread.DEFAULT_ROUNDS if args.rounds is None else args.rounds
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: must be 1 or more")
    if args.engine == "vllm":
        if args.log_interval is not None:
            p.error(f"--log-interval {args.log_interval}: only with --engine sglang")
        return args
    args.log_interval = 16 if args.log_interval is None else args.log_interval
    if args.log_interval < 1 or args.steps < 2 * args.log_interval:
        p.error(f"--steps {args.steps} --log-interval {args.log_interval}: each timed call "
                "needs two step records or more, so steps >= 2 x log-interval >= 2")
    return args


def vllm_spec(args, model: str, key: str) -> dict:
    """engine_run's spec for one timing engine of backend `key`."""
    names, _ = backend_table("vllm", args.arch, args.kv_cache_dtype)
    return {"model": model, "backend": names[key], "kv_cache_dtype": args.kv_cache_dtype,
            "load_format": "dummy", "mode": "graphs",
            "max_model_len": args.context + args.steps + 64, "max_num_seqs": args.batch,
            "gpu_memory_utilization": 0.6, "max_num_batched_tokens": 16384,
            "timing": {"prompt_len": args.context - args.steps - 1, "batch": args.batch,
                       "steps": args.steps, "repeats": args.repeats,
                       "gpu_busy": args.gpu_busy}}


def _vllm_row(args, model: str, config: dict, logs: str) -> e2e_spread.SpreadRow:
    """Time every backend of args.backends in vLLM: args.rounds engine processes each, started
    in turn (bench.common.round_orders), each timing args.repeats repeats."""
    heads = config["H"]
    vllm_version = _vllm_version()
    skipped: dict[str, str] = {}
    tokens_per_s: dict[str, list[float]] = {}
    walls = e2e_spread.WallTimes(heads)

    def seen(key: str, t: dict) -> None:
        tokens_per_s.setdefault(key, []).append(t["decode_tokens_per_s"])
        walls.seen(key, t)

    def timer(key: str, spec: dict):
        return e2e_spread.engine_timer(
            lambda log_path, label: engines.run_engine(spec, log_path, label=label,
                                                       timeout_s=900),
            f"H={heads} {spec['backend']}", f"h{heads}-{key}", logs,
            lambda t: seen(key, t), "gpu_busy_us_all" if args.gpu_busy else "step_us_all")

    timers = {}
    for key in args.backends:
        spec = vllm_spec(args, model, key)
        refused = vllm_refuses(spec["backend"], args.kv_cache_dtype, vllm_version)
        if refused:
            skipped[key] = refused
            common.log(f"H={heads} {spec['backend']}: not started: {refused}")
        else:
            timers[key] = timer(key, spec)
    timings = common.time_in_rounds(timers, args.rounds, e2e_spread.failure_recorder(skipped))
    row = e2e_spread.assemble_row(config, timings, skipped)
    row.notes["ours"] = "tokens/s " + ", ".join(
        f"{k} {statistics.median(v):.0f}" for k, v in tokens_per_s.items() if k in row.us)
    if args.gpu_busy:
        walls.keep(row)
    return row


def results_job(args) -> str:
    """The results file's job name: one per engine, model and cache, so runs of a day do not
    overwrite each other."""
    job = "e2e_decode" if args.engine == "vllm" else "e2e_decode_sglang"
    if args.arch == "v32":
        job += "_v32"
    if args.kv_cache_dtype not in BF16_CACHES:
        job += f"_{args.kv_cache_dtype}"
    if args.gpu_busy:
        job += "_gpu_busy"
    return job


def write_model(args, folder: str, heads: int) -> str:
    """config.json of the timed model (dummy weights) in `folder`."""
    v32 = {"index_topk": V32_INDEX_TOPK} if args.arch == "v32" else {}
    return tiny_model.write_config(
        folder, arch=args.arch, heads=heads, layers=args.layers, hidden=7168,
        q_lora_rank=1536, intermediate=18432, experts=8, experts_per_token=8,
        moe_intermediate=2048, vocab=32768, max_positions=args.context + 1024, **v32)


def row_config(args, heads: int) -> dict:
    """A results row's config: the model, its cache and the workload."""
    config = {"model": ("DeepSeek-V3.2 attention dims and indexer" if args.arch == "v32"
                        else "DeepSeek-V3 attention dims"),
              "arch": args.arch, "H": heads, "layers": args.layers, "batch": args.batch,
              "context": args.context, "dtype": "bf16", "kv_cache_dtype": args.kv_cache_dtype}
    if args.arch == "v32":
        config["index_topk"] = V32_INDEX_TOPK
    return config


def main(argv=None) -> int:
    args = _parse(argv if argv is not None else sys.argv[1:])
    missing = engines.engine_missing(args.engine)
    if missing:
        common.log(missing)
        return 2
    gpu, date, commit = common.gpu_name(), common.today(), common.git_commit()
    path = common.resolve_out(args.out, results_job(args), gpu, date)
    tmp = tempfile.TemporaryDirectory(prefix="e2e_decode_")
    logs = args.logs or tmp.name
    os.makedirs(logs, exist_ok=True)
    engine_version = f"{args.engine} {_version(args.engine)}, torch {_version('torch')}"
    rows = []
    for heads in args.heads:
        model = write_model(args, os.path.join(tmp.name, f"ds{args.arch}-h{heads}"), heads)
        config = row_config(args, heads)
        if args.engine == "vllm":
            rows.append(_vllm_row(args, model, config, logs))
        else:
            rows.append(e2e_sglang.time_row(args, model, config, logs))
        # after every row: a run cut short still leaves what it measured
        timed = ("the GPU's busy time per decode step (torch profiler: the union of kernels, "
                 "copies and memsets); wall_us_rounds: the wall times per step of the same calls"
                 if args.gpu_busy else "the wall time per decode step" if args.engine == "vllm"
                 else "SGLang's decode step-time records")
        common.write_results(path, job="e2e_decode", gpu=gpu, date=date, commit=commit,
                             copy_bw_gbs=None, rows=rows,
                             extra={"engine": args.engine, "engine_version": engine_version,
                                    "timed": timed})
    common.print_table(rows, list(args.backends), None)
    common.print_summary(rows)
    for row in rows:
        common.log(e2e_spread.verdict(row))
    common.log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
