"""The metadata builders against vLLM's real base classes (0.25 or 0.33), on the CPU: hand-
worked batches map to the decode rows and plans worked out below. The planners and vLLM's
Triton token map are GPU code: tests.cpu.vllm_env replaces them with CPU stand-ins that
record their arguments (and compute what the GPU code computes)."""

import pytest
import torch

pytest.importorskip("vllm")

from tests.cpu.vllm_env import (  # noqa: E402
    V033,
    V32,
    add_layer,
    common,
    host_without_gpu,
    mla_spec,
    model_dir,
    planner_stand_in,
    sparse_planner_stand_in,
    token_to_req_indices_twin,
    vllm_config,
)


@pytest.fixture(autouse=True)
def _host(monkeypatch):
    host_without_gpu(monkeypatch)


@pytest.fixture
def fake_planner(monkeypatch):
    return planner_stand_in(monkeypatch)


def _builder(cfg):
    from mla_backend.vllm.dense import MLADenseMetadataBuilder

    return MLADenseMetadataBuilder(mla_spec(), [add_layer(cfg)], cfg, torch.device("cpu"))


def test_builder_decode_first_batch_with_a_prefill(tmp_path, fake_planner):
    b = _builder(vllm_config(model_dir(tmp_path)))
    assert b.workspace.args == (32, 1, 16, None)
    # three decodes (q_len 1), then a new 5-token prompt
    m = b.build(0, common([1, 1, 1, 5], [10, 70, 200, 5]))
    assert (m.num_decodes, m.num_decode_tokens, m.num_prefills) == (3, 3, 1)
    assert fake_planner == [{"seq_lens": [10, 70, 200], "s_q": 1, "heads": 16,
                             "kv_cache_dtype": None}]
    plan = m.decode.plan
    # H = 16 rows of a 16-bit cache at batch 3: the wgmma kernel, 64-token units ->
    # ceil(L / 64) = [1, 2, 4] units per request; 7 units in all is a small step (at most
    # DENSE_ONE_PAGE_MAX_PAGES), so one unit a CTA: an aligned plan of U = 1
    assert (plan.batch, plan.q_tokens_per_req, plan.unit_tokens) == (3, 1, 64)
    assert plan.metadata[:5].tolist() == [0, 1, 3, 7, 1]
    assert m.decode.block_table.shape == (3, 8)
    assert m.decode.block_table[:, 0].tolist() == [7, 15, 23]
    assert m.decode.seq_lens.tolist() == [10, 70, 200]
    assert m.prefill is not None and m.prefill.max_query_len == 5


def test_builder_padded_cuda_graph_rows(tmp_path, fake_planner):
    b = _builder(vllm_config(model_dir(tmp_path)))
    # a FULL graph captured for 4 requests replayed with 2: padding rows have seq_len 0
    m = b.build(0, common([1, 1, 0, 0], [100, 7, 0, 0], num_tokens=4))
    assert (m.num_decodes, m.num_decode_tokens, m.num_prefills) == (4, 4, 0)
    assert fake_planner[-1]["seq_lens"] == [100, 7, 0, 0]
    # units [2, 1, 0, 0], a small step aligned on U = 1: the padding rows own no unit
    assert m.decode.plan.batch == 4 and m.decode.plan.metadata.tolist() == [0, 2, 3, 3, 3, 1]


def test_builder_spec_decode_rows_take_the_decode_kernel(tmp_path, fake_planner):
    b = _builder(vllm_config(model_dir(tmp_path), spec_tokens=3))
    assert b.reorder_batch_threshold == 4 and b.workspace.args == (32, 4, 16, None)
    # two verification rows (1 + 3 drafts each), then a 7-token prefill
    m = b.build(0, common([4, 4, 7], [50, 300, 7]))
    assert (m.num_decodes, m.num_decode_tokens, m.num_prefills) == (2, 8, 1)
    plan = m.decode.plan
    # 4 x 16 = 64 rows: the wgmma kernel, one 64-token page per unit
    assert (plan.batch, plan.q_tokens_per_req, plan.unit_tokens) == (2, 4, 64)
    assert plan.metadata.tolist() == [0, 1, 6, 1]  # units [1, 5], a small step: U = 1
    # padded uniform batch during graph replay: the zero-length row is a decode too
    m = b.build(0, common([4, 4, 0], [50, 300, 0], num_tokens=12))
    assert (m.num_decodes, m.decode.plan.batch, m.decode.plan.q_tokens_per_req) == (3, 3, 4)


