"""Decode context parallelism (DCP) in the vLLM adapter, against vLLM 0.25's real classes on
the CPU.

With DCP of size N, vLLM stores token t of a request on DCP rank (t // I) % N (I: the
interleave size, cp_kv_cache_interleave_size, 1 by default), all-gathers q over the DCP group
(so each rank decodes heads-per-TP-rank x N heads over its own part of the context), and
merges the ranks' outputs by the lse each returns. The dense builder must then plan the
decode over the rank's local lengths (CommonAttentionMetadata.dcp_local_seq_lens, which the
model runner fills with vLLM's get_dcp_local_seq_lens) for heads x N query heads, and keep
the whole lengths in dcp_tot_seq_lens. The DCP group is replaced by a stand-in with the
rank and size (vLLM's own fallback when no group exists is size 1).

The sparse (DeepSeek-V3.2) path refuses DCP; the refusal is what a user sees from vLLM's
selection step and from the builder.
"""

import re
import types

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.attention import mla_attention  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens  # noqa: E402
from vllm.v1.kv_cache_interface import MLAAttentionSpec  # noqa: E402

from mla_backend.vllm import support  # noqa: E402
from mla_backend_entry import vllm_plugin  # noqa: E402
from tests.cpu.test_vllm_adapter import (  # noqa: E402, F401 (the two fixtures are used)
    _builder,
    _model_dir,
    _select,
    _vllm_config,
    extension_present,
    fake_planner,
)

V32 = {"architectures": ["DeepseekV32ForCausalLM"], "index_topk": 256, "index_n_heads": 4,
       "index_head_dim": 128}
DCP_REFUSAL = ("decode context parallelism with DeepSeek-V3.2: neither MLA_BACKEND's sparse "
               "path nor any vLLM 0.25 sparse MLA backend for Hopper runs it; use "
               "--decode-context-parallel-size 1")


@pytest.fixture(autouse=True)
def _registered():
    vllm_plugin.register()


@pytest.fixture
def planner_calls(request):
    """The adapter tests' CPU stand-in for the planner: the calls it recorded."""
    return request.getfixturevalue("fake_planner")


@pytest.fixture
def dcp_rank(monkeypatch):
    """Make the builders see a DCP group of the given size with this process at rank."""
    def use(rank: int, size: int = 2):
        group = types.SimpleNamespace(world_size=size, rank_in_group=rank)
        monkeypatch.setattr(mla_attention, "get_dcp_group", lambda: group)
    return use


# Whole lengths of four decode requests and what each of two ranks holds, worked by hand
# from the layout above: I = 1 puts even positions on rank 0 (ceil(L / 2) tokens) and odd
# ones on rank 1 (floor(L / 2)); I = 64 gives rank 0 the first 64 of every 128, rank 1 the
# next 64. The last request is CUDA-graph padding (length 0).
LENGTHS = [10, 1, 129, 300, 0]
LOCAL = {1: ([5, 1, 65, 150, 0], [5, 0, 64, 150, 0]),
         64: ([10, 1, 65, 172, 0], [0, 0, 64, 128, 0])}


@pytest.mark.parametrize("interleave", [1, 64])
def test_vllm_splits_the_context_as_worked_by_hand(interleave):
    lens = torch.tensor(LENGTHS, dtype=torch.int32)
    for rank in (0, 1):
        got = get_dcp_local_seq_lens(lens, 2, rank, interleave)
        assert got.tolist() == LOCAL[interleave][rank]
    both = get_dcp_local_seq_lens(lens, 2, None, interleave)
    assert (both.sum(-1) == lens).all()


def _decode_batch(rank: int, interleave: int) -> CommonAttentionMetadata:
    """Four decodes (one query token each) plus a graph-padding row, as the model runner gives
    them to DCP rank `rank`: whole seq_lens, local dcp_local_seq_lens."""
    n = len(LENGTHS)
    qsl = torch.tensor([0, 1, 2, 3, 4, 4], dtype=torch.int32)
    seq = torch.tensor(LENGTHS, dtype=torch.int32)
    local = get_dcp_local_seq_lens(seq, 2, rank, interleave)
    table = torch.arange(n * 8, dtype=torch.int32).view(n, 8).flip(1).contiguous()
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=n,
        num_actual_tokens=n, max_query_len=1, max_seq_len=max(LENGTHS),
        block_table_tensor=table, slot_mapping=torch.zeros(n, dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq, _seq_lens_cpu=seq,
        _num_computed_tokens_cpu=seq - torch.tensor([1, 1, 1, 1, 0], dtype=torch.int32),
        dcp_local_seq_lens=local, dcp_local_seq_lens_cpu=local)


