// The combine kernel and its launcher (see combine.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cutlass/functional.h>

#include "common/convert.cuh"
#include "common/launch.h"
#include "common/mla_shapes.h"
#include "common/ptx.cuh"
#include "splitkv/combine.h"
#include "splitkv/partials.cuh"
#include "splitkv/schedule.cuh"

namespace mla_backend::splitkv {
namespace {

// Merge the partials of requests that span CTAs; zero out requests with no keys. Two kernels:
// combine_kernel where requests span many CTAs on average (small batch), combine_rows_kernel
// where they span few (launch_combine picks).
// combine_kernel: one block of kWarps warps per (row, request): warp g takes splits c = first +
// g (mod kWarps), each lane 16 columns (float32 partials: 4 float4 per split, 4 splits at a
// time; 16-bit: 2 loads of 8 values, 8 splits at a time), so 16 loads per lane are in flight;
// the warps' float32 sums meet in shared memory. Blocks of unsplit requests exit at once.
// Few blocks (small batch, few heads) get 16 warps each, many get 4: a request split over
// ~130 CTAs is otherwise merged by 4 warps taking ~32 splits each, one after another.
constexpr int kManyWarps = 4, kFewWarps = 16;
constexpr int kFewBlocks = 512;    // below this many (row, request) blocks: kFewWarps
// combine_rows_kernel where num_ctas <= kRowsMaxSplits times the batch and rows >= kRowsMinRows:
// measured on the H100 (2026-11-27) against combine_kernel's 4 warps a row, per layer,
// H·s_q >= 64 at batch 32 to 256: -6 to -10% at 1k, -2 to -4% at 4k; 16 rows at batch 32 and 64:
// +3 to +7% (too few warps to hide the chain), so those keep combine_kernel
constexpr int kRowsMaxSplits = 8;
constexpr int kRowsMinRows = 64;

// max (NaN-propagating: a NaN lse, a NaN in the keys, makes the row NaN) or sum of v over the
// warp's lanes
__device__ __forceinline__ float warp_reduce(float v, bool is_max) {
  const cutlass::maximum<float, true> fmax_nan;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(0xffffffff, v, o);
    v = is_max ? fmax_nan(v, w) : v + w;
  }
  return v;
}

// acc += w * the partials at src + k * k_stride, k < kLoads (16 bytes, kVals values each),
// into acc[k * kVals / 4 ...]
template <typename Part>
__device__ __forceinline__ void add_split(float4 (&acc)[4], const Part* src, int k_stride, float w) {
  constexpr int kVals = 16 / int(sizeof(Part)), kLoads = 16 / kVals;
#pragma unroll
  for (int k = 0; k < kLoads; ++k) {
    float4 v[kVals / 4];
    load_partials_16B(src + k * k_stride, v);
#pragma unroll
    for (int j = 0; j < kVals / 4; ++j) {
      float4& a = acc[k * kVals / 4 + j];
      a.x += w * v[j].x; a.y += w * v[j].y; a.z += w * v[j].z; a.w += w * v[j].w;
    }
  }
}

template <typename T, typename Part, int kCombineWarps>
__global__ void __launch_bounds__(32 * kCombineWarps) combine_kernel(const __grid_constant__ DecodeParams p) {
  constexpr int kCombineThreads = 32 * kCombineWarps;
  const cutlass::maximum<float, true> fmax_nan;  // max.NaN: NaN when either input is (fmaxf: the other)
  __shared__ float4 s_acc[kCombineWarps - 1][4][32];
  __shared__ float s_red[kCombineWarps];
  cudaGridDependencySynchronize();  // the decode kernel's partials
  const int row = blockIdx.x;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  auto P_at = [&](int r) { return plan_start<true>(p, r); };
  const int U = plan_units_per_cta<true>(p);
  const int r = blockIdx.y;
  const int Pr = P_at(r), Pr1 = P_at(r + 1);
  const int64_t orow = int64_t(request_entry(p, r)) * p.rows + row;  // dense: the batch entry's row
  T* out = static_cast<T*>(p.out) + orow * kDv;
  if (Pr == Pr1) {  // zero-length request (or no unit): out = 0, lse = -inf
    if (kCombineThreads == kDv / 4 || tid < kDv / 4)  // 4 columns a thread
      *reinterpret_cast<uint2*>(out + tid * 4) = make_uint2(pack2<T>(0.f, 0.f), pack2<T>(0.f, 0.f));
    if (tid == 0) p.lse[orow] = -INFINITY;
    return;
  }
  const int first = Pr / U, last = (Pr1 - 1) / U;
  if (first == last) return;  // written directly by its CTA
  auto slot_row = [&](int c) {
    const int slot = (c == first && Pr != c * U) ? 1 : 0;
    return (int64_t(c) * 2 + slot) * p.rows + row;
  };
  auto block_reduce = [&](float v, bool is_max) {
    v = warp_reduce(v, is_max);
    if (lane == 0) s_red[warp] = v;
    __syncthreads();
    v = s_red[0];
#pragma unroll
    for (int i = 1; i < kCombineWarps; ++i) v = is_max ? fmax_nan(v, s_red[i]) : v + s_red[i];
    __syncthreads();
    return v;
  };
  // max and sum of exp over the splits' lse, all threads striding over splits (a NaN lse, a
  // NaN in the keys, makes the row NaN: the max keeps it)
  float mx = -INFINITY;
  for (int c = first + tid; c <= last; c += 32 * kCombineWarps) mx = fmax_nan(mx, __ldg(p.part_lse + slot_row(c)));
  mx = block_reduce(mx, true);
  float wsum = 0.f;
  if (mx != -INFINITY)
    for (int c = first + tid; c <= last; c += 32 * kCombineWarps) wsum += __expf(__ldg(p.part_lse + slot_row(c)) - mx);
  wsum = block_reduce(wsum, false);
  // each lane's 16 columns: kLoads 16-byte loads per split of kVals adjacent values (4 float32
  // or 8 16-bit ones) at columns k * 32 * kVals + lane * kVals; 16 loads per lane in flight
  // either way (kUnroll splits)
  constexpr int kVals = 16 / int(sizeof(Part)), kLoads = 16 / kVals, kUnroll = 16 / kLoads;
  const Part* part_out = static_cast<const Part*>(p.part_out);
  float4 acc[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
  if (mx != -INFINITY) {
#pragma unroll kUnroll
    for (int c = first + warp; c <= last; c += kCombineWarps) {
      const int64_t pr = slot_row(c);
      const float w = __expf(__ldg(p.part_lse + pr) - mx);
      add_split(acc, part_out + pr * kDv + lane * kVals, 32 * kVals, w);
    }
  }
  if (warp > 0) {
#pragma unroll
    for (int k = 0; k < 4; ++k) s_acc[warp - 1][k][lane] = acc[k];
  }
  __syncthreads();
  if (warp != 0) return;
  const float inv = wsum != 0.f ? 1.f / wsum : 0.f;  // 0: no split had a key
  // out's columns as the partials' loads had them: float32, each acc[k] where it was loaded;
  // 16-bit, acc[2k] and acc[2k + 1] as one 16-byte store
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#pragma unroll
    for (int g = 0; g < kCombineWarps - 1; ++g) {
      const float4 v = s_acc[g][k][lane];
      acc[k].x += v.x; acc[k].y += v.y; acc[k].z += v.z; acc[k].w += v.w;
    }
    if constexpr (kVals == 4)
      *reinterpret_cast<uint2*>(out + k * 32 * kVals + lane * kVals) =
          make_uint2(pack2<T>(acc[k].x * inv, acc[k].y * inv), pack2<T>(acc[k].z * inv, acc[k].w * inv));
  }
  if constexpr (kVals == 8) {
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const float4 &a = acc[2 * k], &b = acc[2 * k + 1];
      *reinterpret_cast<uint4*>(out + k * 32 * kVals + lane * kVals) =
          make_uint4(pack2<T>(a.x * inv, a.y * inv), pack2<T>(a.z * inv, a.w * inv),
                     pack2<T>(b.x * inv, b.y * inv), pack2<T>(b.z * inv, b.w * inv));
    }
  }
  if (lane == 0) p.lse[orow] = wsum != 0.f ? mx + __logf(wsum) : -INFINITY;
}

