// The two consumer warpgroups of the decode kernel (decode_kernel.cuh): their state and the
// CTA's units, one request piece at a time. Per piece the seesaw over unit pairs or the split
// schedule over single units, then the epilogue. The K-buffer steps (loads, waits, releases)
// are lambdas here, the wgmma and softmax steps structs in consumer_steps.cuh.
//
// Seesaw (every source but fp8_ds_mla): units of a piece go in pairs, warpgroup 0 owns even
// units (buffer K0), warpgroup 1 odd units (buffer K1); warpgroup w holds output columns
// [256w, 256w + 256).
//   S        : each warpgroup computes S = Q K^T for its own unit, 64 rows x 64 keys over
//              576 (wgmma m64n64k16).
//   softmax  : warpgroup 0 first, then warpgroup 1 on top of its running max; the max and
//              the rescale factors go through smem (named barriers kBarMax0, kBarMax1).
//   PV       : each warpgroup multiplies its own P from registers (RS) by its half of its own
//              unit's V, and the other's P (smem, after barriers kBarP0 / kBarP1) by its half
//              of the other unit's V.
// Each half of a K buffer (chunks 0-3 = V left, 4-8 = V right + rope) is released as soon as
// its last reader's wgmma retires (dense: its TMA refill is issued; with a producer: the
// producer's "empty" mbarrier is signalled), so the next pair of units streams in while this
// pair computes.
// Split (fp8_ds_mla): one unit at a time; warpgroup 0 computes S, the softmax and O's left
// half (P from registers), warpgroup 1 only O's right half (P from smem).
#pragma once

#include <cuda.h>

#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/copy_sm90.hpp>
#include <cutlass/arch/barrier.h>

#include <type_traits>
#include <utility>

#include "common/convert.cuh"
#include "common/mla_shapes.h"
#include "common/ptx.cuh"
#include "splitkv/partials.cuh"
#include "splitkv/schedule.cuh"
#include "wgmma/config.cuh"
#include "wgmma/consumer_steps.cuh"
#include "wgmma/fp8_tile.cuh"
#include "wgmma/gmma.cuh"
#include "wgmma/smem_layout.cuh"
#include "wgmma/staged_rows.cuh"
#include "wgmma/tensor_map.h"
#include "wgmma/timeline.cuh"

