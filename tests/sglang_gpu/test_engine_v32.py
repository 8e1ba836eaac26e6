"""A tiny DeepSeek-V3.2 (DSA: a lightning indexer keeps index_topk = 2048 keys per query token;
2 layers, 16 heads, mla_backend.demo.tiny_model) through sgl.Engine with decode CUDA graphs,
on mla_backend and on SGLang's own `dsa` backend, each engine in a process of its own.

Prompts of 1, 2040, 2600 and 3800 tokens in one batch with chunked prefill (1024): two prompts
whose keys all fit in the top-k (the 2040-token one outgrows it while it decodes) and two whose
indexer really selects (2600 and 3800 keys for 2048 slots; the engines hold 4096), prefill chunks that read the
context back, steps that mix prefills and decodes; 12 tokens each. index_topk is DeepSeek-V3.2's
own, 2048: SGLang's top-k kernels (sgl-kernel, its default) take no other width.

SGLang's DSA kernels under the SGLang kit (no FA3, no tilelang; flashinfer_sparse_mla is for
SM120 GLM only): `flashmla_sparse` (FlashMLA's sparse prefill kernel, bf16 keys; as decode
only on a bf16 cache) and `flashmla_kv` (FlashMLA's sparse decode kernel, which reads the
656-byte fp8 token: on a bf16 cache SGLang quantizes the cache to it at every call). Every
SGLang engine here names both explicitly: its Hopper default decode for a bf16 cache is `fa3`.
SGLang's `dsa` also sends prefills whose keys fit in index_topk to a dense FA3 kernel;
SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD=0 keeps them on its sparse kernels (set only
for SGLang's engines: ours never takes that route).

References and tolerances (the vLLM e2e tier's rule: max(2 x the spread between two of
SGLang's own backends on the same model, prompts and graphs, 0.02), top-5 overlap >= 0.6; the
indexer keeps the top 2048 fp8 scores, so a bf16-level difference in layer 1 swaps keys at the
top-k boundary in layer 2 and moves logprobs more than any kernel's rounding: the spread of
two correct backends measures that on this model):
  * bf16 cache: ours against flashmla_sparse (prefill and decode; the only DSA kernel of the
    kit that attends over bf16 keys). Yardstick: flashmla_sparse against flashmla_sparse
    prefill + flashmla_kv decode, SGLang's only other DSA decode kernel on a bf16 cache. It
    reads that cache rounded to fp8, so this yardstick holds fp8 key rounding in its decode
    steps besides the kernels' difference: looser than a pair of bf16 kernels would give
    (the kit has none), and said so in the report's name for it.
  * fp8 cache (fp8_e4m3: the 656-byte token, SGLang's writer): ours against flashmla_kv
    (prefill and decode: SGLang's Hopper default for this cache). Yardstick: flashmla_kv
    against flashmla_sparse prefill (keys of the chunk itself unquantized, the cached prefix
    dequantized) + flashmla_kv decode: the two prefill kernels SGLang offers for this cache.

Groups (`bash scripts/gpu-sglang -k ...`, one 10-minute call each): `e2e_v32_bf16` and
`e2e_v32_fp8`, three engines each; `negative_control` (ours eager with q's RoPE dims zeroed
must fail the bf16 rule; with test_engine.py's dense control). See docs/sglang.md for the expected times.
"""

import pytest

from mla_backend.demo import sglang_run, tiny_model
from tests.sglang_gpu import engine_runs
from tests.sglang_gpu.engine_runs import NAME, assert_not_uniform, check_close, tolerance

pytestmark = pytest.mark.gpu
PROMPT_LENS = [1, 2040, 2600, 3800]
HEADS = 16
INDEX_TOPK = 2048  # sgl-kernel's fast_topk_* assert topk == 2048
# SGLang's dsa backend with its kernels named, every prefill on them (FA3 is not in the kit)
_sglang_dsa = sglang_run.dsa_spec


