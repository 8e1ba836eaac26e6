"""mla_backend in vLLM or SGLang, end to end, with no model download:

    python -m mla_backend.demo                 # vLLM, a tiny DeepSeek-V3 written to a temp dir
    python -m mla_backend.demo --engine sglang # the same in SGLang
    python -m mla_backend.demo --model PATH    # a real DeepSeek-V2/V3 checkpoint

Runs the same greedy prompts through the engine with our backend (vLLM: `--attention-backend
CUSTOM`; SGLang: `--attention-backend mla_backend`) and with a built-in one (--baseline NAME;
default: vLLM's own choice of MLA backend, SGLang's `flashmla`), each engine in its own
process, then prints the generated tokens of both, whether they agree, and the decode speed
of each (batch --batch, prompts of --context tokens, CUDA graphs for decode): the GPU's busy
time per step, which the attention backend changes, and the wall clock, which with two layers
is mostly the engine's host work (vLLM with --tp > 1: the wall clock only).
The tiny model's weights make attention non-uniform (mla_backend.demo.tiny_model), so
agreement means something. Where the greedy tokens part, the demo prints the baseline's
logprob margin between the two tokens, and whether that is a near-tie.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile

from . import engines, sglang_run, tiny_model

# engine -> (our backend's name in it, the default baseline: None = the engine's own choice)
ENGINES = {"vllm": ("CUSTOM", None), "sglang": ("mla_backend", "flashmla")}


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m mla_backend.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="vllm", choices=list(ENGINES),
                   help="the serving engine to run both backends in (default: vllm)")
    p.add_argument("--model", help="a DeepSeek-V2/V3 checkpoint dir (default: a tiny one)")
    p.add_argument("--heads", type=int, default=16,
                   help="query heads of the tiny model (16 = DeepSeek-V3 at TP8)")
    p.add_argument("--baseline", default=None,
                   help="the engine's backend to compare with (default: vLLM's own choice; "
                        "SGLang: flashmla)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (--model)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--batch", type=int, default=32, help="decode batch for tokens/s")
    p.add_argument("--context", type=int, default=2048, help="prompt tokens for tokens/s")
    p.add_argument("--logs", default=None, help="dir for the engines' logs (default: temp)")
    return p.parse_args(argv)


def _chosen_backend(log_path: str) -> str | None:
    with open(log_path, errors="replace") as f:
        text = f.read()
    m = re.findall(r"Using (?:AttentionBackendEnum\.)?([A-Z0-9_]+)(?: attention)? backend", text)
    return m[-1] if m else None


def _prompts(model: str | None, vocab: int) -> tuple[list[list[int]], object]:
    if model is not None:
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(model)
            texts = ["The capital of France is", "def fibonacci(n):",
                     "Multi-head latent attention compresses the KV cache by"]
            return [tok(t)["input_ids"] for t in texts], tok
        except Exception as e:  # a checkpoint without a tokenizer still runs on token ids
            print(f"(no tokenizer in {model}: {e}; using token ids)", file=sys.stderr)
    import torch

    gen = torch.Generator().manual_seed(0)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in (5, 40, 700)], None


def _token(tok, t: int) -> str:
    return repr(tok.decode([t])) if tok is not None else str(t)


def _partings(ours: list[dict], peer: list[dict], cmp: dict, peer_name: str, tok,
              ours_name: str = "CUSTOM") -> list[str]:
    """One line per prompt whose greedy tokens part (cmp = engines.compare(ours, peer)): the
    two tokens and the baseline's logprob margin between them. The margin is a near-tie when
    it is within twice the largest |logprob difference| of the two backends at the positions
    where they agree: logprobs that differ by up to d can order two tokens within 2 d either
    way."""
    cut = {d["prompt"]: d["position"] for d in cmp["divergences"]}

    def agreed(outputs):
        return [dict(o, token_ids=o["token_ids"][:cut.get(i)], logprobs=o["logprobs"][:cut.get(i)])
                for i, o in enumerate(outputs)]

    spread = engines.compare(agreed(ours), agreed(peer))["max_abs_logprob_diff"]
    lines = []
    for d in cmp["divergences"]:
        i, j = d["prompt"], d["position"]
        a, b = d["tokens"]
        head = (f"  prompt {i} parts at generated token {j}: {ours_name} chose {_token(tok, a)}, "
                f"{peer_name} {_token(tok, b)}")
        ranked = peer[i]["logprobs"]
        top = dict(map(tuple, ranked[j])) if j < len(ranked) else {}
        if b in top and a in top:
            margin = top[b] - top[a]
            verdict = "a near-tie" if margin <= 2 * spread else "not a near-tie"
            lines.append(f"{head}; {peer_name} puts its token {margin:.4f} above ours in "
                         f"logprob: {verdict} (where they agree, the backends' logprobs differ "
                         f"by up to {spread:.4f})")
        elif b in top:
            lines.append(f"{head}; ours is not in {peer_name}'s top {len(top)} there")
        else:
            lines.append(f"{head}; no logprobs of {peer_name} there")
    return lines


def gpu_busy_measured(args) -> bool:
    """Whether the decode timing records the GPU's busy time per step: always but for vLLM
    with tensor parallelism, whose workers run in processes the profiler does not see."""
    return args.engine != "vllm" or args.tp == 1


def speed_lines(args, runs: list[tuple[str, dict]]) -> list[str]:
    """The decode speed of each (name, engine result) and ours (the first) against the
    baseline (the second). The comparison is by GPU busy time per step where it was measured:
    with two layers, the wall clock of a step is mostly the engine's host work, which moves
    between runs by more than attention backends differ (mla_backend.demo.gpu_busy)."""
    head = (f"decode (batch {args.batch}, {args.context}-token context, "
            f"{'eager' if args.eager else 'CUDA graphs'}), median of the repeats:")
    lines, busy = [head], {}
    for name, run in runs:
        t = run.get("timing")
        if t is None:
            lines.append(f"  {name:22s}: not measured ({run.get('timing_error', 'no timing')})")
            continue
        wall = (f"{t['step_us']:.0f} us per step by the wall clock "
                f"({t['decode_tokens_per_s']:.0f} tokens/s)")
        if t.get("gpu_busy_us_all"):
            busy[name] = statistics.median(t["gpu_busy_us_all"])
            lines.append(f"  {name:22s}: GPU busy {busy[name]:.0f} us per step; {wall}")
        else:
            lines.append(f"  {name:22s}: {wall}")
    (ours, a), (peer, b) = runs
    if ours in busy and peer in busy:
        lines.append(f"  {ours} against {peer}: {busy[peer] / busy[ours]:.2f}x by GPU busy time "
                     "(the wall clock of a few-layer model is mostly host work)")
    elif a.get("timing") and b.get("timing"):
        ratio = a["timing"]["decode_tokens_per_s"] / b["timing"]["decode_tokens_per_s"]
        lines.append(f"  {ours} against {peer}: {ratio:.2f}x by the wall clock")
    return lines


def engine_spec(args, model: str, tokenizer: bool, prompts: list[list[int]]) -> dict:
    """Everything but the backend of the engine runs' spec (engine_run's keys for vLLM,
    sglang_run's for SGLang). Decode is timed on `batch` prompts of context - max_tokens
    tokens, 32 steps, median of 3 repeats, with the GPU's busy time (gpu_busy_measured)."""
    timing = {"prompt_len": args.context - args.max_tokens, "batch": args.batch, "steps": 32,
              "repeats": 3, "gpu_busy": gpu_busy_measured(args)}
    if args.engine == "vllm":
        return {"model": model, "tokenizer": tokenizer,
                "mode": "eager" if args.eager else "graphs",
                "kv_cache_dtype": args.kv_cache_dtype, "max_model_len": args.context + 512,
                "max_num_seqs": max(64, args.batch), "tensor_parallel_size": args.tp,
                "gpu_memory_utilization": 0.5, "prompts": prompts,
                "max_tokens": args.max_tokens, "logprobs": 5, "timing": timing}
    # flashinfer_mla_disable_ragged: prefill (not compared here) on FlashInfer's paged MLA
    # kernel only, one JIT build on first use instead of two
    engine_args = {"flashinfer_mla_disable_ragged": True}
    if args.tp > 1:
        engine_args["tp_size"] = args.tp
    return {"model": model, "graphs": not args.eager,
            "kv_cache_dtype": {"auto": "auto", "fp8": "fp8_e4m3"}[args.kv_cache_dtype],
            "context_length": args.context + 512, "chunked_prefill_size": 8192,
            "max_running_requests": max(len(prompts), args.batch),
            "mem_fraction_static": None if args.model else 0.3, "engine_args": engine_args,
            "prompts": prompts, "max_new_tokens": args.max_tokens, "logprobs": 5,
            "timing": dict(timing, log_interval=8)}