// combine_rows_kernel: the same merge with one warp per (row, request), kRowWarps rows a block,
// for plans whose requests span few CTAs (many requests): no block-wide reductions or
// barriers, so a row's merge is one chain of loads (the splits' lse, then their partials, 16
// loads per lane in flight) instead of many small blocks' chains with their barriers between
// (H 128, batch 128, 1k: the merge of 4 warps a row took about a fifth of the decode step). A
// request split over many CTAs takes its splits one after another in one warp: the host sends
// plans with many splits a request to combine_kernel.
// With more requests than CTAs (by_cta), blockIdx.y = c < num_ctas takes the one request that
// starts in CTA c's range and continues past it, if there is one (every split request starts
// in exactly one CTA), and the blocks after those zero the empty requests, one per thread:
// fewer blocks to launch.
constexpr int kRowWarps = 4;

template <typename T, typename Part>
__global__ void __launch_bounds__(32 * kRowWarps) combine_rows_kernel(const __grid_constant__ DecodeParams p,
                                                                      bool by_cta) {
  const cutlass::maximum<float, true> fmax_nan;  // max.NaN: NaN when either input is (fmaxf: the other)
  cudaGridDependencySynchronize();  // the decode kernel's partials
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int row0 = blockIdx.x * kRowWarps, row = row0 + warp;
  auto P_at = [&](int r) { return plan_start<true>(p, r); };
  const int U = plan_units_per_cta<true>(p);
  // the 16 columns [16 lane, 16 lane + 16) of out row `row` of request r: 0, and lse -inf
  auto zero_row = [&](int r, int rw) {
    const int64_t orow = int64_t(request_entry(p, r)) * p.rows + rw;
    uint4* o = reinterpret_cast<uint4*>(static_cast<T*>(p.out) + orow * kDv + lane * 16);
#pragma unroll
    for (int k = 0; k < 16 * int(sizeof(T)) / 16; ++k) o[k] = make_uint4(0u, 0u, 0u, 0u);
    if (lane == 0) p.lse[orow] = -INFINITY;
  };
  int r = blockIdx.y;
  if (by_cta) {
    if (int(blockIdx.y) >= p.num_ctas) {  // empty requests: out = 0, lse = -inf, a request a thread
      const int rz = (int(blockIdx.y) - p.num_ctas) * 32 * kRowWarps + tid;
      if (rz < p.batch && P_at(rz) == P_at(rz + 1)) {
        for (int rw = row0; rw < min(row0 + kRowWarps, p.rows); ++rw) {
          const int64_t orow = int64_t(request_entry(p, rz)) * p.rows + rw;
          uint4* o = reinterpret_cast<uint4*>(static_cast<T*>(p.out) + orow * kDv);
#pragma unroll 8
          for (int k = 0; k < kDv * int(sizeof(T)) / 16; ++k) o[k] = make_uint4(0u, 0u, 0u, 0u);
          p.lse[orow] = -INFINITY;
        }
      }
      return;
    }
    const int c = blockIdx.y, c_end = (c + 1) * U;
    if (c_end >= P_at(p.batch)) return;  // nothing continues past CTA c
    r = plan_request_of_unit<true>(p, c_end - 1);
    if (P_at(r) < c * U || P_at(r + 1) <= c_end) return;  // starts earlier, or ends in c
  }
  if (row >= p.rows) return;
  const int Pr = P_at(r), Pr1 = P_at(r + 1);
  if (Pr == Pr1) {  // zero-length request (or no unit)
    zero_row(r, row);
    return;
  }
  const int first = Pr / U, last = (Pr1 - 1) / U;
  if (first == last) return;  // written directly by its CTA
  auto slot_row = [&](int c) {
    const int slot = (c == first && Pr != c * U) ? 1 : 0;
    return (int64_t(c) * 2 + slot) * p.rows + row;
  };
  float mx = -INFINITY;
  for (int c = first + lane; c <= last; c += 32) mx = fmax_nan(mx, __ldg(p.part_lse + slot_row(c)));
  mx = warp_reduce(mx, true);
  float wsum = 0.f;
  if (mx != -INFINITY)
    for (int c = first + lane; c <= last; c += 32) wsum += __expf(__ldg(p.part_lse + slot_row(c)) - mx);
  wsum = warp_reduce(wsum, false);
  // this lane's 16 columns: kLoads 16-byte loads per split of kVals values at columns
  // [16 lane + k kVals, ...), kUnroll splits in flight
  constexpr int kVals = 16 / int(sizeof(Part)), kLoads = 16 / kVals, kUnroll = 16 / kLoads;
  const Part* part_out = static_cast<const Part*>(p.part_out);
  float4 acc[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
  if (mx != -INFINITY) {
#pragma unroll kUnroll
    for (int c = first; c <= last; ++c) {
      const int64_t pr = slot_row(c);
      const float w = __expf(__ldg(p.part_lse + pr) - mx);
      add_split(acc, part_out + pr * kDv + lane * 16, kVals, w);
    }
  }
  const float inv = wsum != 0.f ? 1.f / wsum : 0.f;  // 0: no split had a key
  const int64_t orow = int64_t(request_entry(p, r)) * p.rows + row;  // dense: the batch entry's row
  T* out = static_cast<T*>(p.out) + orow * kDv + lane * 16;
#pragma unroll
  for (int k = 0; k < 2; ++k) {  // 8 columns a 16-byte store
    const float4 &a = acc[2 * k], &b = acc[2 * k + 1];
    *reinterpret_cast<uint4*>(out + 8 * k) =
        make_uint4(pack2<T>(a.x * inv, a.y * inv), pack2<T>(a.z * inv, a.w * inv),
                   pack2<T>(b.x * inv, b.y * inv), pack2<T>(b.z * inv, b.w * inv));
  }
  if (lane == 0) p.lse[orow] = wsum != 0.f ? mx + __logf(wsum) : -INFINITY;
}

}  // namespace

