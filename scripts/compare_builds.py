"""Do two builds of the extension compute the same bits? Runs sparse prefill and sparse decode
over bf16 and fp8_ds_mla caches (H 16, 64, 100, 128; random indices with -1 and out-of-range
entries) and dense paged decode (bf16, fp16, per-tensor fp8; s_q 1, 2) on fixed inputs
with each build, in a process of its own, and compares outputs and lse bit for bit. For
changes meant to move time only (schedule, addressing, launch shape).

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
        # dense paged decode (bf16, fp16, per-tensor fp8), ragged lengths and a permuted
        # block table; s_q 1 and 2 run the wgmma seesaw at H >= 32 (64-row tiles)
        lens = torch.randint(2, 2000, (16,), device="cuda", generator=g, dtype=torch.int32)
        table = torch.randperm(16 * 32, device="cuda", generator=g).view(16, 32).to(torch.int32)
        pages = torch.randn(16 * 32, 64, 576, device="cuda", generator=g)
        for s_q in (1, 2):
            for dt, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
                qq = torch.randn(16, s_q, heads, 576, device="cuda", generator=g).to(dt)
                dplan = ops.plan_decode(lens, s_q, heads)
                res[f"dense {name} s_q={s_q} H={heads}"] = ops.mla_decode(
                    qq, pages.to(dt), table, lens, dplan, 576 ** -0.5)
            qq = torch.randn(16, s_q, heads, 576, device="cuda", generator=g).to(torch.bfloat16)
            fplan = ops.plan_decode(lens, s_q, heads, kv_cache_dtype=torch.float8_e4m3fn)
            res[f"dense fp8 s_q={s_q} H={heads}"] = ops.mla_decode(
                qq, (pages * 0.5).to(torch.float8_e4m3fn), table, lens, fplan, 576 ** -0.5,
                kv_scale=2.0)
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