def _run(engine: str, spec: dict, log: str, label: str) -> dict:
    if engine == "vllm":
        return engines.run_engine(spec, log, label=label, progress=True)
    return sglang_run.run(spec, log, timeout_s=900, label=label, progress=True)


def main(argv=None) -> int:
    args = _parse(argv if argv is not None else sys.argv[1:])
    missing = engines.engine_missing(args.engine)
    if missing:
        print(missing, file=sys.stderr)
        return 2
    ours_backend, default_baseline = ENGINES[args.engine]
    baseline = args.baseline or default_baseline
    tmp = tempfile.TemporaryDirectory(prefix="mla_backend_demo_")
    logs = args.logs or tmp.name
    os.makedirs(logs, exist_ok=True)
    if args.model:
        model, tokenizer_ok = args.model, True
        desc = args.model
    else:
        model = tiny_model.write_checkpoint(os.path.join(tmp.name, "tiny-dsv3"), heads=args.heads,
                                            layers=2, max_positions=args.context + 512)
        tokenizer_ok = False
        desc = f"tiny DeepSeek-V3 ({args.heads} heads, 2 layers, random non-uniform weights)"
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    prompts, tok = _prompts(args.model, vocab)
    where = " in SGLang" if args.engine == "sglang" else ""
    print(f"mla_backend demo{where}: {desc}\n  model dir: {model}", flush=True)
    base = engine_spec(args, model, tokenizer_ok and tok is not None, prompts)
    runs = {}
    for label, backend in ((ours_backend, ours_backend), ("baseline", baseline)):
        log = os.path.join(logs, f"engine-{label}.log")
        try:
            res = _run(args.engine, dict(base, backend=backend), log, f"[{label}]")
        except engines.EngineFailed as e:
            print(str(e), file=sys.stderr)
            return 1
        if args.engine == "vllm":
            backend = _chosen_backend(log) or (backend or "vLLM default")
        res["backend_name"] = backend
        runs[label] = res
    ours, peer = runs[ours_backend], runs["baseline"]
    ours_name = "CUSTOM (mla_backend)" if args.engine == "vllm" else ours_backend
    peer_name = peer["backend_name"]
    print()
    for i, (a, b) in enumerate(zip(ours["outputs"], peer["outputs"], strict=True)):
        print(f"prompt {i} ({a['prompt_len']} tokens)")
        for name, out in ((ours_name, a), (peer_name, b)):
            text = tok.decode(out["token_ids"]) if tok is not None else " ".join(
                map(str, out["token_ids"]))
            print(f"  {name:22s}: {text}")
    cmp = engines.compare(ours["outputs"], peer["outputs"])
    same = cmp["matching_tokens"] == cmp["total_tokens"]
    agree = "yes" if same else "until they part (later tokens follow different contexts)"
    print(f"\ngenerated tokens agree: {agree} ({cmp['matching_tokens']}/"
          f"{cmp['total_tokens']}); largest |logprob difference| over "
          f"{cmp['positions_compared']} positions: {cmp['max_abs_logprob_diff']:.4f}")
    for line in _partings(ours["outputs"], peer["outputs"], cmp, peer_name, tok,
                          ours_backend):
        print(line)
    for line in speed_lines(args, [(ours_name, ours), (peer_name, peer)]):
        print(line)
    kept = "" if args.logs else " (deleted on exit; --logs DIR keeps them)"
    print(f"engine logs: {logs}{kept}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
