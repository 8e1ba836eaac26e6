"""vLLM 0.25 on several GPUs: tensor parallelism (TP) and decode context parallelism (DCP) with
`--attention-backend CUSTOM`, against vLLM's own backends under the same parallel settings,
on tiny checkpoints whose weights make attention non-uniform. Skips itself below 2 CUDA GPUs
(the TP 4 case below 4). Engines, result cache, report and the closeness rule:
tests/e2e/harness.py; hooks in every worker: tests/e2e/worker_hooks.py.

What runs (DeepSeek-V3, 128 heads; DeepSeek-V3.2, 128 heads, index_topk 256):
- V3 at TP 2 (64 heads per GPU), FULL CUDA graphs: CUSTOM against FLASHMLA;
- V3 at TP 2 + DCP 2 (each rank holds every other token of the context; the decode kernel sees
  all 128 heads over its half and returns out and lse, which vLLM merges across the ranks),
  FULL graphs: CUSTOM against FLASHMLA under the same settings, and a negative control: the
  lse returned on DCP rank 1 shifted by 1 (that rank's keys weighted e times) must fail;
- V3 at TP 2 with n-gram speculation (3 drafts), eager so that the hooks see every kernel
  call: verification rows of 4 query tokens must reach ops.mla_decode in both ranks;
  against FLASHMLA without speculation (vLLM returns the target model's logprobs);
- V3.2 at TP 2, FULL graphs: CUSTOM on a bf16 and on an fp8_ds_mla cache against
  FLASHMLA_SPARSE on a bf16 cache (for fp8_ds_mla: with every cache write rounded through
  the fp8_ds_mla format, as tests/e2e/test_vllm_sparse.py does on one GPU);
- with 4 GPUs: V3 at TP 4 (32 heads per GPU), FULL graphs, CUSTOM against FLASHMLA.

Tolerances, as on one GPU: max(2 x the largest |logprob difference| between two built-in
backends on the same model, prompts and parallel settings -- FLASHMLA and TRITON_MLA for
V3, FLASHMLA_SPARSE and FLASH_ATTN_MLA_SPARSE for V3.2 -- , 0.02), top-5 overlap >= 0.6.
The reference's logprobs must be far from uniform (median top-1 logprob >= 1 nat above
-ln(vocab)), or agreement would mean nothing.

Every CUSTOM engine must show, for each worker rank, vLLM's line choosing the CUSTOM backend,
our metadata builder's line, and ops.mla_decode (or ops.sparse_mla_decode) calls. Workers
are spawned (harness), and engine_run registers nothing when the package's entry point is
installed: the plugin reaches each worker through its entry point only.

Prompts: 1, 9, 300 and 4100 tokens (the long one prefilled in chunks of 1024, and split
2050 / 2050 across the DCP ranks); 12 tokens each. Engines share the GPUs, up to
$E2E_PARALLEL_ENGINES at a time, each with a fixed 1 GiB KV cache.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from mla_backend.demo import engine_run, engines
from tests.e2e import harness, parallel
from tests.e2e.harness import check_close, check_fails, model, save

pytestmark = pytest.mark.e2e

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_2 = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs; this machine has {GPUS}")
needs_4 = pytest.mark.skipif(GPUS < 4, reason=f"needs 4 CUDA GPUs; this machine has {GPUS}")

PROMPT_LENS = [1, 9, 300, 4100]
FLOOR = 0.02
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
COMMON = {"max_model_len": 4224, "max_num_seqs": 8, "gpu_memory_utilization": 0.2,
          "kv_cache_memory_bytes": 1 << 30}


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(31)
    return [torch.randint(2, 2048, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _engines(workdir) -> dict[str, tuple[dict | None, dict]]:
    """Every engine of the module: key -> (hooks, spec), in the order they are started."""
    v3 = model(workdir, "v3", 128)
    v32 = model(workdir, "v32", 128, index_topk=256)
    base = dict(COMMON, prompts=_prompts())
    count = {"count": True}

    def eng(m, tp, backend, hooks=None, **spec):
        return hooks, dict(base, model=m, tensor_parallel_size=tp, backend=backend, **spec)

    return {
        "v3-h128-tp2-FLASHMLA-graphs": eng(v3, 2, "FLASHMLA"),
        "v3-h128-tp2-CUSTOM-graphs": eng(v3, 2, "CUSTOM", count),
        "v3-h128-tp2-TRITON_MLA-graphs": eng(v3, 2, "TRITON_MLA"),
        "v3-h128-tp2-dcp2-FLASHMLA-graphs": eng(v3, 2, "FLASHMLA",
                                                decode_context_parallel_size=2),
        "v3-h128-tp2-dcp2-CUSTOM-graphs": eng(v3, 2, "CUSTOM", count,
                                              decode_context_parallel_size=2),
        "v3-h128-tp2-dcp2-CUSTOM-eager-lse_shifted": eng(
            v3, 2, "CUSTOM", {"perturb": "lse_shifted_on_dcp_rank_1"}, mode="eager",
            decode_context_parallel_size=2),
        "v3-h128-tp2-CUSTOM-eager-ngram": eng(v3, 2, "CUSTOM", count, mode="eager",
                                              speculative=NGRAM),
        "v32-h128-tp2-FLASHMLA_SPARSE-graphs": eng(v32, 2, "FLASHMLA_SPARSE"),
        "v32-h128-tp2-FLASH_ATTN_MLA_SPARSE-graphs": eng(v32, 2, "FLASH_ATTN_MLA_SPARSE"),
        "v32-h128-tp2-CUSTOM-graphs": eng(v32, 2, "CUSTOM", count),
        "v32-h128-tp2-CUSTOM-graphs-fp8_ds_mla": eng(v32, 2, "CUSTOM", count,
                                                     kv_cache_dtype="fp8_ds_mla"),
        "v32-h128-tp2-FLASHMLA_SPARSE-graphs-rounded_fp8_ds_mla": eng(
            v32, 2, "FLASHMLA_SPARSE", {"round_cache_to": "fp8_ds_mla"}),
        "v3-h128-tp4-FLASHMLA-graphs": eng(v3, 4, "FLASHMLA"),
        "v3-h128-tp4-CUSTOM-graphs": eng(v3, 4, "CUSTOM", count),
        "v3-h128-tp4-TRITON_MLA-graphs": eng(v3, 4, "TRITON_MLA"),
    }


# the engines each test reads (the module fixture starts those of the selected tests)
NEEDS = {
    "test_tp2_custom_matches_flashmla_with_cuda_graphs": [
        "v3-h128-tp2-FLASHMLA-graphs", "v3-h128-tp2-CUSTOM-graphs",
        "v3-h128-tp2-TRITON_MLA-graphs"],
    "test_tp2_dcp2_custom_matches_flashmla": [
        "v3-h128-tp2-FLASHMLA-graphs", "v3-h128-tp2-TRITON_MLA-graphs",
        "v3-h128-tp2-dcp2-FLASHMLA-graphs", "v3-h128-tp2-dcp2-CUSTOM-graphs"],
    "test_tp2_dcp2_negative_control_lse_shifted_on_one_rank": [
        "v3-h128-tp2-FLASHMLA-graphs", "v3-h128-tp2-TRITON_MLA-graphs",
        "v3-h128-tp2-dcp2-FLASHMLA-graphs", "v3-h128-tp2-dcp2-CUSTOM-eager-lse_shifted"],
    "test_tp2_spec_decode_ngram": [
        "v3-h128-tp2-FLASHMLA-graphs", "v3-h128-tp2-TRITON_MLA-graphs",
        "v3-h128-tp2-CUSTOM-eager-ngram"],
    "test_tp2_sparse_custom_matches_flashmla_sparse": [
        "v32-h128-tp2-FLASHMLA_SPARSE-graphs", "v32-h128-tp2-FLASH_ATTN_MLA_SPARSE-graphs",
        "v32-h128-tp2-CUSTOM-graphs", "v32-h128-tp2-CUSTOM-graphs-fp8_ds_mla",
        "v32-h128-tp2-FLASHMLA_SPARSE-graphs-rounded_fp8_ds_mla"],
    "test_tp4_custom_matches_flashmla": [
        "v3-h128-tp4-FLASHMLA-graphs", "v3-h128-tp4-CUSTOM-graphs",
        "v3-h128-tp4-TRITON_MLA-graphs"],
}


@pytest.fixture(scope="module", autouse=True)
def started(request, workdir):
    """Start the engines of this module's selected tests in the background, in the order of
    _engines (the TP 2 dense comparisons first), the TP 4 ones only with 4 GPUs."""
    selected = {item.originalname for item in request.session.items
                if item.module is request.module}
    keys = {k for name in selected for k in NEEDS.get(name, [])}
    if GPUS < 2 or not keys or not engine_run.entry_point_installed():
        return
    for key, (hooks, spec) in _engines(workdir).items():
        if key in keys and spec["tensor_parallel_size"] <= GPUS:
            harness.start(workdir, key, hooks, **spec)


def _run(workdir, key: str) -> dict:
    assert engine_run.entry_point_installed(), (
        "pip install this package on the GPU machine first: every worker must get the "
        "plugin from its entry point (bash scripts/gpu-e2e does it)")
    hooks, spec = _engines(workdir)[key]
    return harness.run(workdir, key, hooks, **spec)


def _vocab(res: dict) -> int:
    with open(pathlib.Path(res["spec"]["model"]) / "config.json") as f:
        return json.load(f)["vocab_size"]


def _tolerance(workdir, ref_key: str, peer_key: str) -> tuple[dict, float]:
    """The reference's result and the tolerance: max(2 x its spread against the peer, FLOOR);
    the reference must be far from uniform."""
    ref, peer = _run(workdir, ref_key), _run(workdir, peer_key)
    gap = parallel.above_uniform(ref["outputs"], _vocab(ref))
    spread = engines.compare(ref["outputs"], peer["outputs"])
    save(f"{ref_key} vs {peer_key}", dict(spread, reference_above_uniform_nats=gap))
    assert gap >= parallel.MIN_ABOVE_UNIFORM, (
        f"{ref_key}: median top-1 logprob only {gap:.3f} nats above uniform: a comparison on "
        f"this model proves nothing")
    return ref, max(2 * spread["max_abs_logprob_diff"], FLOOR)


def _assert_ours_in_every_rank(res: dict, tp: int, dcp: int = 1, *, builder: str,
                               sparse: bool = False) -> None:
    """vLLM chose CUSTOM in every worker rank, our builder logged `builder` in each, and each
    rank's hooks saw our kernel called."""
    log = res["log"]
    for text in (parallel.CUSTOM_SELECTED, builder):
        missing = parallel.missing_ranks(log, text, tp, dcp)
        assert not missing, (f"no {text!r} line from {missing}; ranks that printed it: "
                             f"{parallel.ranks_logging(log, text)}")
    by_rank = res.get("hooks_by_rank") or {}
    assert sorted(by_rank) == sorted(parallel.rank_names(tp, dcp)), sorted(by_rank)
    for name, rep in by_rank.items():
        calls = rep["sparse_mla_decode_calls"] if sparse else (
            sum(rep["mla_decode_calls_by_s_q"].values())
            + sum(rep["mla_decode_captured_by_s_q"].values()))
        assert calls > 0, (name, rep)


