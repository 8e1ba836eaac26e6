// MLA decode for 64-row tiles with wgmma (sm_90a): two consumer warpgroups alternating
// 64-key units ("seesaw"; the idea is FlashMLA's, this code is ours). One kernel template,
// five key sources (KeySource in config.cuh):
//   kPagedTma    dense paged decode, 16-bit cache: TMA loads whole 64-token pages (256 threads);
//   kPagedFp8    dense paged decode, per-tensor fp8 e4m3 cache (576 bytes per token): TMA loads
//                each page's raw bytes and the consumers convert them in place to q's type
//                (fp8_tile.cuh; 256 threads);
//   kPagedFp8F16 ... converted to fp16, the wgmmas on fp16 operands (a bf16 Q converted once
//                per request piece);
//   kSparse16    sparse (DSA) decode / prefill over a bf16 cache, and
//   kSparseDsMla ... over the 656-byte fp8_ds_mla cache: for these two a third, producer
//                warpgroup gathers the 64 listed tokens of each unit (384 threads): with
//                cp.async (key_producer.cuh), or converting fp8_ds_mla in registers
//                (reg_fp8_producer.cuh), so the consumers see the same tile as from a 16-bit
//                cache.
//
// A CTA works on one 64-row tile; its unit of work is 64 keys (a page, or 64 list entries).
// The consumers (consumer.cuh, consumer_steps.cuh) compute S = Q K^T (wgmma m64n64k16; Q
// chunks 0-7 from smem, the rope chunk 8 from registers for the dense sources, since their
// smem then holds the second P buffer), the online softmax and O += P V (m64n256k16),
// warpgroup w holding output columns [256w, 256w + 256).
// Shared memory: Q 72 KiB + 2 x K 72 KiB + one P buffer 8 KiB + scalars = 225 KiB.
// fp8_ds_mla runs the split schedule (kSplitOf): one unit at a time, the producer converting
// in registers (128 of them). With two row tiles (H > 64) it runs paired: the tiles are a
// 2-CTA cluster and each converts half of every unit for both (kPaired).
#pragma once

#include <cuda.h>

#include <cute/arch/cluster_sm90.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "common/ptx.cuh"
#include "splitkv/schedule.cuh"
#include "wgmma/config.cuh"
#include "wgmma/consumer.cuh"
#include "wgmma/key_producer.cuh"
#include "wgmma/reg_fp8_producer.cuh"
#include "wgmma/smem_layout.cuh"
#include "wgmma/tensor_map.h"
#include "wgmma/timeline.cuh"

