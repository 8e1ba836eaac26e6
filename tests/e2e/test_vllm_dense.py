"""vLLM 0.25 with `--attention-backend CUSTOM` on tiny DeepSeek checkpoints whose weights make
attention non-uniform (mla_backend.demo.tiny_model), against vLLM's FLASHMLA and TRITON_MLA
on the same prompts. Engines, prompts, result cache and report: tests/e2e/harness.py.

Tolerance (stated in docs/vllm.md): the largest |logprob difference| over the top-5 tokens of
every compared position must be within max(2 x the same number between FLASHMLA and
TRITON_MLA -- two correct built-in backends -- , 0.02); greedy tokens may part only where
the peers' logprobs allow it (a near-tie), which the same bound covers.
"""

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from mla_backend.demo import engine_run, engines, tiny_model
from tests.e2e.harness import PROMPT_LENS, check_close, run, save

pytestmark = pytest.mark.e2e


def _model(workdir, arch="v3", heads=16):
    path = workdir / f"tiny-{arch}-h{heads}"
    if not (path / "model.safetensors").exists():
        tiny_model.write_checkpoint(str(path), arch=arch, heads=heads, layers=2)
    return str(path)


def _assert_ours(res):
    log = res["log"]
    assert "Using AttentionBackendEnum.CUSTOM backend" in log
    assert "mla_backend: dense MLA decode on MLA_BACKEND kernels" in log


def _tolerance(workdir, arch, heads, mode="graphs"):
    fm = run(workdir, f"{arch}-h{heads}-FLASHMLA-{mode}", model=_model(workdir, arch, heads),
             backend="FLASHMLA", mode=mode)
    tr = run(workdir, f"{arch}-h{heads}-TRITON_MLA-{mode}", model=_model(workdir, arch, heads),
             backend="TRITON_MLA", mode=mode)
    spread = engines.compare(fm["outputs"], tr["outputs"])
    save(f"{arch}-h{heads}-{mode}: FLASHMLA vs TRITON_MLA", spread)
    return fm, max(2 * spread["max_abs_logprob_diff"], 0.02)


@pytest.mark.parametrize("heads", [16, 128])
def test_custom_matches_flashmla_with_cuda_graphs(workdir, heads):
    fm, tol = _tolerance(workdir, "v3", heads)
    ours = run(workdir, f"v3-h{heads}-CUSTOM-graphs", model=_model(workdir, "v3", heads),
               backend="CUSTOM", mode="graphs")
    _assert_ours(ours)
    assert "FULL" in ours["cudagraph_mode"]
    check_close(f"v3-h{heads}-graphs: CUSTOM vs FLASHMLA", ours, fm, tol)


def test_custom_eager_matches_flashmla(workdir):
    fm, tol = _tolerance(workdir, "v3", 16)
    ours = run(workdir, "v3-h16-CUSTOM-eager", model=_model(workdir, "v3", 16),
               backend="CUSTOM", mode="eager")
    _assert_ours(ours)
    assert ours["cudagraph_mode"].endswith("NONE")
    check_close("v3-h16: CUSTOM eager vs FLASHMLA graphs", ours, fm, tol)


def test_deepseek_v2_on_model_runner_v2(workdir):
    model = _model(workdir, "v2", 16)
    fm = run(workdir, "v2-h16-FLASHMLA-graphs", model=model, backend="FLASHMLA")
    ours = run(workdir, "v2-h16-CUSTOM-graphs", model=model, backend="CUSTOM")
    _assert_ours(ours)
    assert ours["use_v2_model_runner"], "DeepseekV2ForCausalLM should run on Model Runner V2"
    _, tol = _tolerance(workdir, "v3", 16)
    check_close("v2-h16-graphs: CUSTOM vs FLASHMLA", ours, fm, tol)


@pytest.mark.parametrize("heads", [16, 128])
def test_fp8_kv_cache_at_least_as_close_as_flashmla_fp8(workdir, heads):
    """Per-tensor fp8 cache: our kernel reads bf16 q and the e4m3 cache; FlashMLA's fp8 path
    also quantizes q. Both are measured against FlashMLA on a bf16 cache. H = 16 runs our
    mma.sync kernel, H = 128 the wgmma kernel's converting producer."""
    model = _model(workdir, "v3", heads)
    fm_bf16, tol = _tolerance(workdir, "v3", heads)
    fm8 = run(workdir, f"v3-h{heads}-FLASHMLA-graphs-fp8", model=model, backend="FLASHMLA",
              kv_cache_dtype="fp8")
    ours8 = run(workdir, f"v3-h{heads}-CUSTOM-graphs-fp8", model=model, backend="CUSTOM",
                kv_cache_dtype="fp8")
    _assert_ours(ours8)
    peer = engines.compare(fm8["outputs"], fm_bf16["outputs"])
    ours = engines.compare(ours8["outputs"], fm_bf16["outputs"])
    save(f"v3-h{heads} fp8 cache: FLASHMLA fp8 vs FLASHMLA bf16", peer)
    save(f"v3-h{heads} fp8 cache: CUSTOM fp8 vs FLASHMLA bf16", ours)
    assert ours["positions_compared"] >= len(PROMPT_LENS) * 2
    assert ours["max_abs_logprob_diff"] <= max(1.5 * peer["max_abs_logprob_diff"], tol), (
        ours, peer)


def test_spec_decode_verification_rows(workdir):
    """n-gram speculation (3 draft tokens) sends verification rows of 4 query tokens per
    request to forward_mqa; greedy results must match the same engine without speculation."""
    model = _model(workdir, "v3", 16)
    plain = run(workdir, "v3-h16-CUSTOM-graphs", model=model, backend="CUSTOM")
    spec = run(workdir, "v3-h16-CUSTOM-graphs-ngram", model=model, backend="CUSTOM",
               speculative={"method": "ngram", "num_speculative_tokens": 3,
                            "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    _assert_ours(spec)
    assert "up to 4 query tokens per request" in spec["log"]
    _, tol = _tolerance(workdir, "v3", 16)
    if all(o["logprobs"] for o in spec["outputs"]):
        check_close("v3-h16: CUSTOM ngram-spec vs CUSTOM", spec, plain, tol)
    else:  # no logprobs from the speculative path: greedy tokens must agree
        cmp_tokens = [o["token_ids"] for o in spec["outputs"]]
        assert cmp_tokens == [o["token_ids"] for o in plain["outputs"]]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_serve_answers_a_completion(workdir):
    """The README's serve command (vLLM defaults: torch.compile + CUDA graphs) with the
    plugin found through its installed entry point."""
    assert engine_run.entry_point_installed(), \
        "pip install this package on the GPU machine first (the engine process needs the entry point)"
    model = _model(workdir, "v3", 16)
    port = _free_port()
    log_path = workdir / "serve.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
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
            body = json.dumps({"model": model, "prompt": list(range(2, 40)), "max_tokens": 8,
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
