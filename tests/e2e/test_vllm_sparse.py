"""vLLM (0.25 or 0.33) with `--attention-backend CUSTOM` on a tiny DeepSeek-V3.2 checkpoint (sparse
attention: a lightning indexer picks index_topk keys per token) against vLLM's two sparse MLA
backends for Hopper, FLASHMLA_SPARSE and FLASH_ATTN_MLA_SPARSE (FlashAttention 3 over the
top-k slots; vLLM's first choice on Hopper), on the same prompts. Engines, prompts, result
cache, report and the closeness rule: tests/e2e/harness.py; test-only hooks in the engines:
tests/e2e/hooks.py.

Prompts of 1 to 8200 tokens: shorter and longer than index_topk (256 and 2048), in one batch
with max_num_batched_tokens 1024 (steps mix prefills and decodes; chunked prefill).

Tolerance, as the dense tier's: the largest |logprob difference| over the top-5 tokens of
every compared position, CUSTOM against FLASHMLA_SPARSE, must be within max(2 x the same
number between FLASHMLA_SPARSE and FLASH_ATTN_MLA_SPARSE -- two correct built-in backends,
same model, prompts and mode -- , 0.02), and the top-5 overlap >= 0.6 (0.02: under one bf16
step of the logits, 0.031 at magnitude 4 to 8).
The indexer quantizes its q and k to fp8 and keeps the top index_topk scores, so a
bf16-level difference in one layer's output can swap keys at the top-k boundary in the next
and move logprobs by more than any kernel's rounding; the peers' spread measures that effect
on this model and these prompts. The kernel itself is held to the float32 reference by the
gpu tier.

fp8_ds_mla: no backend of vLLM 0.25 runs it on Hopper (FLASHMLA_SPARSE stops at the cache
reshape, see docs/vllm.md; FLASH_ATTN_MLA_SPARSE takes 16-bit caches only). The peer is
FLASHMLA_SPARSE on a bf16 cache whose every write is rounded through the fp8_ds_mla format
as the installed vLLM's writer quantizes it (tests/e2e/hooks.py, round_cache_to): it attends
over the values an fp8_ds_mla cache holds (rounded to bf16), so CUSTOM on a real fp8_ds_mla
cache must meet it within the same tolerance.

Negative control: CUSTOM with a deliberately wrong kernel (scores without the 64 RoPE dims)
must fail the same rule.
"""

import pytest

from mla_backend.demo import engines
from tests.e2e.harness import check_close, check_fails, model, run, save

pytestmark = pytest.mark.e2e
FLOOR = 0.02


def _model(workdir, topk, heads=16):
    return model(workdir, "v32", heads, index_topk=topk)


def _tolerance(workdir, m, tag):
    """FLASHMLA_SPARSE's result (FULL graphs) and the tolerance: max(2 x its spread against
    FLASH_ATTN_MLA_SPARSE, FLOOR)."""
    fs = run(workdir, f"{tag}-FLASHMLA_SPARSE-graphs", model=m, backend="FLASHMLA_SPARSE")
    fa = run(workdir, f"{tag}-FLASH_ATTN_MLA_SPARSE-graphs", model=m,
             backend="FLASH_ATTN_MLA_SPARSE")
    spread = engines.compare(fs["outputs"], fa["outputs"])
    save(f"{tag}: FLASHMLA_SPARSE vs FLASH_ATTN_MLA_SPARSE", spread)
    return fs, max(2 * spread["max_abs_logprob_diff"], FLOOR)


def _assert_ours(res):
    assert "Using AttentionBackendEnum.CUSTOM backend" in res["log"]
    assert "mla_backend: sparse MLA (DSA) on MLA_BACKEND kernels" in res["log"]


# index_topk 2048 (DeepSeek-V3.2's own) with prompts up to 8200 tokens: top-k of 4x as many keys
@pytest.mark.parametrize("topk", [256, 2048])
def test_custom_matches_flashmla_sparse(workdir, topk):
    m = _model(workdir, topk)
    peer, tol = _tolerance(workdir, m, f"v32-h16-topk{topk}")
    ours = run(workdir, f"v32-h16-topk{topk}-CUSTOM-graphs", model=m, backend="CUSTOM")
    _assert_ours(ours)
    assert f"index_topk {topk}," in ours["log"]
    assert "FULL" in ours["cudagraph_mode"]
    check_close(f"v32-h16-topk{topk}-graphs: CUSTOM vs FLASHMLA_SPARSE", ours, peer, tol)


def test_custom_eager_h128(workdir):
    m = _model(workdir, 256, heads=128)
    peer, tol = _tolerance(workdir, m, "v32-h128-topk256")
    ours = run(workdir, "v32-h128-topk256-CUSTOM-eager", model=m, backend="CUSTOM",
               mode="eager")
    _assert_ours(ours)
    check_close("v32-h128-topk256: CUSTOM eager vs FLASHMLA_SPARSE graphs", ours, peer, tol)


# H = 128: the fp8_ds_mla kernel's two row tiles run as a 2-CTA cluster (inside CUDA graphs)
@pytest.mark.parametrize("heads", [16, 128])
def test_fp8_ds_mla_cache(workdir, heads):
    m = _model(workdir, 256, heads=heads)
    tag = f"v32-h{heads}-topk256"
    peer_bf16, tol = _tolerance(workdir, m, tag)
    rounded = run(workdir, f"{tag}-FLASHMLA_SPARSE-graphs-rounded_fp8_ds_mla", model=m,
                  backend="FLASHMLA_SPARSE", hooks={"round_cache_to": "fp8_ds_mla"})
    assert rounded["hooks"]["rounded_cache_writes"] > 0, rounded["hooks"]
    ours = run(workdir, f"{tag}-CUSTOM-graphs-fp8_ds_mla", model=m, backend="CUSTOM",
               kv_cache_dtype="fp8_ds_mla")
    _assert_ours(ours)
    assert "cache fp8_ds_mla" in ours["log"]
    # for the record: how far the fp8_ds_mla rounding moves this model
    save(f"{tag}: FLASHMLA_SPARSE on fp8_ds_mla-rounded vs bf16 cache",
         engines.compare(rounded["outputs"], peer_bf16["outputs"]))
    check_close(f"{tag}: CUSTOM fp8_ds_mla vs FLASHMLA_SPARSE on the fp8_ds_mla-rounded bf16 "
                "cache", ours, rounded, tol)


def test_negative_control_sparse(workdir):
    """The rule above fails on a wrong kernel: CUSTOM (eager) scoring over the 512 latent dims
    only (q's RoPE dims zeroed), against FLASHMLA_SPARSE."""
    m = _model(workdir, 256)
    peer, tol = _tolerance(workdir, m, "v32-h16-topk256")
    wrong = run(workdir, "v32-h16-topk256-CUSTOM-eager-rope_dropped", model=m,
                backend="CUSTOM", mode="eager", hooks={"perturb": "rope_dropped"})
    _assert_ours(wrong)
    assert wrong["hooks"]["perturbed_calls"] > 0, wrong["hooks"]
    check_fails("v32-h16-topk256 negative control: CUSTOM without the RoPE dims vs "
                "FLASHMLA_SPARSE", wrong, peer, tol)
