// The planner kernel (see planner.h): one 1024-thread block scans the requests' unit counts.
#include <climits>

#include <cub/block/block_scan.cuh>
#include <cub/warp/warp_reduce.cuh>
#include <cub/warp/warp_scan.cuh>

#include "common/launch.h"
#include "common/ptx.cuh"
#include "splitkv/planner.h"

namespace mla_backend::splitkv {
namespace {

constexpr int kWholeShareDivisor = 32;  // whole requests may also cost 1/32 of the balanced share

__global__ void __launch_bounds__(1024) plan_decode_kernel(const int* __restrict__ lens, int batch, int repeat,
                                                          int max_len, int* __restrict__ meta, int num_ctas,
                                                          int min_units, int unit, int whole_extra,
                                                          int align_extra) {
  using Scan = cub::BlockScan<int, 1024>;
  __shared__ typename Scan::TempStorage tmp;
  cudaTriggerProgrammaticLaunchCompletion();
  cudaGridDependencySynchronize();  // the lengths may come from the previous kernel
  __shared__ int carry, fewest, most;  // units so far; the fewest and most units of a request
  __shared__ int s_per_cta, s_whole;
  __shared__ int s_units[1024];  // each request's units, when batch <= 1024 (aligned plans)
  if (threadIdx.x == 0) { carry = 0; fewest = INT_MAX; most = 0; meta[0] = 0; }
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
    }
    __syncthreads();
    if (threadIdx.x == 0) carry += agg;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const int total = carry;
    int per_cta = max((total + num_ctas - 1) / num_ctas, min_units);
    s_whole = 0;
    if (whole_extra >= 0 && batch > 0 && fewest == most && most > 0) {  // equal lengths
      const int u = most;
      const int whole = u * max((batch + num_ctas - 1) / num_ctas, (min_units + u - 1) / u);
      if (whole - per_cta <= max(whole_extra, per_cta / kWholeShareDivisor)) { per_cta = whole; s_whole = 1; }
    }
    s_per_cta = per_cta;
    meta[batch + 1] = per_cta;
  }
  __syncthreads();
  // aligned: the smallest U in [per_cta, per_cta + align_extra] that gives every request CTAs
  // of its own (sum of ceil(units / U) <= num_ctas); its starts then become multiples of U.
  // One warp does it from shared memory: no block-wide barrier per candidate.
  if (align_extra < 0 || s_whole || batch < 2 || batch > min(num_ctas, 1024) || threadIdx.x >= 32) return;
  using WarpSum = cub::WarpReduce<int>;
  using WarpScan = cub::WarpScan<int>;
  __shared__ typename WarpSum::TempStorage sum_tmp;
  __shared__ typename WarpScan::TempStorage scan_tmp;
  const int lane = threadIdx.x;
  for (int U = s_per_cta; U <= s_per_cta + align_extra; ++U) {
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
}

}  // namespace

void launch_planner(const int* lens, int batch, int repeat, int max_len, int* meta, int num_ctas, int min_units,
                    int unit, int whole_extra, int align_extra, cudaStream_t stream) {
  launch_pdl(plan_decode_kernel, dim3(1), dim3(1024), 0, stream, lens, batch, repeat, max_len, meta, num_ctas,
             min_units, unit, whole_extra, align_extra);
}

}  // namespace mla_backend::splitkv