def _dense_builder(heads: int) -> str:
    return f"mla_backend: dense MLA decode on MLA_BACKEND kernels ({heads} query heads"


@needs_2
def test_tp2_custom_matches_flashmla_with_cuda_graphs(workdir):
    ref, tol = _tolerance(workdir, "v3-h128-tp2-FLASHMLA-graphs", "v3-h128-tp2-TRITON_MLA-graphs")
    ours = _run(workdir, "v3-h128-tp2-CUSTOM-graphs")
    _assert_ours_in_every_rank(ours, 2, builder=_dense_builder(64))
    assert "FULL" in ours["cudagraph_mode"]
    check_close("v3-h128 TP2 graphs: CUSTOM vs FLASHMLA", ours, ref, tol)


@needs_2
def test_tp2_dcp2_custom_matches_flashmla(workdir):
    """Each rank decodes all 128 heads (64 per TP rank, all-gathered over DCP) over its half
    of the context; vLLM merges the two halves by the lse each rank returns."""
    _, tol = _tolerance(workdir, "v3-h128-tp2-FLASHMLA-graphs", "v3-h128-tp2-TRITON_MLA-graphs")
    peer = _run(workdir, "v3-h128-tp2-dcp2-FLASHMLA-graphs")
    ours = _run(workdir, "v3-h128-tp2-dcp2-CUSTOM-graphs")
    _assert_ours_in_every_rank(ours, 2, 2, builder=_dense_builder(128))
    assert "FULL" in ours["cudagraph_mode"]
    save("v3-h128 TP2 DCP2: FLASHMLA DCP2 vs FLASHMLA without DCP (for the record)",
         engines.compare(peer["outputs"], _run(workdir, "v3-h128-tp2-FLASHMLA-graphs")["outputs"]))
    check_close("v3-h128 TP2 DCP2 graphs: CUSTOM vs FLASHMLA", ours, peer, tol)


