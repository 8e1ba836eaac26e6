"""What the e2e tests share: the tiny checkpoints, the engine spec and prompts, engine runs in
their own processes (mla_backend.demo.engines), each run once per session and, when
$E2E_CACHE_DIR is set, cached across sessions under a key of the build and the inputs
(build_identity, cache_key), every comparison written to $E2E_REPORT (JSON) when set, and
the closeness rule against a peer backend. Engines may be started ahead (start): up to
$E2E_PARALLEL_ENGINES (default 1) at a time in the background, while tests wait for theirs.

A multi-GPU engine (tensor_parallel_size > 1) starts its workers with the `spawn` method, so
each worker is a fresh interpreter that gets the plugin from the installed entry point and
nothing from the engine's process; its hooks reach the workers through
tests/e2e/worker_hooks.py and come back as result["hooks_by_rank"].

Prompts of 1 to 8200 tokens go in one batch with max_num_batched_tokens 1024, so steps mix
prefills and decodes, and the long prompts are prefilled in chunks that read the context back
from the cache. The first generated token comes from prefill alone; decode kernels show from
the second on (12 tokens per prompt).
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import os
import pathlib
import threading
from importlib import metadata

from mla_backend.demo import engines, tiny_model
from tests.e2e import parallel, worker_hooks

ROOT = pathlib.Path(__file__).resolve().parents[2]
HOOKS = "tests.e2e.hooks"  # imported into an engine's process by engine_run (spec "preload")
PROMPT_LENS = [1, 7, 64, 300, 1000, 3000, 8200]
MAX_POSITIONS = 16384  # the checkpoints' max_position_embeddings, above max_model_len
BASE = {"mode": "graphs", "max_model_len": 8704, "max_num_seqs": 32,
        "max_num_batched_tokens": 1024, "gpu_memory_utilization": 0.3, "max_tokens": 12,
        "logprobs": 5}
MIN_TOPK_OVERLAP = 0.6
_results: dict = {}
_report: dict = {}
_written: set = set()
_pending: dict = {}  # key -> Future of a started run
_pool: list = []  # the executor of started runs, made on first use
_lock = threading.Lock()


def prompts():
    import torch

    gen = torch.Generator().manual_seed(7)
    return [torch.randint(2, 2048, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def model(workdir, arch: str = "v3", heads: int = 16, **kwargs) -> str:
    """A tiny checkpoint (2 layers) in workdir, written once per session (a folder left by an
    earlier session is rewritten: it may come from another tiny_model)."""
    name = "-".join(["tiny", arch, f"h{heads}"]
                    + [f"{k}{_flat(v)}" for k, v in sorted(kwargs.items())])
    path = pathlib.Path(workdir) / name
    if name not in _written:
        tiny_model.write_checkpoint(str(path), arch=arch, heads=heads, layers=2,
                                    max_positions=MAX_POSITIONS, **kwargs)
        _written.add(name)
    return str(path)


def _flat(v) -> str:
    return ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)


def _sha256_files(paths, base: pathlib.Path | None = None) -> str:
    h = hashlib.sha256()
    for p in sorted(map(pathlib.Path, paths)):
        h.update(str(p.relative_to(base) if base else p.name).encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    return h.hexdigest()


@functools.cache
def build_identity() -> dict:
    """What the engines' results depend on besides their inputs: the extension's content
    (sha256 of the file mla_backend._extension.extension_path() names, None when there is
    none), the vLLM version, and mla_backend's Python sources (ops, adapters, formats, the
    engine runner, the tiny checkpoints) with the entry point and the test hooks that engines
    import."""
    import mla_backend
    from mla_backend import _extension

    ext = _extension.extension_path()
    package = pathlib.Path(mla_backend.__file__).parent
    sources = [*package.rglob("*.py"), *(ROOT / "plugin_entry").glob("*.py"),
               ROOT / "tests" / "e2e" / "hooks.py", ROOT / "tests" / "e2e" / "worker_hooks.py"]
    return {"extension_sha256": _sha256_files([ext]) if ext and os.path.isfile(ext) else None,
            "vllm": _vllm_version(),
            "python_sources_sha256": _sha256_files(sources, base=package.parent)}


def _vllm_version() -> str | None:
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def _model_sha256(path: str) -> str | None:
    files = sorted(p for p in pathlib.Path(path).glob("*") if p.is_file())
    stats = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return _sha256_of(stats) if files else None


@functools.cache
def _sha256_of(stats: tuple) -> str:
    """The files' hash, once per (name, size, mtime) state of a checkpoint."""
    return _sha256_files(s[0] for s in stats)


