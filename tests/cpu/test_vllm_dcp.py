"""Decode context parallelism (DCP) in the vLLM adapter, against vLLM's real classes (0.25 or
0.33, whichever is installed) on the CPU.

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

import dataclasses
import re

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.attention import mla_attention  # noqa: E402
from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens  # noqa: E402

from mla_backend import _extension  # noqa: E402
from mla_backend.vllm import support  # noqa: E402
from mla_backend_entry import vllm_plugin  # noqa: E402
from tests.cpu.vllm_env import (  # noqa: E402
    V033,
    V32,
    add_layer,
    common,
    host_without_gpu,
    mla_spec,
    model_dir,
    planner_stand_in,
    select_backend,
    vllm_config,
)

if V033:  # vLLM 0.33's FLASHMLA_SPARSE runs DCP on Hopper: the refusal names it
    DCP_REFUSAL = ("decode context parallelism with DeepSeek-V3.2: MLA_BACKEND's sparse path "
                   "does not run it; use --decode-context-parallel-size 1, or "
                   "--attention-backend FLASHMLA_SPARSE")
else:
    DCP_REFUSAL = ("decode context parallelism with DeepSeek-V3.2: neither MLA_BACKEND's "
                   "sparse path nor any vLLM 0.25 sparse MLA backend for Hopper runs it; use "
                   "--decode-context-parallel-size 1")


@pytest.fixture(autouse=True)
def _registered(monkeypatch):
    vllm_plugin.register()
    host_without_gpu(monkeypatch)


@pytest.fixture
def planner_calls(monkeypatch):
    """The CPU stand-in for the planner: the calls it recorded."""
    return planner_stand_in(monkeypatch)


class _GroupStandIn:
    """vLLM's DCP GroupCoordinator as the builders read it: rank and size (hashable like the
    real one; vLLM 0.33 caches its direct-communication checks per group)."""

    device_group = None  # no process group on the CPU: vLLM's non-direct collectives

    def __init__(self, world_size: int, rank_in_group: int):
        self.world_size, self.rank_in_group = world_size, rank_in_group


@pytest.fixture
def dcp_rank(monkeypatch):
    """Make the builders see a DCP group of the given size with this process at rank (vLLM
    0.25 and 0.33 alike: MLACommonMetadataBuilder.__init__ reads mla_attention's
    get_dcp_group)."""
    def use(rank: int, size: int = 2):
        group = _GroupStandIn(world_size=size, rank_in_group=rank)
        monkeypatch.setattr(mla_attention, "get_dcp_group", lambda: group)
        if V033:  # vLLM 0.33's layer-level DCP collectives take the group from their module
            from vllm.v1.attention.ops import dcp

            monkeypatch.setattr(dcp, "get_dcp_group", lambda: group)
    return use


def _builder(cfg):
    from mla_backend.vllm.dense import MLADenseMetadataBuilder

    name = add_layer(cfg)
    if V033:  # vLLM 0.33's builder under DCP hands its workspace to the layer's DCP manager
        from vllm.v1.attention.ops.dcp import MLADCPManager

        cfg.compilation_config.static_forward_context[name].dcp_manager = MLADCPManager(
            vllm_config=cfg, device=torch.device("cpu"), num_heads=64, query_head_dim=576,
            output_head_dim=512, query_dtype=torch.bfloat16, output_dtype=torch.bfloat16,
            padded_num_heads=None, is_lse_base_on_e=False, use_pcp=False)
    return MLADenseMetadataBuilder(mla_spec(), [name], cfg, torch.device("cpu"))


def _selection_of(cfg, **overrides):
    """vLLM's selection step inside the engine's current config, with what the engine passes
    about DCP."""
    if V033:  # vLLM 0.33's selector also asks the backend about DCP
        overrides["use_dcp"] = cfg.parallel_config.decode_context_parallel_size > 1
    with set_current_vllm_config(cfg):
        return select_backend(**overrides)


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


def _decode_batch(rank: int, interleave: int):
    """Four decodes (one query token each) plus a graph-padding row, as the model runner gives
    them to DCP rank `rank`: whole seq_lens, local dcp_local_seq_lens."""
    batch = common([1, 1, 1, 1, 0], LENGTHS, num_tokens=len(LENGTHS))
    local = get_dcp_local_seq_lens(batch.seq_lens, 2, rank, interleave)
    if V033:  # vLLM 0.33 keeps a CPU upper bound of the local lengths instead of a copy
        return dataclasses.replace(batch, dcp_local_seq_lens=local,
                                   dcp_local_seq_lens_cpu_upper_bound=local)
    return dataclasses.replace(batch, dcp_local_seq_lens=local, dcp_local_seq_lens_cpu=local)


@pytest.mark.parametrize("interleave", [1, 64])
@pytest.mark.parametrize("rank", [0, 1])
def test_dense_builder_plans_the_local_context_for_all_gathered_heads(
        tmp_path, planner_calls, dcp_rank, rank, interleave):
    dcp_rank(rank)
    # DeepSeek-V3's 128 heads at TP 2: 64 per TP rank, all-gathered over DCP 2 -> 128
    cfg = vllm_config(model_dir(tmp_path, heads=128), tp=2, dcp=2)
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
    cfg = vllm_config(model_dir(tmp_path, heads=128), tp=2, dcp=2, spec_tokens=3)
    assert support.max_decode_query_len(cfg) == 1
    b = _builder(cfg)
    assert b.reorder_batch_threshold == 1 and b.workspace.args == (32, 1, 128, None)


def test_dcp_heads_per_gpu_limit(tmp_path):
    ok = vllm_config(model_dir(tmp_path, heads=128), tp=2, dcp=2)
    assert support.decode_heads(ok) == 128 and support.config_reason(ok) is None
    wide = vllm_config(model_dir(tmp_path, heads=256), tp=2, dcp=2)
    assert support.decode_heads(wide) == 256
    assert support.config_reason(wide) == (
        "256 query heads per GPU (heads / tensor-parallel size x decode-context-parallel "
        "size): MLA_BACKEND decodes at most 128")


def test_sparse_dcp_refusal_is_what_vllm_selection_raises(tmp_path, monkeypatch):
    """The message a user gets from `--attention-backend CUSTOM -dcp 2` on DeepSeek-V3.2:
    vLLM's selection step (which runs inside the engine's current config) raises it."""
    monkeypatch.setattr(_extension, "is_available", lambda: True)
    cfg = vllm_config(model_dir(tmp_path, heads=128, **V32), tp=2, dcp=2)
    with pytest.raises(ValueError) as err:
        _selection_of(cfg, use_sparse=True)
    # vLLM 0.33 asks supports_dcp first and lists its own reason ahead of ours
    reasons = ["DCP not supported", DCP_REFUSAL] if V033 else [DCP_REFUSAL]
    assert str(err.value) == ("Selected backend AttentionBackendEnum.CUSTOM is not valid for "
                              f"this configuration. Reason: {reasons!r}")
    # the same model without DCP is accepted, and a dense model with DCP too
    assert _selection_of(vllm_config(model_dir(tmp_path, heads=128, **V32), tp=2),
                         use_sparse=True).endswith("MLASparseBackend")
    assert _selection_of(vllm_config(model_dir(tmp_path, heads=128), tp=2, dcp=2)).endswith(
        "MLADenseBackend")


def test_sparse_builder_refuses_dcp(tmp_path):
    from mla_backend.vllm.sparse import MLASparseBackend

    cfg = vllm_config(model_dir(tmp_path, heads=128, **V32), tp=2, dcp=2)
    with pytest.raises(ValueError, match=re.escape(DCP_REFUSAL)):
        MLASparseBackend.get_builder_cls()(mla_spec(), [add_layer(cfg)], cfg,
                                           torch.device("cpu"))
