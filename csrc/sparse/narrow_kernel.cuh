// Sparse attention for H <= 16 over a bf16 cache, keys as the MMA's M dimension (the "narrow"
// kernel). The 64-row kernel pads H <= 16 to 64 rows, 4x the MMA work of the heads it serves,
// so its H = 16 prefill costs as much as H = 64 (~2.0 us per unit, where the copy alone takes
// 1.25: bench/gather_ceiling.cu). Here S^T = K Q^T (wgmma m64nNk16, N = kN = 16 heads: M = the
// unit's 64 keys, A = the keys as the producer lays them out) and
// O^T = V^T P^T (M = 512 value columns in 8 tiles, A = the same keys read M-major, B = P^T
// from shared memory): the MMA work is the heads'. Warpgroup w takes the piece's units
// i = w (mod 2) with its own running max, sums and O^T (8 tiles x kN / 2 floats); the two
// never wait on each other inside a piece and merge at its end, through Q's shared memory.
// The producer is the bf16 seesaw's (KeyProducer). A unit's left half (chunks 0-3: V columns
// 0-255) and right half (chunks 4-8) live in rings of their own, 3 and 2 slots, taken in the
// order of the CTA's units (unit g: left slot g % 3, right slot g % 2), so the next unit's
// left half is in flight while both right slots are in use (2 left slots: 4% slower at H =
// 16). The layout is written for any kN that is a multiple of 8; kN = 32 (H 17-32) is correct
// but decodes up to 60% slower than the 64-row kernel at batch <= 32, so only kN = 16 is built.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "common/launch.h"
#include "common/mla_shapes.h"
#include "common/ptx.cuh"
#include "sparse/launch.h"
#include "splitkv/combine.h"
#include "splitkv/schedule.cuh"
#include "wgmma/config.cuh"
#include "wgmma/gmma.cuh"
#include "wgmma/key_producer.cuh"
#include "wgmma/smem_layout.cuh"
#include "wgmma/tensor_map.h"

