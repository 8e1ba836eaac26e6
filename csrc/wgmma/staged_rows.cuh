// A 64-row tile of O written as 16-bit rows through shared memory: from the wgmma accumulator
// layout each 4-byte global store would span 8 rows (8 lines per instruction); staged, the 256
// consumer threads store 16 contiguous bytes each. Used for dense split partials in a build
// with staged 16-bit partials (splitkv::kStagedPartials) and for dense whole-request outputs
// (store_tile_staged); the sparse kernels' whole-request out (consumer.cuh) stages the same way.
#pragma once

#include <cute/arch/copy_sm90.hpp>
#include <cutlass/arch/barrier.h>

#include "common/convert.cuh"
#include "common/mla_shapes.h"
#include "common/ptx.cuh"
#include "wgmma/config.cuh"

namespace mla_backend::wgmma {

// o: this warpgroup's 64 rows x 256 columns (wgmma accumulators), rows wrow and wrow + 8 of
// each warp's 16 scaled by inv_l[0] and inv_l[1], rounded to T; stage: the shared::cta address
// of 64 KiB that nothing reads or writes until the next consumers_sync (at smem + (stage -
// base) in the generic space). Row m < valid_rows of the tile goes to dst + m * kDv.
template <typename T, typename Sync>
__device__ __forceinline__ void store_rows_staged(const float (&o)[128], const float (&inv_l)[2],
                                                  unsigned char* smem, uint32_t base, uint32_t stage, int wg,
                                                  int wtid, int lane, T* dst, int valid_rows, Sync& consumers_sync) {
  // rows of 1024 bytes, 16-byte units XOR-swizzled by row % 8; one stmatrix per 4 n-blocks
  auto staged = [&](int m, int unit) { return uint32_t(m * 1024 + ((unit ^ (m & 7)) << 4)); };
  const int srow = (wtid >> 5) * 16 + (lane & 7);  // row of the matrix this lane addresses
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int mrow = srow + hr * 8;
#pragma unroll
    for (int g = 0; g < 8; ++g) {  // n-blocks 4g .. 4g + 3: matrix j = lane / 8
      const int unit = wg * 32 + 4 * g + (lane >> 3);
      uint32_t v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int n = 4 * g + j;
        v[j] = pack2<T>(o[n * 4 + hr * 2] * inv_l[hr], o[n * 4 + hr * 2 + 1] * inv_l[hr]);
      }
      cute::SM90_U32x4_STSM_N::copy(v[0], v[1], v[2], v[3], *smem_ptr<cute::uint128_t>(stage + staged(mrow, unit)));
    }
  }
  consumers_sync();
  const int ctid = wg * 128 + wtid;
#pragma unroll 4
  for (int k = 0; k < kRows * 64 / kConsumerThreads; ++k) {
    const int i = k * kConsumerThreads + ctid, m = i >> 6, unit = i & 63;
    if (m >= valid_rows) continue;
    const uint4 val = *reinterpret_cast<const uint4*>(smem + (stage - base) + staged(m, unit));
    *reinterpret_cast<uint4*>(dst + int64_t(m) * kDv + unit * 8) = val;
  }
  cutlass::arch::fence_view_async_shared();  // generic accesses to the stage; the async proxy may write it next
}

// The tile normalised: rows wrow and wrow + 8 of each warp's 16 (sums lt, running maxima mt in
// log2, as the epilogue holds them) as O * kv_scale / l through store_rows_staged to dst, and
// their lse (natural log; -inf for an empty row) to lse_dst[m] by warpgroup 0.
template <typename T, typename Sync>
__device__ __forceinline__ void store_tile_staged(const float (&o)[128], const float (&lt)[2], const float (&mt)[2],
                                                  float kv_scale, unsigned char* smem, uint32_t base, uint32_t stage,
                                                  int wg, int wtid, int lane, int wrow, int qd, T* dst, float* lse_dst,
                                                  int valid_rows, Sync& consumers_sync) {
  float inv_l[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    inv_l[hr] = lt[hr] != 0.f ? kv_scale / lt[hr] : 0.f;
    const int m = wrow + hr * 8;
    if (wg == 0 && qd == 0 && m < valid_rows)
      lse_dst[m] = lt[hr] != 0.f ? (mt[hr] + __log2f(lt[hr])) * kLn2 : -INFINITY;
  }
  store_rows_staged(o, inv_l, smem, base, stage, wg, wtid, lane, dst, valid_rows, consumers_sync);
}

}  // namespace mla_backend::wgmma
