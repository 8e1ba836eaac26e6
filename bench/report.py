"""Render a results file as a markdown table (any bench's config columns) and, for dense
decode, a plot (µs vs mean seq_len per H) for docs/.

    python -m bench.report bench/results/dense_decode-h100-80gb-hbm3-2026-11-24.json \
        --png docs/img/dense_decode-h100-2026-11-24.png > table.md
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict


def table(results: dict) -> str:
    kernels: list[str] = []
    for row in results["rows"]:
        for k in row["us"]:
            if k not in kernels:
                kernels.append(k)
    config_keys: list[str] = []  # the config's own keys (dense: H, s_q, batch, seq_len, dtype)
    for row in results["rows"]:
        for k in row["config"]:
            if k not in config_keys:
                config_keys.append(k)
    head = config_keys + [f"{k} µs" for k in kernels] + [
        "ours TF/s", "ours GB/s", "ours / best peer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    speedups = []
    for row in results["rows"]:
        c = row["config"]
        cells = [str(c.get(k, "")) for k in config_keys]
        cells += [f"{row['us'][k]:.1f}" if k in row["us"] else "-" for k in kernels]
        sp = row.get("speedup_vs_best_peer")
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        cells += [fmt(row.get("tflops_ours"), ".0f"), fmt(row.get("gbs_ours"), ".0f"),
                  fmt(sp, ".2f")]
        if sp is not None:  # rows without ours or without a counted peer have none
            speedups.append(sp)
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    if speedups:
        geo = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
        lines.append(f"Geometric mean of ours / best peer: **{geo:.3f}** over the "
                     f"{len(speedups)} rows with a counted peer; worst row {min(speedups):.3f}; "
                     f"rows at or above 1.0: {sum(s >= 1.0 for s in speedups)}.")
    else:
        lines.append("No row has both ours and a counted peer.")
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = sorted({r["config"]["H"] for r in results["rows"]})
    fig, axes = plt.subplots(1, len(heads), figsize=(4.2 * len(heads), 3.8), squeeze=False)
    for ax, h in zip(axes[0], heads, strict=True):
        series: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        for r in results["rows"]:
            c = r["config"]
            if c["H"] != h or c["s_q"] != 1 or c["batch"] != 128:
                continue
            for k, us in r["us"].items():
                series[k][c["seq_len"]].append(us)
        for k, pts in series.items():
            xs = sorted(pts)
            ax.plot(xs, [sum(pts[x]) / len(pts[x]) for x in xs], marker="o", label=k,
                    linewidth=2.5 if k == "ours" else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"H={h}, s_q=1, batch 128")
        ax.set_xlabel("mean seq_len")
        ax.set_ylabel("µs per call")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"dense decode, {results['gpu']}, {results['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("results")
    ap.add_argument("--png", help="write the plot here")
    args = ap.parse_args()
    results = json.load(open(args.results))
    print(table(results))
    if args.png:
        plot(results, args.png)


if __name__ == "__main__":
    main()
