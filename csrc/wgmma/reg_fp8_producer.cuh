// The producer warpgroup of the split schedule (fp8_ds_mla cache): loads each unit's raw
// bytes into registers, converts them there and stores the 16-bit tile.
#pragma once

#include <cuda_bf16.h>

#include <cute/arch/copy.hpp>
#include <cute/arch/util.hpp>
#include <cutlass/arch/barrier.h>

#include "common/convert.cuh"
#include "common/mla_shapes.h"
#include "common/ptx.cuh"
#include "splitkv/schedule.cuh"
#include "wgmma/config.cuh"
#include "wgmma/smem_layout.cuh"

namespace mla_backend::wgmma {

// Lane l of producer warp w handles entry (kPaired: 32 rank + 8 w + l % 8, a quarter of each
// half, part l / 8; otherwise 16 w + l % 16, a half of each half, part l / 16) of every unit
// and loads its raw e4m3 bytes, scale and rope straight into registers with plain 16-byte
// loads, before it waits for the part to be released; after the release it only converts and
// stores. Nothing raw goes to shared memory, so a refill's latency is the conversion, not the
// gather. kPaired (two row tiles as a 2-CTA cluster): each CTA converts half of every unit and
// each warp bulk-copies its rows to the peer's tile. A 16-byte store instruction is served 8
// lanes at a time: with the entry in the low lane bits those are 8 rows of the 128-byte
// swizzle, all 8 bank groups, so the stores are conflict-free (entry-major lanes: 2 or 4 ways).
template <bool kPaired>
struct RegFp8Producer {
  static constexpr int kPer = kPaired ? 4 : 2;          // threads per entry
  static constexpr int kWarpEntries = 32 / kPer;        // entries per producer warp
  static constexpr int kVals = 256 / kPer;              // e4m3 values per thread and half
  static constexpr int kLoads = kVals / 16;             // 16-byte loads of them
  static constexpr int kRopeLoads = 128 / kPer / 16;    // the entry's 128 rope bytes, shared
  const DecodeParams& p;
  const unsigned char* kv;
  uint32_t kbuf0, bars_full, bars_empty;
  // as KeyProducer's (bit 2j of word w = entry 16w + j); kPaired [2][8]: bit 2j of word w =
  // entry 8w + j (each producer warp's own word)
  uint32_t* masks;
  int e, part, warp, lane;
  uint32_t peer_delta;
  uint32_t used = 0, empty_phase = 0;

  struct Left { uint4 raw[kLoads]; float scale; };
  struct Right { uint4 raw[kLoads]; uint4 rope[kRopeLoads]; float scale; };

  // this thread's entry and part from its lane (see above)
  __device__ __forceinline__ static int entry_of(int rank, int wtid) {
    return kPaired ? 32 * rank + 8 * (wtid >> 5) + (wtid & 7) : 16 * (wtid >> 5) + (wtid & 15);
  }
  __device__ __forceinline__ static int part_of(int wtid) { return (wtid & 31) / kWarpEntries; }