def cache_key(spec: dict, identity: dict | None = None) -> str:
    """sha256 of the build identity and the run's inputs: the full spec (prompts included)
    and the checkpoint's files. A run of one of vLLM's own backends never loads our extension
    (the plugin registers CUSTOM by name only), so its key leaves the extension's hash out."""
    identity = dict(build_identity() if identity is None else identity)
    if spec.get("backend") != "CUSTOM":
        identity.pop("extension_sha256", None)
    inputs = dict(spec, model_sha256=_model_sha256(spec["model"]))
    blob = json.dumps({"build": identity, "inputs": inputs}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def start(workdir, key: str, hooks: dict | None = None, **spec) -> None:
    """Begin run(workdir, key, hooks, **spec) in the background (at most $E2E_PARALLEL_ENGINES
    engines at a time, in the order started); a later run() of the same key waits for it and
    raises what it raised. Engines that share GPUs need kv_cache_memory_bytes in their spec:
    vLLM's memory profiling takes other processes' allocations for its own."""
    with _lock:
        if key in _results or key in _pending:
            return
        if not _pool:
            workers = int(os.environ.get("E2E_PARALLEL_ENGINES", "1"))
            _pool.append(concurrent.futures.ThreadPoolExecutor(max(1, workers), "e2e-engine"))
        _pending[key] = _pool[0].submit(_run, workdir, key, hooks, spec)


def run(workdir, key: str, hooks: dict | None = None, **spec) -> dict:
    """The engine's result for BASE + prompts + spec (a spec's own prompts replace the
    harness' prompts), run once per key in a session (workdir: the session's folder for models
    and logs). hooks: options for tests/e2e/hooks.py, which the engine's process then imports
    (its report comes back as result["hooks"]; with tensor_parallel_size > 1 every worker's
    comes back in result["hooks_by_rank"]). With $E2E_CACHE_DIR, a result stored there under
    the same cache_key is reused; one under another key is run again and replaced."""
    with _lock:
        future = _pending.get(key)
    if future is not None:
        return future.result()
    return _run(workdir, key, hooks, spec)


def engine_spec(hooks: dict | None = None, **spec) -> dict:
    """The full spec an engine gets: BASE, the harness' prompts, spec, and the hooks (preloaded
    into a one-GPU engine's process; for a multi-GPU engine under "worker_hooks", which
    engine_run ignores and the harness turns into worker_hooks' environment)."""
    full = {**BASE, "prompts": prompts(), **spec}
    if hooks is not None:
        key = "worker_hooks" if full.get("tensor_parallel_size", 1) > 1 else "preload"
        full[key] = hooks if key == "worker_hooks" else {HOOKS: hooks}
    return full


# NVLink multicast stays off (the GPU machines' rule: it can take shared GPUs out of service);
# set here only where the environment does not already say so.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


def _engine_env(workdir, key: str, full: dict) -> dict:
    """PYTHONPATH (the repository root: engines import tests.e2e.hooks) and, for a multi-GPU
    engine, the spawn start method, no NVLink multicast (nor vLLM's symmetric-memory
    all-reduce, which is built on it), process ids in the log records (tests/e2e/parallel.py)
    and the worker hooks' plugin and options."""
    path = [str(ROOT)]
    env = {}
    if full.get("tensor_parallel_size", 1) > 1:
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        env["VLLM_ALLREDUCE_USE_SYMM_MEM"] = "0"
        env.update(parallel.PID_TAG_ENV)  # each log record names its process
        env.update({k: v for k, v in NO_MULTICAST.items() if k not in os.environ})
        if full.get("worker_hooks") is not None:
            plugin = worker_hooks.write_plugin(pathlib.Path(workdir) / "worker-hooks-plugin")
            path.insert(0, plugin)
            env.update(worker_hooks.engine_env(plugin, _hooks_dir(workdir, key),
                                               full["worker_hooks"]))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*path, os.environ.get("PYTHONPATH")]))
    return env


