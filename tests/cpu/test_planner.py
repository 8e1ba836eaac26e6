"""Split-KV planner arithmetic (the Python twin of the GPU planner)."""

from itertools import pairwise

import pytest
import torch

from mla_backend import reference as ref


@pytest.mark.parametrize("lens,num_ctas,min_units", [
    ([0], 4, 4), ([1], 132, 4), ([4096] * 128, 132, 4), ([0, 100, 33, 5000, 1], 8, 4),
    ([17, 0, 0, 900, 64, 65, 16384, 2], 66, 2), (list(range(0, 3000, 7)), 33, 4),
])
def test_every_unit_once_and_partial_slots_unique(lens, num_ctas, min_units):
    seq = torch.tensor(lens, dtype=torch.int32)
    meta = ref.plan_decode_metadata(seq, num_ctas, min_units)
    units = [-(-n // 32) for n in lens]
    assert meta[:-1].tolist() == [0] + torch.cumsum(torch.tensor(units), 0).tolist()
    sched = ref.decode_schedule(meta, num_ctas)
    covered = [[0] * u for u in units]
    slots = set()
    for cta, pieces in enumerate(sched):
        assert len([p for p in pieces if p[3] >= 0]) <= 2
        for r, lo, hi, slot in pieces:
            for u in range(lo, hi):
                covered[r][u] += 1
            if slot >= 0:
                assert (cta, slot) not in slots
                slots.add((cta, slot))
    assert all(c == 1 for row in covered for c in row)
    prefix, per_cta = meta[:-1].tolist(), int(meta[-1])
    for r, u in enumerate(units):
        holders = [(c, p) for c, ps in enumerate(sched) for p in ps if p[0] == r]
        if u == 0:
            assert holders == []  # an empty request costs no CTA
            continue
        # held by the CTAs from the one with its first unit to the one with its last, in order
        first, last = prefix[r] // per_cta, (prefix[r] + u - 1) // per_cta
        assert [c for c, _ in holders] == list(range(first, last + 1))
        # written directly iff one CTA holds all of it
        assert all((p[3] == -1) == (first == last) for _, p in holders)


def test_schedule_worked_by_hand():
    # units (32 keys each) [0, 4, 2, 157, 1] = 164 over 8 CTAs: 21 per CTA. Request 1 holds
    # units 0-3, request 2 4-5 (both inside CTA 0), request 3 6-162 (CTAs 0-7), request 4 163
    meta = ref.plan_decode_metadata(torch.tensor([0, 100, 33, 5000, 1], dtype=torch.int32), 8, 4)
    assert meta.tolist() == [0, 0, 4, 6, 163, 164, 21]
    sched = ref.decode_schedule(meta, 8)
    assert sched[0] == [(1, 0, 4, -1), (2, 0, 2, -1), (3, 0, 15, 1)]
    for cta in range(1, 7):
        assert sched[cta] == [(3, 15 + 21 * (cta - 1), 15 + 21 * cta, 0)]
    assert sched[7] == [(3, 141, 157, 0), (4, 0, 1, -1)]


def test_units_per_cta_balances_and_respects_minimum():
    seq = torch.tensor([4096] * 128, dtype=torch.int32)
    meta = ref.plan_decode_metadata(seq, 132, 4)
    assert int(meta[-1]) == -(-128 * 128 // 132)
    assert int(ref.plan_decode_metadata(torch.tensor([64], dtype=torch.int32), 132, 4)[-1]) == 4


@pytest.mark.parametrize("lens,unit,num_ctas,extra,want", [
    ([8192] * 64, 64, 66, 4, 128),   # SGLang's decode bench at H 128: one request a CTA
    ([8192] * 64, 64, 66, 2, 128),   # 3 units above 125: 2 is less than 125 // 32 = 3
    ([4096] * 30, 64, 31, 1, 62),    # 2 units above 62: more than 1 and than 62 // 32
    ([8192] * 64, 64, 66, -1, 125),  # never
    ([4096] * 128, 64, 66, 4, 128),  # two requests a CTA
    ([4096] * 128, 64, 132, 4, 64),  # the balanced share is already one request
    ([8192] * 128, 64, 66, 4, 256),  # 7 units above 249: more than 4, within 249 // 32
    ([8192] * 67, 64, 66, 4, 130),   # two requests (256) would double the share of 130
    ([1024] * 32, 64, 66, 4, 8),     # one request (16) would double the share of 8
    ([700] * 8, 64, 132, 4, 2),      # one request (11 units) a CTA would be 9 above 2
    ([100] * 4, 64, 132, 4, 2),      # 2-unit requests: the minimum is a whole request
    ([8192] * 63 + [8128], 64, 66, 4, 125),  # lengths differ by one unit: balanced
    ([0] * 5, 64, 66, 4, 2),         # no keys at all: the minimum
])
def test_equal_lengths_take_whole_requests_when_it_costs_few_units(lens, unit, num_ctas, extra,
                                                                    want):
    seq = torch.tensor(lens, dtype=torch.int32)
    meta = ref.plan_decode_metadata(seq, num_ctas, 2, unit, extra)
    assert int(meta[-1]) == want
    if len(set(lens)) == 1 and lens[0] > 0 and want % -(-lens[0] // unit) == 0:
        # whole requests: no request is split over CTAs, so no partial slot is used
        assert all(p[3] == -1 for ps in ref.decode_schedule(meta, num_ctas) for p in ps)


# ---- aligned plans: every request on CTAs of its own when that costs few units a CTA

@pytest.mark.parametrize("lens,num_ctas,min_units,extra", [
    ([1190, 978, 777, 1151], 132, 2, 1),                     # the bench's batch 4 at 1k
    ([0, 100, 33, 5000, 1], 8, 4, 40),
    ([17, 0, 0, 900, 64, 65, 16384, 2], 66, 2, 2),
    (torch.randint(0, 2000, (32,), generator=torch.Generator().manual_seed(3)).tolist(),
     132, 2, 1),
])
def test_aligned_plan_starts_every_request_on_a_cta_and_covers_its_units_once(lens, num_ctas,
                                                                              min_units, extra):
    seq = torch.tensor(lens, dtype=torch.int32)
    units = [-(-n // 64) for n in lens]
    packed = ref.plan_decode_metadata(seq, num_ctas, min_units, 64)
    meta = ref.plan_decode_metadata(seq, num_ctas, min_units, 64, align_extra=extra)
    prefix, U = meta[:-1].tolist(), int(meta[-1])
    assert int(packed[-1]) <= U <= int(packed[-1]) + extra
    assert all(p % U == 0 for p in prefix)                    # every start on a CTA boundary
    assert [-(-(b - a) // U) for a, b in pairwise(prefix)] == \
        [-(-u // U) for u in units]                           # padding below one CTA's share
    assert prefix[-1] // U <= num_ctas
    sched = ref.decode_schedule(meta, num_ctas, units)
    assert all(len(pieces) <= 1 for pieces in sched)          # one piece a CTA: no restart
    covered = [[0] * u for u in units]
    for pieces in sched:
        for r, lo, hi, slot in pieces:
            assert lo < hi and (slot == -1) == (units[r] <= U)
            for u in range(lo, hi):
                covered[r][u] += 1
    assert all(c == 1 for row in covered for c in row)


def test_aligned_plan_worked_by_hand():
    # pages [19, 16, 13, 18] = 66 on 132 CTAs: balanced 1, minimum 2. U = 2 gives
    # 10 + 8 + 7 + 9 = 34 CTAs, every request starting on one: P = [0, 20, 36, 50, 68]
    seq = torch.tensor([1190, 978, 777, 1151], dtype=torch.int32)
    meta = ref.plan_decode_metadata(seq, 132, 2, 64, align_extra=0)
    assert meta.tolist() == [0, 20, 36, 50, 68, 2]
    # packed, requests 1 and 2 start inside CTAs 9 and 17 (units 19 and 35)
    assert ref.plan_decode_metadata(seq, 132, 2, 64).tolist() == [0, 19, 35, 48, 66, 2]


@pytest.mark.parametrize("lens,num_ctas,extra,why", [
    ([1000] * 200, 132, 4, "more requests than CTAs"),
    ([5000], 132, 4, "one request: no start inside a CTA to avoid"),
    ([0, 100, 33, 5000, 1], 8, 1, "pages [0, 2, 1, 79, 1] need 10 CTAs at U = 11 + 1"),
    ([64 * 9] * 16 + [64 * 7], 16, 0, "U = 8 needs 2 CTAs for each 9-page request"),
    ([4096] * 64, 132, 1, "equal lengths: whole requests first"),
])
def test_aligned_plan_not_taken(lens, num_ctas, extra, why):
    seq = torch.tensor(lens, dtype=torch.int32)
    meta = ref.plan_decode_metadata(seq, num_ctas, 2, 64, whole_extra=4, align_extra=extra)
    packed = ref.plan_decode_metadata(seq, num_ctas, 2, 64, whole_extra=4)
    assert torch.equal(meta, packed), why


# ---- padded plans: a CTA that restarts for a second piece gets fewer units

def test_padded_plan_worked_by_hand():
    # pages [5, 3, 6, 2] = 16 on 4 CTAs, pad 2. U = 4: 5 + 2 | 3 + 2 (to the boundary) | 6 + 2 | 2
    # = 22 > 16. U = 5: 5 (ends on a boundary) | 3 + 2 | 6 + 2 (its 6th unit in CTA 3) | 2 = 20
    seq = torch.tensor([300, 192, 384, 100], dtype=torch.int32)
    assert ref.plan_decode_metadata(seq, 4, 1, 64, restart_pad=2).tolist() == [0, 5, 10, 18, 20, 5]
    assert ref.plan_decode_metadata(seq, 4, 1, 64).tolist() == [0, 5, 8, 14, 16, 4]
    # CTA 3 holds request 2's last unit and request 3: 3 units of keys and one restart
    assert ref.decode_schedule(ref.plan_decode_metadata(seq, 4, 1, 64, restart_pad=2), 4,
                               [5, 3, 6, 2])[3] == [(2, 5, 6, 0), (3, 0, 2, -1)]


@pytest.mark.parametrize("seed,batch,num_ctas,pad", [(1, 32, 132, 4), (2, 128, 66, 4), (3, 40, 33, 3),
                                                     (4, 256, 132, 4), (5, 9, 8, 1), (6, 64, 132, 0)])
def test_padded_plan_keeps_padding_in_the_ending_cta_and_covers_units_once(seed, batch, num_ctas, pad):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 9000, (batch,), generator=g)
    lens[::7] = 0  # empty requests are skipped, not padded
    seq = lens.to(torch.int32)
    units = [-(-int(n) // 64) for n in lens]
    packed = ref.plan_decode_metadata(seq, num_ctas, 2, 64)
    meta = ref.plan_decode_metadata(seq, num_ctas, 2, 64, restart_pad=pad)
    prefix, U = meta[:-1].tolist(), int(meta[-1])
    assert int(packed[-1]) <= U < int(packed[-1]) + 32 and prefix[-1] <= num_ctas * U
    for r, (a, b) in enumerate(pairwise(prefix)):
        gap = b - a - units[r]
        assert 0 <= gap <= pad and (gap == 0 or (units[r] > 0 and r < batch - 1)), (r, a, b)
        if units[r] > 0:  # the padding ends in the CTA of the request's last unit
            assert (a + units[r] - 1) // U == (b - 1) // U, (r, a, b, U)
            assert gap == (min(pad, -(a + units[r]) % U) if r < batch - 1 else 0)
    covered = [[0] * u for u in units]
    for pieces in ref.decode_schedule(meta, num_ctas, units):
        for r, lo, hi, _slot in pieces:
            assert lo < hi, "a CTA with nothing of a request's keys"
            for u in range(lo, hi):
                covered[r][u] += 1
    assert all(c == 1 for row in covered for c in row)


@pytest.mark.parametrize("lens,num_ctas,why", [
    ([1000] * 3 + [7000] * 254, 132, "more requests than kPadMaxBatch"),
    ([5000], 132, "one request"),
    ([1190, 978, 777, 1151], 132, "an aligned plan fits first"),
    ([4096] * 64, 132, "equal lengths: whole requests first"),
])
def test_padded_plan_not_taken(lens, num_ctas, why):
    seq = torch.tensor(lens, dtype=torch.int32)
    meta = ref.plan_decode_metadata(seq, num_ctas, 2, 64, whole_extra=4, align_extra=1, restart_pad=4)
    other = ref.plan_decode_metadata(seq, num_ctas, 2, 64, whole_extra=4, align_extra=1)
    assert torch.equal(meta, other), why


# ---- the split minimum and the workspace's partial buffers (mla_backend.ops.dense)

def test_min_units_rounds_up_and_reads_the_minimum_at_call_time(monkeypatch):
    from mla_backend.ops import cost_model

    assert cost_model._min_units(64) == -(-cost_model.MIN_TOKENS_PER_CTA // 64)
    assert [cost_model._min_units(u, 256) for u in (32, 64)] == [8, 4]
    assert [cost_model._min_units(u, 100) for u in (32, 64)] == [4, 2]
    monkeypatch.setattr(cost_model, "MIN_TOKENS_PER_CTA", 512)
    assert [cost_model._min_units(u) for u in (32, 64)] == [16, 8]


def test_small_step_takes_one_unit_per_cta():
    # one request of 1000 keys: 16 pages; two pages a CTA, or one when the step has at most
    # one_unit_max units in all
    seq = torch.tensor([1000], dtype=torch.int32)
    assert ref.plan_decode_metadata(seq, 132, 2, 64).tolist() == [0, 16, 2]
    assert ref.plan_decode_metadata(seq, 132, 2, 64, one_unit_max=24).tolist() == [0, 16, 1]
    assert ref.plan_decode_metadata(seq, 132, 2, 64, one_unit_max=15).tolist() == [0, 16, 2]
    # 3 requests, 21 pages: aligned on one-page CTAs (every start on a boundary either way)
    seq = torch.tensor([700, 0, 600], dtype=torch.int32)
    assert ref.plan_decode_metadata(seq, 132, 2, 64, align_extra=1).tolist() == [0, 12, 12, 22, 2]
    assert ref.plan_decode_metadata(seq, 132, 2, 64, align_extra=1,
                                    one_unit_max=24).tolist() == [0, 11, 11, 21, 1]


def test_no_request_split_over_more_than_the_cap_of_ctas():
    # one request of 16k keys (256 pages) on 132 one-tile CTAs: 3 pages a CTA (86 CTAs), not 2
    # (128); 8k keys keep 2 (64 CTAs); at 66 CTAs (two row tiles) the cap never binds
    cap = ref.MAX_CTAS_PER_REQUEST
    for keys, u_want in ((8192, 2), (16384, 3), (32768, 6)):
        meta = ref.plan_decode_metadata(torch.tensor([keys], dtype=torch.int32), 132, 2, 64)
        assert int(meta[-1]) == u_want and -(-(keys // 64) // u_want) <= cap
    meta = ref.plan_decode_metadata(torch.tensor([16384], dtype=torch.int32), 66, 2, 64)
    assert int(meta[-1]) == 4
    # a batch whose longest request would otherwise take 114 CTAs: U rises to 12 (86 CTAs for it)
    seq = torch.tensor([65536, 1000, 1000, 1000], dtype=torch.int32)
    meta = ref.plan_decode_metadata(seq, 132, 2, 64, align_extra=1, restart_pad=4)
    assert int(meta[-1]) >= 12 and -(-1024 // int(meta[-1])) <= cap


def test_planner_knobs_give_small_steps_one_page_up_to_four_row_tiles(monkeypatch):
    from mla_backend.ops import cost_model, dense

    knobs = dense._planner_knobs(16, 64, 64, False, False)  # H 16, s_q 1, bf16, wgmma
    assert knobs["min_units"] == 2 and knobs["one_unit_max"] == cost_model.DENSE_ONE_PAGE_MAX_PAGES
    assert dense._planner_knobs(256, 64, 64, False, False)["one_unit_max"] >= 0  # 4 tiles
    assert dense._planner_knobs(257, 64, 64, False, False)["one_unit_max"] == -1  # 5 tiles
    assert dense._planner_knobs(512, 64, 64, False, False)["one_unit_max"] == -1  # H 128, s_q 4
    assert dense._planner_knobs(16, 16, 32, True, False)["one_unit_max"] == -1  # mma.sync
    assert dense._planner_knobs(16, 64, 64, False, False, 128)["one_unit_max"] == -1  # override
    assert dense._planner_knobs(16, 64, 64, False, True)["lpt_extra"] == max(
        cost_model.DENSE_LPT_EXTRA_UNITS, 0)
    monkeypatch.setattr(cost_model, "DENSE_ONE_PAGE_MAX_PAGES", -1)
    assert dense._planner_knobs(16, 64, 64, False, False)["one_unit_max"] == -1  # never


def test_dense_min_units_takes_one_page_only_for_fp8_in_one_wgmma_row_tile(monkeypatch):
    from mla_backend.ops import cost_model, dense

    # (unit_tokens, rows, rows_per_cta, kv_fp8) -> units: 128 keys, but 64 for fp8 on the
    # wgmma kernel (64-key units) when every row fits its 64-row tile
    assert dense._dense_min_units(64, 16, 64, True) == 1    # H 16, s_q 1
    assert dense._dense_min_units(64, 64, 64, True) == 1    # H 64, s_q 1: a full tile
    assert dense._dense_min_units(64, 65, 64, True) == 2    # two tiles
    assert dense._dense_min_units(64, 128, 64, True) == 2   # H 128
    assert dense._dense_min_units(64, 16, 64, False) == 2   # 16-bit cache
    assert dense._dense_min_units(32, 16, 16, True) == 4    # the mma.sync kernel's 32-key units
    assert dense._dense_min_units(64, 16, 64, True, 256) == 4  # an explicit minimum wins
    monkeypatch.setattr(cost_model, "MIN_TOKENS_PER_CTA_FP8_ONE_TILE", 192)
    assert dense._dense_min_units(64, 16, 64, True) == 3    # read at each call


@pytest.fixture
def partial_width(monkeypatch):
    """Stand in for the extension's dense_partial_bytes (2 or 4) without loading it."""
    from mla_backend import _extension
    from mla_backend.ops import dense

    monkeypatch.setattr(_extension, "require", lambda op: None)

    def set_width(width: int) -> None:
        monkeypatch.setattr(dense, "_partial_bytes", [width])
    return set_width


@pytest.mark.parametrize("width,dtype", [(4, torch.float32), (2, torch.bfloat16)])
def test_workspace_partials_follow_the_build(partial_width, width, dtype):
    from mla_backend.ops import dense

    partial_width(width)
    ws = dense._workspace(8, range(1, 3), 128, False, torch.device("cpu"), 132, "decode_workspace")
    # s_q 2 x H 128: 4 tiles of 64 rows, 33 CTAs, two partial slots each; s_q 1: 66 CTAs
    rows = max(2 * 66 * 128, 2 * 33 * 256)
    assert ws.partial_out.dtype == dtype and ws.partial_out.numel() == rows * 512
    assert ws.partial_lse.dtype == torch.float32 and ws.partial_lse.numel() == rows
    plan = ws.plan_view(8, 2)
    assert plan.partial_out.shape == (66, 256, 512) and plan.partial_out.dtype == dtype
    assert plan.partial_out.data_ptr() == ws.partial_out.data_ptr()


@pytest.mark.parametrize("max_batch,heads,kv_fp8,ctas", [
    (64, 16, False, 132),  # 16-bit: the wgmma kernel at every batch, one 64-row tile, 132 CTAs
    (15, 8, True, 132),    # fp8 below MMA_MIN_BATCH_FP8: wgmma only
    (16, 8, True, 264),    # fp8 from 16 requests, up to 8 rows: the mma.sync kernel's 2 CTAs per SM
    (64, 16, True, 132),   # fp8 above MMA_MAX_ROWS_FP8 rows: wgmma at every batch
])
def test_workspace_partials_sized_for_the_kernels_the_rule_can_take(partial_width, max_batch,
                                                                    heads, kv_fp8, ctas):
    from mla_backend.ops import dense

    partial_width(2)
    ws = dense._workspace(max_batch, [1], heads, kv_fp8, torch.device("cpu"), 132,
                          "decode_workspace")
    assert ws.partial_lse.numel() == 2 * ctas * heads
    plan = ws.plan_view(max_batch, 1)  # the largest batch's plan fits the buffers
    assert plan.partial_out.shape == (2 * plan.num_ctas, heads, 512)
    assert plan.rows_per_cta == (16 if ctas == 264 else 64)


def test_partials_reach_the_kernel_in_q_dtype():
    from mla_backend.ops import dense

    f32 = torch.zeros(2, 16, 512)
    b16 = torch.zeros(2, 16, 512, dtype=torch.bfloat16)
    assert dense._partials_as(f32, torch.float16) is f32  # float32 partials: as they are
    assert dense._partials_as(b16, torch.bfloat16) is b16
    as_half = dense._partials_as(b16, torch.float16)  # 16-bit ones: the same bytes as q's dtype
    assert as_half.dtype == torch.float16 and as_half.data_ptr() == b16.data_ptr()
    assert as_half.shape == b16.shape


def test_decode_workspace_needs_the_extension_and_says_so(monkeypatch, tmp_path):
    from mla_backend import _extension, ops
    from mla_backend.ops import dense

    monkeypatch.setitem(_extension._state, "loaded", False)
    monkeypatch.setitem(_extension._state, "error", None)
    monkeypatch.setenv("MLA_BACKEND_EXTENSION", str(tmp_path / "missing_C.abi3.so"))
    monkeypatch.setattr(dense, "_partial_bytes", [])
    with pytest.raises(_extension.ExtensionNotBuiltError,
                       match="mla_backend.ops.decode_workspace needs the CUDA extension"):
        ops.decode_workspace(4, 1, 16, device="cuda", num_sms=132)


def test_longest_first_plan_worked_by_hand():
    """Units [1, 3, 2, 2] on 2 CTAs, in rounds of 2: 3 -> CTA 0, 2 -> CTA 1; then CTA 1 is the
    less loaded (2 < 3): 2 -> CTA 1, 1 -> CTA 0. U 4, order [1, 0, 2, 3], each CTA's last
    request padded to its end."""
    seq = torch.tensor([64, 192, 128, 128], dtype=torch.int32)
    meta = ref.plan_decode_metadata(seq, 2, 1, 64, lpt_extra=0)
    assert meta.tolist() == [0, 3, 4, 6, 8, 4, 1, 0, 2, 3]


def test_longest_first_plan_deals_a_round_by_the_loads_before_it():
    """Units [5, 1, 1, 1] on 2 CTAs: 5 -> CTA 0, 1 -> CTA 1; the second round goes by the loads
    before it (CTA 1 then CTA 0): 1 -> CTA 1, 1 -> CTA 0. U 6 (a one-by-one greedy would put
    both on CTA 1: U 5); taken at lpt_extra 2, not at 1 (the balanced share is 4)."""
    seq = torch.tensor([320, 64, 64, 64], dtype=torch.int32)
    meta = ref.plan_decode_metadata(seq, 2, 1, 64, lpt_extra=2)
    assert meta.tolist() == [0, 5, 6, 7, 12, 6, 0, 3, 1, 2]
    refused = ref.plan_decode_metadata(seq, 2, 1, 64, lpt_extra=1)
    assert refused[6:].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("seed,batch,num_ctas", [(0, 128, 66), (1, 128, 33), (2, 256, 66),
                                                 (3, 32, 16), (4, 130, 66)])
def test_longest_first_plan_splits_nothing_and_covers_every_unit_once(seed, batch, num_ctas):
    gen = torch.Generator().manual_seed(seed)
    lens = (torch.rand(batch, generator=gen) * 1024 + 512).to(torch.int32)
    lens[::17] = 0  # requests with no keys sit at the end of the order
    meta = ref.plan_decode_metadata(lens, num_ctas, 2, 64, restart_pad=4, lpt_extra=8)
    assert meta.shape == (2 * batch + 2,)
    prefix, per_cta, perm = meta[:batch + 1].tolist(), int(meta[batch + 1]), meta[batch + 2:].tolist()
    assert sorted(perm) == list(range(batch)) and perm != list(range(batch))
    units = [-(-int(lens[b]) // 64) for b in perm]  # in the plan's order
    assert all(lo <= hi for lo, hi in pairwise(prefix)) and prefix[-1] == num_ctas * per_cta
    balanced = -(-sum(units) // num_ctas)
    assert per_cta - balanced <= max(8, balanced // ref.WHOLE_SHARE_DIVISOR)
    sched = ref.decode_schedule(meta[:batch + 2], num_ctas, units)
    held = [0] * batch
    for pieces in sched:
        assert pieces, "every CTA has a request"
        for v, lo, hi, slot in pieces:
            assert slot == -1 and lo == 0 and hi == units[v]  # whole, written directly
            held[v] += 1
    assert held == [1 if u > 0 else 0 for u in units]


@pytest.mark.parametrize("lens,num_ctas", [
    ([1000] * 10, 16),          # fewer requests with keys than CTAs
    ([4096] * 128, 66),         # equal lengths: the whole-request plan
    ([64] * 60 + [0] * 10, 66),  # too few with keys
])
def test_longest_first_plan_falls_back_to_the_plan_in_order(lens, num_ctas):
    seq = torch.tensor(lens, dtype=torch.int32)
    meta = ref.plan_decode_metadata(seq, num_ctas, 2, 64, whole_extra=4, restart_pad=4, lpt_extra=4)
    plain = ref.plan_decode_metadata(seq, num_ctas, 2, 64, whole_extra=4, restart_pad=4)
    assert meta.tolist() == plain.tolist() + list(range(len(lens)))
