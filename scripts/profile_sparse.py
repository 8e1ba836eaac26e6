"""One sparse call of ours and of FlashMLA (when vLLM's kit is there) between
cudaProfilerStart/Stop, for Nsight Compute (`ncu --profile-from-start off ...`); inputs as in
bench.sparse.

    python3 scripts/profile_sparse.py prefill [H] [tokens] [s_kv]   (default 64 1024 8192)
    python3 scripts/profile_sparse.py decode [H] [s_q] [batch] [topk] [cache]
                                                     (default 64 1 128 2048 bf16)
"""

import sys

import torch

from bench import sparse


def case(argv: list[str]) -> sparse.Case:
    job, rest = (argv[0] if argv else "prefill"), argv[1:]
    if job == "prefill":
        H, tokens, s_kv = (int(a) for a in rest[:3] + ["64", "1024", "8192"][len(rest[:3]):])
        return sparse.make_prefill_case(H, tokens, 2048, s_kv, seed=1)
    if job == "decode":
        H, s_q, batch, topk = (int(a) for a in
                               rest[:4] + ["64", "1", "128", "2048"][len(rest[:4]):])
        cache = rest[4] if len(rest) > 4 else "bf16"
        return sparse.make_decode_case(H, s_q, batch, topk, 32768, cache, seed=1, pool={})
    raise SystemExit(f"job must be prefill or decode; got {job!r}")


def main() -> int:
    c = case(sys.argv[1:])
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
