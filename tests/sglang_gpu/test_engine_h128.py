"""A tiny DeepSeek-V3 with 128 heads (2 layers, mla_backend.demo.tiny_model; the most heads a
GPU decodes, DeepSeek-V3's own count at TP 1) through sgl.Engine, on mla_backend, SGLang's
flashmla and SGLang's triton backend, each engine in a process of its own: decode CUDA graphs
on and off, a bf16 and an fp8_e4m3 cache.

Prompts, chunked prefill and the closeness rule as in test_engine.py (1 to 3000 tokens in one
batch, 12 tokens each; max(2 x the flashmla-triton spread, 0.02), top-5 overlap >= 0.6); the
prefill of flashmla and ours runs on FlashInfer's paged MLA kernel (one FlashInfer build).
  * graphs: ours against flashmla, both with decode graphs; yardstick flashmla vs triton.
  * eager (disable_cuda_graph): ours eager against flashmla with graphs, the same yardstick
    (as the vLLM tier's eager case).
  * fp8 cache (per-tensor e4m3, scale 1: the checkpoint has none): ours against flashmla on
    the same cache; yardstick flashmla fp8 vs triton fp8. FlashMLA's fp8 kernel also rounds
    the query to fp8, triton and ours keep it 16-bit: the yardstick holds that difference.

Groups (`bash scripts/gpu-sglang -k ...`, one 10-minute call each): `e2e_h128_graphs` (three
engines), `e2e_h128_eager` (ours eager; flashmla and triton again unless cached from the
graphs group: scripts/gpu-sglang keeps results in $SGLANG_E2E_CACHE_DIR), `e2e_h128_fp8`
(three engines).
"""

import pytest

from mla_backend.demo import tiny_model
from tests.sglang_gpu import engine_runs
from tests.sglang_gpu.engine_runs import NAME, assert_not_uniform, check_close, tolerance

pytestmark = pytest.mark.gpu
PROMPT_LENS = [1, 64, 1000, 3000]
HEADS = 128
DENSE = {"engine_args": {"flashinfer_mla_disable_ragged": True}}


def _dense(backend: str, **spec) -> dict:
    return dict(DENSE, backend=backend, **spec)


# label -> overrides of engine_runs.BASE (also read by tests/sglang_cpu)
ENGINE_SPECS = {
    "flashmla": _dense("flashmla"),
    "triton": _dense("triton"),
    "mla_backend": _dense(NAME),
    "mla_backend-eager": _dense(NAME, graphs=False),
    "flashmla-fp8": _dense("flashmla", kv_cache_dtype="fp8_e4m3"),
    "triton-fp8": _dense("triton", kv_cache_dtype="fp8_e4m3"),
    "mla_backend-fp8": _dense(NAME, kv_cache_dtype="fp8_e4m3"),
}


def write_model(path: str) -> str:
    return tiny_model.write_checkpoint(path, arch="v3", heads=HEADS, layers=2,
                                       vocab=engine_runs.VOCAB, max_positions=8192)


@pytest.fixture(scope="module")
def h128(tmp_path_factory):
    model = write_model(str(tmp_path_factory.mktemp("tiny-v3-h128")))
    return engine_runs.Engines("v3-h128", model, engine_runs.prompts(PROMPT_LENS), ENGINE_SPECS)


def _assert_ours_ran(result: dict, cache: str) -> None:
    line = f"{NAME}: dense MLA decode on {NAME} kernels ({HEADS} query heads, cache {cache},"
    assert line in result["log"], line


def _bf16_reference(h128) -> tuple[dict, float]:
    ref = h128.run("flashmla")
    assert_not_uniform("v3-h128 bf16", ref)
    return ref, tolerance("v3-h128 bf16, decode graphs: flashmla vs triton", ref,
                          h128.run("triton"))


def test_e2e_h128_graphs_ours_matches_flashmla(h128):
    ref, tol = _bf16_reference(h128)
    ours = h128.run("mla_backend")
    _assert_ours_ran(ours, "torch.bfloat16")
    check_close("v3-h128 bf16, decode graphs: mla_backend vs flashmla", ours, ref, tol)


def test_e2e_h128_eager_ours_matches_flashmla(h128):
    ref, tol = _bf16_reference(h128)
    ours = h128.run("mla_backend-eager")
    _assert_ours_ran(ours, "torch.bfloat16")
    check_close("v3-h128 bf16: mla_backend eager vs flashmla with decode graphs", ours, ref, tol)


def test_e2e_h128_fp8_ours_matches_flashmla_fp8(h128):
    ref = h128.run("flashmla-fp8")
    assert_not_uniform("v3-h128 fp8", ref)
    tol = tolerance("v3-h128 fp8_e4m3, decode graphs: flashmla vs triton", ref,
                    h128.run("triton-fp8"))
    ours = h128.run("mla_backend-fp8")
    _assert_ours_ran(ours, "torch.float8_e4m3fn")
    check_close("v3-h128 fp8_e4m3, decode graphs: mla_backend vs flashmla", ours, ref, tol)
