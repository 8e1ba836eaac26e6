"""What the SGLang engine tests (test_engine*.py) share: the engine spec, prompts, one run per
engine configuration, the report, and the closeness rule of the vLLM e2e tier.

Engines: each configuration (a label within a group) runs once per pytest session, in a
process of its own (mla_backend.demo.sglang_run), when a test first asks for it, so `-k`
runs only the engines its tests need. With $SGLANG_E2E_CACHE_DIR set (scripts/gpu-sglang
sets it on the GPU machine), a finished run is kept there under a key of everything its
result depends on (cache_key) and reused by later sessions, so a group split over several
calls, or one stopped by a call's time limit, does not run its reference engines again.

Report: every engine's start and generate times and every comparison go to
$SGLANG_E2E_OUT/sglang-e2e-report.json (rewritten as entries come), engine logs beside it.

Negative controls: a configuration with "worker_hooks": OPTIONS (tests/e2e/hooks.py's options,
e.g. {"perturb": "partial_page_dropped"}) runs with those hooks installed in SGLang's
scheduler process, through a throwaway `sglang.srt.plugins` entry point
(tests/e2e/worker_hooks.py); the processes' hook reports come back as result["hooks"].
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
import os
import pathlib
import statistics
import tempfile
import threading

from mla_backend.demo import engines, sglang_run
from tests.e2e import worker_hooks
from tests.e2e.harness import failures

ROOT = pathlib.Path(__file__).resolve().parents[2]
NAME = "mla_backend"
VOCAB = 2048
FLOOR = 0.02  # under one bf16 step of a logit of magnitude 4 to 8 (0.031)
MIN_ABOVE_UNIFORM = 1.0  # nats: the reference's median top-1 logprob above -ln(vocab)
ENGINE_TIMEOUT_S = 300  # one engine, first-use compiles included
# max_running_requests also caps the decode graphs (sglang_run): batch 1, 2 and 4.
# max_total_tokens keeps the cache pool small (a few prompts need 5k slots); SGLang's
# flashmla_kv on a bf16 DSA cache quantizes the whole pool at every call.
BASE = {"graphs": True, "context_length": 4096, "chunked_prefill_size": 1024,
        "max_running_requests": 4, "mem_fraction_static": 0.3, "max_new_tokens": 12,
        "logprobs": 5, "engine_args": {"max_total_tokens": 16384}}
HOOKS_PLUGIN = "mla_backend_e2e_worker_hooks"  # worker_hooks' entry point name
_report: dict = {}
_lock = threading.Lock()


def out_dir() -> pathlib.Path:
    """$SGLANG_E2E_OUT (scripts/gpu-sglang: $OUT), else one temporary folder per session."""
    path = pathlib.Path(os.environ.get("SGLANG_E2E_OUT") or _session_tmp())
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def _session_tmp() -> str:
    return tempfile.mkdtemp(prefix="sg-e2e-")


def prompts(lens: list[int], vocab: int = VOCAB) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(7)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lens]


def full_spec(model: str, prompt_ids: list[list[int]], overrides: dict,
              base: dict = BASE) -> dict:
    """BASE + the model and prompts + a configuration's overrides; engine_args and env are
    merged key by key (an override's own keys win)."""
    spec = copy.deepcopy(base)
    spec.update(model=model, prompts=prompt_ids)
    for key, value in overrides.items():
        if key in ("engine_args", "env"):
            spec[key] = dict(spec.get(key, {}), **value)
        else:
            spec[key] = value
    return spec


def save(key: str, value) -> None:
    """Adds key: value to the session's report (rewritten each time)."""
    with _lock:
        _report[key] = value
        with open(out_dir() / "sglang-e2e-report.json", "w") as f:
            json.dump(_report, f, indent=1)


def _sha256_files(paths) -> str:
    h = hashlib.sha256()
    for p in sorted(map(pathlib.Path, paths)):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


@functools.cache
def _sha256_dir(path: str) -> str:
    return _sha256_files(p for p in pathlib.Path(path).iterdir() if p.is_file())


@functools.cache
def _identity(ours: bool) -> dict:
    """What a run's result depends on besides its spec: SGLang's version and the engine
    runner; for our backend also the package's Python sources, the entry point and the
    extension's bytes."""
    from importlib import metadata

    demo = ROOT / "mla_backend" / "demo"
    ident = {"sglang": metadata.version("sglang"),
             "runner": _sha256_files([demo / "sglang_run.py", demo / "engines.py"])}
    if ours:
        from mla_backend import _extension

        ext = _extension.extension_path()
        sources = [*(ROOT / "mla_backend").rglob("*.py"), *(ROOT / "plugin_entry").glob("*.py")]
        ident["sources"] = hashlib.sha256(
            "".join(f"{p.relative_to(ROOT)}:{_sha256_files([p])}"
                    for p in sorted(sources)).encode()).hexdigest()
        ident["extension"] = _sha256_files([ext]) if ext and os.path.isfile(ext) else None
    return ident


def cache_key(spec: dict) -> str:
    """sha256 of the run's identity (_identity) and inputs: the spec with the model folder
    replaced by the hash of its files (the same checkpoint in another temporary folder
    gives the same key)."""
    inputs = dict(spec, model=_sha256_dir(spec["model"]))
    blob = json.dumps({"identity": _identity(spec["backend"] == NAME), "inputs": inputs},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


class Engines:
    """The engine configurations of one group (one model, one set of prompts): label ->
    overrides of BASE. run(label) starts the engine the first time, then returns its result
    (outputs, times, and the log's text under "log")."""

    def __init__(self, group: str, model: str, prompt_ids: list[list[int]],
                 configs: dict[str, dict]):
        self.group, self.model, self.prompts, self.configs = group, model, prompt_ids, configs
        self._results: dict[str, dict] = {}

    def spec(self, label: str) -> dict:
        return full_spec(self.model, self.prompts, self.configs[label])

    def run(self, label: str) -> dict:
        if label not in self._results:
            self._results[label] = self._run(label)
        return self._results[label]

    def _run(self, label: str) -> dict:
        spec = self.spec(label)
        log = out_dir() / f"engine-{self.group}-{label}.log"
        key = cache_key(spec)
        cache = os.environ.get("SGLANG_E2E_CACHE_DIR")
        cached = pathlib.Path(cache) / f"{key}.json" if cache else None
        if cached is not None and cached.exists():
            result = json.loads(cached.read_text())
            log.write_text(result["log"])
            from_cache = True
        else:
            run_spec, reports = _hooked(spec, out_dir() / f"hooks-{self.group}-{label}")
            result = sglang_run.run(run_spec, str(log), timeout_s=ENGINE_TIMEOUT_S,
                                    label=f"{self.group} {label}")
            result["log"] = log.read_text(errors="replace")
            if reports is not None:
                result["hooks"] = [json.loads(p.read_text())
                                   for p in sorted(reports.glob("*.json"))]
            if cached is not None:
                cached.parent.mkdir(parents=True, exist_ok=True)
                cached.write_text(json.dumps(result))
            from_cache = False
        save(f"{self.group} {label}", {"engine_start_s": result["engine_start_s"],
                                       "generate_s": result.get("generate_s"),
                                       "from_cache": from_cache, "cache_key": key[:16]})
        return result


def _hooked(spec: dict, folder: pathlib.Path) -> tuple[dict, pathlib.Path | None]:
    """The spec the engine runs (without "worker_hooks"), and where its processes' hook
    reports go (None: no hooks). With hooks: the throwaway plugin first on PYTHONPATH, the
    repository root after it (the plugin's module is tests.e2e.worker_hooks), the options in
    the environment, and SGLANG_PLUGINS naming both our plugin and the hooks' (a whitelist
    without the latter would leave the kernel unperturbed)."""
    options = spec.get("worker_hooks")
    run_spec = {k: v for k, v in spec.items() if k != "worker_hooks"}
    if options is None:
        return run_spec, None
    plugin = worker_hooks.write_plugin(folder / "plugin", group="sglang.srt.plugins")
    reports = folder / "reports"
    env = worker_hooks.engine_env(plugin, str(reports), options)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (plugin, str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env["SGLANG_PLUGINS"] = f"{NAME},{HOOKS_PLUGIN}"
    run_spec["env"] = dict(run_spec.get("env", {}), **env)
    return run_spec, reports


def perturbed_calls(result: dict) -> int:
    """How many kernel calls the hooks perturbed, over the engine's processes."""
    return sum(r.get("perturbed_calls", 0) for r in result.get("hooks", []))


def above_uniform(outputs: list[dict], vocab: int = VOCAB) -> float:
    """Median over generated positions of the top-1 logprob + ln(vocab): 0 for a model whose
    every token is equally likely, against which any two kernels agree."""
    top1 = [max(lp for _, lp in pos) for out in outputs for pos in out["logprobs"] if pos]
    return statistics.median(top1) + math.log(vocab)


def assert_not_uniform(name: str, reference: dict) -> None:
    margin = above_uniform(reference["outputs"])
    save(f"{name}: reference median top-1 logprob above -ln(vocab)", margin)
    assert margin > MIN_ABOVE_UNIFORM, (name, margin)


def tolerance(name: str, a: dict, b: dict) -> float:
    """max(2 x the largest |top-5 logprob difference| between two of SGLang's own backends
    on the same model, prompts and mode, FLOOR); the spread goes to the report."""
    spread = engines.compare(a["outputs"], b["outputs"])
    tol = max(2 * spread["max_abs_logprob_diff"], FLOOR)
    save(f"{name} (yardstick)", dict(spread, tolerance=tol))
    return tol


def check_fails(name: str, wrong: dict, peer: dict, tol: float) -> dict:
    """A negative control: a deliberately wrong kernel's outputs must fail the rule on the
    logprobs or the top-5 overlap (not only on the number of compared positions), and the
    hooks must have perturbed its calls."""
    assert perturbed_calls(wrong) > 0, (name, "no kernel call was perturbed", wrong.get("hooks"))
    cmp = engines.compare(wrong["outputs"], peer["outputs"])
    failed = failures(cmp, tol, len(peer["outputs"]))
    save(name, dict(cmp, tolerance=tol, failed=failed, negative_control=True,
                    perturbed_calls=perturbed_calls(wrong)))
    assert any(f.startswith(("max_abs_logprob_diff", "min_topk_overlap")) for f in failed), (
        f"{name}: the wrong kernel passed the closeness rule", cmp, tol)
    return cmp


def check_close(name: str, ours: dict, peer: dict, tol: float) -> dict:
    """ours against peer under the vLLM e2e tier's rule (tests/e2e/harness.py: failures):
    decode positions compared, max |top-5 logprob difference| <= tol, top-5 overlap >= 0.6."""
    cmp = engines.compare(ours["outputs"], peer["outputs"])
    failed = failures(cmp, tol, len(peer["outputs"]))
    save(name, dict(cmp, tolerance=tol, failed=failed))
    assert not failed, (name, failed, cmp)
    return cmp
