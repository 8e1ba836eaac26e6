"""vLLM (0.25 or 0.33) with `--attention-backend CUSTOM` on tiny DeepSeek checkpoints whose
weights make attention non-uniform (mla_backend.demo.tiny_model), against vLLM's FLASHMLA and
TRITON_MLA on the same prompts (1 to 8200 tokens). Engines, prompts, result cache, report and the
closeness rule: tests/e2e/harness.py; test-only hooks in the engines: tests/e2e/hooks.py.

Tolerance: the largest |logprob difference| over the top-5 tokens of every compared position
must be within max(2 x the same number between FLASHMLA and TRITON_MLA -- two correct built-in
backends, same model, prompts and mode -- , 0.02), and the top-5 overlap >= 0.6; greedy tokens
may part only where the peers' logprobs allow it (a near-tie), which the same bound covers.
The 0.02 floor sits under one bf16 step of logits of magnitude 4 to 8 (0.031), by which two
correct backends can differ.

Per-tensor fp8 cache: the checkpoint carries KV-cache scales (k_scale 1.5, v_scale 2.5; vLLM
writes the cache as e4m3(x / k_scale)); every ops.mla_decode call must get k_scale, and CUSTOM
fp8 against FLASHMLA on a bf16 cache must be within max(1.5 x FLASHMLA fp8 against the same,
the bf16 tolerance).

Negative control: CUSTOM with a deliberately wrong kernel (the keys of each request's partly
filled last page left out) must fail the same rule.
"""

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from mla_backend.demo import engine_run, engines
from tests.e2e.harness import (
    PROMPT_LENS,
    check_close,
    check_fails,
    model,
    run,
    save,
)

pytestmark = pytest.mark.e2e
# n-gram speculation: 3 draft tokens, so verification rows of 4 query tokens per request
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
KV_SCALES = (1.5, 2.5)  # (k_scale, v_scale); MLA writes its one latent cache with k_scale


def _assert_ours(res):
    log = res["log"]
    assert "Using AttentionBackendEnum.CUSTOM backend" in log
    assert "mla_backend: dense MLA decode on MLA_BACKEND kernels" in log


def _tolerance(workdir, heads, arch="v3"):
    """FLASHMLA's result (FULL graphs) and the dense tolerance for this model."""
    m = model(workdir, arch, heads)
    fm = run(workdir, f"{arch}-h{heads}-FLASHMLA-graphs", model=m, backend="FLASHMLA")
    tr = run(workdir, f"{arch}-h{heads}-TRITON_MLA-graphs", model=m, backend="TRITON_MLA")
    spread = engines.compare(fm["outputs"], tr["outputs"])
    save(f"{arch}-h{heads}-graphs: FLASHMLA vs TRITON_MLA", spread)
    return fm, max(2 * spread["max_abs_logprob_diff"], 0.02)


@pytest.mark.parametrize("heads", [16, 128])
def test_custom_matches_flashmla_with_cuda_graphs(workdir, heads):
    fm, tol = _tolerance(workdir, heads)
    ours = run(workdir, f"v3-h{heads}-CUSTOM-graphs", model=model(workdir, "v3", heads),
               backend="CUSTOM")
    _assert_ours(ours)
    assert "FULL" in ours["cudagraph_mode"]
    check_close(f"v3-h{heads}-graphs: CUSTOM vs FLASHMLA", ours, fm, tol)


def test_deepseek_v2_on_model_runner_v2(workdir):
    m = model(workdir, "v2", 16)
    fm = run(workdir, "v2-h16-FLASHMLA-graphs", model=m, backend="FLASHMLA")
    ours = run(workdir, "v2-h16-CUSTOM-graphs", model=m, backend="CUSTOM")
    _assert_ours(ours)
    assert ours["use_v2_model_runner"], "DeepseekV2ForCausalLM should run on Model Runner V2"
    _, tol = _tolerance(workdir, 16)
    check_close("v2-h16-graphs: CUSTOM vs FLASHMLA", ours, fm, tol)


