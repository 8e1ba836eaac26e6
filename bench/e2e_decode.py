"""Decode throughput of a DeepSeek-shaped model in vLLM: CUSTOM (mla_backend) vs FLASHMLA vs
FLASH_ATTN_MLA (vLLM's default on Hopper), in one run on one GPU; with --engine sglang, the
same model in SGLang: mla_backend vs flashmla (bench/e2e_sglang.py says what is timed there).

The model has DeepSeek-V3's attention dims (hidden 7168, q_lora 1536, latent 512 + rope 64,
H = 128 at TP1 or H = 16 as at TP8), a few layers (the last one MoE with a few experts) and
the engine's dummy weights (speed does not depend on them). vLLM: each engine runs in its own
process (mla_backend.engine_run), decode steps in FULL CUDA graphs without torch.compile (the
same for every backend). Time per decode step: `batch` requests whose `context`-token prompts
are in vLLM's prefix cache are driven through the engine's step loop; once all of them decode,
the span of the whole-batch steps over their number (prefill excluded); median of
`repeats`. (The first method, differences of `generate` wall times, gave repeats 2x apart on
the H200. This one ran on the H200 on 2026-11-21, docs/vllm.md: repeats still 18-42% apart,
more than the differences between backends.)
Writes bench/results/e2e_decode-<gpu>-<date>.json, or e2e_decode_sglang-<gpu>-<date>.json
(design.md's shape plus "engine": `us` = us per decode step; tokens/s in the printed table).

    python -m bench.e2e_decode [--heads 128 16] [--batch 64] [--context 8192] [--out DIR]
    python -m bench.e2e_decode --engine sglang [--backends ours flashmla triton] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from bench import common, e2e_sglang
from mla_backend.demo import engines, tiny_model

BACKENDS = {"ours": "CUSTOM", "flashmla": "FLASHMLA", "fa3_mla": "FLASH_ATTN_MLA"}
ENGINE_BACKENDS = {"vllm": BACKENDS, "sglang": e2e_sglang.BACKENDS}


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench.e2e_decode")
    p.add_argument("--engine", default="vllm", choices=list(ENGINE_BACKENDS))
    p.add_argument("--heads", type=int, nargs="+", default=[128, 16])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--backends", nargs="+", default=None,
                   help=f"vllm: {' '.join(BACKENDS)} (default: all); sglang: "
                        f"{' '.join(e2e_sglang.BACKENDS)} (default: "
                        f"{' '.join(e2e_sglang.DEFAULT_BACKENDS)})")
    p.add_argument("--rounds", type=int, default=None,
                   help="sglang: engine processes per backend, started in turn (default "
                        f"{e2e_sglang.DEFAULT_ROUNDS})")
    p.add_argument("--log-interval", type=int, default=None,
                   help="sglang: decode steps per step-time record (default 16)")
    p.add_argument("--out", default=None, help="results file or directory")
    p.add_argument("--logs", default=None, help="directory for the engines' logs")
    args = p.parse_args(argv)
    known = ENGINE_BACKENDS[args.engine]
    if args.backends is None:
        args.backends = list(BACKENDS) if args.engine == "vllm" else e2e_sglang.DEFAULT_BACKENDS
    for key in args.backends:
        if key not in known:
            p.error(f"--backends {key}: not a backend of --engine {args.engine}; choose from "
                    f"{', '.join(known)}")
    if args.engine == "vllm":
        for name, value in (("--rounds", args.rounds), ("--log-interval", args.log_interval)):
            if value is not None:
                p.error(f"{name} {value}: only with --engine sglang")
        return args
    args.rounds = e2e_sglang.DEFAULT_ROUNDS if args.rounds is None else args.rounds
    args.log_interval = 16 if args.log_interval is None else args.log_interval
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: must be 1 or more")
    if args.log_interval < 1 or args.steps < 2 * args.log_interval:
        p.error(f"--steps {args.steps} --log-interval {args.log_interval}: each timed call "
                "needs two step records or more, so steps >= 2 x log-interval >= 2")
    return args


def _vllm_row(args, model: str, config: dict, logs: str) -> common.BenchRow:
    """Time every backend of args.backends in vLLM, one engine each."""
    heads = config["H"]
    row = common.BenchRow(config=config)
    tokens_per_s = {}
    for key in args.backends:
        spec = {"model": model, "backend": BACKENDS[key], "load_format": "dummy",
                "mode": "graphs", "max_model_len": args.context + args.steps + 64,
                "max_num_seqs": args.batch, "gpu_memory_utilization": 0.6,
                "max_num_batched_tokens": 16384,
                "timing": {"prompt_len": args.context - args.steps - 1, "batch": args.batch,
                           "steps": args.steps, "repeats": args.repeats}}
        log_path = os.path.join(logs, f"h{heads}-{key}.log")
        common.log(f"H={heads} {BACKENDS[key]}: starting (log {log_path})")
        try:
            res = engines.run_engine(spec, log_path, label=f"H={heads} {BACKENDS[key]}",
                                     timeout_s=900)
        except engines.EngineFailed as e:
            row.skipped[key] = common.short_error(e)
            common.log(str(e))
            continue
        if "timing" not in res:
            row.skipped[key] = res.get("timing_error", "no timing")
            common.log(f"H={heads} {BACKENDS[key]}: not timed: {row.skipped[key]}")
            continue
        t = res["timing"]
        row.us[key] = t["step_us"]
        tokens_per_s[key] = t["decode_tokens_per_s"]
        common.log(f"H={heads} {BACKENDS[key]}: {t['step_us']:.0f} us per step "
                   f"({t['decode_tokens_per_s']:.0f} tokens/s; all: "
                   f"{', '.join(f'{x:.0f}' for x in t['step_us_all'])}; engine start "
                   f"{res['engine_start_s']:.0f} s)")
    t_ours = row.us.get("ours")
    peers = [v for k, v in row.us.items() if k != "ours"]
    if t_ours and peers:
        row.speedup_vs_best_peer = min(peers) / t_ours
    row.notes["ours"] = "tokens/s " + ", ".join(
        f"{k} {v:.0f}" for k, v in tokens_per_s.items())
    return row


def main(argv=None) -> int:
    args = _parse(argv if argv is not None else sys.argv[1:])
    missing = engines.engine_missing(args.engine)
    if missing:
        common.log(missing)
        return 2
    gpu, date, commit = common.gpu_name(), common.today(), common.git_commit()
    job = "e2e_decode" if args.engine == "vllm" else "e2e_decode_sglang"
    path = common.resolve_out(args.out, job, gpu, date)
    tmp = tempfile.TemporaryDirectory(prefix="e2e_decode_")
    logs = args.logs or tmp.name
    os.makedirs(logs, exist_ok=True)
    rows = []
    for heads in args.heads:
        model = tiny_model.write_config(
            os.path.join(tmp.name, f"dsv3-h{heads}"), heads=heads, layers=args.layers,
            hidden=7168, q_lora_rank=1536, intermediate=18432, experts=8, experts_per_token=8,
            moe_intermediate=2048, vocab=32768, max_positions=args.context + 1024)
        config = {"model": "DeepSeek-V3 attention dims", "H": heads, "layers": args.layers,
                  "batch": args.batch, "context": args.context, "dtype": "bf16"}
        if args.engine == "vllm":
            rows.append(_vllm_row(args, model, config, logs))
        else:
            rows.append(e2e_sglang.time_row(args, model, config, logs))
        # after every row: a run cut short still leaves what it measured
        common.write_results(path, job="e2e_decode", gpu=gpu, date=date, commit=commit,
                             copy_bw_gbs=None, rows=rows, extra={"engine": args.engine})
    common.print_table(rows, list(args.backends), None)
    common.print_summary(rows)
    if args.engine == "sglang":
        for row in rows:
            common.log(e2e_sglang.verdict(row))
    common.log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
