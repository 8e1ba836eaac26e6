// The wgmma decode kernel family (decode_kernel.cuh): key sources, tile sizes, the shared
// memory budget, register budgets, barrier numbering.
#pragma once

#include <cutlass/arch/barrier.h>

#include <cstddef>
#include <type_traits>

#include "common/mla_shapes.h"
#include "splitkv/params.h"

namespace mla_backend::wgmma {

using splitkv::DecodeParams;
// the mbarrier operations (static members on a barrier's address, see smem_ptr in common/ptx.cuh)
using cutlass::arch::ClusterBarrier;
using cutlass::arch::ClusterTransactionBarrier;

// Where a unit's keys come from.
enum class KeySource {
  kPagedTma,    // dense paged decode, 16-bit cache: TMA loads whole 64-token pages (no producer)
  kPagedFp8,    // dense paged decode, per-tensor fp8 e4m3 cache (576 bytes per token): raw pages by
                // TMA, converted in place by the consumers to q's type (fp8_tile.cuh)
  kPagedFp8F16, // ... converted to fp16 whatever q's type, a bf16 Q converted once per piece
  kSparse16,    // sparse (DSA) decode / prefill over a bf16 cache
  kSparseDsMla  // sparse over the 656-byte fp8_ds_mla cache (split schedule, RegFp8Producer)
};

constexpr int kRows = 64;                              // query rows per CTA (one row tile)
constexpr int kKeys = splitkv::kUnitWgmma;             // 64 keys per unit
constexpr int kConsumerThreads = 256;                  // two warpgroups
constexpr int kChunkBytes = 64 * 128;                  // one 64-column chunk of a 64-row tile
constexpr int kTileBytes = (kDqk / 64) * kChunkBytes;  // 9 chunks: 72 KiB
constexpr int kPBytes = kChunkBytes;                   // 64 rows x 64 keys
constexpr int kHalfL = 4 * kChunkBytes;                // chunks 0-3: V columns 0-255
// Q, K0, K1, P0; sM, sScale0, sScale1, sSum[2] (5 x 64 floats); 18 mbarriers; the sparse key
// masks (2 buffers x 8 words, 4 used unless paired); alignment slack
constexpr size_t kSmem = 3 * size_t(kTileBytes) + kPBytes + 5 * kRows * sizeof(float) + 18 * 8 + 16 * 4 + 1024;
static_assert(kSmem <= 232448, "more shared memory than an sm_90 block can have");
// With a producer warpgroup: the producer keeps few registers, the consumers take the rest
// (2 x 224 + 56 = 3 x 168, the launch's 168 per thread; at 224 ptxas neither spills nor
// serializes the wgmmas, which it does at 232 with Q's rope chunk held in registers).
constexpr int kProducerRegs = 56;
constexpr int kConsumerRegs = 224;
// The split schedule (kSplitOf): warpgroup 0 computes S, the softmax and the left half of O,
// warpgroup 1 only the right half of O; neither needs 224, and the producer gets enough to
// convert from registers (at 200 warpgroup 0 spills; 224 / 160 / 120 measure the same as these).
constexpr int kSplitWg0Regs = 208;
constexpr int kSplitWg1Regs = 168;
constexpr int kSplitProducerRegs = 504 - kSplitWg0Regs - kSplitWg1Regs;
constexpr float kNoMax = -1e30f;  // running-max start: finite, so no inf - inf

template <KeySource kSrc> constexpr bool kSparseOf = kSrc == KeySource::kSparse16 || kSrc == KeySource::kSparseDsMla;
// the partial O element type with output type T: the dense kernels' (splitkv::DensePartial),
// float32 for the sparse sources
template <typename T, KeySource kSrc>
using PartialOf = std::conditional_t<kSparseOf<kSrc>, float, splitkv::DensePartial<T>>;
// The dense seesaw's pairs wholly inside every row's key limit run with no per-key test;
// the sparse sources keep their validity masks
template <KeySource kSrc> constexpr bool kMaskFreeOf = !kSparseOf<kSrc>;
// Row max on raw S, S * scale_log2 - m as one FFMA in the exponent. kPagedTma only: there the
// scale is the host-checked softmax scale (> 0, so the max of S * scale is the max of S times
// scale, bit for bit); the fp8 source multiplies in kv_scale from device memory, whose sign
// nothing checks
template <KeySource kSrc> constexpr bool kFoldScaleOf = kSrc == KeySource::kPagedTma;
// The dense sources whose pages come by TMA, issued by a consumer thread at each release: no
// producer warpgroup (256 threads); every other source has one that fills the K buffers
template <KeySource kSrc> constexpr bool kTmaPagesOf =
    kSrc == KeySource::kPagedTma || kSrc == KeySource::kPagedFp8 || kSrc == KeySource::kPagedFp8F16;
template <KeySource kSrc> constexpr bool kProducedOf = !kTmaPagesOf<kSrc>;
template <KeySource kSrc> constexpr int kThreadsOf = kTmaPagesOf<kSrc> ? 256 : 384;
// per-tensor fp8: S = kv_scale * (q . k8) and O = kv_scale * (P . v8), kv_scale read on the GPU
template <KeySource kSrc>
constexpr bool kPerTensorFp8Of = kSrc == KeySource::kPagedFp8 || kSrc == KeySource::kPagedFp8F16;
// The grid's order: the dense kernels' row tiles are blockIdx.x and their plan CTAs
// blockIdx.y, so the CTAs that read the same pages are consecutive blocks and start together
// (FlashMLA's order; 16-bit cache, 4 and 8 tiles: batch 1 -3 to -5%, batch >= 32 -1.5% against
// the plan's CTA in x); the sparse kernels keep the plan's CTA in x.
template <KeySource kSrc> constexpr bool kTileFastestOf = kTmaPagesOf<kSrc>;
// With a producer, each K buffer is filled in two halves (h = 0: chunks 0-3, h = 1: chunks
// 4-8, the rope chunk included), each with a "full" and an "empty" mbarrier. P0 lives in K0's
// rope chunk once S of its unit is done (its only smem reader, warpgroup 1's PV with V0's
// right half, is also the last reader of that half), P1 in a buffer of its own: so every
// half is released by its own last reader and K1's right half right after warpgroup 1's PV.
constexpr int kFills = 4;
__device__ __forceinline__ int fill_id(int b, int h) { return 2 * b + h; }
// The bf16 sparse source converts nothing: its copies announce themselves on the "full"
// mbarrier as they land (cp.async.mbarrier.arrive.noinc, 128 arrivals), plus one plain
// arrival per producer warp after its lane 0 wrote the unit's mask (release for that store),
// so the producer never waits for its own copies. The fp8_ds_mla producer converts in
// registers and announces its stores.
template <KeySource kSrc> constexpr bool kLandArrivesOf = kSrc == KeySource::kSparse16;
// fp8_ds_mla runs the split schedule: one unit at a time, warpgroup 0 S + softmax + O's left
// half, warpgroup 1 O's right half, the producer converting from registers (RegFp8Producer)
template <KeySource kSrc> constexpr bool kSplitOf = kSrc == KeySource::kSparseDsMla;
// Sparse sources: each piece's Q comes by TMA (q_maps; heads past H zero-filled as out of
// bounds), issued by one thread on its own mbarrier (kQBar), so the 72 KiB stay off the
// load/store path the producer keeps busy
template <KeySource kSrc> constexpr bool kQTmaOf = kSrc == KeySource::kSparse16 || kSrc == KeySource::kSparseDsMla;
constexpr int kQBar = 16;
static_assert(2 * kFills <= kQBar && kQBar < 18, "the Q mbarrier must not overlap the fills'");
// Dense sources: whole-request outputs staged for 16-byte stores (store_tile_staged), as the
// split partials are
template <KeySource kSrc> constexpr bool kDenseStagedOutOf = !kSparseOf<kSrc>;
// ... and the TMA-page sources' Q by TMA (make_dense_q_maps; cp.async where dense_q_by_tma
// says no), each piece's issued by the previous piece's epilogue. Its mbarrier is the 19th:
// their 18 chunk barriers take ids 0-17, and it uses none of the sparse key-mask words after
// them.
template <KeySource kSrc> constexpr bool kDenseQTmaOf = kTmaPagesOf<kSrc>;
constexpr int kDenseQBar = 18;

// Named barriers (id 0 is __syncthreads): both warpgroups, 256 threads ...
constexpr int kBarMax0 = 1;       // warpgroup 0's max / scale published
constexpr int kBarMax1 = 2;       // warpgroup 1's max / scale published
constexpr int kBarP0 = 3;         // P0 in smem
constexpr int kBarP1 = 4;         // P1 in smem
constexpr int kBarWg0 = 5;        // ... and one warpgroup's 128 threads (ids 5, 6)
constexpr int kBarConsumers = 7;  // both consumer warpgroups where a producer runs beside them

}  // namespace mla_backend::wgmma
