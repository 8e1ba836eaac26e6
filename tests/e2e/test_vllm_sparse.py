"""vLLM 0.25 with `--attention-backend CUSTOM` on a tiny DeepSeek-V3.2 checkpoint (sparse
attention: a lightning indexer picks index_topk keys per token) against FLASHMLA_SPARSE on
the same prompts. Same harness as test_vllm_dense.py (engines in their own processes,
results cached in $E2E_CACHE_DIR, comparisons in $E2E_REPORT).

Prompts of 1 to 3000 tokens: shorter and longer than index_topk (256 and 2048), in one batch
with max_num_batched_tokens 1024 (steps mix prefills and decodes; chunked prefill).

Tolerance (stated in docs/vllm.md): max |top-5 logprob difference| <= 0.05 with a bf16
cache. There is no second sparse backend on Hopper to measure the spread between two correct
implementations (the dense tests' rule); 0.05 is 1.6x the largest dense CUSTOM-vs-FLASHMLA
difference measured on the same tiny-model family (0.031), leaving room for the indexer's
top-k to part on near-ties once layer 0's outputs differ at bf16 level. fp8_ds_mla cache:
ours vs FLASHMLA_SPARSE on a bf16 cache within 0.15 (the dense per-tensor fp8 cache measured
0.11 against bf16; fp8_ds_mla has finer scales).
"""

import pytest

from tests.e2e import test_vllm_dense as dense

pytestmark = pytest.mark.e2e
workdir = dense.workdir  # the same session fixture (one cache directory)
TOL_BF16, TOL_FP8 = 0.05, 0.15


def _model(workdir, topk, heads=16):
    from mla_backend import tiny_model

    path = workdir / f"tiny-v32-h{heads}-topk{topk}"
    if not (path / "model.safetensors").exists():
        tiny_model.write_checkpoint(str(path), arch="v32", heads=heads, layers=2,
                                    index_topk=topk)
    return str(path)


def _assert_ours(res):
    assert "Using AttentionBackendEnum.CUSTOM backend" in res["log"]
    assert "mla_backend: sparse MLA (DSA) on MLA_BACKEND kernels" in res["log"]


@pytest.mark.parametrize("topk", [256, 2048])
def test_custom_matches_flashmla_sparse(workdir, topk):
    model = _model(workdir, topk)
    peer = dense._run(workdir, f"v32-h16-topk{topk}-FLASHMLA_SPARSE-graphs", model=model,
                      backend="FLASHMLA_SPARSE")
    ours = dense._run(workdir, f"v32-h16-topk{topk}-CUSTOM-graphs", model=model,
                      backend="CUSTOM")
    _assert_ours(ours)
    assert "FULL" in ours["cudagraph_mode"]
    dense._check_close(f"v32-h16-topk{topk}-graphs: CUSTOM vs FLASHMLA_SPARSE", ours, peer,
                       TOL_BF16)


def test_custom_eager_h128(workdir):
    model = _model(workdir, 256, heads=128)
    peer = dense._run(workdir, "v32-h128-topk256-FLASHMLA_SPARSE-graphs", model=model,
                      backend="FLASHMLA_SPARSE")
    ours = dense._run(workdir, "v32-h128-topk256-CUSTOM-eager", model=model, backend="CUSTOM",
                      mode="eager")
    _assert_ours(ours)
    dense._check_close("v32-h128-topk256: CUSTOM eager vs FLASHMLA_SPARSE graphs", ours, peer,
                       TOL_BF16)


def test_fp8_ds_mla_cache(workdir):
    model = _model(workdir, 256)
    peer = dense._run(workdir, "v32-h16-topk256-FLASHMLA_SPARSE-graphs", model=model,
                      backend="FLASHMLA_SPARSE")
    ours = dense._run(workdir, "v32-h16-topk256-CUSTOM-graphs-fp8_ds_mla", model=model,
                      backend="CUSTOM", kv_cache_dtype="fp8_ds_mla")
    _assert_ours(ours)
    assert "cache fp8_ds_mla" in ours["log"]
    dense._check_close("v32-h16-topk256: CUSTOM fp8_ds_mla vs FLASHMLA_SPARSE bf16", ours,
                       peer, TOL_FP8)
