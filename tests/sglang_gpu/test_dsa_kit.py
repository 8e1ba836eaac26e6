"""SGLang's attention test kit (sglang.test.kits.attention_unittest.attention_methods.
dsa_attention, shipped in the 0.5.17 wheel) on its DSA sparse cases, against mla_backend's DSA
backend, with SGLang's own dsa backend on the same cases as the control: each case builds the
backend through SGLang's registry over a real DSATokenToKVPool (shuffled pages), runs a tiny
absorbed-MLA module with the given top-k and compares with the kit's PyTorch reference at the
kit's tolerances.

The kit hands top-k *positions* (what SGLang's indexer returns with SGLANG_DSA_FUSE_TOPK=0,
mapped to cache slots by the backend), so these cases run with that setting; the fused
default, in which the indexer returns cache slots, is covered by converting the kit's
positions to slots through the fixture's req_to_token before the forward."""


import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.test.kits.attention_unittest.attention_methods import dsa_attention
from sglang.test.kits.attention_unittest.attention_methods.dsa_attention import (
    DSA_PAGE_SIZE,
    DSA_SPARSE_ATOL,
    DSA_SPARSE_RTOL,
    DSAAttentionCase,
    build_dsa_sparse_attention_fixture,
    expected_dsa_sparse_fixture_output,
    make_dsa_sparse_cases,
    run_dsa_sparse_attention_case,
    run_dsa_sparse_fixture_eager,
    run_dsa_sparse_fp8_decode_case,
    run_dsa_sparse_fp8_prefill_case,
    run_dsa_sparse_speculative_forward_mode_case,
)
from sglang.test.kits.attention_unittest.runner_modes import cuda_graph_decode_runner
from sglang.test.kits.attention_unittest.runner_modes.cuda_graph_decode_runner import (
    run_dsa_sparse_cuda_graph_decode_case,
)

from mla_backend.sglang import registration
from tests.sglang_gpu import kit_cases

pytestmark = pytest.mark.gpu
BACKENDS = ["mla_backend", "dsa"]


@pytest.fixture(scope="module", autouse=True)
def registered():
    registration.register()


# SGLang's unfused position -> slot transform (transform_index_page_table_*) takes only
# DeepSeek-V3.2's index_topk, 2048; the kit's cases are 128 wide
SGLANG_UNFUSED_TOPK = 2048


@pytest.fixture
def position_topk(monkeypatch, request):
    """The kit's top-k are positions: the unfused indexer's form. SGLang's `dsa` (the control)
    takes positions only 2048 wide, so its fixtures are built that wide (the kit's keys, then
    -1); ours runs the kit's own width."""
    monkeypatch.setenv("SGLANG_DSA_FUSE_TOPK", "0")
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or callspec.params.get("backend") != "dsa":
        return
    build = dsa_attention.build_dsa_sparse_attention_fixture

    def build_wide(testcase, case, **kwargs):
        kwargs["index_topk"] = SGLANG_UNFUSED_TOPK
        return build(testcase, case, **kwargs)

    # every kit runner looks the builder up in its own module at call time
    for module in (dsa_attention, cuda_graph_decode_runner):
        monkeypatch.setattr(module, "build_dsa_sparse_attention_fixture", build_wide)


def _case(name, backend, mode, prefix, extend=(), heads=4):
    return DSAAttentionCase(name=name, backend=backend, forward_mode=mode, num_heads=heads,
                            num_kv_heads=1, page_size=DSA_PAGE_SIZE, prefix_lens=prefix,
                            extend_lens=extend)


SPARSE_NAMES = [c.name for c in make_dsa_sparse_cases("dsa")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("index", range(len(SPARSE_NAMES)), ids=SPARSE_NAMES)
def test_sparse_cases(position_topk, backend, index):
    # SGLang's own list: sparse prefill above the dense threshold (one and several requests,
    # multi-token extends), decode with short / ragged / long prefixes and -1 padding
    run_dsa_sparse_attention_case(kit_cases.KitTestCase(), make_dsa_sparse_cases(backend)[index])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", ["strided", "head_tail"])
def test_non_trailing_index_patterns(position_topk, backend, pattern):
    case = _case(f"dsa_sparse_decode_{pattern}_index_long_prefix", backend, ForwardMode.DECODE,
                 (2048,))
    run_dsa_sparse_attention_case(kit_cases.KitTestCase(), case, index_pattern=pattern)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads", [16, 128])
def test_head_counts(position_topk, backend, heads):
    # ours runs every head count as it is; SGLang's flashmla kernels pad to 64 / 128
    case = _case(f"dsa_sparse_decode_h{heads}", backend, ForwardMode.DECODE, (64, 200, 2048),
                 heads=heads)
    run_dsa_sparse_attention_case(kit_cases.KitTestCase(), case)
    # prefixes above the dense threshold (2048 keys), where SGLang's dsa is sparse too
    case = _case(f"dsa_sparse_prefill_h{heads}", backend, ForwardMode.EXTEND, (2048, 2050),
                 (3, 1), heads=heads)
    run_dsa_sparse_attention_case(kit_cases.KitTestCase(), case)


def test_short_prefill_is_sparse_on_ours(position_topk):
    # keys <= index_topk: SGLang's dsa runs these on a dense MHA kernel (FA3, not in the kit);
    # ours runs them sparse (the top-k then holds every earlier key), checked against the
    # kit's reference alone
    case = _case("dsa_sparse_prefill_short", "mla_backend", ForwardMode.EXTEND, (0, 30, 64),
                 (70, 3, 1))
    run_dsa_sparse_attention_case(kit_cases.KitTestCase(), case)


@pytest.mark.parametrize("backend", BACKENDS)
def test_interleaved_page_layout(position_topk, backend):
    case = _case("layout_dsa_sparse_decode_long_prefix", backend, ForwardMode.DECODE, (2048,))
    run_dsa_sparse_attention_case(kit_cases.KitTestCase(), case, loc_layout="interleaved_pages")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", [ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2],
                         ids=["target_verify", "draft_extend_v2"])
