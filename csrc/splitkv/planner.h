// The planner: one small kernel that writes a plan's schedule (splitkv/schedule.cuh) from the
// requests' key counts, so the plan follows lengths that live on the device.
#pragma once

#include <cuda_runtime.h>

namespace mla_backend::splitkv {

// meta[0..batch] = P (unit prefix sums), meta[batch + 1] = U = max(ceil(all units / num_ctas),
// min_units), with min_units read as 1 wherever it appears when one_unit_max >= 0 and the
// requests hold at most one_unit_max units in all (a small step: more, shorter CTAs), and as at
// least ceil(the longest request's units / kMaxCtasPerRequest) everywhere: no request is split
// over more than that many CTAs. (One request of 16k keys on 132 one-tile CTAs: 86 CTAs of 3
// pages took 5-9% off 128 of 2, and at 32k 86 of 6 took 2-8% off 128 of 4; H100, 2026-11-27.
// Plans with two or more row tiles have at most 66 CTAs, so it never binds there.) Request b has min(max(lens[b / repeat], 0), max_len) keys (lens == nullptr:
// max_len), in units of `unit` tokens. Dense: lens = seq_lens, repeat 1; sparse: lens =
// topk_length per batch entry, one request per (entry, query token), max_len = topk.
// whole_extra >= 0: when every request has the same u > 0 units, U becomes a whole number of
// requests, u * max(ceil(batch / num_ctas), ceil(min_units / u)), if that is at most
// max(whole_extra, balanced U / 32) units above the balanced U: no request is split, so no
// partials and nothing to merge. -1: never.
// align_extra >= 0 (dense wgmma plans; not taken with whole requests, with one request, or with
// more requests than min(num_ctas, 1024)): an aligned plan when some U at most align_extra units above the balanced
// one gives each request CTAs of its own, sum of ceil(units_r / U) <= num_ctas. Then U is the
// smallest such, and P[r + 1] = U * sum over r' <= r of ceil(units_r' / U): every request starts
// on a CTA boundary, so no CTA runs two pieces (a second piece costs a CTA its pipeline restart).
// A request's units past its own (fewer than U, in its last CTA's range) are padding that no CTA
// computes: the kernels clamp a piece to the request's key count (splitkv::dense_piece_end).
// -1: never.
// restart_pad >= 0 (dense wgmma plans; not taken with whole requests or an aligned plan, with
// one request, or with more than kPadMaxBatch requests): a padded plan. Each request that ends
// inside a CTA's range, but the last, is followed by restart_pad units of padding, or by the
// units left to that CTA's end where fewer remain (then the next request starts on the
// boundary). A CTA that holds a request's end, and so starts a second piece, gets that many
// fewer units of keys: the second piece's pipeline restart costs about as much. U is the
// smallest of per_cta .. per_cta + 31 whose layout fits num_ctas * U units (none: the packed
// plan). The padding stays inside the CTA of the request's last unit, so the schedule, the
// kernels' piece clamp and the merge read it as an aligned plan's. -1: never.
// lpt_extra >= 0 (dense wgmma plans): meta holds 2 * batch + 2 ints, the plan over an order of
// the requests and, at meta[batch + 2 + v], the request at position v of that order (the
// identity unless a longest-first plan is taken). Where batch <= kLptMaxBatch, num_ctas <=
// kLptMaxCtas, at least num_ctas requests have units and all units are under kLptMaxUnits, and
// no whole-request plan of equal lengths was taken: whole requests longest first, dealt in
// rounds of num_ctas, the round's i-th longest to the CTA i-th least loaded before the round
// (ties: the lower CTA; the greedy of longest-processing-time-first scheduling, made parallel
// per round). CTA c's requests then start at c * U, one after another, its last padded to
// (c + 1) * U; U is the most units of one CTA. Taken when that U is at most
// max(lpt_extra, balanced U / 32) above the balanced U: no request is split, so nothing to
// merge. Requests with no units come last (P = num_ctas * U). -1: meta has batch + 2 ints and
// the plans above.
constexpr int kPadMaxBatch = 256;
constexpr int kMaxCtasPerRequest = 88;
constexpr int kLptMaxBatch = 1024, kLptMaxCtas = 256, kLptMaxUnits = 1 << 21;
void launch_planner(const int* lens, int batch, int repeat, int max_len, int* meta, int num_ctas, int min_units,
                    int unit, int whole_extra, int align_extra, int restart_pad, int lpt_extra, int one_unit_max,
                    cudaStream_t stream);

}  // namespace mla_backend::splitkv