@needs_2
def test_tp2_dcp2_negative_control_lse_shifted_on_one_rank(workdir):
    """The DCP comparison fails on a wrong lse: CUSTOM (eager) whose lse on DCP rank 1 is 1
    too large, against FLASHMLA with DCP 2."""
    _, tol = _tolerance(workdir, "v3-h128-tp2-FLASHMLA-graphs", "v3-h128-tp2-TRITON_MLA-graphs")
    peer = _run(workdir, "v3-h128-tp2-dcp2-FLASHMLA-graphs")
    wrong = _run(workdir, "v3-h128-tp2-dcp2-CUSTOM-eager-lse_shifted")
    by_rank = wrong["hooks_by_rank"]
    assert by_rank["Worker_TP1_DCP1"]["perturbed_calls"] > 0, by_rank
    assert by_rank["Worker_TP0_DCP0"]["perturbed_calls"] == 0, by_rank
    check_fails("v3-h128 TP2 DCP2 negative control: CUSTOM with lse + 1 on DCP rank 1 vs "
                "FLASHMLA", wrong, peer, tol)


@needs_2
def test_tp2_spec_decode_ngram(workdir):
    ref, tol = _tolerance(workdir, "v3-h128-tp2-FLASHMLA-graphs", "v3-h128-tp2-TRITON_MLA-graphs")
    ours = _run(workdir, "v3-h128-tp2-CUSTOM-eager-ngram")
    _assert_ours_in_every_rank(ours, 2, builder=_dense_builder(64))
    assert parallel.missing_ranks(ours["log"], "up to 4 query tokens per request", 2) == []
    by_rank = {name: rep["mla_decode_calls_by_s_q"]
               for name, rep in ours["hooks_by_rank"].items()}
    save("v3-h128 TP2 ngram: CUSTOM ops.mla_decode calls by query tokens per request, by rank",
         by_rank)
    for name, calls in by_rank.items():
        assert sum(n for s_q, n in calls.items() if int(s_q) > 1) > 0, (name, calls)
    check_close("v3-h128 TP2 ngram: CUSTOM eager vs FLASHMLA graphs without speculation",
                ours, ref, tol)


