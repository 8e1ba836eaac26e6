// The plan's schedule on the device: which units a CTA takes, which request a unit belongs
// to, and a sparse request's key list.
#pragma once

#include "splitkv/params.h"

namespace mla_backend::splitkv {

// P[r] = the first unit of request r (P[batch] = all units), U = units per CTA. A plan from
// the planner kernel keeps P[0..batch] and U in p.meta. A uniform sparse plan (every request
// topk entries: no topk_length) has P[r] = r * uniform_units and U from the host: no planner
// launch, and no chain of dependent loads of P (log2(batch) of them to find a CTA's first
// request) before a CTA's first copy. kMaybeUniform: the caller may run a uniform plan (the
// sparse kernels, the combine); the dense kernels never do.
template <bool kMaybeUniform>
__device__ __forceinline__ int plan_start(const DecodeParams& p, int r) {
  return kMaybeUniform && p.uniform_units > 0 ? r * p.uniform_units : __ldg(p.meta + r);
}

// U, the plan's units per CTA
template <bool kMaybeUniform>
__device__ __forceinline__ int plan_units_per_cta(const DecodeParams& p) {
  return kMaybeUniform && p.uniform_units > 0 ? p.units_per_cta : __ldg(p.meta + p.batch + 1);
}

// CTA c's units [u_begin, u_end) under the plan (CTA c of every row tile takes units
// [cU, cU + U)); false when it has none.
template <bool kMaybeUniform = false>
__device__ __forceinline__ bool cta_units_of(const DecodeParams& p, int c, int& u_begin, int& u_end, int& U) {
  const int total = plan_start<kMaybeUniform>(p, p.batch);
  U = plan_units_per_cta<kMaybeUniform>(p);
  u_begin = c * U;
  u_end = min(u_begin + U, total);
  return u_begin < total;
}
// the same for the CTA blockIdx.x
template <bool kMaybeUniform = false>
__device__ __forceinline__ bool cta_units(const DecodeParams& p, int& u_begin, int& u_end, int& U) {
  return cta_units_of<kMaybeUniform>(p, int(blockIdx.x), u_begin, u_end, U);
}

// Request owning unit u: the last r with P[r] <= u (skips empty requests).
__device__ __forceinline__ int request_of_unit(const int* P, int batch, int u) {
  int lo = 0, hi = batch;  // P[lo] <= u < P[hi] holds for u < P[batch]
  while (hi - lo > 1) {
    int mid = (lo + hi) >> 1;
    if (__ldg(P + mid) <= u) lo = mid; else hi = mid;
  }
  return lo;
}
template <bool kMaybeUniform>
__device__ __forceinline__ int plan_request_of_unit(const DecodeParams& p, int u) {
  return kMaybeUniform && p.uniform_units > 0 ? u / p.uniform_units : request_of_unit(p.meta, p.batch, u);
}

// The request pieces of units [u_begin, u_end) in order: fn(r, Pr, pg_begin, pg_end) with Pr =
// P[r] and the piece's units of request r at [pg_begin, pg_end) (counted from Pr).
template <bool kMaybeUniform, typename Fn>
__device__ __forceinline__ void for_each_piece(const DecodeParams& p, int u_begin, int u_end, Fn&& fn) {
  int r = plan_request_of_unit<kMaybeUniform>(p, u_begin);
  for (int u = u_begin; u < u_end;) {
    while (u >= plan_start<kMaybeUniform>(p, r + 1)) ++r;
    const int Pr = plan_start<kMaybeUniform>(p, r);
    const int pg_begin = u - Pr, pg_end = min(u_end, plan_start<kMaybeUniform>(p, r + 1)) - Pr;
    fn(r, Pr, pg_begin, pg_end);
    u = Pr + pg_end;
  }
}

// The batch entry of dense request r of the plan (its seq_len, block table row, query and
// output): p.order[r] for a plan with an order of the requests (splitkv/planner.h), else r
__device__ __forceinline__ int request_entry(const DecodeParams& p, int r) {
  return p.order != nullptr ? __ldg(p.order + r) : r;
}

// The end (in units from P[r], exclusive) of a dense piece of request r whose plan range ends at
// plan_end: clamped to the request's own units, ceil(len / unit) for its key count len. An
// aligned plan (planner.h) pads a request's units up to a multiple of U; the padding, in the
// request's last CTA, is computed by no CTA. The next piece starts at the plan's end, not here.
__device__ __forceinline__ int dense_piece_end(int plan_end, int len, int unit) {
  return min(plan_end, (max(len, 0) + unit - 1) / unit);
}

// Sparse: the index list of query group r and its length (entries past it, and slots outside
// [0, num_slots), are skipped like -1; the producers check them).
__device__ __forceinline__ const int* sparse_group_indices(const DecodeParams& p, int r) {
  return p.indices + int64_t(r / p.group_s_q) * p.idx_stride_b + int64_t(r % p.group_s_q) * p.idx_stride_s;
}
__device__ __forceinline__ int sparse_group_len(const DecodeParams& p, int r) {
  return p.topk_length != nullptr ? min(max(__ldg(p.topk_length + r / p.group_s_q), 0), p.topk) : p.topk;
}

}  // namespace mla_backend::splitkv