namespace mla_backend::sparse {
namespace narrow {

using namespace wgmma;  // the 64-row kernel's tile sizes, barriers, producer and descriptors

constexpr int kNarrowLeft = 3;
constexpr int kNarrowLeftBytes = 4 * kChunkBytes;   // 32 KiB
constexpr int kNarrowRightBytes = 5 * kChunkBytes;  // 40 KiB
template <int kN>
struct NarrowLayout {
  static constexpr int kQChunk = kN * 128;                              // one 64-column chunk of Q
  static constexpr int kOffR = (kDqk / 64) * kQChunk;                   // after Q (a 1 KiB multiple)
  static constexpr int kOffL = kOffR + 2 * kNarrowRightBytes;
  static constexpr int kOffP = kOffL + kNarrowLeft * kNarrowLeftBytes;  // P^T of each warpgroup
  static constexpr int kOffRed = kOffP + 2 * kQChunk;                   // maxima [2 wg][2][4 warps][kN]
  static constexpr int kOffSum = kOffRed + 2 * 2 * 4 * kN * 4;          // sums [2 wg][4 warps][kN]
  static constexpr int kOffM1 = kOffSum + 2 * 4 * kN * 4;               // warpgroup 1's max [kN]
  static constexpr int kOffBars = kOffM1 + kN * 4;                      // full, empty: left slots, right
  static constexpr int kOffMask = kOffBars + (kQBar + 1) * 8;           // [left slot][4 words]
  static constexpr size_t kSmem = size_t(kOffMask) + kNarrowLeft * 4 * 4 + 1024;
  static_assert(kSmem <= 232448, "more shared memory than an sm_90 block can have");
  static_assert(2 * (kNarrowLeft + 2) <= kQBar, "the Q mbarrier must not overlap the rings'");
  // the merge moves half of warpgroup 1's O^T (2 kN floats per thread) through sQ, then out
  // goes through it as bf16 [kN][512]
  static_assert(2 * kN * 128 * 4 <= kOffR && kDv * kN * 2 <= kOffR, "merge and out go through Q");
};
template <int kN> struct NarrowMma;
template <> struct NarrowMma<16> {
  using QK = G::MMA_64x16x16_F32BF16BF16_SS<G::Major::K, G::Major::K>;
  using PV = G::MMA_64x16x16_F32BF16BF16_SS<G::Major::MN, G::Major::K>;
};

template <int kN>
__global__ void __launch_bounds__(384, 1) sparse_narrow_kernel(const __grid_constant__ DecodeParams p,
                                                               const __grid_constant__ QMaps q_maps) {
  using T = __nv_bfloat16;
  using L = NarrowLayout<kN>;
  using QK = typename NarrowMma<kN>::QK;
  using PV = typename NarrowMma<kN>::PV;
  constexpr int kRings = kNarrowLeft + 2;  // barrier bit: left slot s, right slot kNarrowLeft + s
  constexpr int kHd = kN / 4;              // heads per thread
  constexpr int kAcc = kN / 2;             // accumulator floats per thread and 64-row tile
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  const uint32_t sQ = base;
  // chunk c of unit g's tile: c < 4 in its left slot, c >= 4 in its right slot; these are the
  // addresses of chunk 0 of each, as KeyProducer::issue_to and the descriptors count
  auto left_at = [&](int g) { return base + L::kOffL + (g % kNarrowLeft) * kNarrowLeftBytes; };
  auto right_at = [&](int g) { return base + L::kOffR + (g & 1) * kNarrowRightBytes - 4 * kChunkBytes; };
  float* sXfer = reinterpret_cast<float*>(smem);  // end of a piece: O^T halves, then bf16 out
  float* sRed = reinterpret_cast<float*>(smem + L::kOffRed);
  float* sSumW = reinterpret_cast<float*>(smem + L::kOffSum);
  float* sM1 = reinterpret_cast<float*>(smem + L::kOffM1);
  const uint32_t bars = base + L::kOffBars;
  uint32_t* sMask = reinterpret_cast<uint32_t*>(smem + L::kOffMask);

  const int tid = threadIdx.x, lane = tid & 31;
  const int wg = tid >> 7, wtid = tid & 127, warp = wtid >> 5;
  const int qd = lane & 3;
  if (tid == 0) {
    for (int i = 0; i < kRings; ++i) ClusterBarrier::init(smem_ptr<uint64_t>(bars + i * 8), 132);  // see kLandArrivesOf
    for (int i = kRings; i < 2 * kRings; ++i) ClusterBarrier::init(smem_ptr<uint64_t>(bars + i * 8), 4);
    ClusterBarrier::init(smem_ptr<uint64_t>(bars + kQBar * 8), 1);
    cutlass::arch::fence_barrier_init();
  }
  cudaTriggerProgrammaticLaunchCompletion();
  cudaGridDependencySynchronize();  // the plan, q, the indices and the cache are written by earlier kernels
  const int cta = blockIdx.x;
  int u_begin, u_end, U;
  if (!splitkv::cta_units<true>(p, u_begin, u_end, U)) return;
  __syncthreads();  // barriers initialised

  if (wg == 2) {  // ---- producer warpgroup: the CTA's units in order, left half first
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    KeyProducer<T, KeySource::kSparse16> prod{p,    static_cast<const unsigned char*>(p.kv), 0u, bars,
                                              bars + kRings * 8, sMask, wtid >> 1, wtid & 1, warp, lane};
    splitkv::for_each_piece<true>(p, u_begin, u_end, [&](int r, int Pr, int pg_begin, int pg_end) {
      const int* list = splitkv::sparse_group_indices(p, r);
      const int len = splitkv::sparse_group_len(p, r);
      auto slot_of = [&](int pg) {
        const int pos = pg * kKeys + prod.tk;
        const int v = pg < pg_end && pos < len ? __ldg(list + pos) : -1;
        return v >= 0 && v < p.num_slots ? v : -1;
      };
      int slot_next = slot_of(pg_begin);
#pragma unroll 1
      for (int pg = pg_begin; pg < pg_end; ++pg) {
        const int g = Pr + pg - u_begin;  // the unit's index in the CTA
        const int slot = slot_next;
        slot_next = slot_of(pg + 1);  // in flight while this unit's copies are issued
        prod.issue_to(g % kNarrowLeft, left_at(g), g % kNarrowLeft, 0, slot);
        prod.issue_to(kNarrowLeft + (g & 1), right_at(g), g % kNarrowLeft, 1, slot);
      }
    });
    return;
  }

  // ---- consumers: warpgroup wg takes units i = wg (mod 2) of each piece
  cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
  const float scale_log2 = p.scale_log2;
  const uint32_t q_bar = bars + kQBar * 8;
  uint32_t q_phase = 0;
  int red_par = 0;
  const uint32_t sP = base + L::kOffP + wg * L::kQChunk;
  const uint64_t dQ = make_desc(sQ, 16, 1024);
  const uint64_t dP = make_desc(sP, 16, 1024);
  // this thread's accumulator elements: S^T s[4j + 2hr + e] and O^T tile t o[kAcc t + 4j + 2hr
  // + e] are key / value column 16 warp + lane / 4 + 8 hr of the tile, head 8j + 2 qd + e; its
  // heads hd = 2j + e
  auto head_of = [&](int hd) { return 8 * (hd >> 1) + 2 * qd + (hd & 1); };
  auto acc_of = [&](int hd, int hr) { return 4 * (hd >> 1) + 2 * hr + (hd & 1); };
  float o[8 * kAcc], s[kAcc], m_run[kHd], l_run[kHd];
  // ring slot `bit`'s use number `use` has landed
  auto wait_full = [&](int bit, int use) {
    mbar_wait(bars + bit * 8, use & 1);
    cutlass::arch::fence_view_async_shared();  // cp.async wrote it through the generic proxy
  };
  auto release = [&](int bit) {
    if (lane == 0) ClusterBarrier::arrive(smem_ptr<uint64_t>(bars + (kRings + bit) * 8));
  };
  auto wg0_sync = [&] { named_sync(kBarWg0, 128); };
  // S^T over chunks [c0, c1) of the unit whose chunk 0 descriptor is dK, one commit group
  // (chunk bounds compile-time: the loops unroll into one straight wgmma sequence)
  auto s_chunks = [&](uint64_t dK, auto c0_, auto c1_) {
    constexpr int c0 = decltype(c0_)::value, c1 = decltype(c1_)::value;
    cute::warpgroup_arrive();
#pragma unroll
    for (int c = c0; c < c1; ++c)
#pragma unroll
      for (int k = 0; k < 4; ++k)
        gmma_ss<QK>(desc_at(dK, c * kChunkBytes + k * 32), desc_at(dQ, c * L::kQChunk + k * 32), s,
                    c != 0 || k != 0, std::make_index_sequence<kAcc>{});
    cute::warpgroup_commit_batch();
  };
  // O^T tiles [t0, t0 + 4) += V^T P^T (tile t: value columns 64t .. 64t + 63, chunk t of the
  // unit whose chunk 0 descriptor is dV), one commit group
  auto pv_tiles = [&](uint64_t dV, auto t0_) {
    constexpr int t0 = decltype(t0_)::value;
    cute::warpgroup_arrive();
#pragma unroll
    for (int t = t0; t < t0 + 4; ++t)
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
        gmma_ss<PV>(desc_at(dV, t * kChunkBytes + ks * 2048), desc_at(dP, ks * 32), o + kAcc * t, true,
                    std::make_index_sequence<kAcc>{});
    cute::warpgroup_commit_batch();
  };

  splitkv::for_each_piece<true>(p, u_begin, u_end, [&](int r, int Pr, int pg_begin, int pg_end) {
    if (tid == 0) {  // the previous piece's last reads of sQ are behind a barrier tid 0 passed
      ClusterTransactionBarrier::arrive_and_expect_tx(smem_ptr<uint64_t>(q_bar), (kDqk / 64) * L::kQChunk);
      const int qs = r % p.group_s_q, qb = r / p.group_s_q;
#pragma unroll
      for (int c = 0; c < kDv / 64; ++c) tma_load_4d(sQ + c * L::kQChunk, &q_maps.nope, c * 64, 0, qs, qb, q_bar);
      tma_load_4d(sQ + (kDv / 64) * L::kQChunk, &q_maps.pe, 0, 0, qs, qb, q_bar);  // the rope columns
    }
#pragma unroll
    for (int i = 0; i < 8 * kAcc; ++i) o[i] = 0.f;
#pragma unroll
    for (int hd = 0; hd < kHd; ++hd) { m_run[hd] = kNoMax; l_run[hd] = 0.f; }
    mbar_wait(q_bar, q_phase);
    q_phase ^= 1;

    const int n = pg_end - pg_begin;
#pragma unroll 1
    for (int i = wg; i < n; i += 2) {
      const int g = Pr + pg_begin + i - u_begin;
      const int lbit = g % kNarrowLeft, rbit = kNarrowLeft + (g & 1);
      const uint64_t dKL = make_desc(left_at(g), 16, 1024), dKR = make_desc(right_at(g), 16, 1024);
      const uint64_t dVL = make_desc(left_at(g), kChunkBytes, 1024), dVR = make_desc(right_at(g), kChunkBytes, 1024);
      // S^T = K Q^T, the left half's chunks as soon as they land
      wait_full(lbit, g / kNarrowLeft);
      s_chunks(dKL, std::integral_constant<int, 0>{}, std::integral_constant<int, 4>{});
      wait_full(rbit, g >> 1);
      s_chunks(dKR, std::integral_constant<int, 4>{}, std::integral_constant<int, 9>{});
      cute::warpgroup_wait<0>();
      fence_regs<kAcc>(s);

      // softmax over the unit's keys (the M dimension: lanes, then the 4 warps)
      const uint32_t valid = sMask[lbit * 4 + warp];  // bit 2j: key 16 warp + j of the unit
      const int key = lane >> 2;
      const bool ok[2] = {bool((valid >> (2 * key)) & 1), bool((valid >> (2 * key + 16)) & 1)};
      float mx[kHd];
#pragma unroll
      for (int hd = 0; hd < kHd; ++hd) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          float& v = s[acc_of(hd, hr)];
          v = ok[hr] ? v * scale_log2 : -INFINITY;
        }
        mx[hd] = fmaxf(s[acc_of(hd, 0)], s[acc_of(hd, 1)]);
        mx[hd] = fmaxf(mx[hd], __shfl_xor_sync(0xffffffff, mx[hd], 4));
        mx[hd] = fmaxf(mx[hd], __shfl_xor_sync(0xffffffff, mx[hd], 8));
        mx[hd] = fmaxf(mx[hd], __shfl_xor_sync(0xffffffff, mx[hd], 16));
      }
      float* red = sRed + (wg * 2 + red_par) * 4 * kN;  // double-buffered: the next unit's
      red_par ^= 1;                                     // writes come after its own barrier
      if (lane < 4) {
#pragma unroll
        for (int hd = 0; hd < kHd; ++hd) red[warp * kN + head_of(hd)] = mx[hd];
      }
      named_sync(kBarWg0 + wg, 128);
      float sc[kHd];
      bool rescale = false;
#pragma unroll
      for (int hd = 0; hd < kHd; ++hd) {
        const int h = head_of(hd);
        const float umax = fmaxf(fmaxf(red[h], red[kN + h]), fmaxf(red[2 * kN + h], red[3 * kN + h]));
        const float m_new = fmaxf(m_run[hd], umax);
        sc[hd] = exp2f(m_run[hd] - m_new);
        rescale |= sc[hd] != 1.f;
        m_run[hd] = m_new;
        float psum = 0.f;
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          float& v = s[acc_of(hd, hr)];
          v = exp2f(v - m_new);
          psum += v;
          // P^T (B operand, K-major: row = head, column = key)
          *reinterpret_cast<T*>(smem + (sP - base) + sw128_offset(h, 16 * warp + key + 8 * hr)) =
              __float2bfloat16(v);
        }
        l_run[hd] = l_run[hd] * sc[hd] + psum;
      }
      cutlass::arch::fence_view_async_shared();
      if (__any_sync(0xffffffff, rescale)) {
#pragma unroll
        for (int t = 0; t < 8; ++t)
#pragma unroll
          for (int hd = 0; hd < kHd; ++hd)
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) o[kAcc * t + acc_of(hd, hr)] *= sc[hd];
      }
      named_sync(kBarWg0 + wg, 128);  // all of P^T is in smem
      // O^T += V^T P^T, tile t = value columns 64t .. 64t + 63 (chunk t of the unit), the left
      // half's tiles first: that half is released as they retire
      fence_regs<8 * kAcc>(o);
      pv_tiles(dVL, std::integral_constant<int, 0>{});
      pv_tiles(dVR, std::integral_constant<int, 4>{});
      cute::warpgroup_wait<1>();
      release(lbit);
      cute::warpgroup_wait<0>();
      fence_regs<8 * kAcc>(o);
      release(rbit);
    }

