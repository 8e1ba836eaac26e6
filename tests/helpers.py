"""What the tests share: paged inputs, the naive float64 decode, e4m3 code populations, and
(from bench/common.py, which the benches use too) the block-table builder, the rel L2 error
and the CUDA-graph capture."""

from __future__ import annotations

import torch

from bench.common import block_tables, capture_graph, rel_l2

__all__ = ["D_QK", "D_V", "PAGE", "E4M3_POPULATIONS", "block_tables", "capture_graph",
           "e4m3_codes", "naive_dense_decode", "paged_case", "rel_l2"]

D_QK, D_V, PAGE = 576, 512, 64


def paged_case(seq_lens: list[int], s_q: int, heads: int, *, dtype=torch.bfloat16,
               device="cpu", spare_blocks: int = 3, seed: int = 0, nan_unused: bool = True):
    """Random q, a paged cache whose blocks are handed out in a random order, a block table
    whose unused entries hold out-of-range garbage, and NaN in every slot no request uses."""
    g = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    blocks_per_req = [-(-n // PAGE) for n in seq_lens]
    max_blocks = max(blocks_per_req + [1]) + 1
    num_blocks = sum(blocks_per_req) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g)
    cache = torch.randn(num_blocks, PAGE, D_QK, generator=g).to(dtype)
    used = torch.zeros(num_blocks, PAGE, dtype=torch.bool)
    garbage = torch.randint(num_blocks + 1000, 2**30, (batch, max_blocks), generator=g,
                            dtype=torch.int32)
    table = block_tables(perm, blocks_per_req, width=max_blocks, unused=garbage)[0]
    for b, n in enumerate(seq_lens):
        for j in range(blocks_per_req[b]):
            used[int(table[b, j]), : min(PAGE, n - j * PAGE)] = True
    if nan_unused:
        cache[~used] = float("nan")
    q = torch.randn(batch, s_q, heads, D_QK, generator=g).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return (q.to(device), cache.to(device), table.to(device), lens.to(device))


def naive_dense_decode(q, cache, table, lens, scale, causal=True):
    """Explicit per-(request, query, head) softmax in float64, one loop iteration each."""
    batch, s_q, heads, _ = q.shape
    out = torch.zeros(batch, s_q, heads, D_V, dtype=torch.float64)
    lse = torch.full((batch, s_q, heads), float("-inf"), dtype=torch.float64)
    for b in range(batch):
        n = int(lens[b])
        keys = torch.stack([cache[int(table[b, t // PAGE]), t % PAGE] for t in range(n)]) \
            if n else torch.zeros(0, D_QK)
        keys = keys.double()
        for i in range(s_q):
            limit = n - s_q + i + 1 if causal else n
            if limit <= 0:
                continue
            kk = keys[:limit]
            for h in range(heads):
                s = (kk @ q[b, i, h].double()) * scale
                w = torch.softmax(s, 0)
                out[b, i, h] = w @ kk[:, :D_V]
                lse[b, i, h] = torch.logsumexp(s, 0)
    return out, lse


# e4m3 byte populations for the fp8 conversion tests: every code but the two NaNs, only the
# subnormals (and zeros), only the two largest binades
E4M3_POPULATIONS = {
    "every": [c for c in range(256) if c & 0x7F != 0x7F],
    "subnormal": list(range(0x00, 0x08)) + list(range(0x80, 0x88)),
    "largest": list(range(0x70, 0x7F)) + list(range(0xF0, 0xFF)),
}


def e4m3_codes(population: str, shape, g: torch.Generator) -> torch.Tensor:
    """Random uint8 e4m3 codes drawn uniformly from one of E4M3_POPULATIONS."""
    pool = torch.tensor(E4M3_POPULATIONS[population], dtype=torch.uint8)
    return pool[torch.randint(0, pool.numel(), tuple(shape), generator=g)]
