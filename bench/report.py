"""Render a results file as a markdown table (any bench's config columns) and, for dense
decode, a plot (µs vs mean seq_len per H; per layer where the file has per-layer times) for
docs/.

    python -m bench.report bench/results/dense_decode-h100-80gb-hbm3-2026-11-24.json \
        --png docs/img/dense_decode-h100-2026-11-24.png > table.md
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict


def _geomean_line(speedups: list[float], what: str = "") -> str:
    """The geometric mean, worst row and rows >= 1.0 of one speedup column; `what` names
    the column where a file has two."""
    what = f" {what}" if what else ""
    if not speedups:
        return f"No row has both ours and a counted peer{what}."
    geo = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
    return (f"Geometric mean of ours / best peer{what}: **{geo:.3f}** over the "
            f"{len(speedups)} rows with a counted peer; worst row {min(speedups):.3f}; "
            f"rows at or above 1.0: {sum(s >= 1.0 for s in speedups)}.")


def table(results: dict) -> str:
    """Files with per-layer times (dense decode): a kernel's cell is 'per layer (per call)'
    where its per-step metadata was timed, TF/s and GB/s are ours per layer, and both
    speedups follow, per layer first."""
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
    per_layer = any("us_per_layer" in row for row in results["rows"])
    if per_layer:
        head = config_keys + [f"{k} µs per layer (per call)" for k in kernels] + [
            "ours TF/s per layer", "ours GB/s per layer", "ours / best peer per layer",
            "ours / best peer per call"]
    else:
        head = config_keys + [f"{k} µs" for k in kernels] + [
            "ours TF/s", "ours GB/s", "ours / best peer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    speedups: list[float] = []
    speedups_layer: list[float] = []
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for row in results["rows"]:
        c = row["config"]
        cells = [str(c.get(k, "")) for k in config_keys]
        sp = row.get("speedup_vs_best_peer")
        if sp is not None:  # rows without ours or without a counted peer have none
            speedups.append(sp)
        if per_layer:
            layer, only = row.get("us_per_layer", {}), row.get("us_kernel_only", {})
            for k in kernels:
                if k not in row["us"]:
                    cells.append("-")
                elif k in only:
                    cells.append(f"{layer[k]:.1f} ({row['us'][k]:.1f})")
                else:
                    cells.append(f"{row['us'][k]:.1f}")
            sp_layer = row.get("speedup_vs_best_peer_per_layer")
            if sp_layer is not None:
                speedups_layer.append(sp_layer)
            cells += [fmt(row.get("tflops_ours_per_layer"), ".0f"),
                      fmt(row.get("gbs_ours_per_layer"), ".0f"), fmt(sp_layer, ".2f"),
                      fmt(sp, ".2f")]
        else:
            cells += [f"{row['us'][k]:.1f}" if k in row["us"] else "-" for k in kernels]
            cells += [fmt(row.get("tflops_ours"), ".0f"), fmt(row.get("gbs_ours"), ".0f"),
                      fmt(sp, ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    if per_layer:
        layers = results.get("layers_per_step", "the model's")
        lines.append(_geomean_line(speedups_layer, f"per layer (per-step metadata amortized "
                                                   f"over {layers} layers)"))
        lines.append("")
        lines.append(_geomean_line(speedups, "per call (metadata in every call)"))
        meta = results.get("per_step_metadata", {})
        if meta:
            lines.append("")
            lines.append("Per-step metadata: " + "; ".join(f"{k}: {v}" for k, v in meta.items())
                         + ".")
    else:
        lines.append(_geomean_line(speedups))
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = sorted({r["config"]["H"] for r in results["rows"]})
    per_layer = any("us_per_layer" in r for r in results["rows"])  # per-layer times plotted
    fig, axes = plt.subplots(1, len(heads), figsize=(4.2 * len(heads), 3.8), squeeze=False)
    for ax, h in zip(axes[0], heads, strict=True):
        series: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        for r in results["rows"]:
            c = r["config"]
            if c["H"] != h or c["s_q"] != 1 or c["batch"] != 128:
                continue
            for k, us in r.get("us_per_layer", r["us"]).items():
                series[k][c["seq_len"]].append(us)
        for k, pts in series.items():
            xs = sorted(pts)
            ax.plot(xs, [sum(pts[x]) / len(pts[x]) for x in xs], marker="o", label=k,
                    linewidth=2.5 if k == "ours" else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"H={h}, s_q=1, batch 128")
        ax.set_xlabel("mean seq_len")
        ax.set_ylabel("µs per layer" if per_layer else "µs per call")
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
