// The planner kernel (see planner.h): one 1024-thread block scans the requests' unit counts.
#include <climits>

#include <cub/block/block_merge_sort.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/warp/warp_reduce.cuh>
#include <cub/warp/warp_scan.cuh>

#include "common/launch.h"
#include "common/ptx.cuh"
#include "splitkv/planner.h"

namespace mla_backend::splitkv {
namespace {

constexpr int kWholeShareDivisor = 32;  // whole requests may also cost 1/32 of the balanced share
// Up to this batch the longest-first plan sorts by counting (batch steps a thread), above it by
// CUB's merge sort (fixed passes over 1024 keys): on the H100 the counting sort was 3-8 us faster
// at 128-256 requests, the merge sort 3 us faster at 512 and 30 us at 1024.
constexpr int kLptCountingSortMaxBatch = 384;

// The longest-first plan of planner.h (lpt_extra), by the planner's 1024 threads: the requests
// sorted by units (descending, ties in request order), then dealt in rounds of num_ctas, the
// round's longest to the least loaded CTA (thread c ranks CTA c by load * 256 + c among all;
// a round is one rank pass, where a request-by-request greedy is a serial chain per request),
// then every thread writes its request's start and position. Whether it was taken; on false
// meta is untouched. may: the caller's conditions (no equal-lengths plan, enough requests with
// units, few units); with_units: the requests with units.
__device__ bool longest_first(int* __restrict__ meta, int batch, int num_ctas, int per_cta, bool may, int lpt_extra,
                              int with_units, const int* s_units) {
  if (!may || batch > kLptMaxBatch || num_ctas > kLptMaxCtas) return false;  // block-uniform
  // in place order: the request, its units, its CTA, its offset there and its rank among the CTA's
  __shared__ int s_req[kLptMaxBatch], s_size[kLptMaxBatch], s_cta[kLptMaxBatch], s_off[kLptMaxBatch],
      s_rank[kLptMaxBatch];
  __shared__ int s_key[kLptMaxCtas];    // CTA c's load * 256 + c
  __shared__ int s_first[kLptMaxCtas];  // the position of CTA c's first request
  __shared__ int s_count[kLptMaxCtas];  // CTA c's requests
  __shared__ int s_u;
  const int t = threadIdx.x;
  // the requests by units, descending, ties in request order: key units * 1024 + (1023 - request),
  // descending, so that thread t learns the request in place t
  static_assert(kLptMaxBatch == 1024 && kLptMaxUnits <= (1 << 22), "the sort key packs units and 10 bits of request");
  auto key_of = [&](int b) { return (unsigned(s_units[b]) << 10) | unsigned(kLptMaxBatch - 1 - b); };
  if (batch <= kLptCountingSortMaxBatch) {  // by counting: place = the keys above one's own
    if (t < batch) {
      const unsigned kt = key_of(t);
      int place = 0;
      for (int j = 0; j < batch; ++j) place += key_of(j) > kt ? 1 : 0;
      s_req[place] = t;
    }
    __syncthreads();
  } else {  // CUB's block merge sort, one key per thread
    using Sort = cub::BlockMergeSort<unsigned, 1024, 1>;
    __shared__ typename Sort::TempStorage sort_tmp;
    unsigned sort_key[1] = {t < batch ? key_of(t) : 0u};
    Sort(sort_tmp).Sort(sort_key, [](unsigned a, unsigned b) { return a > b; });
    if (t < batch) s_req[t] = kLptMaxBatch - 1 - int(sort_key[0] & (kLptMaxBatch - 1));
    __syncthreads();
  }
  const int n = t < batch ? s_units[s_req[t]] : 0;  // the units of the request in place t
  s_size[t] = n;
  if (t < num_ctas) s_key[t] = t;
  if (t == 0) s_u = 0;
  __syncthreads();
  int count = 0;  // CTA t's requests so far
  for (int first = 0; first < with_units; first += num_ctas) {  // one round (block-uniform)
    int rank = 0, key = 0;
    if (t < num_ctas) {
      key = s_key[t];
#pragma unroll 4
      for (int j = 0; j < num_ctas; ++j) rank += s_key[j] < key ? 1 : 0;
    }
    __syncthreads();  // every rank read before the keys change
    const int i = first + rank;
    if (t < num_ctas && i < with_units) {
      const int load = key >> 8;
      s_cta[i] = t; s_off[i] = load; s_rank[i] = count++;
      s_key[t] = key + (s_size[i] << 8);
    }
    __syncthreads();
  }
  if (t < num_ctas) {
    s_count[t] = count;
    atomicMax(&s_u, s_key[t] >> 8);
  }
  __syncthreads();
  if (t < 32) {  // positions: CTA c's requests from the sum of the counts of CTAs before it
    int sum = 0;
    for (int c0 = 0; c0 < num_ctas; c0 += 32) {
      const int c = c0 + t;
      const int cnt = c < num_ctas ? s_count[c] : 0;
      int incl = cnt;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int x = __shfl_up_sync(0xffffffffu, incl, o);
        if (t >= o) incl += x;
      }
      if (c < num_ctas) s_first[c] = sum + incl - cnt;
      sum += __shfl_sync(0xffffffffu, incl, 31);
    }
  }
  __syncthreads();
  const int U = s_u;
  if (U - per_cta > max(lpt_extra, per_cta / kWholeShareDivisor)) return false;  // block-uniform
  if (t < batch) {
    const int v = n > 0 ? s_first[s_cta[t]] + s_rank[t] : t;  // no units: after those with units
    meta[v] = n > 0 ? s_cta[t] * U + s_off[t] : num_ctas * U;
    meta[batch + 2 + v] = s_req[t];
  }
  if (t == 0) {
    meta[batch] = num_ctas * U;
    meta[batch + 1] = U;
  }
  return true;
}

__global__ void __launch_bounds__(1024) plan_decode_kernel(const int* __restrict__ lens, int batch, int repeat,
                                                          int max_len, int* __restrict__ meta, int num_ctas,
                                                          int min_units, int unit, int whole_extra,
                                                          int align_extra, int restart_pad, int lpt_extra,
                                                          int one_unit_max) {
  using Scan = cub::BlockScan<int, 1024>;
  __shared__ typename Scan::TempStorage tmp;
  cudaTriggerProgrammaticLaunchCompletion();
  cudaGridDependencySynchronize();  // the lengths may come from the previous kernel
  __shared__ int carry, fewest, most, with_units;  // units so far; the fewest and most units of a request;
                                                   // requests with units
  __shared__ int s_per_cta, s_whole;
  __shared__ int s_units[1024];  // each request's units, when batch <= 1024 (aligned plans)
  if (threadIdx.x == 0) { carry = 0; fewest = INT_MAX; most = 0; with_units = 0; meta[0] = 0; }
  __syncthreads();
  auto units_of = [&](int b) {
    const int len = b >= batch ? 0 : lens != nullptr ? min(max(lens[b / repeat], 0), max_len) : max_len;
    return (len + unit - 1) / unit;
  };
  for (int base = 0; base < batch; base += 1024) {
    const int b = base + threadIdx.x;
    int units = units_of(b), incl, agg;
    if (b < min(batch, 1024)) s_units[b] = units;
    Scan(tmp).InclusiveSum(units, incl, agg);
    if (b < batch) {
      meta[b + 1] = carry + incl;
      atomicMin(&fewest, units);
      atomicMax(&most, units);
      if (units > 0) atomicAdd(&with_units, 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) carry += agg;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const int total = carry;
    int floor_units = one_unit_max >= 0 && total <= one_unit_max ? 1 : min_units;  // a small step: 1
    floor_units = max(floor_units, (most + kMaxCtasPerRequest - 1) / kMaxCtasPerRequest);  // see planner.h
    int per_cta = max((total + num_ctas - 1) / num_ctas, floor_units);
    s_whole = 0;
    if (whole_extra >= 0 && batch > 0 && fewest == most && most > 0) {  // equal lengths
      const int u = most;
      const int whole = u * max((batch + num_ctas - 1) / num_ctas, (floor_units + u - 1) / u);
      if (whole - per_cta <= max(whole_extra, per_cta / kWholeShareDivisor)) { per_cta = whole; s_whole = 1; }
    }
    s_per_cta = per_cta;
    meta[batch + 1] = per_cta;
  }
  __syncthreads();
  if (lpt_extra >= 0) {  // the order after P and U: longest first (then done), or the identity
    if (longest_first(meta, batch, num_ctas, s_per_cta, s_whole == 0 && with_units >= num_ctas && carry < kLptMaxUnits,
                      lpt_extra, with_units, s_units))
      return;
    for (int b = threadIdx.x; b < batch; b += 1024) meta[batch + 2 + b] = b;
  }
  // One warp picks an aligned plan, else a padded one, from shared memory (no block-wide
  // barrier per candidate); without either the packed plan above stands.
  if (s_whole || batch < 2 || threadIdx.x >= 32) return;
  using WarpSum = cub::WarpReduce<int>;
  using WarpScan = cub::WarpScan<int>;
  __shared__ typename WarpSum::TempStorage sum_tmp;
  __shared__ typename WarpScan::TempStorage scan_tmp;
  const int lane = threadIdx.x;
  // aligned: the smallest U in [per_cta, per_cta + align_extra] that gives every request CTAs
  // of its own (sum of ceil(units / U) <= num_ctas); its starts then become multiples of U.
  const int align_last = align_extra >= 0 && batch <= min(num_ctas, 1024) ? s_per_cta + align_extra : s_per_cta - 1;
  for (int U = s_per_cta; U <= align_last; ++U) {
    int need = 0;
    for (int b = lane; b < batch; b += 32) need += (s_units[b] + U - 1) / U;
    need = __shfl_sync(0xffffffffu, WarpSum(sum_tmp).Sum(need), 0);  // the sum is lane 0's
    __syncwarp();  // sum_tmp is reused
    if (need > num_ctas) continue;
    int carry = 0;
    for (int base = 0; base < batch; base += 32) {
      const int b = base + lane;
      int incl, agg;
      WarpScan(scan_tmp).InclusiveSum(b < batch ? (s_units[b] + U - 1) / U : 0, incl, agg);
      __syncwarp();  // scan_tmp is reused
      if (b < batch) meta[b + 1] = (carry + incl) * U;
      carry += agg;
    }
    if (lane == 0) meta[batch + 1] = U;
    return;
  }
  // padded: lane i lays the requests out for U = per_cta + i, each request that ends inside a
  // CTA's range (but the last) followed by restart_pad units of padding, or fewer where the
  // CTA's range ends sooner (the padding never leaves that CTA); the smallest U whose layout
  // fits num_ctas CTAs wins. The layout is a chain over the requests: each end's place in its
  // CTA depends on every padding before it.
  if (restart_pad < 0 || batch > kPadMaxBatch) return;
  // the padding after request b for lane l: byte b % 4 of s_pad[b / 4][l]
  __shared__ uint32_t s_pad[kPadMaxBatch / 4][32];
  const int U = s_per_cta + lane;
  const float inv_u = 1.f / float(U);
  unsigned off = 0;  // where the next request starts, in units from its CTA's first
  int pads = 0;
  // 16 requests at a time: their remainders first (independent loads and arithmetic), then the
  // chain through `off`, 5 dependent integer steps a request, in registers (shared-memory
  // stores inside the chain would keep the compiler from hoisting the next loads above them)
  constexpr int kChunk = 16;
  for (int b0 = 0; b0 < batch; b0 += kChunk) {
    int rem[kChunk];
    uint32_t may_pad = 0;  // bit j: request b0 + j may be followed by padding (not empty, not the last)
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      const int b = b0 + j;
      const int u = b < batch ? s_units[b] : 0;
      // u mod U: u <= all units <= num_ctas * U, so the float quotient is at most num_ctas and
      // off by at most one, which the two corrections below undo
      int m = u - __float2int_rz(float(u) * inv_u) * U;
      m += m < 0 ? U : 0;
      m -= m >= U ? U : 0;
      rem[j] = m;
      may_pad |= (u > 0 && b < batch - 1 ? 1u : 0u) << j;
    }
    uint32_t packed[kChunk / 4] = {};
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      const unsigned pad_b = (may_pad >> j) & 1u ? unsigned(restart_pad) : 0u;
      const unsigned snap_b = unsigned(max(U - int(pad_b), 1));  // an end at t >= snap_b pads to the boundary
      const unsigned t1 = off + unsigned(rem[j]), t2 = off + unsigned(rem[j] - U);
      const unsigned t = min(t1, t2);  // the request's end, mod U (unsigned: t2 wraps when t1 < U)
      const bool room = t - 1u < snap_b - 1u;  // 0 < t < snap_b: pad_b units fit before the boundary
      off = room ? t + pad_b : 0u;
      const unsigned pad = room ? pad_b : t == 0 ? 0u : unsigned(U) - t;
      packed[j / 4] |= pad << (8 * (j % 4));
      pads += int(pad);
    }
#pragma unroll
    for (int k = 0; k < kChunk / 4; ++k)
      if (b0 + 4 * k < batch) s_pad[(b0 >> 2) + k][lane] = packed[k];
  }
  const unsigned fits = __ballot_sync(0xffffffffu, int64_t(carry) + pads <= int64_t(num_ctas) * U);
  if (fits == 0) return;
  const int win = __ffs(int(fits)) - 1;
  __syncwarp();  // s_pad is complete
  int done = 0;
  for (int base = 0; base < batch; base += 32) {
    const int b = base + lane;
    int incl, agg;
    const int pad = b < batch ? int((s_pad[b >> 2][win] >> (8 * (b & 3))) & 0xffu) : 0;
    WarpScan(scan_tmp).InclusiveSum(b < batch ? s_units[b] + pad : 0, incl, agg);
    __syncwarp();  // scan_tmp is reused
    if (b < batch) meta[b + 1] = done + incl;
    done += agg;
  }
  if (lane == 0) meta[batch + 1] = s_per_cta + win;
}

}  // namespace

void launch_planner(const int* lens, int batch, int repeat, int max_len, int* meta, int num_ctas, int min_units,
                    int unit, int whole_extra, int align_extra, int restart_pad, int lpt_extra, int one_unit_max,
                    cudaStream_t stream) {
  launch_pdl(plan_decode_kernel, dim3(1), dim3(1024), 0, stream, lens, batch, repeat, max_len, meta, num_ctas,
             min_units, unit, whole_extra, align_extra, restart_pad, lpt_extra, one_unit_max);
}

}  // namespace mla_backend::splitkv
