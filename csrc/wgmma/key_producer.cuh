// The producer warpgroup of the seesaw kernel for the kSparse16 key source, and of the sparse
// kernel for H <= 16 (sparse/narrow_kernel.cuh): it copies each unit's 64 listed tokens of a
// bf16 cache into a K buffer with cp.async; the copies announce themselves on the fill's
// "full" mbarrier as they land.
#pragma once

#include <cute/arch/copy.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cutlass/arch/barrier.h>

#include "common/mla_shapes.h"
#include "common/ptx.cuh"
#include "splitkv/schedule.cuh"
#include "wgmma/config.cuh"
#include "wgmma/smem_layout.cuh"
#include "wgmma/timeline.cuh"

namespace mla_backend::wgmma {

// Thread t of the producer's 128 handles list entry t / 2 of every unit (its slot and
// validity; the copies go through copy_rows, whole lines at a time).
// Fills run in the order the consumers release parts of the K buffers (unit pair a, b: K0
// left, K1 right, K0 right, K1 left; see kFills and the consumer loop), each after the previous
// occupant's release ("empty" mbarrier: one arrival per warp of the releasing warpgroup). K0
// goes first: warpgroup 0's S of the next pair needs it. T: the tile's element type (bf16).
template <typename T, KeySource kSrc>
struct KeyProducer {
  static_assert(kSrc == KeySource::kSparse16, "fp8_ds_mla: RegFp8Producer; the dense sources have none");
  const DecodeParams& p;
  const unsigned char* kv;
  uint32_t kbuf0, bars_full, bars_empty;
  // sparse: [2 buffers][4 words]: bit 2j of word w = entry 16w + j of the unit is valid;
  uint32_t* masks;
  int tk, part, warp, lane;
  uint32_t used = 0, empty_phase = 0;  // bit fill_id(b, h): that part filled before / parity

  // this thread's entry and part as the constructor takes them
  __device__ __forceinline__ static int entry_of(int wtid) { return wtid >> 1; }
  __device__ __forceinline__ static int part_of(int wtid) { return wtid & 1; }

  __device__ uint32_t kbuf(int b) const { return kbuf0 + b * kTileBytes; }
  __device__ const unsigned char* token_row(int slot) const {
    const unsigned s = unsigned(slot);  // callers pass slot >= 0: unsigned division is cheaper
    return kv + (int64_t(s / kPage) * p.kv_stride_block + int64_t(s % kPage) * p.kv_stride_tok) * 2;
  }

  // bf16 source: copies 16-byte units [0, kUnits) at byte src_off of each of the warp's 16
  // entry rows to dst_of(entry, unit). 8 lanes share an entry, each taking every 8th unit, so
  // one copy instruction reads whole 128-byte lines of 4 entries (one whose 32 lanes read 32
  // different lines costs L1 and L2 a request per line, 8x more). Each entry's row offset
  // comes from its owner threads (entry e: lanes 2e, 2e + 1 of the warp) by shuffle, computed
  // there once per fill (per lane and entry, the address math and its stride reloads would
  // lengthen each fill's issue), and all of it before the fill's empty wait (gather_rows):
  // after the release only the copies are left, which the consumers' next S waits on.
  struct RowOffs {
    uint32_t v[4];   // entry 4 j + lane / 8's row offset from kv in 16-byte units (0: none)
    uint32_t valid;  // the warp's ballot: bit 2 e set when entry e has a row
  };
  __device__ __forceinline__ RowOffs gather_rows(int slot) const {
    // 32 bits of 16-byte units: ops checks that the cache spans under 64 GiB
    const uint32_t row16 = slot >= 0 ? uint32_t((token_row(slot) - kv) >> 4) : 0u;
    const uint32_t ln = fresh_lane_id();  // lane-derived values kept live would spill the producer
    RowOffs r;
#pragma unroll
    for (int j = 0; j < 4; ++j) r.v[j] = __shfl_sync(0xffffffff, row16, 2 * (j * 4 + ln / 8));
    r.valid = __ballot_sync(0xffffffff, slot >= 0);
    return r;
  }
  template <int kUnits, typename DstOf>
  __device__ __forceinline__ void copy_rows(const RowOffs& r, int src_off, DstOf dst_of) const {
    static_assert(kUnits % 8 == 0, "whole 128-byte lines");
    const uint32_t ln = fresh_lane_id();
    // every copy of an entry at an immediate offset from one base; a copy of no entry reads
    // nothing at kv (a per-copy `ok ? 16 u : 0` costs 13.5 instructions per copy where ~3 do)
    const unsigned char* base = kv + src_off + (ln % 8) * 16;
    const uint32_t mine = r.valid >> (2 * (ln / 8));  // bit 8 j: entry 4 j + ln / 8
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int e = j * 4 + ln / 8;
      const unsigned char* row = base + (uint64_t(r.v[j]) << 4);
      const int nbytes = (mine >> (8 * j)) & 1 ? 16 : 0;
#pragma unroll
      for (int k = 0; k < kUnits / 8; ++k) {
        cp_async_16(dst_of(16 * warp + e, ln % 8 + 8 * k), row + 8 * 16 * k, nbytes);
      }
    }
  }