  __device__ const unsigned char* token_row(int slot) const {
    const unsigned s = unsigned(slot);
    return kv + int64_t(s / kPage) * p.kv_stride_block + int64_t(s % kPage) * p.kv_stride_tok;
  }
  __device__ __forceinline__ static uint4 ld16(const unsigned char* src) {
    return __ldg(reinterpret_cast<const uint4*>(src));
  }
  // this thread's bytes of half h of cache slot `slot` (-1: zeros)
  __device__ __forceinline__ void load(int h, int slot, uint4* raw, uint4* rope, float& scale) const {
    if (slot >= 0) {
      const unsigned char* row = token_row(slot);
#pragma unroll
      for (int j = 0; j < kLoads; ++j) raw[j] = ld16(row + 256 * h + part * kVals + 16 * j);
      scale = __ldg(reinterpret_cast<const float*>(row + 512) + 2 * h + (part * kVals >> 7));
      if (rope != nullptr) {
#pragma unroll
        for (int j = 0; j < kRopeLoads; ++j) rope[j] = ld16(row + 528 + part * (128 / kPer) + 16 * j);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kLoads; ++j) raw[j] = make_uint4(0, 0, 0, 0);
      scale = 0.f;
      if (rope != nullptr) {
#pragma unroll
        for (int j = 0; j < kRopeLoads; ++j) rope[j] = make_uint4(0, 0, 0, 0);
      }
    }
  }
  // an L2 prefetch of this thread's share of slot `slot`'s 656-byte row (its 128-byte lines)
  __device__ __forceinline__ void prefetch_l2(int slot) const {
    if (slot < 0) return;
    const unsigned char* row = token_row(slot);
#pragma unroll
    for (int k = part; k < 7; k += kPer) {
      cute::prefetch(row + (k < 6 ? 128 * k : 655));
    }
  }
  __device__ __forceinline__ static void store16(uint32_t dst, uint32_t off, uint4 v) {
    unsigned char* gen = reinterpret_cast<unsigned char*>(__cvta_shared_to_generic(dst));
    *reinterpret_cast<uint4*>(gen + off) = v;
  }
  // part h of buffer b: wait for its release, write the unit's mask (h = 0), convert and
  // store, announce
  __device__ __forceinline__ void put(int b, int h, int slot, const uint4* raw, const uint4* rope, float scale) {
    const int bit = fill_id(b, h);
    if ((used >> bit) & 1) {
      mbar_wait(bars_empty + bit * 8, (empty_phase >> bit) & 1);
      empty_phase ^= 1u << bit;
    }
    used |= 1u << bit;
    const uint32_t full = bars_full + bit * 8;
    if (h == 0) {
      // lane l reports entry l / 2 of the warp's (held by lane l / 2): bit 2j (and 2j + 1) of
      // the word is entry j
      const bool entry_ok = __shfl_sync(0xffffffff, slot >= 0, lane >> 1);
      if constexpr (kPaired) {
        // the warp's 8 entries in the low 16 bits, in both CTAs
        const uint32_t valid = __ballot_sync(0xffffffff, lane < 16 && entry_ok);
        if (lane == 0) {
          uint32_t* word = masks + b * 8 + e / 8;
          *word = valid;
          st_async_b32(cute::cast_smem_ptr_to_uint(word) + peer_delta, valid, full + peer_delta);
        }
      } else {
        const uint32_t valid = __ballot_sync(0xffffffff, entry_ok);
        if (lane == 0) masks[b * 4 + warp] = valid;
      }
    }
    const uint32_t dst = kbuf0 + b * kTileBytes;
    // unpaired: the entry read afresh from %tid.x (held across the loop, the store offsets
    // derived from it are hoisted and spill)
    int row = e;
    if constexpr (!kPaired) {
      const int t = int(fresh_tid_x());
      row = entry_of(0, t & 127);
    }
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      uint32_t v[8];
      convert_e4m3x16<__nv_bfloat16>(raw[j], scale, v);
      const int col = 256 * h + part * kVals + 16 * j;
      store16(dst, sw128_offset(row, col), make_uint4(v[0], v[1], v[2], v[3]));
      store16(dst, sw128_offset(row, col + 8), make_uint4(v[4], v[5], v[6], v[7]));
    }
    if (rope != nullptr) {
#pragma unroll
      for (int j = 0; j < kRopeLoads; ++j) store16(dst, sw128_offset(row, 512 + part * (64 / kPer) + 8 * j), rope[j]);
    }
    cutlass::arch::fence_view_async_shared();
    if constexpr (kPaired) {
      // the warp's rows of each chunk of the half are contiguous (1 KiB): once every lane's
      // stores are fenced, lane 0 copies them to the peer's tile (chunks 0-3, or 4-8 with
      // the rope), completing on the peer's "full" barrier, and expects the same from the
      // peer's counterpart warp (plus its mask word)
      constexpr int kRowBytes = kWarpEntries * 128;
      __syncwarp();
      if (lane == 0) {
        const int c0 = 4 * h, c1 = h == 0 ? 4 : 9;
        const uint32_t rows = uint32_t(e & ~(kWarpEntries - 1)) * 128;
        for (int c = c0; c < c1; ++c) {
          const uint32_t src = dst + c * kChunkBytes + rows;
          bulk_copy_s2cluster(src + peer_delta, src, kRowBytes, full + peer_delta);
        }
        const uint32_t bytes = kRowBytes * (c1 - c0) + (h == 0 ? 4 : 0);
        ClusterTransactionBarrier::arrive_and_expect_tx(smem_ptr<uint64_t>(full), bytes);
      } else {
        ClusterBarrier::arrive(smem_ptr<uint64_t>(full));
      }
    } else {
      ClusterBarrier::arrive(smem_ptr<uint64_t>(full));
    }
  }
};

}  // namespace mla_backend::wgmma
