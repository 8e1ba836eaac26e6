"""One sparse decode call of ours and of FlashMLA (when vLLM's kit is there) between
cudaProfilerStart/Stop, for Nsight Compute (`ncu --profile-from-start off ...`); inputs as
in bench.sparse (a 32k context per request).

    python3 scripts/profile_sparse_decode.py [H] [s_q] [batch] [topk] [bf16|fp8_ds_mla]
"""

import sys

import torch

from bench import sparse

args = sys.argv[1:5] + ["64", "1", "128", "2048"][len(sys.argv[1:5]):]
H, s_q, batch, topk = (int(a) for a in args)
cache = sys.argv[5] if len(sys.argv) > 5 else "bf16"
c = sparse.make_decode_case(H, s_q, batch, topk, 32768, cache, seed=1, pool={})
kernels = {"ours": sparse.build_ours(c)}
try:
    kernels["flashmla"] = sparse.build_flashmla(c)
except Exception as e:  # noqa: BLE001 - the peer is optional here
    print(f"flashmla not profiled: {e}")
for k in kernels.values():  # warm-up: module loads, plans
    k.step(0)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
for name, k in kernels.items():
    torch.cuda.nvtx.range_push(name)
    k.step(1)
    torch.cuda.nvtx.range_pop()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print("profiled:", ", ".join(kernels))
