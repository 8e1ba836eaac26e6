"""One sparse prefill launch of ours and of FlashMLA (when vLLM's kit is there) between
cudaProfilerStart/Stop, for Nsight Compute (`ncu --profile-from-start off ...`).

    python3 scripts/profile_sparse_prefill.py [H] [tokens] [s_kv]
"""

import sys

import torch

from bench import sparse

H = int(sys.argv[1]) if len(sys.argv) > 1 else 64
tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
s_kv = int(sys.argv[3]) if len(sys.argv) > 3 else 8192
c = sparse.make_prefill_case(H, tokens, 2048, s_kv, seed=1)
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