namespace mla_backend::wgmma {

// What the kernel's prologue computed, by reference (see consumer_steps.cuh)
struct SeesawCta {
  unsigned char* const& smem;  // shared memory, 1024-byte aligned (SW128 atoms need it), generic
  const uint32_t& base;        // ... and its shared::cta address
  const uint32_t& sQ;          // Q, then K0, K1 (kTileBytes each)
  // dense: P0 in a buffer of its own, P1 in Q's rope chunk once that is in registers;
  // with a producer (fewer registers left): P0 in K0's rope chunk, dead once S of its unit is
  // done (see kFills), P1 in the buffer of its own
  const uint32_t& sP0;
  const uint32_t& sP1;
  float* const& sM;       // running max (log2) [64]
  float* const& sScale0;  // rescale factors published by warpgroup 0 [64] ...
  float* const& sScale1;  // ... and warpgroup 1 [64]
  float* const& sSum;     // row sums [2][64]
  // mbarriers. dense: one per 8 KiB chunk c of buffer b, at bars + (9b + c) * 8. With a
  // producer: "full" of part h of buffer b at bars + fill_id(b, h) * 8, "empty" at
  // bars + (kFills + fill_id(b, h)) * 8; the Q barrier (kQTmaOf) at bars + kQBar * 8.
  const uint32_t& bars;
  uint32_t* const& sMask;  // sparse: [2][4] (kPaired [2][8]) words of valid-entry bits
  const int& tid;
  const int& lane;
  const int& wtid;        // thread in the warpgroup
  const int& wrow;        // this thread's rows of the tile: wrow, wrow + 8
  const int& qd;          // lane % 4: its columns of the accumulator fragments
  const bool& wg_leader;  // wtid == 0
  const uint32_t& peer_delta;  // kPaired: the peer CTA's shared::cluster address of x is x + peer_delta
  const float& scale_log2;     // the softmax scale in the log2 domain (times kv_scale)
  const int& cta;              // the plan's CTA (decode_kernel.cuh: blockIdx.x, or y where the row tile is x)
  const int& row0;             // the first row of the CTA's tile
  const int& u_begin;          // the CTA's units [u_begin, u_end), U per CTA
  const int& u_end;
  const int& U;
};

// The consumer warpgroups (256 threads). The split schedule instantiates this once per
// warpgroup (wg_id a compile-time constant), each under its own register limit: a shared path
// would have to fit the smaller one.
template <typename T, KeySource kSrc, bool kPaired, typename WgId>
__device__ __forceinline__ void consumer_warpgroups(const DecodeParams& p, const CUtensorMap& kv_map,
                                                    const QMaps& q_maps, const SeesawCta& c, WgId wg_id) {
  constexpr bool kSparse = kSparseOf<kSrc>;
  constexpr bool kProduced = kProducedOf<kSrc>;
  constexpr bool kQTma = kQTmaOf<kSrc>;
  constexpr bool kDenseQTma = kDenseQTmaOf<kSrc>;
  constexpr bool kConverts = kPerTensorFp8Of<kSrc>;  // raw fp8 pages, see fp8_tile.cuh
  // the wgmmas' operand type: kPagedFp8F16, fp16 (a bf16 Q converted per piece, each row scaled
  // by a power of two whose inverse joins that row's softmax scale); else q's type
  using Op = std::conditional_t<kSrc == KeySource::kPagedFp8F16, __half, T>;
  constexpr bool kQToF16 = kSrc == KeySource::kPagedFp8F16 && !std::is_same_v<T, __half>;
  // the kernel's locals under their own names, bound once here (see consumer_steps.cuh)
  auto& smem = c.smem;
  auto& base = c.base;
  auto& sQ = c.sQ;
  auto& sP0 = c.sP0;
  auto& sP1 = c.sP1;
  auto& sM = c.sM;
  auto& sScale0 = c.sScale0;
  auto& sScale1 = c.sScale1;
  auto& sSum = c.sSum;
  auto& bars = c.bars;
  auto& sMask = c.sMask;
  auto& tid = c.tid;
  auto& lane = c.lane;
  auto& wtid = c.wtid;
  auto& wrow = c.wrow;
  auto& qd = c.qd;
  auto& wg_leader = c.wg_leader;
  auto& peer_delta = c.peer_delta;
  auto& scale_log2 = c.scale_log2;
  auto& cta = c.cta;
  auto& row0 = c.row0;
  auto& u_begin = c.u_begin;
  auto& u_end = c.u_end;
  auto& U = c.U;
  auto sKbuf = [&](int b) { return base + (1 + b) * kTileBytes; };
  // per-tensor fp8: O = kv_scale * (P . v8) (read again in the epilogue rather than held in a
  // register); 1 otherwise
  auto read_kv_scale = [&] {
    return kPerTensorFp8Of<kSrc> ? (p.kv_scale_ptr != nullptr ? __ldg(p.kv_scale_ptr) : p.kv_scale_value) : 1.f;
  };
  // the plan (the sparse kernels may run a uniform plan: see plan_start)
  auto P_at = [&](int r) { return splitkv::plan_start<kSparse>(p, r); };
  auto request_of = [&](int u) { return splitkv::plan_request_of_unit<kSparse>(p, u); };
  // block id of page pi of request r (0 past the block table: the page is then masked and
  // its V zeroed, see n_valid)
  auto block_of = [&](int r, int pi) {
    return pi < p.max_blocks ? __ldg(p.block_table + r * p.bt_stride + pi) : 0;
  };
  const int wg = wg_id;
  auto consumers_sync = [&] {
    if constexpr (kProduced) named_sync(kBarConsumers, kConsumerThreads);
    else __syncthreads();
  };

  // dense: bit (9b + c): parity of buffer b chunk c's next completion; with a producer:
  // bit fill_id(b, h) of that part's "full" barrier
  uint32_t phases = 0;
  const T* qbase = static_cast<const T*>(p.q);
  const uint32_t q_bar = bars + (kDenseQTma ? kDenseQBar : kQBar) * 8;
  uint32_t q_phase = 0;
  // kQTma: Q of query group rq -> sQ (one thread; sQ is free): chunks 0-7 from the latent
  // part's map, chunk 8 from the rope part's
  auto load_q = [&](int rq) {
    ClusterTransactionBarrier::arrive_and_expect_tx(smem_ptr<uint64_t>(q_bar), kTileBytes);
    const int qs = rq % p.group_s_q, qb = rq / p.group_s_q;
#pragma unroll
    for (int c = 0; c < kDv / 64; ++c) tma_load_4d(sQ + c * kChunkBytes, &q_maps.nope, c * 64, row0, qs, qb, q_bar);
    tma_load_4d(sQ + (kDv / 64) * kChunkBytes, &q_maps.pe, 0, row0, qs, qb, q_bar);
  };
  // kDenseQTma where the host made q maps (dense_q_by_tma): Q of request rq -> sQ by TMA (one
  // thread; sQ is free), the same chunks as load_q, the tile's box at (head, token) (h0, s0)
  const bool q_tma = kDenseQTma && dense_q_by_tma(p);
  const int h0 = q_tma ? row0 % p.heads : 0, s0 = q_tma ? row0 / p.heads : 0;
  auto load_q_dense = [&](int rq) {
    ClusterTransactionBarrier::arrive_and_expect_tx(smem_ptr<uint64_t>(q_bar), kTileBytes);
#pragma unroll
    for (int c = 0; c < kDv / 64; ++c) tma_load_4d(sQ + c * kChunkBytes, &q_maps.nope, c * 64, h0, s0, rq, q_bar);
    tma_load_4d(sQ + (kDv / 64) * kChunkBytes, &q_maps.pe, 0, h0, s0, rq, q_bar);
  };

  // TMA of one half of buffer b (h = 0: chunks 0-3, h = 1: chunks 4-8), one mbarrier per
  // chunk so S can start on each as it lands. kPagedFp8: 128 raw bytes a row per box, into
  // the odd chunks 1, 3 (h = 0) and 5, 7, 8 (h = 1; chunk 8's box ends past the token's 576
  // bytes, its last 64 bytes a row are zero fill), each on its own chunk's mbarrier
  auto load_half = [&](int b, int h, int blk) {
    if constexpr (kConverts) {
      const int c0 = h == 0 ? 1 : 5, c1 = h == 0 ? 4 : 9;
      for (int c = c0; c < c1; c += (c == 7 ? 1 : 2)) {
        const uint32_t bar = bars + (9 * b + c) * 8;
        ClusterTransactionBarrier::arrive_and_expect_tx(smem_ptr<uint64_t>(bar), kChunkBytes);
        tma_load_3d(sKbuf(b) + c * kChunkBytes, &kv_map, (c >> 1) * 128, 0, blk, bar);
      }
    } else {
      const int c0 = h == 0 ? 0 : 4, c1 = h == 0 ? 4 : 9;
      for (int c = c0; c < c1; ++c) {
        const uint32_t bar = bars + (9 * b + c) * 8;
        ClusterTransactionBarrier::arrive_and_expect_tx(smem_ptr<uint64_t>(bar), kChunkBytes);
        tma_load_3d(sKbuf(b) + c * kChunkBytes, &kv_map, c * 64, 0, blk, bar);
      }
    }
  };
  // half h of buffer b is no longer read by this warpgroup (its wgmmas retired): dense,
  // TMA the next page there (if there is one); otherwise tell the producer
  auto release = [&](int b, int h, bool has_next, int next_blk) {
    if constexpr (kProduced) {
      const uint32_t empty = bars + (kFills + fill_id(b, h)) * 8;
      if (lane == 0) ClusterBarrier::arrive(smem_ptr<uint64_t>(empty));
      if (kPaired && lane == 0) mbar_arrive_remote(empty + peer_delta);  // the peer's producer writes here too
    } else {
      if (wg_leader && has_next) load_half(b, h, next_blk);
    }
  };
  auto wait_chunk = [&](int b, int c) {
    if constexpr (kProduced) {
      // one barrier per half: chunks 0-3, 4-8
      if (c != 0 && c != 4) return;
      const int bit = fill_id(b, c >> 2);
      mbar_wait(bars + bit * 8, (phases >> bit) & 1);
      phases ^= 1u << bit;
      // kLandArrivesOf: cp.async wrote the half through the generic proxy and no producer
      // thread fenced it. kPaired: the peer's rows come by bulk copy (async proxy) and the
      // local ones are fenced by the producer, so this fence is redundant (it costs nothing
      // measurable, and the tested build has it)
      if constexpr (kLandArrivesOf<kSrc> || kPaired) cutlass::arch::fence_view_async_shared();
    } else if constexpr (kConverts) {
      // S reads chunks c and c + 1 (c even) from raw chunk c + 1, chunk 8 from its own raw
      // bytes: this warpgroup (S of buffer b is its own, and the first reader of the page)
      // converts them once landed, then fences them for the wgmmas of every warpgroup
      if (c & 1) return;
      const int rc = c == 8 ? 8 : c + 1;
      const int bit = 9 * b + rc;
      mbar_wait(bars + bit * 8, (phases >> bit) & 1);
      phases ^= 1u << bit;
      unsigned char* tile = smem + (sKbuf(b) - base);
      if (rc == 8) convert_raw_rope<Op>(tile, wtid);
      else convert_raw_chunk<Op>(tile, rc, wtid);
      cutlass::arch::fence_view_async_shared();
      named_sync(kBarWg0 + wg, 128);  // the warpgroup's wgmmas read every thread's rows
    } else {
      const int bit = 9 * b + c;
      mbar_wait(bars + bit * 8, (phases >> bit) & 1);
      phases ^= 1u << bit;
    }
  };
  // rows >= n_valid of a page's V (chunks 0-7) hold whatever the cache has there: zero them
  // (a producer zero-fills the entries it does not copy)
  auto zero_tail = [&](int b, int n_valid) {
    if constexpr (!kProduced) {
      if (n_valid >= kKeys) return;
      for (int i = wtid; i < (kKeys - n_valid) * 64; i += 128) {
        const int t = n_valid + i / 64, c = i % 64;  // 8 chunks x 8 16-byte units per row
        *reinterpret_cast<uint4*>(smem + (sKbuf(b) - base) + sw128_offset(t, c * 8)) = make_uint4(0, 0, 0, 0);
      }
      cutlass::arch::fence_view_async_shared();
      named_sync(kBarWg0 + wg, 128);
    }
  };
  // wgmma descriptors of Q, the K buffers and this warpgroup's V columns of them (desc_at)
  const uint64_t dQ = make_desc(sQ, 16, 1024);
  const uint64_t dK0 = make_desc(sKbuf(0), 16, 1024), dK1 = make_desc(sKbuf(1), 16, 1024);
  const uint64_t dV0 = make_desc(sKbuf(0) + wg * kHalfL, kChunkBytes, 1024);
  const uint64_t dV1 = make_desc(sKbuf(1) + wg * kHalfL, kChunkBytes, 1024);
  float o[128];        // O: this warpgroup's 64 rows x 256 columns (wgmma accumulators)
  float s[32];         // S of this warpgroup's current unit, then its P (fp32)
  uint32_t q8[4][4];   // dense: Q's rope chunk (columns 512-575) as wgmma A fragments
  float l_run[2];      // row sums of P
  float row_scale[2] = {scale_log2, scale_log2};  // kQToF16: rows wrow, wrow + 8's (set per piece)
  Gemms<Op, kSrc, kPaired, decltype(wait_chunk)> mm{wait_chunk, dQ, dK0, dK1, dV0, dV1, s, o, q8};
  auto nothing = [] {};
  Softmax<Op, kSrc, kPaired> sx{p, s, o, sM, sMask, smem, base, scale_log2, row0, wrow, qd, wtid, lane, row_scale};

  // ---- the CTA's unit range, one request piece at a time
  int r = request_of(u_begin);
  for (int u = u_begin; u < u_end;) {
    while (u >= P_at(r + 1)) ++r;
    const int Pr = P_at(r);
    const int rb = kSparse ? r : splitkv::request_entry(p, r);  // dense: its batch entry
    const int seq_len = kSparse ? 0 : __ldg(p.seq_lens + rb);
    // page indices; plan_end: where the plan's range of r in this CTA ends (dense: pg_end without
    // an aligned plan's padding)
    const int pg_begin = u - Pr, plan_end = min(u_end, P_at(r + 1)) - Pr;
    const int pg_end = kSparse ? plan_end : splitkv::dense_piece_end(plan_end, seq_len, kKeys);
    if (q_tma && tid == 0 && u == u_begin) load_q_dense(rb);  // later pieces': the epilogue's
    // dense prologue: first pages of the piece (both buffers are free: the previous piece
    // ended with a CTA barrier after every wgmma retired)
    if (!kProduced && wg_leader) {
      const int pg = pg_begin + wg;
      if (pg < pg_end) {
        const int blk = block_of(rb, pg);
        load_half(wg, 0, blk);
        load_half(wg, 1, blk);
      }
    }
    if constexpr (kQTma) {  // the previous piece ended with a consumer barrier: sQ is free
      if (tid == 0) load_q(r);
      if (tid < kRows) sM[tid] = kNoMax;
      if (!kSplitOf<kSrc> || wg == 0) mbar_wait(q_bar, q_phase);  // split: only warpgroup 0 reads Q
      if (wtid == 0 && u == u_begin) TL(4 + wg);
      q_phase ^= 1;
      consumers_sync();
    } else if (q_tma) {  // the running max is read after the barrier that ends the rope LDSM
      if (tid < kRows) sM[tid] = kNoMax;
      mbar_wait(q_bar, q_phase);
      q_phase ^= 1;
    } else {
    // Q tile -> smem (cp.async: every copy in flight at once, rows past `rows` zero-filled;
    // plain loads stalled each store on its load), the running max reset. The latent and the
    // rope columns are copied by separate loops: their sources may be separate tensors, and
    // 64 and 8 chunks per row keep the index math to shifts.
    auto copy_q = [&](const T* src0, int64_t sb, int64_t ss, int64_t sh, auto chunks, int col0) {
      constexpr int kC = decltype(chunks)::value;
      for (int i = tid; i < kRows * kC; i += kConsumerThreads) {
        const int m = i / kC, c = i % kC;
        const int row = row0 + m;
        const T* src = src0;
        if (row < p.rows) {
          const int qi = row / p.heads, h = row % p.heads;
          // dense: request r = batch entry; sparse: group r = (b, s), qi = 0
          src += int64_t(rb / p.group_s_q) * sb + int64_t(rb % p.group_s_q + qi) * ss + int64_t(h) * sh + c * 8;
        }
        cp_async_16(base + sw128_offset(m, col0 + c * 8), src, row < p.rows ? 16 : 0);
      }
    };
    copy_q(qbase, p.q_stride_b, p.q_stride_s, p.q_stride_h, cute::Int<kDv / 8>{}, 0);
    copy_q(static_cast<const T*>(p.q_pe), p.qpe_stride_b, p.qpe_stride_s, p.qpe_stride_h,
           cute::Int<(kDqk - kDv) / 8>{}, kDv);
    cute::cp_async_fence();
    if (tid < kRows) sM[tid] = kNoMax;
    cp_async_wait<0>();
    cutlass::arch::fence_view_async_shared();
    consumers_sync();
    }
    if constexpr (kQToF16) {  // Q -> fp16 in place, each row's 2^-k (fp8_tile.cuh) through sSum
      q_rows_to_f16(smem + (sQ - base), sSum, tid);
      cutlass::arch::fence_view_async_shared();
      __syncthreads();
      row_scale[0] = sSum[wrow] * scale_log2;
      row_scale[1] = sSum[wrow + 8] * scale_log2;
    }
    if constexpr (!kProduced) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {  // Q rope chunk -> registers (A fragments)
        const int row = (wtid >> 5) * 16 + (lane & 15);
        cute::SM75_U32x4_LDSM_N::copy(
            *reinterpret_cast<const cute::uint128_t*>(smem + sw128_offset(row, 512 + kk * 16 + (lane >> 4) * 8)),
            q8[kk][0], q8[kk][1], q8[kk][2], q8[kk][3]);
      }
      __syncthreads();  // chunk 8 of sQ is now free for P1
    }
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    l_run[0] = l_run[1] = 0.f;

    if constexpr (kSplitOf<kSrc>) {
      // ---- split schedule, one unit at a time (unit i in buffer i % 2). Warpgroup 0: S,
      // the softmax, P to sP with its scale, O's left half (P from registers); warpgroup 1:
      // O's right half from sP. The running max lives in warpgroup 0's registers.
      const int n = pg_end - pg_begin;
      const uint32_t sP = sP1;
      if (wg == 0) {
        float m_run[2] = {kNoMax, kNoMax};
        // S of the unit in buffer b, chunk by chunk as its halves land; between() after the
        // left half's 4 groups (the previous unit's PV, issued before, then has retired)
        auto issue_s_split = [&](int b, auto between) {
#pragma unroll
          for (int c = 0; c < 9; ++c) {
            wait_chunk(b, c);
            cute::warpgroup_arrive();
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              const uint32_t koff = c * kChunkBytes + k * 32;
              gmma_ss<typename Gmma<T>::QK_SS>(desc_at(dQ, koff), desc_at(mm.dK(b), koff),
                                               s, c != 0 || k != 0, std::make_index_sequence<32>{});
            }
            cute::warpgroup_commit_batch();
            if (c == 3) between();
          }
        };
        if (n > 0) issue_s_split(0, nothing);
        uint32_t pfrag[4][4];
#pragma unroll 1
        for (int i = 0; i < n; ++i) {
          const int b = i & 1;
          cute::warpgroup_wait<0>();
          fence_regs<32>(s);
          fence_regs<128>(o);
          float rmax[2], m_new[2], scale[2], rsum[2];
          sx.mask_and_max(0, 0, rmax, b);
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            m_new[hr] = fmaxf(m_run[hr], rmax[hr]);
            scale[hr] = exp2f(m_run[hr] - m_new[hr]);
            m_run[hr] = m_new[hr];
          }
          sx.exponentiate(m_new, rsum);
          const float one[2] = {1.f, 1.f};
          sx.pack_p(pfrag, one);
          if (i > 0) named_sync(kBarP1, 256);  // warpgroup 1 is done with sP and sScale0
          if (qd == 0) { sScale0[wrow] = scale[0]; sScale0[wrow + 8] = scale[1]; }
          sx.store_p(sP, pfrag);
          named_arrive(kBarP0, 256);
          sx.scale_o(scale);
          l_run[0] = l_run[0] * scale[0] + rsum[0];
          l_run[1] = l_run[1] * scale[1] + rsum[1];
          fence_regs<128>(o);
          mm.issue_pv_rs(pfrag, b);
          if (i + 1 < n) {
            // the next unit's S behind this PV; the PV retires during its left half, then
            // this unit's left half is released
            issue_s_split(b ^ 1, [&] {
              cute::warpgroup_wait<4>();
              release(b, 0, false, 0);
            });
          } else {
            cute::warpgroup_wait<0>();
            release(b, 0, false, 0);
          }
        }
        cute::warpgroup_wait<0>();
        fence_regs<128>(o);
        if (qd == 0) { sM[wrow] = m_run[0]; sM[wrow + 8] = m_run[1]; }
      } else {
#pragma unroll 1
        for (int i = 0; i < n; ++i) {
          const int b = i & 1;
          named_sync(kBarP0, 256);  // P of unit i and its scale are in smem
          const float scale[2] = {sScale0[wrow], sScale0[wrow + 8]};
          sx.scale_o(scale);
          fence_regs<128>(o);
          mm.issue_pv_ss(sP, b);
          cute::warpgroup_wait<0>();
          fence_regs<128>(o);
          if (i + 1 < n) named_arrive(kBarP1, 256);
          release(b, 1, false, 0);
        }
      }
    } else {
    // this warpgroup's first page
    if (pg_begin + wg < pg_end) {
      if (wg == 0) mm.issue_s(std::integral_constant<int, 0>{}, nothing);
      else mm.issue_s(std::integral_constant<int, 1>{}, nothing);
      cute::warpgroup_wait<0>();
      fence_regs<32>(s);
    }

    // The max handshake (kBarMax0, kBarMax1) carries only what the other warpgroup needs: each
    // warpgroup announces its max as soon as it is published, and warpgroup 1 takes its row
    // maxima before it waits: each wait sits on the chain that ends in K0 right's refill
    // (sparse prefill H = 128 -6% in cycles, dense decode up to -6.5%, against waits on both).
    // Pair: page pa_ (warpgroup 0), pa_ + 1 (warpgroup 1); kMask = false: no key test (the
    // dense sources compile it both ways, see kMaskFreeOf)
    auto pair = [&](int pa_, auto mask_c) {
      constexpr bool kMask = decltype(mask_c)::value;
      if (wtid == 0 && wg == 0) {
        const int k = 8 + (u - u_begin + pa_ - pg_begin) / 2;
        if (k < 56) TL(k);
      }
      const int pb = pa_ + 1;  // warpgroup 1's page
      const bool has_b = pb < pg_end;
      // block ids of the next pair, read now so the load latency hides behind this pair
      int blk_a2 = 0, blk_b2 = 0;
      if (!kProduced && wg_leader) {
        if (pa_ + 2 < pg_end) blk_a2 = block_of(rb, pa_ + 2);
        if (pb + 2 < pg_end) blk_b2 = block_of(rb, pb + 2);
      }
      if (wg == 0) {
        // ---- softmax of page pa_ on top of the running max
        float rmax[2], m_new[2], scale0[2], rsum[2];
        sx.template mask_and_max<kMask>(pa_ * kKeys, seq_len, rmax, 0);
        sx.update_max(rmax, m_new, scale0, sScale0);
        named_arrive(kBarMax0, 256);
        {
          // ptxas would hoist 24 of the exponentials above the arrive (~190 cycles of MUFU on
          // the chain it starts). Reading back the published scale (only this warpgroup writes
          // sScale0) and adding back - scale, an exact 0, to the max keeps them below it: the
          // load cannot pass the barrier, nor the exponentials the load
          __syncwarp();
          const float back = *reinterpret_cast<volatile float*>(sScale0 + wrow);
          const float zero = back - scale0[0];
          m_new[0] += zero;
          m_new[1] += zero;
        }
        sx.exponentiate(m_new, rsum);
        sx.scale_o(scale0);
        l_run[0] = l_run[0] * scale0[0] + rsum[0];
        l_run[1] = l_run[1] * scale0[1] + rsum[1];
        const int n_valid = pa_ < p.max_blocks ? min(kKeys, seq_len - pa_ * kKeys) : 0;
        if (kMask) zero_tail(0, n_valid);
        uint32_t pfrag[4][4];
        const float one[2] = {1.f, 1.f};
        sx.pack_p(pfrag, one);
        fence_regs<128>(o);
        mm.issue_pv_rs(pfrag, 0);
        cute::warpgroup_wait<0>();
        fence_regs<128>(o);
        named_sync(kBarMax1, 256);
        // left half of K0 is done (S and both its PV readers are warpgroup 0's)
        release(0, 0, pa_ + 2 < pg_end, blk_a2);
        const float scale1[2] = {sScale1[wrow], sScale1[wrow + 8]};
        sx.pack_p(pfrag, scale1);  // P0 rescaled to warpgroup 1's max, for its PV
        sx.store_p(sP0, pfrag);
        named_arrive(kBarP0, 256);
        sx.scale_o(scale1);
        l_run[0] *= scale1[0];
        l_run[1] *= scale1[1];
        if (has_b) {
          named_sync(kBarP1, 256);
          fence_regs<128>(o);
          mm.issue_pv_ss(sP1, 1);
        }
        // the PV with page b retires first: then buffer 1's left half can be refilled
        auto release_k1_left = [&] {
          if (!has_b) return;
          cute::warpgroup_wait<4>();  // all but the 4 chunk groups of S issued after it
          release(1, 0, pb + 2 < pg_end, blk_b2);
        };
        if (pa_ + 2 < pg_end) {
          mm.issue_s(std::integral_constant<int, 0>{}, release_k1_left);
        } else if (has_b) {
          cute::warpgroup_wait<0>();
          release(1, 0, pb + 2 < pg_end, blk_b2);
        }
        cute::warpgroup_wait<0>();
        fence_regs<128>(o);
        fence_regs<32>(s);
      } else {
        float rmax[2], m_new[2], scale1[2], rsum[2] = {0.f, 0.f};
        if (has_b) sx.template mask_and_max<kMask>(pb * kKeys, seq_len, rmax, 1);  // needs nothing of warpgroup 0's
        named_sync(kBarMax0, 256);
        const float scale0[2] = {sScale0[wrow], sScale0[wrow + 8]};
        if (!has_b) rmax[0] = rmax[1] = -INFINITY;
        sx.update_max(rmax, m_new, scale1, sScale1);  // on top of warpgroup 0's new max
        named_arrive(kBarMax1, 256);
        const float both[2] = {scale0[0] * scale1[0], scale0[1] * scale1[1]};
        // P1 is stored and signalled before this warpgroup scales its O (warpgroup 0's PV with
        // P1 releases K1's left half when it retires)
        uint32_t pfrag[4][4];
        if (has_b) {
          sx.exponentiate(m_new, rsum);
          const int n_valid = pb < p.max_blocks ? min(kKeys, seq_len - pb * kKeys) : 0;
          if (kMask) zero_tail(1, n_valid);
          const float one[2] = {1.f, 1.f};
          sx.pack_p(pfrag, one);
          sx.store_p(sP1, pfrag);
          named_arrive(kBarP1, 256);
        }
        sx.scale_o(both);
        l_run[0] = l_run[0] * both[0] + rsum[0];
        l_run[1] = l_run[1] * both[1] + rsum[1];
        if (has_b) {
          fence_regs<128>(o);
          mm.issue_pv_rs(pfrag, 1);
        }
        named_sync(kBarP0, 256);
        fence_regs<128>(o);
        mm.issue_pv_ss(sP0, 0);
        if (has_b) {
          cute::warpgroup_wait<1>();
          release(1, 1, pb + 2 < pg_end, blk_b2);
        }
        cute::warpgroup_wait<0>();
        fence_regs<128>(o);
        release(0, 1, pa_ + 2 < pg_end, blk_a2);
        if (pb + 2 < pg_end) {
          mm.issue_s(std::integral_constant<int, 1>{}, nothing);
          cute::warpgroup_wait<0>();
          fence_regs<32>(s);
        }
      }
    };
    if constexpr (kMaskFreeOf<kSrc>) {  // the untested pairs, then those at the request end (<= 2)
      int pa_ = pg_begin;
      for (const int end = sx.untested_end(seq_len, pg_end); pa_ < end; pa_ += 2) pair(pa_, std::false_type{});
#pragma unroll 1
      for (; pa_ < pg_end; pa_ += 2) pair(pa_, std::true_type{});
    } else {
      for (int pa_ = pg_begin; pa_ < pg_end; pa_ += 2) pair(pa_, std::true_type{});
    }

    }  // seesaw schedule

    if (wtid == 0) TL(56 + wg);
    // ---- epilogue of the piece: row sums of both warpgroups, then out / partial
    float l0 = l_run[0], l1 = l_run[1];
    l0 += __shfl_xor_sync(0xffffffff, l0, 1); l0 += __shfl_xor_sync(0xffffffff, l0, 2);
    l1 += __shfl_xor_sync(0xffffffff, l1, 1); l1 += __shfl_xor_sync(0xffffffff, l1, 2);
    if (qd == 0) { sSum[wg * kRows + wrow] = l0; sSum[wg * kRows + wrow + 8] = l1; }
    consumers_sync();
    const float lt[2] = {sSum[wrow] + sSum[kRows + wrow], sSum[wrow + 8] + sSum[kRows + wrow + 8]};
    const float mt[2] = {sM[wrow], sM[wrow + 8]};
    const int Pr1 = P_at(r + 1);
    const bool split = (Pr / U) != ((Pr1 - 1) / U);
    const float kv_scale = read_kv_scale();
    const int slot = Pr <= u_begin ? 0 : 1;
    // kDenseQTma: the staged stores go through K0 (both K buffers idle: every wgmma retired
    // before the barrier above), so sQ is free and the next piece's Q lands under them
    const uint32_t stage = kDenseQTma ? sKbuf(0) : sQ;
    if (q_tma && tid == 0 && Pr + plan_end < u_end) {
      int rn = r + 1;  // the next piece's request: the first after r with units
      while (Pr + plan_end >= P_at(rn + 1)) ++rn;
      load_q_dense(splitkv::request_entry(p, rn));
    }
    if (kSparse && !split) {
      // a whole request: O (bf16) through sQ (free: this piece's S are done) into rows of 1024
      // bytes, 16-byte units XOR-swizzled by row % 8, with one stmatrix per 4 n-blocks; then
      // the 256 consumer threads store it with 16-byte coalesced stores (from the accumulator
      // layout, each 4-byte store spans 8 rows, 8 lines per instruction: ~5 us per piece).
      auto staged = [&](int m, int unit) { return uint32_t(m * 1024 + ((unit ^ (m & 7)) << 4)); };
      const int srow = (wtid >> 5) * 16 + (lane & 7);  // row of the matrix this lane addresses
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const float inv_l = lt[hr] != 0.f ? 1.f / lt[hr] : 0.f;
        const int mrow = srow + hr * 8;
#pragma unroll
        for (int g = 0; g < 8; ++g) {  // n-blocks 4g .. 4g + 3: matrix j = lane / 8
          const int unit = wg * 32 + 4 * g + (lane >> 3);
          const uint32_t addr = sQ + staged(mrow, unit);
          uint32_t v[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int n = 4 * g + j;
            v[j] = pack2<T>(o[n * 4 + hr * 2] * inv_l, o[n * 4 + hr * 2 + 1] * inv_l);
          }
          cute::SM90_U32x4_STSM_N::copy(v[0], v[1], v[2], v[3], *smem_ptr<cute::uint128_t>(addr));
        }
        const int row = row0 + wrow + hr * 8;
        if (wg == 0 && qd == 0 && row < p.rows)
          p.lse[int64_t(r) * p.rows + row] = lt[hr] != 0.f ? (mt[hr] + __log2f(lt[hr])) * kLn2 : -INFINITY;
      }
      consumers_sync();
      const int ctid = wg * 128 + wtid;
