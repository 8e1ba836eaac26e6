"""Inputs of bench/sparse.py: one config's rotating sets of q and indices over a paged cache
(decode) or a flat kv (prefill), and the float32 reference on a slice of the first set."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bench import common

D_QK, D_V, PAGE = 576, 512, 64
REF_ROWS = 256          # rows (query tokens) checked against the reference


@dataclass
class Case:
    """One config's inputs: nsets rotating sets of (q, indices)."""
    job: str
    H: int
    rows: int                   # B * s_q (decode) or T (prefill)
    batch: int
    s_q: int
    topk: int
    kv: torch.Tensor            # decode: paged cache; prefill: flat [S, 576]
    qs: list[torch.Tensor]      # [B, s_q, H, 576] / [T, H, 576]
    idx: list[torch.Tensor]     # [B, s_q, topk] / [T, topk]
    scale: float

    @property
    def nsets(self) -> int:
        return len(self.qs)


def make_decode_case(H, s_q, batch, topk, context, cache_fmt, seed, pool) -> Case:
    """`batch` requests of `context` tokens in randomly ordered 64-token pages (bf16 or
    fp8_ds_mla), indices: topk distinct random positions of the request's context as global
    slots. pool: the cache of the previous call, reused while (batch, context, cache_fmt)
    stay the same."""
    from mla_backend import formats

    g = torch.Generator(device="cuda").manual_seed(seed)
    if pool.get("key") != (batch, context, cache_fmt):
        pool.clear()
        blocks = batch * math.ceil(context / PAGE)
        kv = (torch.randn(blocks, PAGE, D_QK, device="cuda", generator=g) * 2).to(torch.bfloat16)
        if cache_fmt == "fp8_ds_mla":
            kv = formats.quantize_fp8_ds_mla(kv[..., :D_V].contiguous(), kv[..., D_V:].contiguous())
        perm = torch.randperm(blocks, device="cuda", generator=g)
        table = common.block_tables(perm, [blocks // batch] * batch)[0]
        pool.update(key=(batch, context, cache_fmt), kv=kv, table=table)
    kv, table = pool["kv"], pool["table"]
    touched = batch * s_q * topk * kv.shape[-1] * kv.element_size()
    nsets = common.rotating_sets(touched, hi=32)
    qs, idxs = [], []
    for _ in range(nsets):
        qs.append(torch.randn(batch, s_q, H, D_QK, device="cuda", generator=g).to(torch.bfloat16))
        pos = torch.rand(batch, s_q, context, device="cuda", generator=g).argsort(-1)[..., :topk]
        blk = torch.gather(table.unsqueeze(1).expand(batch, s_q, -1), 2, pos // PAGE)
        idxs.append((blk * PAGE + pos % PAGE).to(torch.int32).contiguous())
    return Case("decode", H, batch * s_q, batch, s_q, topk, kv, qs, idxs, D_QK ** -0.5)


def make_prefill_case(H, tokens, topk, s_kv, seed) -> Case:
    """A flat bf16 kv of s_kv rows; indices random in [0, s_kv); two sets."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    kv = torch.randn(s_kv, D_QK, device="cuda", generator=g).to(torch.bfloat16)
    nsets = 2
    qs = [torch.randn(tokens, H, D_QK, device="cuda", generator=g).to(torch.bfloat16)
          for _ in range(nsets)]
    idxs = [torch.randint(0, s_kv, (tokens, topk), device="cuda", generator=g, dtype=torch.int32)
            for _ in range(nsets)]
    return Case("prefill", H, tokens, tokens, 1, topk, kv, qs, idxs, D_QK ** -0.5)


def reference_out(c: Case) -> torch.Tensor:
    """float32 out of the first REF_ROWS rows (whole requests for decode) of set 0."""
    from mla_backend import reference as ref

    if c.job == "decode":
        b = max(1, min(c.batch, REF_ROWS // c.s_q))
        return ref.sparse_mla_decode(c.qs[0][:b], c.kv, c.idx[0][:b], None, c.scale)[0]
    n = min(c.rows, REF_ROWS)
    return ref.sparse_mla_prefill(c.qs[0][:n], c.kv, c.idx[0][:n], c.scale)[0]
