"""The SGLang half of bench/e2e_decode.py (`python -m bench.e2e_decode --engine sglang`):
decode-step time of a DeepSeek-shaped model through sgl.Engine, mla_backend vs SGLang's
`flashmla` (and `flashinfer`, `triton` with --backends), on one GPU. With --arch v32 (a
DeepSeek-V3.2-shaped model, DSA): mla_backend vs SGLang's `dsa` with its kernels named (the
kit has no FA3): `flashmla_sparse` for prefill and decode on a bf16 cache, `flashmla_kv`
(FlashMLA's sparse decode kernel over the 656-byte fp8 token) on an fp8_e4m3 cache; both
engines get the cache named explicitly (SGLang's "auto" for DSA depends on the GPU).

What is timed: SGLang's scheduler's own decode-step records (SGLANG_RECORD_STEP_TIME): the
wall time of each run of `log_interval` decode steps over their number, taken where the whole
batch decodes. Each engine (mla_backend.demo.sglang_run, dummy weights, decode CUDA graphs up
to the batch, SGLang's overlap scheduler) first generates once from `batch` prompts of
context - steps - 1 tokens, which puts them in the radix cache; each timed call then sends
the same prompts again for 1 + steps tokens, and its step time is the median of its records
less the first (that interval spans the idle time and the prefill of the uncached tails).
A step is everything the engine does for one decode step of the batch: the forward of
`layers` layers (attention, MLP, MoE) in the graph, the step's attention metadata, sampling,
and the scheduler's work between steps where it is not overlapped. Not timed: engine start,
graph capture, every prefill, the client's side. With --gpu-busy the row is the GPU's busy
time per decode step instead: SGLang's own profiler (torch's, in the scheduler process, GPU
activity only) over steps - 2 decode steps of each timed call, the union of its kernels,
copies and memsets over the steps (mla_backend.demo.sglang_run.start_decode_profile); the
step records' wall times stay beside it.

Engines interleaved: `rounds` engine processes per backend, started in turn (round r starts
with backend r mod n, bench.common.round_orders), each timing `repeats` calls. A backend's
`us` is the median of all its calls, `us_rounds` all of them in order, `spread_pct` their
(max - min) / median, printed beside ours vs the best peer: a difference smaller than the
spreads is not resolved.
"""

from __future__ import annotations

from bench import common, e2e_spread
from mla_backend.demo import sglang_run

# key in the results -> SGLang's --attention-backend name
BACKENDS = {"ours": "mla_backend", "flashmla": "flashmla", "flashinfer": "flashinfer",
            "triton": "triton"}
DEFAULT_BACKENDS = ["ours", "flashmla"]
# DeepSeek-V3.2: --kv-cache-dtype -> key -> SGLang's --attention-backend and, for its `dsa`,
# the kernel of both phases (flashmla_sparse decodes a bf16 cache only; flashmla_kv on a bf16
# cache quantizes the whole pool at every call)
DSA_BACKENDS = {"bfloat16": {"ours": ("mla_backend", None),
                             "flashmla_sparse": ("dsa", "flashmla_sparse")},
                "fp8_e4m3": {"ours": ("mla_backend", None),
                             "flashmla_kv": ("dsa", "flashmla_kv")}}


def backend_names(arch: str, kv_cache_dtype: str) -> dict[str, str]:
    """key -> what runs it (for logs and argument checks), for one model and cache."""
    if arch == "v3":
        return dict(BACKENDS)
    return {key: name if kernel is None else f"{name} {kernel}"
            for key, (name, kernel) in DSA_BACKENDS[kv_cache_dtype].items()}


def engine_spec(model: str, backend: str, *, batch: int, context: int, steps: int,
                repeats: int, log_interval: int, arch: str = "v3",
                kv_cache_dtype: str = "auto", gpu_busy: bool = False) -> dict:
    """sglang_run's spec for one timing engine (no compared prompts)."""
    if arch not in ("v3", "v32"):
        raise ValueError(f"arch {arch!r}: not v3 or v32")
    if arch == "v32" and kv_cache_dtype not in DSA_BACKENDS:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: arch v32 takes "
                         f"{', '.join(DSA_BACKENDS)}")
    names = backend_names(arch, kv_cache_dtype)
    if backend not in names:
        raise ValueError(f"backend {backend!r}: not one of arch {arch} with kv_cache_dtype "
                         f"{kv_cache_dtype}; choose from {', '.join(names)}")
    spec = {"model": model, "load_format": "dummy", "graphs": True,
            "context_length": context + steps + 64, "chunked_prefill_size": 8192,
            "max_running_requests": batch, "mem_fraction_static": 0.6,
            "timing": {"prompt_len": context - steps - 1, "batch": batch, "steps": steps,
                       "repeats": repeats, "log_interval": log_interval, "gpu_busy": gpu_busy}}
    if arch == "v3":
        # prefill (not timed) on FlashInfer's paged MLA kernel only: one JIT build
        spec.update(backend=BACKENDS[backend], kv_cache_dtype=kv_cache_dtype,
                    engine_args={"flashinfer_mla_disable_ragged": True})
        return spec
    name, kernel = DSA_BACKENDS[kv_cache_dtype][backend]
    if kernel is None:
        spec.update(backend=name, kv_cache_dtype=kv_cache_dtype)
    else:
        spec.update(sglang_run.dsa_spec(kernel, kernel, kv_cache_dtype))
    return spec


def time_row(args, model: str, config: dict, logs: str) -> e2e_spread.SpreadRow:
    """Time every backend of args.backends on one model in args.rounds interleaved rounds."""
    heads = config["H"]
    names = backend_names(args.arch, args.kv_cache_dtype)

    walls = e2e_spread.WallTimes(heads)

    def timer(key: str):
        spec = engine_spec(model, key, batch=args.batch, context=args.context,
                           steps=args.steps, repeats=args.repeats,
                           log_interval=args.log_interval, arch=args.arch,
                           kv_cache_dtype=args.kv_cache_dtype, gpu_busy=args.gpu_busy)
        return e2e_spread.engine_timer(
            lambda log_path, label: sglang_run.run(spec, log_path, timeout_s=900, label=label),
            f"H={heads} {names[key]}", f"sglang-h{heads}-{key}", logs,
            lambda t: walls.seen(key, t), "gpu_busy_us_all" if args.gpu_busy else "step_us_all")

    skipped: dict[str, str] = {}
    failed = e2e_spread.failure_recorder(skipped)
    timings = common.time_in_rounds({k: timer(k) for k in args.backends}, args.rounds, failed)
    row = e2e_spread.assemble_row(config, timings, skipped)
    if args.gpu_busy:
        walls.keep(row)
    return row