#pragma unroll 4
      for (int k = 0; k < kRows * 64 / kConsumerThreads; ++k) {
        const int i = k * kConsumerThreads + ctid, m = i >> 6, unit = i & 63;
        if (row0 + m >= p.rows) continue;
        const uint4 val = *reinterpret_cast<const uint4*>(smem + (sQ - base) + staged(m, unit));
        *reinterpret_cast<uint4*>(static_cast<T*>(p.out) + (int64_t(r) * p.rows + row0 + m) * kDv + unit * 8) = val;
      }
      cutlass::arch::fence_view_async_shared();  // sQ: generic accesses here, the next piece's Q by TMA
    } else if (!kSparse && splitkv::kStagedPartials && split) {  // 16-bit partials through sQ (free too) or K0
      const int64_t prow0 = (int64_t(cta) * 2 + slot) * p.rows + row0;
      float inv_l[2];
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        inv_l[hr] = lt[hr] != 0.f ? kv_scale / lt[hr] : 0.f;  // kv_scale: O = kv_scale * P.v8
        const int row = row0 + wrow + hr * 8;
        if (wg == 0 && qd == 0 && row < p.rows)
          p.part_lse[prow0 + wrow + hr * 8] = lt[hr] != 0.f ? (mt[hr] + __log2f(lt[hr])) * kLn2 : -INFINITY;
      }
      store_rows_staged(o, inv_l, smem, base, stage, wg, wtid, lane, static_cast<T*>(p.part_out) + prow0 * kDv,
                        p.rows - row0, consumers_sync);
    } else if (kDenseStagedOutOf<kSrc> && !split) {  // a whole request's out the same way
      const int64_t orow0 = int64_t(rb) * p.rows + row0;
      store_tile_staged(o, lt, mt, kv_scale, smem, base, stage, wg, wtid, lane, wrow, qd,
                        static_cast<T*>(p.out) + orow0 * kDv, p.lse + orow0, p.rows - row0, consumers_sync);
    } else {  // split partials stored from the accumulator layout (sparse; dense float32 partials)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = row0 + wrow + hr * 8;
      if (row >= p.rows) continue;
      const float inv_l = lt[hr] != 0.f ? kv_scale / lt[hr] : 0.f;  // kv_scale: O = kv_scale * P.v8
      const float lse_row = lt[hr] != 0.f ? (mt[hr] + __log2f(lt[hr])) * kLn2 : -INFINITY;
      const int64_t prow = (int64_t(cta) * 2 + slot) * p.rows + row;
      PartialOf<T, kSrc>* po = static_cast<PartialOf<T, kSrc>*>(p.part_out) + prow * kDv + wg * 256;
#pragma unroll
      for (int n = 0; n < 32; ++n)
        splitkv::store_partial2(po + n * 8 + qd * 2, o[n * 4 + hr * 2] * inv_l, o[n * 4 + hr * 2 + 1] * inv_l);
      if (wg == 0 && qd == 0) p.part_lse[prow] = lse_row;
    }
    }  // staged or direct stores
    consumers_sync();  // sM, sSum, sQ (and, dense, both K buffers: the stage) are reused by the next piece
    if (tid == 0) TL(58);
    u = Pr + plan_end;
  }
}

}  // namespace mla_backend::wgmma
