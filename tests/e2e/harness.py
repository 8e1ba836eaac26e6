"""What the e2e tests share: the engine spec and prompts, engine runs in their own processes
(mla_backend.demo.engines) cached for the session (and in $E2E_CACHE_DIR across sessions on
one machine, when set), every comparison written to $E2E_REPORT (JSON) when set, and the
closeness check against a peer backend.

Prompts of 1 to 3000 tokens go in one batch with max_num_batched_tokens 1024, so steps mix
prefills and decodes, and the 3000-token prompt is prefilled in chunks that read the context
back from our cache. The first generated token comes from prefill alone; decode kernels
show from the second on (12 tokens per prompt).
"""

import json
import os

from mla_backend.demo import engines

PROMPT_LENS = [1, 7, 64, 300, 1000, 3000]
BASE = {"mode": "graphs", "max_model_len": 4096, "max_num_seqs": 32, "max_num_batched_tokens": 1024,
        "gpu_memory_utilization": 0.3, "max_tokens": 12, "logprobs": 5}
_results: dict = {}
_report: dict = {}


def prompts():
    import torch

    gen = torch.Generator().manual_seed(7)
    return [torch.randint(2, 2048, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def run(workdir, key: str, **spec) -> dict:
    """The engine's result for BASE + prompts + spec, run once per key (workdir: the session's
    folder for models and logs)."""
    if key not in _results:
        cache = os.environ.get("E2E_CACHE_DIR")
        cached = os.path.join(cache, f"{key}.json") if cache else None
        full = dict(BASE, prompts=prompts(), **spec)
        if cached and os.path.exists(cached):
            with open(cached) as f:
                res = json.load(f)
            assert res["spec"] == {k: v for k, v in full.items() if k != "prompts"}, key
        else:
            log = str(workdir / f"{key}.log")
            res = engines.run_engine(full, log, label=key, timeout_s=600)
            res["log"] = open(log, errors="replace").read()
            if cached:
                os.makedirs(cache, exist_ok=True)
                with open(cached, "w") as f:
                    json.dump(res, f)
        _results[key] = res
        save(key, {k: v for k, v in res.items() if k not in ("log", "outputs", "spec")})
    return _results[key]


def save(key, value):
    """Adds key: value to the session's report ($E2E_REPORT, rewritten each time)."""
    _report[key] = value
    if os.environ.get("E2E_REPORT"):
        with open(os.environ["E2E_REPORT"], "w") as f:
            json.dump(_report, f, indent=1)


def check_close(name, ours, peer, tol):
    """ours' outputs against peer's: decode positions compared, max |top-5 logprob
    difference| <= tol, top-5 overlap >= 0.6; the comparison goes to the report."""
    cmp = engines.compare(ours["outputs"], peer["outputs"])
    save(name, dict(cmp, tolerance=tol))
    # decode positions (after the prefill's first token) were compared
    assert cmp["positions_compared"] >= len(PROMPT_LENS) * 2, cmp
    assert cmp["max_abs_logprob_diff"] <= tol, (name, cmp, tol)
    assert cmp["min_topk_overlap"] >= 0.6, (name, cmp)
    return cmp