def test_builder_hands_vllm_033_max_query_len_through(tmp_path, fake_planner, monkeypatch):
    """vLLM 0.33 passes _build_decode the decode rows' longest query (bounded by the
    reorder threshold); 0.25 passes none. Either way the rows come from the token count."""
    from mla_backend.vllm.dense import MLADenseMetadataBuilder

    seen = []
    real = MLADenseMetadataBuilder._build_decode

    def spy(self, **kwargs):
        seen.append(kwargs.get("max_query_len"))
        return real(self, **kwargs)

    monkeypatch.setattr(MLADenseMetadataBuilder, "_build_decode", spy)
    b = _builder(vllm_config(model_dir(tmp_path), spec_tokens=3))
    m = b.build(0, common([4, 4, 7], [50, 300, 7]))
    assert seen == ([4] if V033 else [None])
    assert (m.decode.plan.batch, m.decode.plan.q_tokens_per_req) == (2, 4)


def test_builder_fp8_cache_plans_for_the_fp8_kernel(tmp_path, fake_planner):
    cfg = vllm_config(model_dir(tmp_path))
    cfg.cache_config.cache_dtype = "fp8"
    b = _builder(cfg)
    assert b.workspace.args == (32, 1, 16, torch.float8_e4m3fn)
    m = b.build(0, common([1], [33]))
    assert fake_planner[-1]["kv_cache_dtype"] == torch.float8_e4m3fn
    assert m.decode.plan.kv_fp8


def test_builder_refuses_more_query_tokens_than_the_kernel_takes(tmp_path, fake_planner):
    with pytest.raises(ValueError, match="sends 9 query tokens per request"):
        _builder(vllm_config(model_dir(tmp_path), spec_tokens=8))


def test_decode_shape_rejects_non_uniform_rows():
    from mla_backend.vllm.dense import decode_shape

    assert decode_shape(4, 12) == (4, 3)
    with pytest.raises(RuntimeError, match="13 decode tokens over 4 requests"):
        decode_shape(4, 13)


# ----------------------------------------------------------------------- sparse (V3.2)


@pytest.fixture
def sparse_planner(monkeypatch):
    calls = sparse_planner_stand_in(monkeypatch)
    if V033:  # vLLM 0.33 maps tokens to requests with a Triton kernel
        from vllm.v1.attention.ops import metadata

        monkeypatch.setattr(metadata, "compute_token_to_req_indices", token_to_req_indices_twin)
    return calls


def _sparse_builder(cfg, cache_dtype="auto"):
    from mla_backend.vllm.sparse import MLASparseBackend

    return MLASparseBackend.get_builder_cls()(mla_spec(cache_dtype), [add_layer(cfg)], cfg,
                                              torch.device("cpu"))


def test_request_of_token_maps_mixed_batches():
    if V033:  # vLLM 0.33's common path maps tokens itself (token_to_req_indices)
        from tests.cpu.vllm_env import token_to_req_indices_twin as mapping

        def request_of_token(qsl):
            return mapping(qsl, torch.zeros(6, dtype=torch.int32), 6, 6)
    else:
        from mla_backend.vllm.sparse_own_path import request_of_token
    # two decodes, a 3-token prefill, a 1-token prefill; then graph padding (empty requests)
    qsl = torch.tensor([0, 1, 2, 5, 6, 6, 6], dtype=torch.int32)
    assert request_of_token(qsl).tolist() == [0, 1, 2, 2, 2, 3]


