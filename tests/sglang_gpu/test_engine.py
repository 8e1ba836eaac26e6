"""A tiny DeepSeek-V3 (2 layers, 16 heads, real-looking weights: mla_backend.demo.tiny_model)
through sgl.Engine with decode CUDA graphs, on mla_backend, SGLang's flashmla and SGLang's
triton backend, each engine in a process of its own (mla_backend.demo.sglang_run).

Prompts of 1 to 3000 tokens go in one batch with chunked_prefill_size 1024, so steps mix
prefills and decodes and the long prompts are prefilled in chunks that read the context back.
The first generated token comes from the prefill (SGLang's FlashInfer code for every backend
here but triton); decode kernels show from the second on (12 tokens per prompt).

Kept cheap enough for three engines in about 6 minutes on one H100: most of an engine's time
is first-use compilation (SGLang's JIT kernels while the first decode graph is captured,
FlashInfer's JIT prefill kernels in the first prefill), cached on disk for the engines after
it. So: four prompts, decode graphs for batch 1, 2 and 4 only, and every flashmla / ours
prefill chunk on FlashInfer's paged MLA kernel (flashinfer_mla_disable_ragged: one FlashInfer
build instead of that and the ragged MHA kernel; prefill is FlashInfer's for both alike).
FlashInfer's builds are logged (FLASHINFER_JIT_VERBOSE); each engine's start and generate
times go to the report as it finishes.

The closeness rule is the vLLM e2e tier's: compared positions up to each prompt's first
differing token, largest |top-5 logprob difference| <= max(2 x the spread between flashmla and
triton on the same prompts, 0.02), top-5 overlap >= 0.6. Engine runs (once per configuration,
kept across sessions in $SGLANG_E2E_CACHE_DIR), engine logs and the JSON report:
tests/sglang_gpu/engine_runs.py.

Then the README's server command: `python -m sglang.launch_server --attention-backend
mla_backend` on the same model (with a word-level tokenizer from tiny_model: SGLang's OpenAI
API detokenizes what it returns, so it cannot run with skip_tokenizer_init), in a process
group of its own, answering one OpenAI /v1/completions request with a token-id prompt; the
test stops the server (the whole group) whether it answered or not.
The negative control (`-k negative_control`): ours in an eager engine whose kernel calls
leave out each request's partly filled last page must fail the same rule against flashmla.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from mla_backend.demo import tiny_model
from tests.sglang_gpu import engine_runs
from tests.sglang_gpu.engine_runs import NAME, assert_not_uniform, check_close, tolerance

pytestmark = pytest.mark.gpu
PROMPT_LENS = [1, 64, 1000, 3000]
VOCAB = engine_runs.VOCAB
# label -> overrides of engine_runs.BASE (also read by tests/sglang_cpu); FlashInfer's builds
# are logged (FLASHINFER_JIT_VERBOSE)
ENGINE_SPECS = {b: {"backend": b, "engine_args": {"flashinfer_mla_disable_ragged": True},
                    "env": {"FLASHINFER_JIT_VERBOSE": "1"}}
                for b in ("flashmla", "triton", NAME)}
# the negative control: ours eager, each decode's partly filled last page left out
# (tests/e2e/hooks.py's partial_page_dropped, installed in SGLang's scheduler process)
WRONG = f"{NAME}-eager-partial_page_dropped"
ENGINE_SPECS[WRONG] = dict(ENGINE_SPECS[NAME], graphs=False,
                           worker_hooks={"perturb": "partial_page_dropped"})


@pytest.fixture(scope="module")
def out_dir():
    return engine_runs.out_dir()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-v3-h16"))
    tiny_model.write_checkpoint(path, arch="v3", heads=16, layers=2, vocab=VOCAB,
                                max_positions=8192)
    return tiny_model.write_tokenizer(path, VOCAB)  # for the server; the engines skip it


@pytest.fixture(scope="module")
def runs(model):
    return engine_runs.Engines("v3-h16", model, engine_runs.prompts(PROMPT_LENS), ENGINE_SPECS)


def test_reference_is_not_uniform(runs):
    # near-uniform attention and logits would let every backend "agree"
    assert_not_uniform("v3-h16", runs.run("flashmla"))


def test_ours_served_by_our_backend(runs):
    assert "dense MLA decode on mla_backend kernels" in runs.run(NAME)["log"]


def test_ours_matches_flashmla(runs):
    ref = runs.run("flashmla")
    tol = tolerance("v3-h16, decode graphs: flashmla vs triton", ref, runs.run("triton"))
    check_close("v3-h16, decode graphs: mla_backend vs flashmla", runs.run(NAME), ref, tol)


def test_negative_control_v3_partial_page_dropped(runs):
    # the same rule must fail on a kernel that leaves out each request's partly filled last
    # page (`-k negative_control`: its own call; the references come from the run cache)
    ref = runs.run("flashmla")
    tol = tolerance("v3-h16, decode graphs: flashmla vs triton", ref, runs.run("triton"))
    engine_runs.check_fails("v3-h16 negative control: mla_backend eager with the partial "
                            "last page dropped vs flashmla", runs.run(WRONG), ref, tol)


SERVER_START_S = 300  # until /health answers: start, graph capture, first-use JIT, warmup
COMPLETION_TOKENS = 8


def launch_command(model: str, port: int) -> list[str]:
    """The README's `launch_server --attention-backend mla_backend`, kept small: decode
    graphs up to batch 4, prefill on FlashInfer's paged MLA kernel (one JIT build)."""
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model,
            "--attention-backend", "mla_backend", "--host", "127.0.0.1", "--port", str(port),
            "--context-length", "4096", "--mem-fraction-static", "0.3",
            "--max-running-requests", "4", "--cuda-graph-max-bs-decode", "4",
            "--flashinfer-mla-disable-ragged", "--random-seed", "0"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(server: subprocess.Popen, port: int, log: pathlib.Path) -> None:
    deadline = time.time() + SERVER_START_S
    while time.time() < deadline:
        if server.poll() is not None:
            pytest.fail(f"launch_server exited ({server.returncode}):\n"
                        f"{log.read_text(errors='replace')[-4000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
            return
        except OSError:  # refused, or 503 while it starts
            time.sleep(3)
    pytest.fail(f"launch_server did not answer /health in {SERVER_START_S} s; log {log}")


def _stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (it and its scheduler / detokenizer), SIGKILL
    after 60 s."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(server.pid, signal.SIGKILL)  # children that outlived the leader
    except ProcessLookupError:
        pass
    server.wait(timeout=30)


def test_launch_server_answers_a_completion(model, out_dir):
    port = _free_port()
    log = out_dir / "launch_server-mla_backend.log"
    cmd = launch_command(model, port)
    prompt = list(range(3, 40))
    with open(log, "w") as f:
        server = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                  start_new_session=True,
                                  env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        _wait_healthy(server, port, log)
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": COMPLETION_TOKENS,
                           "temperature": 0, "ignore_eos": True,
                           "return_token_ids": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        answer = json.load(urllib.request.urlopen(req, timeout=120))
    finally:
        _stop(server)
    with open(out_dir / "launch_server-answer.json", "w") as f:
        json.dump({"command": cmd[1:], "answer": answer}, f, indent=1)
    choice = answer["choices"][0]
    assert answer["usage"]["completion_tokens"] == COMPLETION_TOKENS, answer
    assert len(choice["token_ids"]) == COMPLETION_TOKENS, answer
    # the tokenizer's words: "t<id>" per generated token ("</s>" is skipped as special)
    assert choice["text"].split() == [f"t{t}" for t in choice["token_ids"] if t > 2], answer
    assert "dense MLA decode on mla_backend kernels" in log.read_text(errors="replace")
