"""FlashInfer MLA as vLLM 0.25's FLASHINFER_MLA backend calls it:
flashinfer.mla.BatchMLAPagedAttentionWrapper(backend="fa3"), JIT-compiled on first use."""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from bench import common
from bench.common import Kernel, NotApplicable, log
from bench.dense_inputs import BF16, D_ROPE, D_V, I32, PAGE, SCALE, Inputs

FLASHINFER_WORKSPACE = 256 * 2**20
# kept across configs: whether a build ever worked, the error that stops retries, the workspace
_FLASHINFER: dict[str, Any] = {"ok": False, "error": None, "workspace": None}


def build(x: Inputs, args: argparse.Namespace) -> Kernel:
    """run() per call; plan() once per input set, outside the timing (host-side and not
    capturable: vLLM runs it once per step outside its graph). A failure before any build
    worked (import, JIT build) is not retried in later configs."""
    if _FLASHINFER["error"] is not None:
        raise NotApplicable(f"not retried after an earlier failure: {_FLASHINFER['error']}")
    try:
        kernel = _build(x)
    except Exception as e:
        if not _FLASHINFER["ok"]:   # never worked (import / JIT build): do not retry per row
            _FLASHINFER["error"] = common.short_error(e, 200)
        raise
    _FLASHINFER["ok"] = True
    return kernel


def _build(x: Inputs) -> Kernel:
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    p = x.pool
    if _FLASHINFER["workspace"] is None:
        # One float workspace shared by every wrapper: it only holds split-KV partials
        # during run(), and the calls run one after another on one stream.
        _FLASHINFER["workspace"] = torch.empty(FLASHINFER_WORKSPACE, dtype=torch.uint8,
                                               device="cuda")
    ws = _FLASHINFER["workspace"]
    ckv, kpe = p.cache[..., :D_V], p.cache[..., D_V:]     # [nb, 64, 512], [nb, 64, 64] views
    nblk = torch.tensor(p.nblk, device="cuda", dtype=I32)
    kv_indptr = torch.cat([torch.zeros(1, device="cuda", dtype=I32),
                           torch.cumsum(nblk, 0).to(I32)])
    used = torch.arange(p.tables[0].shape[1], device="cuda")[None, :] < nblk[:, None]
    first = not _FLASHINFER["ok"]
    if first:
        log("    flashinfer_mla: first plan() JIT-compiles the fa3 batch-MLA module "
            "(nvcc; can take minutes; --no-flashinfer skips it)")
    t0 = time.perf_counter()
    wrappers = []
    for i in range(x.nsets):
        kv_indices = p.tables[i][used].contiguous()       # row-major: request by request
        w = BatchMLAPagedAttentionWrapper(ws, backend="fa3")
        w.plan(qo_indptr=x.cu_q, kv_indptr=kv_indptr, kv_indices=kv_indices,
               kv_len_arr=p.seq_lens, num_heads=x.H, head_dim_ckv=D_V, head_dim_kpe=D_ROPE,
               page_size=PAGE, causal=True, sm_scale=SCALE, q_data_type=BF16,
               kv_data_type=BF16)
        wrappers.append(w)
    if first:
        log(f"    flashinfer_mla: plan()s (incl. JIT) took {time.perf_counter() - t0:.1f} s")
    out = torch.empty(x.T, x.H, D_V, device="cuda", dtype=BF16)
    lse = torch.empty(x.T, x.H, device="cuda", dtype=torch.float32)

    def step(i: int) -> object:
        # run() only: plan() is host-side and runs once per step outside vLLM's graph.
        return wrappers[i].run(x.q_nope[i], x.q_pe[i], ckv, kpe, out=out)

    def check() -> tuple[torch.Tensor, torch.Tensor]:
        o, l_ = wrappers[0].run(x.q_nope[0], x.q_pe[0], ckv, kpe, out=out, lse=lse,
                                return_lse=True, return_lse_base_on_e=True)
        return o.view(x.B, x.s_q, x.H, D_V), l_.view(x.B, x.s_q, x.H)

    return Kernel(step=step, check=check)