    // ---- end of the piece: sums over keys; warpgroup 1's O^T to warpgroup 0 through sQ in
    // two halves; warpgroup 0 merges and writes out (bf16 through sQ) or the partial
    float lw[kHd];
#pragma unroll
    for (int hd = 0; hd < kHd; ++hd) {
      lw[hd] = l_run[hd];
      lw[hd] += __shfl_xor_sync(0xffffffff, lw[hd], 4);
      lw[hd] += __shfl_xor_sync(0xffffffff, lw[hd], 8);
      lw[hd] += __shfl_xor_sync(0xffffffff, lw[hd], 16);
    }
    if (lane < 4) {
#pragma unroll
      for (int hd = 0; hd < kHd; ++hd) sSumW[(wg * 4 + warp) * kN + head_of(hd)] = lw[hd];
    }
    if (wg == 1 && warp == 0 && lane < 4) {
#pragma unroll
      for (int hd = 0; hd < kHd; ++hd) sM1[head_of(hd)] = m_run[hd];
    }
    constexpr int kHalf = 4 * kAcc;  // floats of O^T per thread in one transfer
    named_sync(kBarConsumers, kConsumerThreads);  // every S of the piece is done: sQ is free
    if (wg == 1) {
#pragma unroll
      for (int i = 0; i < kHalf; ++i) sXfer[i * 128 + wtid] = o[i];
    }
    float f0[kHd], f1[kHd], inv[kHd];
    if (wg == 0) {
#pragma unroll
      for (int hd = 0; hd < kHd; ++hd) {
        const int h = head_of(hd);
        float l0 = 0.f, l1 = 0.f;
#pragma unroll
        for (int w = 0; w < 4; ++w) { l0 += sSumW[w * kN + h]; l1 += sSumW[(4 + w) * kN + h]; }
        const float m1 = sM1[h], m = fmaxf(m_run[hd], m1);
        f0[hd] = exp2f(m_run[hd] - m);
        f1[hd] = exp2f(m1 - m);
        const float lt = l0 * f0[hd] + l1 * f1[hd];
        inv[hd] = lt != 0.f ? 1.f / lt : 0.f;
        l_run[hd] = lt;
        m_run[hd] = m;
      }
    }
    auto merge = [&](int i0) {
#pragma unroll
      for (int i = i0; i < i0 + kHalf; ++i) {
        const int a = i % kAcc, hd = 2 * (a >> 2) + (a & 1);  // a = 4j + 2hr + e
        o[i] = (o[i] * f0[hd] + sXfer[(i - i0) * 128 + wtid] * f1[hd]) * inv[hd];
      }
    };
    named_sync(kBarConsumers, kConsumerThreads);  // the first half is in sQ
    if (wg == 0) merge(0);
    named_sync(kBarConsumers, kConsumerThreads);  // ... and read
    if (wg == 1) {
#pragma unroll
      for (int i = kHalf; i < 2 * kHalf; ++i) sXfer[(i - kHalf) * 128 + wtid] = o[i];
      cutlass::arch::fence_view_async_shared();  // sQ: generic writes here, the next piece's Q by TMA
    }
    named_sync(kBarConsumers, kConsumerThreads);  // the second half is in sQ; warpgroup 1 goes on
    if (wg == 0) {
      merge(kHalf);
      const int Pr1 = splitkv::plan_start<true>(p, r + 1);
      const bool split = (Pr / U) != ((Pr1 - 1) / U);
      const int slot = Pr <= u_begin ? 0 : 1;
      auto col_of = [&](int i) { return 64 * (i / kAcc) + 16 * warp + (lane >> 2) + 8 * ((i >> 1) & 1); };
      auto head_at = [&](int i) { const int a = i % kAcc; return head_of(2 * (a >> 2) + (a & 1)); };
      if (warp == 0 && lane < 4) {
#pragma unroll
        for (int hd = 0; hd < kHd; ++hd) {
          const int h = head_of(hd);
          if (h >= p.rows) continue;
          const float lse = l_run[hd] != 0.f ? (m_run[hd] + __log2f(l_run[hd])) * kLn2 : -INFINITY;
          if (!split) p.lse[int64_t(r) * p.rows + h] = lse;
          else p.part_lse[(int64_t(cta) * 2 + slot) * p.rows + h] = lse;
        }
      }
      if (split) {
#pragma unroll
        for (int i = 0; i < 8 * kAcc; ++i) {
          const int h = head_at(i);
          if (h < p.rows)
            static_cast<float*>(p.part_out)[((int64_t(cta) * 2 + slot) * p.rows + h) * kDv + col_of(i)] = o[i];
        }
      } else {
        unsigned char* stage = smem;  // [head][512] bf16, 16-byte units XOR-swizzled by head % 8
        wg0_sync();                   // the second half is read
#pragma unroll
        for (int i = 0; i < 8 * kAcc; ++i) {
          const int h = head_at(i), col = col_of(i);
          *reinterpret_cast<T*>(stage + h * 1024 + (((col >> 3) ^ (h & 7)) << 4) + (col & 7) * 2) =
              __float2bfloat16(o[i]);
        }
        wg0_sync();
        for (int i = wtid; i < p.rows * 64; i += 128) {  // 16-byte coalesced stores
          const int h = i >> 6, unit = i & 63;
          const uint4 val = *reinterpret_cast<const uint4*>(stage + h * 1024 + ((unit ^ (h & 7)) << 4));
          *reinterpret_cast<uint4*>(static_cast<T*>(p.out) + (int64_t(r) * p.rows + h) * kDv + unit * 8) = val;
        }
      }
      cutlass::arch::fence_view_async_shared();  // sQ: generic accesses here, the next piece's Q by TMA (tid 0)
      wg0_sync();
    }
  });
}

}  // namespace narrow

// One tile of kN heads per CTA, then the combine unless `combine` is false.
template <int kN>
void launch_sparse_narrow(const DecodeParams& p, cudaStream_t stream, bool combine) {
  using namespace narrow;
  const auto kernel = sparse_narrow_kernel<kN>;
  constexpr size_t smem = NarrowLayout<kN>::kSmem;
  MLA_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const wgmma::QMaps q_maps = wgmma::make_q_maps(p, kN);
  launch_pdl(kernel, dim3(p.num_ctas), dim3(384), smem, stream, p, q_maps);
  if (combine) splitkv::launch_combine<__nv_bfloat16>(p, stream);
}

}  // namespace mla_backend::sparse
