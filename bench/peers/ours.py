"""Ours: mla_backend.ops for dense decode (bf16 or per-tensor fp8 cache) and sparse decode /
prefill."""

from __future__ import annotations

import argparse

import torch

from bench.common import Kernel
from bench.dense_inputs import BF16, D_V, FP8, SCALE, Inputs
from bench.sparse_inputs import Case


def build_dense(x: Inputs, args: argparse.Namespace) -> Kernel:
    """plan_decode + mla_decode per call over a bf16 cache, or (fp8 block) an fp8 cache with
    the pool's kv_scale as a CUDA tensor; step_premeta: mla_decode on the plan made once.
    args.min_tokens_per_cta (bench only; None: the library's minimum) sets the plan's least
    keys per CTA."""
    from mla_backend import ops

    p = x.pool
    kv_dtype = FP8 if p.fp8 else None
    plan_kw = {"kv_cache_dtype": kv_dtype,
               "_min_tokens_per_cta": getattr(args, "min_tokens_per_cta", None)}
    plan = ops.plan_decode(p.seq_lens, x.s_q, x.H, **plan_kw)
    out = torch.empty(x.B, x.s_q, x.H, D_V, device="cuda", dtype=BF16)

    def decode(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.mla_decode(x.q4(i), p.cache, p.tables[i], p.seq_lens, plan, SCALE,
                              causal=True, kv_scale=p.kv_scale_t, out=out)

    def step(i: int) -> object:
        # vLLM pays plan_decode once per step for all layers; timed per call (conservative).
        ops.plan_decode(p.seq_lens, x.s_q, x.H, out=plan, **plan_kw)
        return decode(i)

    return Kernel(step=step, check=lambda: step(0), step_premeta=decode)


def build_sparse(c: Case) -> Kernel:
    """Decode: plan_sparse_decode + sparse_mla_decode, the plan in the timed call; prefill:
    sparse_mla_prefill with a plan made once per shape, outside it."""
    from mla_backend import ops

    if c.job == "decode":
        ws = ops.sparse_workspace(c.rows, c.H, device="cuda")

        def step(i):
            plan = ops.plan_sparse_decode(c.batch, c.s_q, c.H, c.topk, workspace=ws,
                                          device="cuda", kv_cache_dtype=c.kv.dtype)
            return ops.sparse_mla_decode(c.qs[i], c.kv, c.idx[i], plan, c.scale)[0]
    else:
        plan = ops.plan_sparse_decode(c.rows, 1, c.H, c.topk, device="cuda",
                                      kv_cache_dtype=c.kv.dtype)

        def step(i):
            return ops.sparse_mla_prefill(c.qs[i], c.kv, c.idx[i], c.scale, plan=plan)[0]
    return Kernel(step=step, check=lambda: step(0))
