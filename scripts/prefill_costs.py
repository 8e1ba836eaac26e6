"""Where the sparse prefill's time goes, ours against FlashMLA (docs/kernels/sparse_decode.md,
"Where the H >= 64 prefill loses"). Two measurements, GPU machine, vLLM kit for the peer:

    python3 scripts/prefill_costs.py fit        # time against topk, fitted per SM
    python3 scripts/prefill_costs.py sustained [--s-kv N]  # 4 s loops, nvidia-smi sampled

fit: tokens = 1056 (8 whole tokens per SM at H = 64, 16 at H = 128 on 132 SMs), topk 512 to
2048, 8k keys; a straight line through time(topk) gives the cost of a 64-key unit and of a
piece (one token's setup, epilogue and pipeline refill) per SM.
sustained: each kernel in a loop for 4 s (the power cap and the clock settle), with
nvidia-smi sampling clock and power every 100 ms: cycles and energy per call.

    python3 scripts/prefill_costs.py builds A/_C.abi3.so B/_C.abi3.so [--rounds 2] [--s-kv 8192]

builds: ours alone, `sustained` once per build and round, each in a process of its own
(MLA_BACKEND_EXTENSION), H = 16 / 64 / 128 at s_kv keys (default 8k); a table of Mcycles per
call last. At the power cap, cycles per call vary ~1% between runs where the 40 ms bench rows
vary up to 13%.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common, sparse  # noqa: E402

KERNELS = (("ours", sparse.build_ours), ("flashmla", sparse.build_flashmla))


def kernels(c: sparse.Case):
    """(name, Kernel) for each kernel that builds on this case (the peer needs the vLLM kit)."""
    for name, build in KERNELS:
        try:
            yield name, build(c)
        except Exception as e:  # noqa: BLE001 - the peer is optional
            print(f"{name}: not run ({e})")


def fit(tokens: int = 1056, s_kv: int = 8192) -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for H in (64, 128):
        pts: dict[str, list[tuple[int, float]]] = {}
        for topk in (512, 1024, 1536, 2048):
            c = sparse.make_prefill_case(H, tokens, topk, s_kv, seed=3)
            for name, k in kernels(c):
                us = common.time_graph(k.step, c.nsets, budget_ms=40).us
                pts.setdefault(name, []).append((topk, us))
                print(f"H={H} topk={topk} {name} {us:.1f} us", flush=True)
            del c
            torch.cuda.empty_cache()
        pieces = tokens * (1 if H <= 64 else 2) / sms  # per SM
        for name, p in pts.items():
            mx = sum(x for x, _ in p) / len(p)
            my = sum(y for _, y in p) / len(p)
            slope = sum((x - mx) * (y - my) for x, y in p) / sum((x - mx) ** 2 for x, _ in p)
            icpt = my - slope * mx
            res = [round(y - icpt - slope * x, 1) for x, y in p]
            print(f"FIT H={H} {name}: {slope * 64 / pieces:.3f} us per 64-key unit, "
                  f"{icpt / pieces:.2f} us per piece (per SM; residuals {res} us)", flush=True)


def sustained(tokens: int = 4096, s_kv: int = 8192, seconds: float = 4.0,
              heads: tuple[int, ...] = (64, 128), only: str | None = None) -> list[dict]:
    """Prints one line per kernel and H; returns them as dicts (name, H, us, MHz, W, Mcycles)."""
    smi = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader",
         "-lms", "100"], stdout=subprocess.PIPE, text=True)
    phases = []
    for H in heads:
        c = sparse.make_prefill_case(H, tokens, 2048, s_kv, seed=1)
        for name, k in kernels(c):
            if only is not None and name != only:
                continue
            k.step(0)
            torch.cuda.synchronize()
            time.sleep(1.5)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0, n = time.time(), 0
            e0.record()
            while time.time() - t0 < seconds:
                for _ in range(10):
                    k.step(n % c.nsets)
                    n += 1
                torch.cuda.synchronize()
            e1.record()
            torch.cuda.synchronize()
            phases.append((name, H, t0 + 1.0, time.time(), e0.elapsed_time(e1) * 1e3 / n))
        del c
        torch.cuda.empty_cache()
    smi.terminate()
    samples = []
    for line in smi.communicate()[0].splitlines():
        stamp, clk, watt = (f.strip() for f in line.split(","))
        t = datetime.datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").astimezone().timestamp()
        samples.append((t, float(clk.split()[0]), float(watt.split()[0])))
    rows = []
    for name, H, a, b, us in phases:
        label = f"{name} H={H}"
        sel = [(c, w) for t, c, w in samples if a <= t <= b]
        if not sel:
            print(f"{label}: {us:.1f} us per call, no clock samples")
            continue
        clk = sum(c for c, _ in sel) / len(sel)
        watt = sum(w for _, w in sel) / len(sel)
        print(f"{label:16s} {us:8.1f} us per call  {clk:6.0f} MHz  {watt:5.0f} W  "
              f"{us * clk / 1e6:7.3f} Mcycles per call  {watt * us / 1e3:7.1f} mJ per call")
        rows.append({"name": name, "H": H, "us": us, "mhz": clk, "w": watt,
                     "mcycles": us * clk / 1e6})
    return rows


BUILD_HEADS = (16, 64, 128)
RESULT = "RESULT "  # sustained-ours: the line `builds` reads back


def builds(sos: list[str], rounds: int, s_kv: int = 8192) -> None:
    """`sustained` for ours, per build and round in a process of its own; Mcycles per call."""
    table: dict[tuple[str, int], list[float]] = {}
    for rnd in range(rounds):
        for so in sos:
            env = dict(os.environ, MLA_BACKEND_EXTENSION=so)
            out = subprocess.run([sys.executable, __file__, "sustained-ours", str(s_kv)], env=env,
                                 capture_output=True, text=True, check=False)
            print(f"== round {rnd} {so}\n{out.stdout}{out.stderr[-2000:]}", flush=True)
            for line in out.stdout.splitlines():
                if line.startswith(RESULT):
                    for r in json.loads(line[len(RESULT):]):
                        table.setdefault((so, r["H"]), []).append(r["mcycles"])
    print(f"Mcycles per call (4096 tokens, topk 2048, s_kv {s_kv}; one value per round)")
    for H in BUILD_HEADS:
        for so in sos:
            vals = table.get((so, H), [])
            print(f"H={H:<4d} {so:50s} " + " ".join(f"{v:6.3f}" for v in vals))


def pop_int(args: list[str], flag: str, default: int) -> int:
    """The value of `flag N` in args (removed from them), or default."""
    if flag not in args:
        return default
    i = args.index(flag)
    value = int(args[i + 1])
    del args[i:i + 2]
    return value


def main() -> int:
    what = sys.argv[1] if len(sys.argv) > 1 else "fit"
    args = sys.argv[2:]
    if what == "fit":
        fit()
    elif what == "sustained":
        sustained(s_kv=pop_int(args, "--s-kv", 8192))
    elif what == "sustained-ours":
        s_kv = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
        print(RESULT + json.dumps(sustained(s_kv=s_kv, heads=BUILD_HEADS, only="ours")))
    elif what == "builds":
        rounds, s_kv = pop_int(args, "--rounds", 2), pop_int(args, "--s-kv", 8192)
        if not args:
            raise SystemExit("usage: prefill_costs.py builds SO [SO ...] [--rounds N] [--s-kv N]")
        builds(args, rounds, s_kv)
    else:
        raise SystemExit(f"usage: prefill_costs.py fit|sustained|builds; got {what!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
