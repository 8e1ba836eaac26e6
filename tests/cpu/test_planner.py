"""Split-KV planner arithmetic (the Python twin of the GPU planner)."""

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