def _hooks_dir(workdir, key: str) -> str:
    return str(pathlib.Path(workdir) / f"{key}.hooks")


def _run(workdir, key: str, hooks: dict | None, spec: dict) -> dict:
    if key in _results:
        return _results[key]
    full = engine_spec(hooks, **spec)
    digest = cache_key(full)
    cache = os.environ.get("E2E_CACHE_DIR")
    cached = os.path.join(cache, f"{key}.json") if cache else None
    res = None
    if cached and os.path.exists(cached):
        with open(cached) as f:
            entry = json.load(f)
        if entry.get("cache_key") == digest:
            res = entry["result"]
    from_cache = res is not None
    if res is None:
        log = str(pathlib.Path(workdir) / f"{key}.log")
        res = engines.run_engine(full, log, label=key, timeout_s=600,
                                 env=_engine_env(workdir, key, full))
        res["log"] = open(log, errors="replace").read()
        if full.get("worker_hooks") is not None:
            res["hooks_by_rank"] = worker_hooks.read_reports(_hooks_dir(workdir, key))
        if cached:
            os.makedirs(cache, exist_ok=True)
            with open(cached, "w") as f:
                json.dump({"cache_key": digest, "result": res}, f)
    res["hooks"] = res.get("preload", {}).get(HOOKS)
    with _lock:
        _results[key] = res
    save(key, dict({k: v for k, v in res.items() if k not in ("log", "outputs", "spec", "preload")},
                   cache_key=digest[:16], from_cache=from_cache))
    return res


def save(key, value):
    """Adds key: value to the session's report ($E2E_REPORT, rewritten each time)."""
    with _lock:
        _report[key] = value
        if os.environ.get("E2E_REPORT"):
            with open(os.environ["E2E_REPORT"], "w") as f:
                json.dump(_report, f, indent=1)


def failures(cmp: dict, tol: float, num_prompts: int = len(PROMPT_LENS)) -> list[str]:
    """The closeness rule's verdict on engines.compare(ours, peer): the criteria it fails
    (empty: close). Decode positions (after the prefill's first token) must be compared (two
    per prompt at least), the largest |top-5 logprob difference| must be <= tol and the top-5
    overlap >= 0.6."""
    failed = []
    if cmp["positions_compared"] < num_prompts * 2:
        failed.append(f"positions_compared {cmp['positions_compared']} < {num_prompts * 2}")
    if cmp["max_abs_logprob_diff"] > tol:
        failed.append(f"max_abs_logprob_diff {cmp['max_abs_logprob_diff']:.4f} > {tol:.4f}")
    if cmp["min_topk_overlap"] < MIN_TOPK_OVERLAP:
        failed.append(f"min_topk_overlap {cmp['min_topk_overlap']:.2f} < {MIN_TOPK_OVERLAP}")
    return failed


def check_close(name, ours, peer, tol):
    """ours' outputs against peer's under the closeness rule (failures); the comparison goes
    to the report."""
    cmp = engines.compare(ours["outputs"], peer["outputs"])
    failed = failures(cmp, tol, len(peer["outputs"]))
    save(name, dict(cmp, tolerance=tol, failed=failed))
    assert not failed, (name, failed, cmp)
    return cmp


def check_fails(name, wrong, peer, tol):
    """A negative control: a deliberately wrong kernel's outputs must FAIL the closeness rule
    on the logprobs or the top-5 overlap (not only on the number of compared positions)."""
    cmp = engines.compare(wrong["outputs"], peer["outputs"])
    failed = failures(cmp, tol, len(peer["outputs"]))
    save(name, dict(cmp, tolerance=tol, failed=failed, negative_control=True))
    assert any(f.startswith(("max_abs_logprob_diff", "min_topk_overlap")) for f in failed), (
        f"{name}: the wrong kernel passed the closeness rule", cmp, tol)
    return cmp
