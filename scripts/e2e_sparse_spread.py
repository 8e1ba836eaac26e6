"""Run-to-run spread of the sparse e2e case H = 16, index_topk 256 (docs/vllm.md).

GPU machine, vLLM kit installed, this package installed (scripts/gpu-e2e does both): runs
FLASHMLA_SPARSE and CUSTOM, each with CUDA graphs and eager, on the checkpoint, prompts and
engine settings of that case in tests/e2e (BASE and prompts below are
tests/e2e/harness.py's: keep them alike), and prints every pairwise comparison: how far the
indexer's top-k decisions move the logprobs between correct configurations. Engine logs go
to /tmp/e2e-spread, spread.json to $OUT (or the current folder).

    PYTHONPATH=/opt/vk/site:$PWD python3 scripts/e2e_sparse_spread.py
"""

import json
import os
import pathlib

import torch

from mla_backend.demo import engines, tiny_model

PROMPT_LENS = [1, 7, 64, 300, 1000, 3000]
BASE = {"mode": "graphs", "max_model_len": 4096, "max_num_seqs": 32, "max_num_batched_tokens": 1024,
        "gpu_memory_utilization": 0.3, "max_tokens": 12, "logprobs": 5}
ENGINES = [("FM-graphs", "FLASHMLA_SPARSE", "graphs"), ("FM-eager", "FLASHMLA_SPARSE", "eager"),
           ("CU-graphs", "CUSTOM", "graphs"), ("CU-eager", "CUSTOM", "eager")]
PAIRS = [("FM-graphs", "FM-eager"), ("CU-graphs", "CU-eager"), ("CU-graphs", "FM-graphs"),
         ("CU-eager", "FM-eager"), ("CU-eager", "FM-graphs"), ("CU-graphs", "FM-eager")]


def main() -> None:
    workdir = pathlib.Path("/tmp/e2e-spread")
    workdir.mkdir(exist_ok=True)
    model = workdir / "tiny-v32-h16-topk256"
    if not (model / "model.safetensors").exists():
        tiny_model.write_checkpoint(str(model), arch="v32", heads=16, layers=2, index_topk=256)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 2048, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    runs = {}
    for name, backend, mode in ENGINES:
        spec = dict(BASE, prompts=prompts, model=str(model), backend=backend, mode=mode)
        runs[name] = engines.run_engine(spec, str(workdir / f"{name}.log"), label=name,
                                        timeout_s=600)
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
