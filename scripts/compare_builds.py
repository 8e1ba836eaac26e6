"""Do two builds of the extension compute the same bits? Runs sparse prefill and sparse decode
over bf16 and fp8_ds_mla caches (H 16, 64, 100, 128; random indices with -1 and out-of-range
entries) on fixed inputs with each build, in a process of its own, and compares outputs and
lse bit for bit. For changes meant to move time only (schedule, addressing, launch shape).

    python3 scripts/compare_builds.py A/mla_backend/_C.abi3.so B/mla_backend/_C.abi3.so
"""

import os
import subprocess
import sys
import tempfile


def run_one(so: str, path: str) -> None:
    os.environ["MLA_BACKEND_EXTENSION"] = so
    import torch

    from mla_backend import formats, ops

    res = {}
    g = torch.Generator(device="cuda").manual_seed(123)
    for heads in (16, 64, 100, 128):
        kv = torch.randn(8192, 576, device="cuda", generator=g).to(torch.bfloat16)
        q = torch.randn(512, heads, 576, device="cuda", generator=g).to(torch.bfloat16)
        idx = torch.randint(-100, 8192 + 100, (512, 2048), device="cuda", generator=g,
                            dtype=torch.int32)
        res[f"prefill H={heads}"] = ops.sparse_mla_prefill(q, kv, idx, 576 ** -0.5)
        cache = torch.randn(200, 64, 576, device="cuda", generator=g).to(torch.bfloat16)
        qd = torch.randn(32, 2, heads, 576, device="cuda", generator=g).to(torch.bfloat16)
        idd = torch.randint(-10, 200 * 64 + 10, (32, 2, 2048), device="cuda", generator=g,
                            dtype=torch.int32)
        plan = ops.plan_sparse_decode(32, 2, heads, 2048, device="cuda")
        res[f"decode H={heads}"] = ops.sparse_mla_decode(qd, cache, idd, plan, 576 ** -0.5)
        packed = formats.quantize_fp8_ds_mla(cache[..., :512].contiguous(),
                                             cache[..., 512:].contiguous())
        res[f"fp8 decode H={heads}"] = ops.sparse_mla_decode(qd, packed, idd, plan, 576 ** -0.5)
    torch.save({k: (o.cpu(), lse.cpu()) for k, (o, lse) in res.items()}, path)


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--one":
        run_one(sys.argv[2], sys.argv[3])
        return 0
    a, b = sys.argv[1], sys.argv[2]
    with tempfile.TemporaryDirectory() as d:
        paths = [os.path.join(d, "a.pt"), os.path.join(d, "b.pt")]
        for so, path in zip((a, b), paths, strict=True):
            subprocess.run([sys.executable, __file__, "--one", so, path], check=True)
        import torch

        ra, rb = (torch.load(p) for p in paths)
    same = True
    word = {True: "identical", False: "DIFFERS"}
    for k in ra:
        out_eq = torch.equal(ra[k][0].view(torch.int16), rb[k][0].view(torch.int16))
        lse_eq = torch.equal(ra[k][1].view(torch.int32), rb[k][1].view(torch.int32))
        same &= out_eq and lse_eq
        print(f"{k:20s} out {word[out_eq]}, lse {word[lse_eq]}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
