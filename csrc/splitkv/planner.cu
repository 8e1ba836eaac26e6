// The planner kernel (see planner.h): one 1024-thread block scans the requests' unit counts.
#include <climits>

#include <cub/block/block_scan.cuh>

#include "common/launch.h"
#include "common/ptx.cuh"
#include "splitkv/planner.h"

namespace mla_backend::splitkv {
namespace {

constexpr int kWholeShareDivisor = 32;  // whole requests may also cost 1/32 of the balanced share

__global__ void __launch_bounds__(1024) plan_decode_kernel(const int* __restrict__ lens, int batch, int repeat,
                                                          int max_len, int* __restrict__ meta, int num_ctas,
                                                          int min_units, int unit, int whole_extra) {
  using Scan = cub::BlockScan<int, 1024>;
  __shared__ typename Scan::TempStorage tmp;
  cudaTriggerProgrammaticLaunchCompletion();
  cudaGridDependencySynchronize();  // the lengths may come from the previous kernel
  __shared__ int carry, fewest, most;  // units so far; the fewest and most units of a request
  if (threadIdx.x == 0) { carry = 0; fewest = INT_MAX; most = 0; meta[0] = 0; }
  __syncthreads();
  for (int base = 0; base < batch; base += 1024) {
    const int b = base + threadIdx.x;
    const int len = b >= batch ? 0 : lens != nullptr ? min(max(lens[b / repeat], 0), max_len) : max_len;
    int units = (len + unit - 1) / unit, incl, agg;
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
    if (whole_extra >= 0 && batch > 0 && fewest == most && most > 0) {  // equal lengths
      const int u = most;
      const int whole = u * max((batch + num_ctas - 1) / num_ctas, (min_units + u - 1) / u);
      if (whole - per_cta <= max(whole_extra, per_cta / kWholeShareDivisor)) per_cta = whole;
    }
    meta[batch + 1] = per_cta;
  }
}

}  // namespace

void launch_planner(const int* lens, int batch, int repeat, int max_len, int* meta, int num_ctas, int min_units,
                    int unit, int whole_extra, cudaStream_t stream) {
  launch_pdl(plan_decode_kernel, dim3(1), dim3(1024), 0, stream, lens, batch, repeat, max_len, meta, num_ctas,
             min_units, unit, whole_extra);
}

}  // namespace mla_backend::splitkv
