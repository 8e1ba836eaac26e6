"""Run-to-run spread of the sparse e2e case H = 16, index_topk 256 (docs/vllm.md).

GPU machine, vLLM kit installed, this package installed (scripts/gpu-e2e does both): runs
FLASHMLA_SPARSE and CUSTOM, each with CUDA graphs and eager (cached in $E2E_CACHE_DIR when
set), and prints every pairwise comparison: how far the indexer's top-k decisions move the
logprobs between correct configurations. Writes spread.json to $OUT (or the current folder).

    PYTHONPATH=/opt/vk/site:$PWD python3 scripts/e2e_sparse_spread.py
"""

import json
import os
import pathlib

from mla_backend.demo import engines
from tests.e2e import test_vllm_dense as dense
from tests.e2e import test_vllm_sparse as sparse

ENGINES = [("FM-graphs", "FLASHMLA_SPARSE", "graphs"), ("FM-eager", "FLASHMLA_SPARSE", "eager"),
           ("CU-graphs", "CUSTOM", "graphs"), ("CU-eager", "CUSTOM", "eager")]
PAIRS = [("FM-graphs", "FM-eager"), ("CU-graphs", "CU-eager"), ("CU-graphs", "FM-graphs"),
         ("CU-eager", "FM-eager"), ("CU-eager", "FM-graphs"), ("CU-graphs", "FM-eager")]


def main() -> None:
    workdir = pathlib.Path("/tmp/e2e-work")
    workdir.mkdir(exist_ok=True)
    model = sparse._model(workdir, 256)
    runs = {name: dense._run(workdir, f"v32-h16-topk256-{backend}-{mode}", model=model,
                             backend=backend, mode=mode)
            for name, backend, mode in ENGINES}
    out = {}
    for a, b in PAIRS:
        c = engines.compare(runs[a]["outputs"], runs[b]["outputs"])
        out[f"{a} vs {b}"] = c
        print(f"{a:10s} vs {b:10s}: max|dlp| {c['max_abs_logprob_diff']:.4f}  "
              f"positions {c['positions_compared']}  overlap {c['min_topk_overlap']:.2f}  "
              f"matching {c['matching_tokens']}/{c['total_tokens']}")
    with open(os.path.join(os.environ.get("OUT", "."), "spread.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