@needs_2
def test_tp2_sparse_custom_matches_flashmla_sparse(workdir):
    ref, tol = _tolerance(workdir, "v32-h128-tp2-FLASHMLA_SPARSE-graphs",
                          "v32-h128-tp2-FLASH_ATTN_MLA_SPARSE-graphs")
    builder = "mla_backend: sparse MLA (DSA) on MLA_BACKEND kernels (64 query heads"
    ours = _run(workdir, "v32-h128-tp2-CUSTOM-graphs")
    _assert_ours_in_every_rank(ours, 2, builder=builder, sparse=True)
    ours8 = _run(workdir, "v32-h128-tp2-CUSTOM-graphs-fp8_ds_mla")
    _assert_ours_in_every_rank(ours8, 2, builder=builder, sparse=True)
    assert parallel.missing_ranks(ours8["log"], "cache fp8_ds_mla", 2) == []
    rounded = _run(workdir, "v32-h128-tp2-FLASHMLA_SPARSE-graphs-rounded_fp8_ds_mla")
    writes = {n: r["rounded_cache_writes"] for n, r in rounded["hooks_by_rank"].items()}
    assert sorted(writes) == parallel.rank_names(2) and all(writes.values()), writes
    save("v32-h128 TP2: FLASHMLA_SPARSE on the fp8_ds_mla-rounded vs bf16 cache (for the "
         "record)", engines.compare(rounded["outputs"], ref["outputs"]))
    failed = []
    for name, got, peer in [
            ("v32-h128 TP2 graphs: CUSTOM bf16 vs FLASHMLA_SPARSE", ours, ref),
            ("v32-h128 TP2 graphs: CUSTOM fp8_ds_mla vs FLASHMLA_SPARSE on the fp8_ds_mla-"
             "rounded bf16 cache", ours8, rounded)]:
        try:
            check_close(name, got, peer, tol)
        except AssertionError as e:  # both comparisons reach the report
            failed.append(str(e))
    assert not failed, failed


@needs_4
def test_tp4_custom_matches_flashmla(workdir):
    ref, tol = _tolerance(workdir, "v3-h128-tp4-FLASHMLA-graphs", "v3-h128-tp4-TRITON_MLA-graphs")
    ours = _run(workdir, "v3-h128-tp4-CUSTOM-graphs")
    _assert_ours_in_every_rank(ours, 4, builder=_dense_builder(32))
    assert "FULL" in ours["cudagraph_mode"]
    check_close("v3-h128 TP4 graphs: CUSTOM vs FLASHMLA", ours, ref, tol)
