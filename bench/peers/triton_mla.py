"""Triton MLA as vLLM 0.25's TRITON_MLA calls it:
vllm.v1.attention.ops.triton_decode_attention.decode_attention_fwd, s_q = 1 only."""

from __future__ import annotations

import argparse

import torch

from bench.common import Kernel, NotApplicable
from bench.dense_inputs import BF16, D_V, PAGE, SCALE, Inputs


def triton_num_kv_splits(max_seq_len: int, sm_count: int) -> int:
    """vLLM 0.25 triton_mla._compute_num_kv_splits: next power of two of max_len / 512,
    capped at 2 x SMs."""
    ideal = 1 << (max(1, max_seq_len // 512) - 1).bit_length()
    return min(ideal, 2 * sm_count)


def build(x: Inputs, args: argparse.Namespace) -> Kernel:
    """decode_attention_fwd alone per call (it has no metadata; the split count is host
    math)."""
    if x.s_q != 1:
        raise NotApplicable("TRITON_MLA decodes s_q = 1 only (vLLM sends it nothing else)")
    from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd

    p = x.pool
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    nsplit = triton_num_kv_splits(p.max_len, sms)
    k_buf = p.cache.unsqueeze(2)                          # [nb, 64, 1, 576]
    v_buf = k_buf[..., :D_V]
    logits = torch.empty(x.B, x.H, nsplit, D_V + 1, device="cuda", dtype=torch.float32)
    out = torch.empty(x.B, x.H, D_V, device="cuda", dtype=BF16)
    lse = torch.empty(x.B, x.H, device="cuda", dtype=BF16)  # q's dtype, as in TritonMLAImpl
    one = torch.tensor(1.0, device="cuda", dtype=torch.float32)   # layer._k_scale

    def step(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        decode_attention_fwd(x.q[i], k_buf, v_buf, out, lse, p.tables[i], p.seq_lens, logits,
                             nsplit, SCALE, PAGE, k_scale=one, v_scale=one, is_mla=True)
        return out, lse

    def check() -> tuple[torch.Tensor, torch.Tensor]:
        o, l_ = step(0)
        return o.view(x.B, 1, x.H, D_V), l_.view(x.B, 1, x.H)

    return Kernel(step=step, check=check)