def test_speculative_modes(position_topk, backend, mode):
    case = _case(f"dsa_sparse_{mode.name.lower()}", backend, mode, (128, 61), (3, 3))
    run_dsa_sparse_speculative_forward_mode_case(kit_cases.KitTestCase(), case)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_decode(position_topk, backend):
    # the 656-byte cache written by SGLang's quantizer; the kit's reference is the bf16 keys
    case = _case("dsa_sparse_fp8_decode", backend, ForwardMode.DECODE, (128, 70))
    run_dsa_sparse_fp8_decode_case(kit_cases.KitTestCase(), case, dsa_decode_backend="flashmla_kv")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_prefill(position_topk, backend):
    case = _case("dsa_sparse_fp8_prefill_paged_topk", backend, ForwardMode.EXTEND, (2048,),
                 (1,))
    run_dsa_sparse_fp8_prefill_case(kit_cases.KitTestCase(), case, dsa_prefill_backend="flashmla_kv")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_cuda_graph_decode(position_topk, backend, fp8):
    case = _case("runner_cuda_graph_dsa_sparse_decode", backend, ForwardMode.DECODE, (127, 128))
    run_dsa_sparse_cuda_graph_decode_case(kit_cases.KitTestCase(), case, fp8_kv_cache=fp8)


def _slot_topk(fixture) -> torch.Tensor:
    """The kit's top-k positions as cache slots (what the fused top-k kernel returns): token t
    of request r reads req_to_token[req_pool_indices[r], position], -1 stays -1."""
    fb, case = fixture.forward_batch, fixture.case
    table = fixture.runner.req_to_token_pool.req_to_token
    tokens = case.input_lens
    request = torch.repeat_interleave(torch.arange(len(tokens)), torch.tensor(tokens))
    rows = table[fb.req_pool_indices.cpu()[request].to(table.device)]
    pos = fixture.topk_indices.long()
    slots = torch.gather(rows, 1, pos.clamp_min(0))
    return torch.where(pos >= 0, slots, -1).to(torch.int32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode, prefix, extend", [
    (ForwardMode.DECODE, (64, 200, 2048), ()), (ForwardMode.EXTEND, (2048, 0), (4, 70))],
    ids=["decode", "extend"])
def test_fused_topk_slots(backend, mode, prefix, extend):
    # SGLang's default: the indexer's top-k kernel returns cache slots
    fixture = build_dsa_sparse_attention_fixture(
        kit_cases.KitTestCase(), _case(f"dsa_sparse_fused_{mode.name.lower()}", backend, mode, prefix, extend))
    assert fixture.backend.use_fused_topk
    fixture.topk_indices = _slot_topk(fixture)
    actual = run_dsa_sparse_fixture_eager(fixture, kit_cases.KitTestCase())
    expected = expected_dsa_sparse_fixture_output(fixture)
    torch.testing.assert_close(actual, expected, atol=DSA_SPARSE_ATOL, rtol=DSA_SPARSE_RTOL)


def test_ours_ran_on_our_kernel(position_topk):
    # the cases above went through our sparse path, not the parent's kernels: a forward
    # leaves our plan (one request per query token, the kit's top-k width)
    from mla_backend import ops
    from mla_backend.sglang.dsa import MLASparseBackend

    case = _case("dsa_sparse_decode_metadata", "mla_backend", ForwardMode.DECODE, (61, 130))
    fixture = build_dsa_sparse_attention_fixture(kit_cases.KitTestCase(), case)
    assert isinstance(fixture.backend, MLASparseBackend)
    actual = run_dsa_sparse_fixture_eager(fixture, kit_cases.KitTestCase())
    plan = fixture.backend._plan
    assert isinstance(plan, ops.SparsePlan)
    assert (plan.batch, plan.q_tokens_per_req, plan.topk) == (2, 1, fixture.index_topk)
    torch.testing.assert_close(actual, expected_dsa_sparse_fixture_output(fixture),
                               atol=DSA_SPARSE_ATOL, rtol=DSA_SPARSE_RTOL)