def test_sparse_builder_plans_the_rows_our_kernel_gets(tmp_path, sparse_planner):
    cfg = vllm_config(model_dir(tmp_path, **V32))
    b = _sparse_builder(cfg)
    assert b.workspace == ("ws", 4096, 16) and b.reorder_batch_threshold == 1
    # two decodes (seq 10, 70), then a 5-token prompt
    m = b.build(0, common([1, 1, 5], [10, 70, 5]))
    assert m.req_id_per_token.tolist() == [0, 1, 2, 2, 2, 2, 2]
    assert m.block_table[:, 0].tolist() == [7, 15, 23]
    if V033:
        # the prompt (5 <= index_topk 256 tokens) runs on vLLM's dense MLA prefill: our
        # kernel gets the 2 decode rows
        assert (m.num_decodes, m.num_decode_tokens, m.num_prefills) == (2, 2, 1)
        assert m.prefill.use_dense_mha and m.topk_tokens == 256 and m.block_size == 64
        assert sparse_planner == [(2, 1, 16, 256, ("ws", 4096, 16), torch.bfloat16)]
        assert m.plan.batch == 2
    else:  # every token of the step comes to our kernel
        assert m.num_actual_tokens == 7 and b.req_id_per_token[7:].eq(0).all()
        assert sparse_planner == [(7, 1, 16, 256, ("ws", 4096, 16), torch.bfloat16)]
    # the plan is tuned for the cache format
    cfg8 = vllm_config(model_dir(tmp_path, **V32), cache_dtype="fp8_ds_mla")
    _sparse_builder(cfg8, "fp8_ds_mla").build(0, common([1], [10]))
    assert sparse_planner[-1] == (1, 1, 16, 256, ("ws", 4096, 16), torch.uint8)


def test_sparse_builder_long_prefills_take_our_kernel(tmp_path, sparse_planner):
    """A prefill whose sequence is longer than index_topk keeps sparse attention: on vLLM
    0.33 all tokens of such a step come to our kernel, as every step does on 0.25."""
    b = _sparse_builder(vllm_config(model_dir(tmp_path, **V32)))
    # a decode (seq 900), then 3 new tokens of a 300-token request (context 297)
    m = b.build(0, common([1, 3], [900, 300]))
    assert m.req_id_per_token.tolist() == [0, 1, 1, 1]
    assert sparse_planner[-1][:4] == (4, 1, 16, 256)
    if V033:
        assert (m.num_decode_tokens, m.num_prefills) == (1, 1)
        assert not m.prefill.use_dense_mha and m.plan.batch == 4


def test_sparse_builder_prefill_only_step(tmp_path, sparse_planner):
    # two new prompts of 5 and 40 tokens: on vLLM 0.33 both run on vLLM's dense MLA prefill
    # and our kernel gets no row (an empty plan: the closed-form planner launches nothing)
    b = _sparse_builder(vllm_config(model_dir(tmp_path, **V32)))
    b.build(0, common([5, 40], [5, 40]))
    assert sparse_planner[-1][:4] == ((0 if V033 else 45), 1, 16, 256)


def test_sparse_builder_padded_cuda_graph_rows(tmp_path, sparse_planner):
    # a FULL graph captured for 4 decode tokens replayed with 2 requests: the padding
    # tokens map to request 0 and are planned with the rest
    b = _sparse_builder(vllm_config(model_dir(tmp_path, **V32)))
    m = b.build(0, common([1, 1], [40, 9], num_tokens=4))
    assert sparse_planner[-1][:4] == (4, 1, 16, 256)
    assert m.req_id_per_token.tolist() == [0, 1, 0, 0]


def test_sparse_builder_refuses_engine_limits(tmp_path, sparse_planner):
    with pytest.raises(ValueError, match="index_topk 200"):
        _sparse_builder(vllm_config(model_dir(tmp_path, **{**V32, "index_topk": 200})))
