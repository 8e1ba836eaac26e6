// The producer warpgroup of the seesaw kernel for the kPagedFp8 and kSparse16 key sources,
// and of the sparse kernel for H <= 16 (sparse/narrow_kernel.cuh): it copies each unit's 64
// tokens into a K buffer with cp.async (paired fp8 tiles: plain loads into registers, see
// kPaired) and, for the fp8 cache, converts them to 16-bit values in shared memory.
#pragma once

#include <cute/arch/cluster_sm90.hpp>
#include <cute/arch/copy.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cutlass/arch/barrier.h>

#include "common/convert.cuh"
#include "common/mla_shapes.h"
#include "common/ptx.cuh"
#include "splitkv/schedule.cuh"
#include "wgmma/config.cuh"
#include "wgmma/smem_layout.cuh"
#include "wgmma/timeline.cuh"

namespace mla_backend::wgmma {

// Thread t of the producer's 128 handles list entry t / 2 (kPaired: see below) of every unit
// (its slot, validity and, fp8, the columns it converts; the bf16 source copies whole lines
// through copy_rows).
// Fills run in the order the consumers release parts of the K buffers (unit pair a, b: K0
// left, K0 right, K1 right, K1 left; the bf16 source K0 left, K1 right, K0 right, K1 left; see
// kFills and the consumer loop), each after the previous occupant's release ("empty"
// mbarrier: one arrival per warp of the releasing warpgroup). K0 goes first: warpgroup 0's S
// of the next pair needs it, and K1's left half is released only when that S is half issued
// (release_k1_left). A fill's copies are issued, then the previous fill is finished
// (cp.async landed; fp8: converted) and announced on its "full" mbarrier (128 arrivals); a
// fill whose buffer is still busy first finishes the one before it, so a consumer never
// waits on a fill the producer holds back. T: the tile's element type (the fp8 cache is
// converted to it). fp8_ds_mla has its own producer (RegFp8Producer).
// kPaired (per-tensor fp8, two row tiles as a 2-CTA cluster): each CTA loads and converts 32
// of the unit's 64 entries, 4 threads an entry (entry 32 rank + 8 warp + lane % 8, part
// lane / 8), and each warp bulk-copies its 8 converted rows of every chunk to the peer's tile:
// the two tiles read the same keys, so each page is converted once, not twice. A thread's
// share of a half is then 64 values (80 with the rope): few enough to load into registers
// before the release wait (load_raw, then put), so after a release only the conversion is
// left, not the copy's latency.
template <typename T, KeySource kSrc, bool kPaired = false>
struct KeyProducer {
  static_assert(kSrc == KeySource::kPagedFp8 || kSrc == KeySource::kSparse16, "fp8_ds_mla: RegFp8Producer");
  static_assert(!kPaired || kSrc == KeySource::kPagedFp8, "only the per-tensor fp8 source runs paired");
  const DecodeParams& p;
  const unsigned char* kv;
  uint32_t kbuf0, bars_full, bars_empty;
  // sparse: [2 buffers][4 words]: bit 2j of word w = entry 16w + j of the unit is valid;
  uint32_t* masks;
  int tk, part, warp, lane;
  uint32_t used = 0, empty_phase = 0;  // bit fill_id(b, h): that part filled before / parity
  uint32_t peer_delta = 0;             // kPaired: the peer CTA's shared::cluster address of x is x + peer_delta

  // this thread's entry and part as the constructor takes them
  __device__ __forceinline__ static int entry_of(int wtid) {
    return kPaired ? 32 * int(cute::block_rank_in_cluster()) + 8 * (wtid >> 5) + (wtid & 7) : wtid >> 1;
  }
  __device__ __forceinline__ static int part_of(int wtid) { return kPaired ? (wtid & 31) >> 3 : wtid & 1; }

  __device__ uint32_t kbuf(int b) const { return kbuf0 + b * kTileBytes; }
  // this thread's entry and part (tk, part), re-derived where the fp8 copies and
  // conversions use them: the offsets ptxas derived from tk and part once and kept across
  // the producer loop spilled the 56-register producer
  __device__ __forceinline__ void fresh_ids(int& e, int& q) const {
    const int t = int(fresh_tid_x() & 127);
    e = entry_of(t);
    q = part_of(t);
  }
  __device__ const unsigned char* token_row(int slot) const {
    const unsigned s = unsigned(slot);  // callers pass slot >= 0: unsigned division is cheaper
    return kv + (int64_t(s / kPage) * p.kv_stride_block + int64_t(s % kPage) * p.kv_stride_tok) *
                    (kSrc == KeySource::kSparse16 ? 2 : 1);
  }