template <typename T, typename Part, int kWarps>
void launch_combine_with(const DecodeParams& p, cudaStream_t stream) {
  launch_pdl(combine_kernel<T, Part, kWarps>, dim3(p.rows, p.batch), dim3(32 * kWarps), 0, stream, p);
}

template <typename T, typename Part>
void launch_combine(const DecodeParams& p, cudaStream_t stream) {
  // a warp per row where a request spans few CTAs on average (num_ctas / batch + 1 at most
  // kRowsMaxSplits + 1) and there are kRowsMinRows rows or more; the by-CTA layout (more
  // requests than CTAs) always
  const int by_cta_blocks = p.num_ctas + (p.batch + 32 * kRowWarps - 1) / (32 * kRowWarps);
  const bool by_cta = by_cta_blocks < p.batch;
  if (by_cta || (p.rows >= kRowsMinRows && int64_t(p.num_ctas) <= int64_t(kRowsMaxSplits) * p.batch)) {
    const dim3 grid((p.rows + kRowWarps - 1) / kRowWarps, by_cta ? by_cta_blocks : p.batch);
    launch_pdl(combine_rows_kernel<T, Part>, grid, dim3(32 * kRowWarps), 0, stream, p, by_cta);
  } else if (int64_t(p.rows) * p.batch < kFewBlocks) {
    launch_combine_with<T, Part, kFewWarps>(p, stream);
  } else {
    launch_combine_with<T, Part, kManyWarps>(p, stream);
  }
}

template void launch_combine<__nv_bfloat16, float>(const DecodeParams& p, cudaStream_t stream);
template void launch_combine<__half, float>(const DecodeParams& p, cudaStream_t stream);
#if MLA_BACKEND_16BIT_PARTIALS
template void launch_combine<__nv_bfloat16, __nv_bfloat16>(const DecodeParams& p,
                                                            cudaStream_t stream);
template void launch_combine<__half, __half>(const DecodeParams& p, cudaStream_t stream);
#endif

}  // namespace mla_backend::splitkv
