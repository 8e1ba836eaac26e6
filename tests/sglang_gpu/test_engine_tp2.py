"""Tensor parallelism 2: the tiny DeepSeek-V3 with 128 heads (test_engine_h128.py's model) through
sgl.Engine with tp_size 2, so each GPU decodes 64 heads, on mla_backend, SGLang's flashmla
and SGLang's triton backend, decode CUDA graphs on; needs 2 GPUs (skipped below, with the
count in the reason).

SGLang starts one scheduler process per rank; each loads the plugin from its entry point and
logs its own line, prefixed with its rank (`[... TP1] mla_backend: dense MLA decode ...`):
both ranks must name our backend with 64 heads. NVLink multicast stays off (the GPU machines'
rule) in NCCL, PyTorch and NVSHMEM, set here where the environment does not already say so.

Closeness rule and prompts as in test_engine_h128.py; the yardstick is flashmla against
triton at TP 2. Group: `bash scripts/gpu-sglang -k e2e_tp2` on a machine with 2 GPUs (three
engines, one 10-minute call).
"""

import os

import pytest
import torch

from tests.e2e.harness import NO_MULTICAST
from tests.sglang_gpu import engine_runs
from tests.sglang_gpu.engine_runs import NAME, assert_not_uniform, check_close, tolerance
from tests.sglang_gpu.test_engine_h128 import DENSE, HEADS, PROMPT_LENS, write_model

TP = 2
_GPUS = torch.cuda.device_count()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(_GPUS < TP, reason=f"tensor parallelism {TP} needs {TP} GPUs; "
                                                    f"this machine has {_GPUS}")]


# All-reduce through NCCL alone, for every backend alike: with multicast off (the GPU machines'
# rule), SGLang's default engine hangs right after FlashInfer's all-reduce-fusion workspace is
# set up. Attention is untouched by either setting.
PLAIN_ALL_REDUCE = {"enforce_disable_flashinfer_allreduce_fusion": True,
                    "disable_custom_all_reduce": True}


def _tp(backend: str) -> dict:
    env = {k: v for k, v in NO_MULTICAST.items() if k not in os.environ}
    return {"backend": backend, "env": env,
            "engine_args": dict(DENSE["engine_args"], tp_size=TP, **PLAIN_ALL_REDUCE)}


# label -> overrides of engine_runs.BASE (also read by tests/sglang_cpu)
ENGINE_SPECS = {f"{b}-tp{TP}": _tp(b) for b in ("flashmla", "triton", NAME)}


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    model = write_model(str(tmp_path_factory.mktemp("tiny-v3-h128-tp2")))
    return engine_runs.Engines("v3-h128", model, engine_runs.prompts(PROMPT_LENS), ENGINE_SPECS)


def test_e2e_tp2_ours_matches_flashmla(tp2):
    ref = tp2.run(f"flashmla-tp{TP}")
    assert_not_uniform(f"v3-h128 TP {TP}", ref)
    tol = tolerance(f"v3-h128 TP {TP}, decode graphs: flashmla vs triton", ref,
                    tp2.run(f"triton-tp{TP}"))
    ours = tp2.run(f"{NAME}-tp{TP}")
    heads = HEADS // TP
    for rank in range(TP):
        line = f" TP{rank}] {NAME}: dense MLA decode on {NAME} kernels ({heads} query heads,"
        assert line in ours["log"], line
    check_close(f"v3-h128 TP {TP}, decode graphs: mla_backend vs flashmla", ours, ref, tol)