  // The 128-byte lines of half h of this thread's entry row to L2 (h = 0: lines 0-3, h = 1:
  // lines 4-8; part 0 takes the first 2 or 3, part 1 the rest). Issued before the fill's
  // release wait, so where the rows come from DRAM the copies after the release find them in
  // L2 or on their way. (A pair ahead, the lines are evicted before use.)
  __device__ __forceinline__ void prefetch_half(int slot, int h) const {
    if (slot < 0) return;
    const unsigned char* row = token_row(slot) + (h ? 512 + 384 * part : 256 * part);
    const int n = h && !part ? 3 : 2;
#pragma unroll
    for (int l = 0; l < 3; ++l)
      if (l < n) cute::prefetch(row + 128 * l);
  }
  // half h of buffer b from cache slot `slot` (-1: zeros, masked): h = 0 chunks 0-3, h = 1
  // chunks 4-8 (see kFills)
  __device__ void issue(int b, int h, int slot) { issue_to(fill_id(b, h), kbuf(b), b, h, slot); }
  // the same into any part: barriers `bit`, chunk c of the tile at dst + c * kChunkBytes (only
  // the half's chunks are written), mask words masks[4 b ..]. The sparse kernel for H <= 16
  // keeps the halves in rings of their own.
  __device__ __forceinline__ void issue_to(int bit, uint32_t dst, int b, int h, int slot) {
    const RowOffs roffs = gather_rows(slot);
    if ((used >> bit) & 1) {
      mbar_wait(bars_empty + bit * 8, (empty_phase >> bit) & 1);
      empty_phase ^= 1u << bit;
    }
    used |= 1u << bit;
    if (lane == 0) masks[b * 4 + warp] = roffs.valid;
    // 16-byte units [0, 32) (h = 0), [32, 64) (h = 1) and the rope's [64, 72)
    copy_rows<32>(roffs, 512 * h, [&](int e, int u) { return dst + sw128_offset(e, (32 * h + u) * 8); });
    if (h == 1) copy_rows<8>(roffs, 1024, [&](int e, int u) { return dst + sw128_offset(e, (64 + u) * 8); });
    // the copies announce themselves as they land (128 arrivals), and each warp once after
    // its lane 0 wrote the unit's mask (release for that store)
    const uint32_t full = bars_full + bit * 8;
    cutlass::arch::cpasync_barrier_arrive_noinc(smem_ptr<uint64_t>(full));
    if (lane == 0) ClusterBarrier::arrive(smem_ptr<uint64_t>(full));
  }
};

}  // namespace mla_backend::wgmma