# label -> overrides of engine_runs.BASE (also read by tests/sglang_cpu)
ENGINE_SPECS = {
    "dsa-flashmla_sparse-bf16": _sglang_dsa("flashmla_sparse", "flashmla_sparse", "bfloat16"),
    "dsa-flashmla_sparse-flashmla_kv-bf16":
        _sglang_dsa("flashmla_sparse", "flashmla_kv", "bfloat16"),
    "mla_backend-bf16": {"backend": NAME, "kv_cache_dtype": "bfloat16"},
    "dsa-flashmla_kv-fp8": _sglang_dsa("flashmla_kv", "flashmla_kv", "fp8_e4m3"),
    "dsa-flashmla_sparse-flashmla_kv-fp8": _sglang_dsa("flashmla_sparse", "flashmla_kv",
                                                       "fp8_e4m3"),
    "mla_backend-fp8": {"backend": NAME, "kv_cache_dtype": "fp8_e4m3"},
    # the negative control: ours eager, q's 64 RoPE dims zeroed in every sparse call
    # (tests/e2e/hooks.py's rope_dropped, installed in SGLang's scheduler process)
    "mla_backend-bf16-eager-rope_dropped": {"backend": NAME, "kv_cache_dtype": "bfloat16",
                                            "graphs": False,
                                            "worker_hooks": {"perturb": "rope_dropped"}},
}


def write_model(path: str) -> str:
    return tiny_model.write_checkpoint(path, arch="v32", heads=HEADS, layers=2,
                                       vocab=engine_runs.VOCAB, max_positions=8192,
                                       index_topk=INDEX_TOPK)


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    model = write_model(str(tmp_path_factory.mktemp("tiny-v32-h16")))
    return engine_runs.Engines("v32-h16", model, engine_runs.prompts(PROMPT_LENS), ENGINE_SPECS)


def _assert_ours_ran(result: dict, cache: str) -> None:
    # the DSA backend's line, logged by the scheduler when it builds our backend
    line = (f"{NAME}: DSA sparse attention on {NAME} kernels ({HEADS} query heads, "
            f"cache {cache}, index_topk {INDEX_TOPK},")
    assert line in result["log"], line


def _bf16_reference(v32) -> tuple[dict, float]:
    """The bf16 cache's reference run and the rule's tolerance (its yardstick's spread)."""
    ref = v32.run("dsa-flashmla_sparse-bf16")
    tol = tolerance("v32-h16 bf16: dsa flashmla_sparse vs flashmla_sparse prefill + flashmla_kv "
                    "decode (fp8-rounded keys in decode)", ref,
                    v32.run("dsa-flashmla_sparse-flashmla_kv-bf16"))
    return ref, tol


def test_e2e_v32_bf16_ours_matches_flashmla_sparse(v32):
    ref, tol = _bf16_reference(v32)
    assert_not_uniform("v32-h16 bf16", ref)
    ours = v32.run("mla_backend-bf16")
    _assert_ours_ran(ours, "bfloat16")
    check_close("v32-h16 bf16, decode graphs: mla_backend vs dsa flashmla_sparse", ours, ref,
                tol)


def test_e2e_v32_fp8_ours_matches_flashmla_kv(v32):
    ref = v32.run("dsa-flashmla_kv-fp8")
    assert_not_uniform("v32-h16 fp8", ref)
    tol = tolerance("v32-h16 fp8: dsa flashmla_kv vs flashmla_sparse prefill + flashmla_kv "
                    "decode", ref, v32.run("dsa-flashmla_sparse-flashmla_kv-fp8"))
    ours = v32.run("mla_backend-fp8")
    _assert_ours_ran(ours, "fp8 656-byte")
    check_close("v32-h16 fp8_e4m3, decode graphs: mla_backend vs dsa flashmla_kv", ours, ref,
                tol)


def test_negative_control_v32_rope_dropped(v32):
    # the bf16 rule must fail on a kernel that scores over the latent dims only
    # (`-k negative_control`: its own call; the references come from the run cache)
    ref, tol = _bf16_reference(v32)
    engine_runs.check_fails("v32-h16 negative control: mla_backend eager with RoPE dropped vs "
                            "dsa flashmla_sparse", v32.run("mla_backend-bf16-eager-rope_dropped"),
                            ref, tol)