@pytest.mark.parametrize("interleave", [1, 64])
@pytest.mark.parametrize("rank", [0, 1])
def test_dense_builder_plans_the_local_context_for_all_gathered_heads(
        tmp_path, planner_calls, dcp_rank, rank, interleave):
    dcp_rank(rank)
    # DeepSeek-V3's 128 heads at TP 2: 64 per TP rank, all-gathered over DCP 2 -> 128
    cfg = _vllm_config(_model_dir(tmp_path, heads=128), tp=2, dcp=2)
    cfg.parallel_config.cp_kv_cache_interleave_size = interleave
    b = _builder(cfg)
    assert (b.num_heads, b.dcp_world_size, b.decode_heads) == (64, 2, 128)
    assert b.workspace.args == (32, 1, 128, None)
    m = b.build(0, _decode_batch(rank, interleave))
    assert (m.num_decodes, m.num_decode_tokens, m.num_prefills) == (5, 5, 0)
    assert planner_calls == [{"seq_lens": LOCAL[interleave][rank], "s_q": 1, "heads": 128,
                             "kv_cache_dtype": None}]
    assert m.decode.seq_lens.tolist() == LOCAL[interleave][rank]
    assert m.decode.dcp_tot_seq_lens.tolist() == LENGTHS
    assert m.decode.plan.batch == 5 and m.decode.plan.num_heads == 128
    assert m.decode.block_table[:, 0].tolist() == [7, 15, 23, 31, 39]


def test_dcp_keeps_speculative_rows_off_the_decode_path(tmp_path, planner_calls, dcp_rank):
    """vLLM sets reorder_batch_threshold to 1 under DCP for backends without DCP varlen
    support: verification rows go to the prefill path, and the workspace holds 1 query token
    per request."""
    dcp_rank(0)
    cfg = _vllm_config(_model_dir(tmp_path, heads=128), tp=2, dcp=2, spec_tokens=3)
    assert support.max_decode_query_len(cfg) == 1
    b = _builder(cfg)
    assert b.reorder_batch_threshold == 1 and b.workspace.args == (32, 1, 128, None)


def test_dcp_heads_per_gpu_limit(tmp_path):
    ok = _vllm_config(_model_dir(tmp_path, heads=128), tp=2, dcp=2)
    assert support.decode_heads(ok) == 128 and support.config_reason(ok) is None
    wide = _vllm_config(_model_dir(tmp_path, heads=256), tp=2, dcp=2)
    assert support.decode_heads(wide) == 256
    assert support.config_reason(wide) == (
        "256 query heads per GPU (heads / tensor-parallel size x decode-context-parallel "
        "size): MLA_BACKEND decodes at most 128")


@pytest.mark.usefixtures("extension_present")
def test_sparse_dcp_refusal_is_what_vllm_selection_raises(tmp_path, monkeypatch):
    """The message a user gets from `--attention-backend CUSTOM -dcp 2` on DeepSeek-V3.2:
    vLLM's selection step (which runs inside the engine's current config) raises it."""
    cfg = _vllm_config(_model_dir(tmp_path, heads=128, **V32), tp=2, dcp=2)
    with set_current_vllm_config(cfg), pytest.raises(ValueError) as err:
        _select(monkeypatch, use_sparse=True)
    assert str(err.value) == ("Selected backend AttentionBackendEnum.CUSTOM is not valid for "
                              f"this configuration. Reason: [{DCP_REFUSAL!r}]")
    # the same model without DCP is accepted, and a dense model with DCP too
    with set_current_vllm_config(_vllm_config(_model_dir(tmp_path, heads=128, **V32), tp=2)):
        assert _select(monkeypatch, use_sparse=True).endswith("MLASparseBackend")
    with set_current_vllm_config(_vllm_config(_model_dir(tmp_path, heads=128), tp=2, dcp=2)):
        assert _select(monkeypatch).endswith("MLADenseBackend")


def test_sparse_builder_refuses_dcp(tmp_path):
    from mla_backend.vllm.sparse import MLASparseMetadataBuilder

    cfg = _vllm_config(_model_dir(tmp_path, heads=128, **V32), tp=2, dcp=2)
    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=re.escape(DCP_REFUSAL)):
        MLASparseMetadataBuilder(spec, ["l0"], cfg, torch.device("cpu"))