namespace mla_backend::wgmma {

// Dense sources: T = bf16 or fp16 (q's type), requests are batch entries. Sparse sources:
// T = bf16, requests are query groups (DecodeParams). kPaired (fp8_ds_mla): see
// RegFp8Producer; launched as 2-CTA clusters along y (row tiles 2i and 2i + 1). kPrefetch
// (kSparse16): the producer prefetches each fill's rows to L2 before its release wait.
template <typename T, KeySource kSrc, bool kPaired, bool kPrefetch>
__global__ void __launch_bounds__(kThreadsOf<kSrc>, 1) decode_wgmma_kernel(const __grid_constant__ DecodeParams p,
                                                                         const __grid_constant__ CUtensorMap kv_map,
                                                                         const __grid_constant__ QMaps q_maps) {
  constexpr bool kSparse = kSparseOf<kSrc>;
  constexpr bool kProduced = kProducedOf<kSrc>;
  extern __shared__ unsigned char smem_raw[];
  // the shared-memory layout (kSmem bytes; what each part holds: SeesawCta in consumer.cuh);
  // SW128 atoms must start on 1024-byte boundaries
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  const uint32_t sQ = base;
  auto sKbuf = [&](int b) { return base + (1 + b) * kTileBytes; };
  const uint32_t sP0 = kProduced ? sKbuf(0) + 8 * kChunkBytes : base + 3 * kTileBytes;
  const uint32_t sP1 = kProduced ? base + 3 * kTileBytes : sQ + 8 * kChunkBytes;
  float* sM = reinterpret_cast<float*>(smem + 3 * kTileBytes + kPBytes);
  float* sScale0 = sM + kRows;
  float* sScale1 = sScale0 + kRows;
  float* sSum = sScale1 + kRows;
  const uint32_t bars = base + 3 * kTileBytes + kPBytes + 5 * kRows * sizeof(float);
  uint32_t* sMask = reinterpret_cast<uint32_t*>(smem + (bars - base) + 18 * 8);

  const int tid = threadIdx.x, lane = tid & 31;
  const int wg = tid >> 7, wtid = tid & 127;
  const int wrow = (wtid >> 5) * 16 + (lane >> 2);
  const int qd = lane & 3;
  const bool wg_leader = wtid == 0;
  // kPaired: the peer CTA's shared::cluster address of x is x + peer_delta
  const uint32_t peer_delta = kPaired ? cute::set_block_rank(base, cute::block_rank_in_cluster() ^ 1u) - base : 0u;
  if (tid == 0) {
    if constexpr (kProduced) {
      // full: every producer thread (+ each producer warp once, see kLandArrivesOf; kPaired:
      // lane 0 of each producer warp with the bytes the peer's counterpart warp copies here)
      for (int i = 0; i < kFills; ++i)
        ClusterBarrier::init(smem_ptr<uint64_t>(bars + i * 8), kLandArrivesOf<kSrc> ? 132 : 128);
      // empty: the releasing warpgroup's warps (kPaired: of both CTAs)
      for (int i = kFills; i < 2 * kFills; ++i)
        ClusterBarrier::init(smem_ptr<uint64_t>(bars + i * 8), kPaired ? 8 : 4);
      if constexpr (kQTmaOf<kSrc>) ClusterBarrier::init(smem_ptr<uint64_t>(bars + kQBar * 8), 1);
    } else {
      for (int i = 0; i < 18; ++i) ClusterBarrier::init(smem_ptr<uint64_t>(bars + i * 8), 1);
      if constexpr (kDenseQTmaOf<kSrc>) ClusterBarrier::init(smem_ptr<uint64_t>(bars + kDenseQBar * 8), 1);
    }
    cutlass::arch::fence_barrier_init();
  }
  if (tid == 0) TL(0);
  cudaTriggerProgrammaticLaunchCompletion();
  cudaGridDependencySynchronize();  // the plan, q, the indices and the cache are written by earlier kernels
  if (tid == 0) TL(1);
  // per-tensor fp8: S = kv_scale * (q . k8); 1 otherwise
  auto read_kv_scale = [&] {
    return kPerTensorFp8Of<kSrc> ? (p.kv_scale_ptr != nullptr ? __ldg(p.kv_scale_ptr) : p.kv_scale_value) : 1.f;
  };
  const float scale_log2 = p.scale_log2 * read_kv_scale();

  // the plan (the sparse kernels may run a uniform plan: see plan_start)
  auto P_at = [&](int r) { return splitkv::plan_start<kSparse>(p, r); };
  auto request_of = [&](int u) { return splitkv::plan_request_of_unit<kSparse>(p, u); };
  // the plan's CTA and the row tile
  const int cta = kTileFastestOf<kSrc> ? blockIdx.y : blockIdx.x;
  const int row0 = (kTileFastestOf<kSrc> ? blockIdx.x : blockIdx.y) * kRows;
  int u_begin, u_end, U;
  if (!splitkv::cta_units_of<kSparse>(p, cta, u_begin, u_end, U)) return;  // kPaired: both CTAs (same cta)
  if constexpr (kPaired) cute::cluster_sync();  // both CTAs' barriers initialised
  else __syncthreads();                         // barriers initialised

  if constexpr (kProduced) {
    if constexpr (kSplitOf<kSrc>) {
      if (wg == 2) {  // ---- producer warpgroup of the split schedule
        cutlass::arch::warpgroup_reg_dealloc<kSplitProducerRegs>();
        using Prod = RegFp8Producer<kPaired>;
        const int entry = Prod::entry_of(int(cute::block_rank_in_cluster()), wtid), part = Prod::part_of(wtid);
        Prod prod{p,    static_cast<const unsigned char*>(p.kv), sKbuf(0), bars, bars + kFills * 8,
                  sMask, entry, part, wtid >> 5, lane, peer_delta};
        int r = request_of(u_begin);
        for (int u = u_begin; u < u_end;) {
          while (u >= P_at(r + 1)) ++r;
          const int Pr = P_at(r);
          const int pg_begin = u - Pr, pg_end = min(u_end, P_at(r + 1)) - Pr;
          const int* list = splitkv::sparse_group_indices(p, r);
          const int len = splitkv::sparse_group_len(p, r);
          auto fetch = [&](int pg) {
            const int pos = pg * kKeys + entry;
            return pg < pg_end && pos < len ? __ldg(list + pos) : -1;
          };
          auto slot_from = [&](int v) { return v >= 0 && v < p.num_slots ? v : -1; };
          // unit i of the piece goes to buffer i % 2 (the consumers count the same way);
          // the left half of unit i + 1 is loaded while unit i's right half waits, the
          // index of unit i + 2 while unit i is converted
          const int n = pg_end - pg_begin;
          int slot = slot_from(fetch(pg_begin));
          int next_entry = fetch(pg_begin + 1);
          // unpaired: unit i + 2's rows are prefetched to L2 during unit i (its index loaded
          // one unit earlier): -1 to -6% unpaired, +0-2% paired, so paired does not
          constexpr bool kL2Prefetch = !kPaired;
          int after_entry = kL2Prefetch ? fetch(pg_begin + 2) : -1;
          typename Prod::Left left;
          typename Prod::Right right;
          prod.load(0, slot, left.raw, nullptr, left.scale);
#pragma unroll 1
          for (int i = 0; i < n; ++i) {
            const int b = i & 1;
            prod.load(1, slot, right.raw, right.rope, right.scale);
            int after_next;
            if constexpr (kL2Prefetch) {
              prod.prefetch_l2(slot_from(after_entry));
              after_next = after_entry;
              after_entry = fetch(pg_begin + i + 3);
            } else {
              after_next = fetch(pg_begin + i + 2);
            }
            prod.put(b, 0, slot, left.raw, nullptr, left.scale);
            const int slot_next = slot_from(next_entry);
            if (i + 1 < n) prod.load(0, slot_next, left.raw, nullptr, left.scale);
            prod.put(b, 1, slot, right.raw, right.rope, right.scale);
            slot = slot_next;
            next_entry = after_next;
          }
          u = Pr + pg_end;
        }
        if constexpr (kPaired) cute::cluster_sync();  // see the end of the kernel
        return;
      }
    } else if (wg == 2) {  // ---- producer warpgroup
      cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
      static_assert(kSrc == KeySource::kSparse16, "the dense sources have no producer");
      using Prod = KeyProducer<T, kSrc>;
      Prod prod{p,     static_cast<const unsigned char*>(p.kv), sKbuf(0), bars, bars + kFills * 8,
                sMask, Prod::entry_of(wtid), Prod::part_of(wtid), wtid >> 5, lane};
      auto issue = [&](int b, int h, int slot) { prod.issue(b, h, slot); };
      // bf16 sparse: the next piece's first two entries, loaded during this piece's last pair
      // (loaded at the next piece's start, a new request's index loads would stand between the
      // last pair's fills and the next piece's first)
      int carry_a = -1, carry_b = -1;
      bool carried = false;
      int r = request_of(u_begin);
      for (int u = u_begin; u < u_end;) {
        while (u >= P_at(r + 1)) ++r;
        const int Pr = P_at(r);
        const int* list = splitkv::sparse_group_indices(p, r);
        const int len = splitkv::sparse_group_len(p, r);
        const int pg_begin = u - Pr, pg_end = min(u_end, P_at(r + 1)) - Pr;
        // unit pg's listed slot for this thread (-1: none), and the cache slot it names (-1:
        // zero-filled, masked), checked at once
        auto fetch = [&](int pg) {
          const int pos = pg * kKeys + prod.tk;
          return pos < len ? __ldg(list + pos) : -1;
        };
        auto slot_from = [&](int entry) { return entry >= 0 && entry < p.num_slots ? entry : -1; };
        // over a cache larger than L2 (kPrefetch: the decode batches): the second pair's
        // entries are loaded with the first's (loaded in the first pair's iteration, they are a
        // second index load in series before the piece's first fill): decode at batch 32 -1.5
        // to -3.5%. The other instance (prefill) measures +1.5% with it (only a CTA's first
        // piece gains there), so it keeps the else branch; one form for both changes the other
        // instance's SASS.
        constexpr bool kSecondPairEarly = kPrefetch;
        int slot_a, slot_b, second_a = -1, second_b = -1;
        if constexpr (kSecondPairEarly) {
          const int entry_a = carried ? carry_a : fetch(pg_begin);
          const int entry_b = pg_begin + 1 < pg_end ? (carried ? carry_b : fetch(pg_begin + 1)) : -1;
          second_a = pg_begin + 2 < pg_end ? fetch(pg_begin + 2) : -1;
          second_b = pg_begin + 3 < pg_end ? fetch(pg_begin + 3) : -1;
          slot_a = slot_from(entry_a);
          slot_b = pg_begin + 1 < pg_end ? slot_from(entry_b) : -1;
        } else {
          slot_a = slot_from(carried ? carry_a : fetch(pg_begin));
          slot_b = pg_begin + 1 < pg_end ? slot_from(carried ? carry_b : fetch(pg_begin + 1)) : -1;
        }
        carried = false;
        for (int pa_ = pg_begin; pa_ < pg_end; pa_ += 2) {
          const bool has_b = pa_ + 1 < pg_end;
          // the next pair's slots (loads in flight while this pair is issued)
          const bool second = kSecondPairEarly && pa_ == pg_begin;
          const int next_a = slot_from(second ? second_a : pa_ + 2 < pg_end ? fetch(pa_ + 2) : -1);
          const int next_b = slot_from(second ? second_b : pa_ + 3 < pg_end ? fetch(pa_ + 3) : -1);
          if (pa_ + 2 >= pg_end && Pr + pg_end < u_end) {  // last pair, and a next piece
            const int nr = request_of(Pr + pg_end);  // it starts at that request's first unit
            const int* nlist = splitkv::sparse_group_indices(p, nr);
            const int nlen = splitkv::sparse_group_len(p, nr);
            carry_a = prod.tk < nlen ? __ldg(nlist + prod.tk) : -1;
            carry_b = kKeys + prod.tk < nlen ? __ldg(nlist + kKeys + prod.tk) : -1;
            carried = true;
          }
          // in the order the halves are released (K0 left, K1 right, K0 right, K1 left), each
          // after a blocking wait (polling K0 left and K1 right for whichever comes free first
          // costs ~18 instructions per poll, 1.7 M polls per 1024 tokens, and is no faster)
          if (wtid == 0 && pa_ == pg_begin && u == u_begin) TL(2);
          // kPrefetch: each fill's lines to L2 before its release wait (see sparse/sparse_mla.cu)
          if constexpr (kPrefetch) prod.prefetch_half(slot_a, 0);
          issue(0, 0, slot_a);
          if (has_b) {
            if constexpr (kPrefetch) prod.prefetch_half(slot_b, 1);
            issue(1, 1, slot_b);
          }
          if constexpr (kPrefetch) prod.prefetch_half(slot_a, 1);
          issue(0, 1, slot_a);
          if (has_b) {
            if constexpr (kPrefetch) prod.prefetch_half(slot_b, 0);
            issue(1, 0, slot_b);
          }
          if (wtid == 0 && pa_ == pg_begin && u == u_begin) TL(3);
          slot_a = next_a;
          slot_b = next_b;
        }
        u = Pr + pg_end;
      }
      return;
    }
  }
  // ---- consumers: two warpgroups, 256 threads
  auto consumers = [&](auto wg_id) {
    const SeesawCta c{smem, base, sQ,  sP0,       sP1,        sM,         sScale0, sScale1, sSum,  bars,  sMask, tid,
                      lane, wtid, wrow, qd, wg_leader, peer_delta, scale_log2, cta,     row0,    u_begin, u_end, U};
    consumer_warpgroups<T, kSrc, kPaired>(p, kv_map, q_maps, c, wg_id);
  };
  if constexpr (kSplitOf<kSrc>) {
    if (wg == 0) {
      cutlass::arch::warpgroup_reg_alloc<kSplitWg0Regs>();
      consumers(std::integral_constant<int, 0>{});
    } else {
      cutlass::arch::warpgroup_reg_dealloc<kSplitWg1Regs>();
      consumers(std::integral_constant<int, 1>{});
    }
  } else {
    if constexpr (kProduced) cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
    consumers(wg);
  }
  // kPaired: no CTA leaves while the peer may still write to its shared memory or arrive on
  // its barriers
  if constexpr (kPaired) cute::cluster_sync();
}

}  // namespace mla_backend::wgmma