@pytest.mark.parametrize("heads", [16, 128])
def test_fp8_kv_cache_with_kv_scales(workdir, heads):
    """Per-tensor fp8 cache with k_scale 1.5 (a dropped, doubled or misrouted scale moves every
    score and value). The scales are set on vLLM's MLA layers after loading (tests/e2e/hooks:
    vLLM 0.25 does not load a DeepSeek checkpoint's KV scales into MLA layers), for both
    engines, so vLLM's cache writer quantizes with them. Our kernel reads bf16 q and the e4m3
    cache; FlashMLA's fp8 path also quantizes q. Both are measured against FlashMLA on a bf16
    cache. Both run the wgmma kernel, which converts the pages in its consumers.
    The hooks record the kv_scale of every ops.mla_decode call (in FULL-graph mode: the eager
    steps and the captures)."""
    plain = model(workdir, "v3", heads)
    fm_bf16, tol = _tolerance(workdir, heads)
    fm8 = run(workdir, f"v3-h{heads}-FLASHMLA-graphs-fp8-kvscales", model=plain,
              backend="FLASHMLA", kv_cache_dtype="fp8", hooks={"kv_scales": KV_SCALES})
    ours8 = run(workdir, f"v3-h{heads}-CUSTOM-graphs-fp8-kvscales", model=plain,
                backend="CUSTOM", kv_cache_dtype="fp8",
                hooks={"count": True, "kv_scales": KV_SCALES})
    _assert_ours(ours8)
    seen = ours8["hooks"]
    assert fm8["hooks"]["scaled_layers"] > 0 and seen["scaled_layers"] > 0, (fm8["hooks"], seen)
    calls = sum(seen["mla_decode_calls_by_s_q"].values()) + sum(
        seen["mla_decode_captured_by_s_q"].values())
    assert calls > 0, seen
    assert seen["mla_decode_kv_scales"] == [KV_SCALES[0]], seen
    peer = engines.compare(fm8["outputs"], fm_bf16["outputs"])
    ours = engines.compare(ours8["outputs"], fm_bf16["outputs"])
    save(f"v3-h{heads} fp8 cache, k_scale {KV_SCALES[0]}: FLASHMLA fp8 vs FLASHMLA bf16", peer)
    limit = max(1.5 * peer["max_abs_logprob_diff"], tol)
    save(f"v3-h{heads} fp8 cache, k_scale {KV_SCALES[0]}: CUSTOM fp8 vs FLASHMLA bf16",
         dict(ours, tolerance=limit))
    assert ours["positions_compared"] >= len(PROMPT_LENS) * 2
    assert ours["max_abs_logprob_diff"] <= limit, (ours, peer)


def test_spec_decode_against_flashmla(workdir):
    """n-gram speculation (3 draft tokens: verification rows of 4 query tokens per request),
    CUSTOM against FLASHMLA under the same speculative config. CUSTOM runs eager so that the
    hooks see every kernel call: calls of ops.mla_decode with more than one query token per
    request must have happened (counted per call from q's shape, not from the config)."""
    m = model(workdir, "v3", 16)
    _, tol = _tolerance(workdir, 16)
    peer = run(workdir, "v3-h16-FLASHMLA-graphs-ngram", model=m, backend="FLASHMLA",
               speculative=NGRAM)
    ours = run(workdir, "v3-h16-CUSTOM-eager-ngram", model=m, backend="CUSTOM", mode="eager",
               speculative=NGRAM, hooks={"count": True})
    _assert_ours(ours)
    assert "up to 4 query tokens per request" in ours["log"]
    assert ours["cudagraph_mode"].endswith("NONE")
    by_s_q = ours["hooks"]["mla_decode_calls_by_s_q"]
    save("v3-h16 ngram: CUSTOM ops.mla_decode calls by query tokens per request", by_s_q)
    assert sum(n for s_q, n in by_s_q.items() if int(s_q) > 1) > 0, by_s_q
    assert all(o["logprobs"] for o in ours["outputs"] + peer["outputs"])
    check_close("v3-h16 ngram: CUSTOM eager vs FLASHMLA graphs", ours, peer, tol)


def test_negative_control_dense(workdir):
    """The rule above fails on a wrong kernel: CUSTOM (eager) with the keys of each request's
    partly filled last page left out -- pages counted as seq_len // 64 -- against FLASHMLA."""
    m = model(workdir, "v3", 16)
    fm, tol = _tolerance(workdir, 16)
    wrong = run(workdir, "v3-h16-CUSTOM-eager-partial_page_dropped", model=m, backend="CUSTOM",
                mode="eager", hooks={"perturb": "partial_page_dropped"})
    _assert_ours(wrong)
    assert wrong["hooks"]["perturbed_calls"] > 0, wrong["hooks"]
    check_fails("v3-h16 negative control: CUSTOM with the partial last page dropped vs "
                "FLASHMLA", wrong, fm, tol)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_serve_answers_a_completion(workdir):
    """The README's serve command (vLLM defaults: torch.compile + CUDA graphs) with the
    plugin found through its installed entry point."""
    assert engine_run.entry_point_installed(), \
        "pip install this package on the GPU machine first (the engine process needs the entry point)"
    m = model(workdir, "v3", 16)
    port = _free_port()
    log_path = workdir / "serve.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", m,
           "--attention-backend", "CUSTOM", "--skip-tokenizer-init", "--max-model-len", "4096",
           "--gpu-memory-utilization", "0.3", "--port", str(port)]
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 480
            while time.time() < deadline:
                assert server.poll() is None, open(log_path).read()[-4000:]
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                    break
                except OSError:
                    time.sleep(3)
            else:
                pytest.fail("vllm serve did not become healthy in 480 s")
            body = json.dumps({"model": m, "prompt": list(range(2, 40)), "max_tokens": 8,
                               "temperature": 0, "return_token_ids": True}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            answer = json.load(urllib.request.urlopen(req, timeout=60))
        finally:
            server.terminate()
            server.wait(timeout=60)
    text = open(log_path, errors="replace").read()
    save("serve", {"answer": answer, "command": " ".join(cmd[2:])})
    assert answer["usage"]["completion_tokens"] == 8, answer
    assert "Using AttentionBackendEnum.CUSTOM backend" in text
    assert re.search(r"mla_backend: dense MLA decode on MLA_BACKEND kernels", text)
