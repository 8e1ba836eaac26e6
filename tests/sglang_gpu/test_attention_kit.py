"""SGLang's own attention test kit (sglang.test.kits.attention_unittest, shipped in the 0.5.17
wheel) run against mla_backend, with SGLang's flashmla backend on the same cases as the
control: each case builds the backend through SGLang's registry, runs a tiny absorbed-MLA
module (real KV pool on shuffled pages) and compares with the kit's PyTorch reference, at the
kit's tolerances. The cases are those SGLang runs for flashmla (page 64, boundaries), plus
decode at 16 and 128 heads (both kernel tiles) and bf16."""


import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.test.kits.attention_unittest.attention_methods.mla_attention import (
    MLAAttentionCase,
    run_mla_attention_case,
)
from sglang.test.kits.attention_unittest.runner_modes.cuda_graph_decode_runner import (
    run_mla_cuda_graph_decode_case,
)
from sglang.test.kits.attention_unittest.runner_modes.speculative_draft_extend_runner import (
    run_mla_draft_extend_v2_cuda_graph_case,
)
from sglang.test.kits.attention_unittest.runner_modes.speculative_target_verify_runner import (
    run_mla_eagle_verify_case,
    run_mla_eagle_verify_cuda_graph_case,
)
from sglang.test.kits.attention_unittest.runner_modes.split_op_runner import (
    run_mla_split_op_extend_case,
)

from mla_backend.sglang import registration
from tests.sglang_gpu import kit_cases

pytestmark = pytest.mark.gpu
BACKENDS = ["mla_backend", "flashmla"]
SHAPE = dict(kv_lora_rank=512, qk_rope_head_dim=64, hidden_size=1024, max_context_len=256)


@pytest.fixture(scope="module", autouse=True)
def registered():
    registration.register()


def _case(name, backend, mode, prefix, extend=(), heads=4):
    return MLAAttentionCase(name=name, backend=backend, forward_mode=mode, num_heads=heads,
                            page_size=64, prefix_lens=prefix, extend_lens=extend)


EAGER = [
    ("extend_zero_prefix_exact_page", ForwardMode.EXTEND, (0,), (64,), 4),
    ("extend_cross_page_boundary", ForwardMode.EXTEND, (63,), (2,), 4),
    ("extend_ragged_page_boundary", ForwardMode.EXTEND, (0, 32, 64), (63, 32, 1), 4),
    ("decode_page_boundary", ForwardMode.DECODE, (61, 62, 63), (), 4),
    ("decode_pages_h16", ForwardMode.DECODE, (0, 63, 64, 127, 200), (), 16),
    ("decode_pages_h128", ForwardMode.DECODE, (1, 64, 129, 255), (), 128),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, mode, prefix, extend, heads", EAGER, ids=[c[0] for c in EAGER])
def test_eager(backend, name, mode, prefix, extend, heads):
    run_mla_attention_case(kit_cases.KitTestCase(), _case(name, backend, mode, prefix, extend, heads), **SHAPE)


@pytest.mark.parametrize("backend", BACKENDS)
def test_eager_bf16_decode(backend):
    case = _case("decode_bf16_page_boundary", backend, ForwardMode.DECODE, (63, 64, 130))
    run_mla_attention_case(kit_cases.KitTestCase(), case, dtype=torch.bfloat16, **SHAPE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prefix", [(61, 62, 63), (5, 64, 190)], ids=["pad1", "pad1_pages"])
def test_cuda_graph_decode(backend, prefix):
    # captured for 4 requests, replayed with 3: one padded row
    run_mla_cuda_graph_decode_case(
        kit_cases.KitTestCase(), _case("runner_cuda_graph_decode", backend, ForwardMode.DECODE, prefix), **SHAPE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("breakable", [False, True], ids=["pcg", "bcg"])
def test_split_op_extend(backend, breakable):
    case = _case("runner_split_op_ragged_page_boundary", backend, ForwardMode.EXTEND,
                 (0, 32, 64), (63, 32, 1))
    run_mla_split_op_extend_case(kit_cases.KitTestCase(), case, breakable=breakable, static_num_tokens=96,
                                 **SHAPE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prefix, drafts", kit_cases.VERIFY, ids=kit_cases.VERIFY_IDS)
def test_eagle_verify(backend, prefix, drafts):
    case = _case("runner_eagle_verify_chain", backend, ForwardMode.TARGET_VERIFY, prefix, drafts)
    run_mla_eagle_verify_case(kit_cases.KitTestCase(), case, topk=1, **SHAPE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prefix, drafts", kit_cases.VERIFY_GRAPH, ids=kit_cases.VERIFY_GRAPH_IDS)
def test_eagle_verify_cuda_graph(backend, prefix, drafts):
    # prefixes within one page: the kit's graph runner rewrites longer ones over the fixture's
    # shuffled pages (kit_cases.py); 5 drafts still cross into the next page
    case = _case(kit_cases.GRAPH_CASE_NAME, backend, ForwardMode.TARGET_VERIFY, prefix, drafts)
    run_mla_eagle_verify_cuda_graph_case(kit_cases.KitTestCase(), case, topk=1, **SHAPE)


@pytest.mark.parametrize("backend", BACKENDS)
def test_draft_extend_v2_cuda_graph(backend):
    case = _case("runner_draft_extend_v2", backend, ForwardMode.DRAFT_EXTEND_V2, (5, 62),
                 (3, 3))
    run_mla_draft_extend_v2_cuda_graph_case(kit_cases.KitTestCase(), case, **SHAPE)


def test_ours_ran_on_our_kernel():
    # the cases above must have gone through our decode path, not a fallback: a decode step
    # leaves our plan and page table in the backend's metadata
    from sglang.test.kits.attention_unittest.attention_methods.mla_attention import (
        build_mla_attention_fixture,
        run_mla_fixture_eager,
    )

    from mla_backend import ops
    from mla_backend.sglang.dense import DecodeMetadata, MLADenseBackend

    fixture = build_mla_attention_fixture(
        kit_cases.KitTestCase(), _case("decode_metadata", "mla_backend", ForwardMode.DECODE, (61, 130)), **SHAPE)
    assert isinstance(fixture.backend, MLADenseBackend)
    run_mla_fixture_eager(fixture)
    meta = fixture.backend.forward_metadata
    assert isinstance(meta, DecodeMetadata) and isinstance(meta.plan, ops.DecodePlan)
    assert meta.cache_seqlens_int32.tolist() == [62, 131]
    assert meta.page_table.shape[0] == 2 and meta.page_table.shape[1] >= 3
