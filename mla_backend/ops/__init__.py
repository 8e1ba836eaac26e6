"""The public kernel API: validates arguments (ValueError / TypeError naming the argument,
its shape and dtype), allocates outputs, and calls torch.ops.mla_backend.*.

Shapes follow vLLM's MLA: one latent KV head, d_qk = 576 (512 latent + 64 rope),
d_v = 512, page (block) size 64. Float32 twins of every op: mla_backend.reference.

    dense.py       plan_decode / decode_workspace, mla_decode
    sparse.py      plan_sparse_decode / sparse_workspace, sparse_mla_decode, sparse_mla_prefill
    cost_model.py  the measured costs the planners schedule by
    _common.py     shapes and argument checks both share
"""

from . import cost_model, dense, sparse
from ._common import D_QK, D_V, MAX_HEADS, PAGE_SIZE, rows_in_place
from .cost_model import (
    BF16_UNIT_US,
    DENSE_ALIGN_EXTRA_UNITS,
    DENSE_WHOLE_REQUEST_EXTRA_UNITS,
    MIN_TOKENS_PER_CTA,
    SPLIT_FIXED_US,
    SPLIT_US_PER_MB,
    WHOLE_REQUEST_EXTRA_UNITS,
    WHOLE_REQUEST_EXTRA_UNITS_FP8_SMALL_H,
)
from .dense import (
    MAX_Q_TOKENS_PER_REQ,
    DecodePlan,
    DecodeWorkspace,
    decode_workspace,
    mla_decode,
    plan_decode,
)
from .sparse import (
    FP8_DS_MLA_BYTES,
    MAX_SPARSE_GROUPS,
    MAX_TOPK,
    SPARSE_ROWS_PER_CTA,
    SPARSE_UNIT_TOKENS,
    SparsePlan,
    SparseWorkspace,
    plan_sparse_decode,
    sparse_mla_decode,
    sparse_mla_prefill,
    sparse_workspace,
)

# the planners' geometry and cost rule, for the tests that check them
_grid = dense._grid
_uses_mma = dense._uses_mma
_sparse_grid = sparse._sparse_grid
_whole_requests_floor = cost_model._whole_requests_floor

__all__ = [
    "BF16_UNIT_US", "DENSE_ALIGN_EXTRA_UNITS", "DENSE_WHOLE_REQUEST_EXTRA_UNITS", "D_QK", "D_V",
    "FP8_DS_MLA_BYTES",
    "MAX_HEADS", "MAX_Q_TOKENS_PER_REQ",
    "MAX_SPARSE_GROUPS", "MAX_TOPK", "MIN_TOKENS_PER_CTA", "PAGE_SIZE", "SPARSE_ROWS_PER_CTA",
    "SPARSE_UNIT_TOKENS", "SPLIT_FIXED_US", "SPLIT_US_PER_MB", "WHOLE_REQUEST_EXTRA_UNITS",
    "WHOLE_REQUEST_EXTRA_UNITS_FP8_SMALL_H", "DecodePlan", "DecodeWorkspace", "SparsePlan",
    "SparseWorkspace", "decode_workspace", "mla_decode", "plan_decode", "plan_sparse_decode",
    "rows_in_place",
    "sparse_mla_decode", "sparse_mla_prefill", "sparse_workspace",
]