  struct Fill {
    int b = -1, h = 0;
  };

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
  __device__ Fill issue(int b, int h, int slot, Fill& pending) {
    return issue_to(fill_id(b, h), kbuf(b), b, h, slot, pending);
  }
  // the same into any part: barriers `bit`, chunk c of the tile at dst + c * kChunkBytes (only
  // the half's chunks are written), mask words masks[4 b ..] (fp8: finish() converts in
  // kbuf(b)). The sparse kernel for H <= 16 keeps the halves in rings of their own.
  __device__ __forceinline__ Fill issue_to(int bit, uint32_t dst, int b, int h, int slot, Fill& pending) {
    RowOffs roffs{};
    if constexpr (kSrc == KeySource::kSparse16) roffs = gather_rows(slot);
    if ((used >> bit) & 1) {
      const uint32_t bar = bars_empty + bit * 8;
      const uint32_t ph = (empty_phase >> bit) & 1;
      // lane 0 decides for its warp: the finish step synchronises the warp
      const bool ready = __shfl_sync(0xffffffff, ClusterBarrier::test_wait(smem_ptr<uint64_t>(bar), ph, 1u), 0);
      if (!ready && pending.b >= 0) {
        cp_async_wait<0>();
        finish(pending);
        pending.b = -1;
      }
      mbar_wait(bar, ph);
      empty_phase ^= 1u << bit;
    }
    used |= 1u << bit;
    if constexpr (kSrc == KeySource::kSparse16) {  // dense fp8 masks by position (seq_len, causal)
      if (lane == 0) masks[b * 4 + warp] = roffs.valid;
    }
    Fill f;
    f.b = b; f.h = h;
    const bool rope_here = h == 1;
    if constexpr (kSrc == KeySource::kSparse16) {
      // 16-byte units [0, 32) (h = 0), [32, 64) (h = 1) and the rope's [64, 72)
      copy_rows<32>(roffs, 512 * h, [&](int e, int u) { return dst + sw128_offset(e, (32 * h + u) * 8); });
      if (rope_here) copy_rows<8>(roffs, 1024, [&](int e, int u) { return dst + sw128_offset(e, (64 + u) * 8); });
    } else {
      // 128 e4m3 values staged raw: units 0-3 in chunk 4h + 1, units 4-7 in chunk 4h + 3, at
      // this entry's 128-byte row (see finish). Each thread copies what it converts (copy_rows'
      // whole-line copies measure slower here).
      static_assert(!kPaired, "kPaired fills go through load_raw and put");
      const bool ok = slot >= 0;
      const unsigned char* row = ok ? token_row(slot) : kv;
      const int nbytes = ok ? 16 : 0;
      int e, pt;
      fresh_ids(e, pt);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint32_t stage = dst + (4 * h + 1 + 2 * (j >> 2)) * kChunkBytes + raw_offset(e, pt * 4 + (j & 3));
        cp_async_16(stage, row + h * 256 + pt * 128 + j * 16, nbytes);
      }
      if (rope_here) {  // rope: 64 e4m3 at byte 512, staged raw in chunk 8's row (units 2 part, 2 part + 1)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          cp_async_16(dst + 8 * kChunkBytes + raw_offset(e, pt * 2 + j), row + 512 + pt * 32 + j * 16, nbytes);
        }
      }
    }
    if constexpr (kLandArrivesOf<kSrc>) {
      const uint32_t full = bars_full + bit * 8;
      cutlass::arch::cpasync_barrier_arrive_noinc(smem_ptr<uint64_t>(full));
      if (lane == 0) ClusterBarrier::arrive(smem_ptr<uint64_t>(full));  // after the mask store above
      f.b = -1;                          // nothing left to finish
    } else {
      cute::cp_async_fence();
    }
    return f;
  }

  // 16 e4m3 values as T at columns col .. col + 15 of row e of the tile at generic `tile`
  __device__ __forceinline__ static void store_converted(unsigned char* tile, int e, int col, uint4 raw) {
    uint32_t v[8];
    convert_e4m3x16<T>(raw, 1.f, v);  // exact: kv_scale is folded into S and O
    *reinterpret_cast<uint4*>(tile + sw128_offset(e, col)) = make_uint4(v[0], v[1], v[2], v[3]);
    *reinterpret_cast<uint4*>(tile + sw128_offset(e, col + 8)) = make_uint4(v[4], v[5], v[6], v[7]);
  }
  // the fill's copies have landed (caller waited): dequantize, publish to the async proxy,
  // announce
  __device__ void finish(const Fill& f) {
    if constexpr (kFp8Of<kSrc>) {
      // raw units j < 4 sit in chunk 4h+1 and become columns of chunk 4h + 2*part; units
      // j >= 4 sit in chunk 4h+3 and become columns of chunk 4h + 2*part + 1 (per-tensor fp8,
      // h = 1: the raw rope in chunk 8 becomes chunk 8). An entry's 128-byte row in each chunk
      // belongs to its two threads (one warp): the warp reads all its raw units before any
      // lands on a raw row.
      const uint32_t dst = kbuf(f.b);
      unsigned char* gen = reinterpret_cast<unsigned char*>(__cvta_shared_to_generic(dst));
      int e, pt;
      fresh_ids(e, pt);
      auto raw_at = [&](int j) {
        return *reinterpret_cast<const uint4*>(gen + (4 * f.h + 1 + 2 * (j >> 2)) * kChunkBytes +
                                               raw_offset(e, pt * 4 + (j & 3)));
      };
      auto put_at = [&](int col, uint4 raw) { store_converted(gen, e, col, raw); };
      auto put = [&](int j, uint4 raw) { put_at(256 * f.h + pt * 128 + j * 16, raw); };
      // each half's four raw units are read before any is converted: the stores go through the
      // same generic pointer, so the compiler keeps each load behind the previous store
      uint4 lo[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) lo[j] = raw_at(j);
#pragma unroll
      for (int j = 0; j < 4; ++j) put(j, lo[j]);  // to chunks 4h, 4h+2: no raw there
      uint4 hi[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) hi[j] = raw_at(4 + j);
      __syncwarp();  // every raw unit of the warp's rows is in registers or already used
#pragma unroll
      for (int j = 0; j < 4; ++j) put(4 + j, hi[j]);
      if (kSrc == KeySource::kPagedFp8 && f.h == 1) {  // rope, raw in chunk 8
        uint4 rope[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          rope[j] = *reinterpret_cast<const uint4*>(gen + 8 * kChunkBytes + raw_offset(e, pt * 2 + j));
        }
        __syncwarp();
#pragma unroll
        for (int j = 0; j < 2; ++j) put_at(512 + pt * 32 + j * 16, rope[j]);
      }
    }
    cutlass::arch::fence_view_async_shared();
    ClusterBarrier::arrive(smem_ptr<uint64_t>(bars_full + fill_id(f.b, f.h) * 8));
  }

  // kPaired: this thread's raw bytes of half h of cache slot `slot` (-1: zeros), by plain
  // 16-byte loads into registers: values 64 part .. 64 part + 63 of the half, and for h = 1
  // the rope's 16 part .. 16 part + 15
  struct Raw {
    uint4 v[4];
    uint4 rope;
  };
  __device__ __forceinline__ void load_raw(int h, int slot, Raw& r) const {
    int e, pt;
    fresh_ids(e, pt);
    if (slot >= 0) {
      const unsigned char* row = token_row(slot);
#pragma unroll
      for (int j = 0; j < 4; ++j) r.v[j] = __ldg(reinterpret_cast<const uint4*>(row + h * 256 + pt * 64 + j * 16));
      r.rope = h == 1 ? __ldg(reinterpret_cast<const uint4*>(row + 512 + pt * 16)) : make_uint4(0, 0, 0, 0);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) r.v[j] = make_uint4(0, 0, 0, 0);
      r.rope = make_uint4(0, 0, 0, 0);
    }
  }
  // kPaired: half h of buffer b from the loaded bytes: wait for its release (both CTAs'
  // consumers), convert into chunk 4h + part (h = 1: the rope into chunk 8's units 2 part,
  // 2 part + 1), share the rows with the peer and announce
  __device__ __forceinline__ void put(int b, int h, const Raw& r) {
    const int bit = fill_id(b, h);
    if ((used >> bit) & 1) {
      mbar_wait(bars_empty + bit * 8, (empty_phase >> bit) & 1);
      empty_phase ^= 1u << bit;
    }
    used |= 1u << bit;
    int e, pt;
    fresh_ids(e, pt);
    unsigned char* gen = reinterpret_cast<unsigned char*>(__cvta_shared_to_generic(kbuf(b)));
#pragma unroll
    for (int j = 0; j < 4; ++j) store_converted(gen, e, 256 * h + pt * 64 + j * 16, r.v[j]);
    if (h == 1) store_converted(gen, e, 512 + pt * 16, r.rope);
    Fill f;
    f.b = b; f.h = h;
    share_with_peer(f);
  }

  // kPaired: once every lane's stores are fenced, lane 0 copies the warp's 8 rows (1 KiB,
  // contiguous in each chunk) of the half's chunks to the peer's tile, completing on the
  // peer's "full" barrier, and expects as many bytes from the peer's counterpart warp
  __device__ __forceinline__ void share_with_peer(const Fill& f) const {
    const uint32_t full = bars_full + fill_id(f.b, f.h) * 8;
    cutlass::arch::fence_view_async_shared();
    __syncwarp();
    if (fresh_lane_id() == 0) {
      constexpr uint32_t kRowBytes = 8 * 128;
      const int c0 = 4 * f.h, c1 = f.h == 0 ? 4 : 9;
      const uint32_t rows = uint32_t(32 * int(cute::block_rank_in_cluster()) + 8 * warp) * 128;
      for (int c = c0; c < c1; ++c) {
        const uint32_t src = kbuf(f.b) + c * kChunkBytes + rows;
        bulk_copy_s2cluster(src + peer_delta, src, kRowBytes, full + peer_delta);
      }
      ClusterTransactionBarrier::arrive_and_expect_tx(smem_ptr<uint64_t>(full), kRowBytes * (c1 - c0));
    } else {
      ClusterBarrier::arrive(smem_ptr<uint64_t>(full));
    }
  }
};

}  // namespace mla_backend::wgmma
