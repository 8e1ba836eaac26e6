// Two groups of steps of the consumer warpgroups (consumer.cuh): the wgmmas (Gemms) and the
// online-softmax pieces (Softmax).
//
// These structs, like SeesawCta, hold references to locals of the kernel or of
// consumer_warpgroups(), the way a lambda capturing by reference does, and are built where
// they are used. That keeps the generated code the same as with the lambdas they replace:
// values copied into a struct, or a struct holding all of them, reach the optimizer later
// and come out as other (slower) code; so do the K-buffer steps as members of a struct,
// which is why those stay lambdas in consumer.cuh.
#pragma once

#include <cuda.h>

#include <cute/arch/copy_sm90.hpp>
#include <cutlass/arch/barrier.h>

#include <utility>

#include "common/convert.cuh"
#include "common/mla_shapes.h"
#include "common/ptx.cuh"
#include "wgmma/config.cuh"
#include "wgmma/gmma.cuh"
#include "wgmma/smem_layout.cuh"

namespace mla_backend::wgmma {

// S = Q K^T and O += P V with wgmma, on the tiles Loads fills
template <typename T, KeySource kSrc, bool kPaired, typename WaitChunk>
struct Gemms {
  static constexpr bool kProduced = kProducedOf<kSrc>;
  WaitChunk& wait_chunk;  // wait_chunk(b, c): chunk c of buffer b has landed
  // wgmma descriptors of Q, the K buffers and this warpgroup's V columns of them (desc_at)
  // (selected, not indexed: b is a run-time value in places, and an indexed local array
  // would live in local memory)
  const uint64_t& dQ;
  const uint64_t& dK0;
  const uint64_t& dK1;
  const uint64_t& dV0;
  const uint64_t& dV1;
  float (&s)[32];        // S of this warpgroup's current unit, then its P (fp32)
  float (&o)[128];       // O: this warpgroup's 64 rows x 256 columns
  uint32_t (&q8)[4][4];  // dense: Q's rope chunk (columns 512-575) as wgmma A fragments

  __device__ __forceinline__ uint64_t dK(int b) const { return b == 0 ? dK0 : dK1; }
  __device__ __forceinline__ uint64_t dV(int b) const { return b == 0 ? dV0 : dV1; }

  // S = Q K^T for the page in buffer b, 9 chunks of 4 k-steps, each chunk issued (one commit
  // group) once it landed; chunk 8 from registers. Buffer 0 (warpgroup 0) takes its left
  // half first, buffer 1 its right half first: the half each warpgroup refilled itself
  // arrives first. between_halves() runs after the first half's 4 groups are issued.
  // (b is a compile-time constant: a run-time chunk order would put the SS/RS choice on a
  // divergent path and ptxas would serialize the wgmmas)
  template <typename B, typename BetweenHalves>
  __device__ __forceinline__ void issue_s(B b_const, BetweenHalves between_halves) {
    constexpr int b = decltype(b_const)::value;
#pragma unroll
    for (int i = 0; i < 9; ++i) {
      const int c = b == 0 ? i : (i + 4) % 9;
      wait_chunk(b, c);
      cute::warpgroup_arrive();
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const bool zero = i == 0 && k == 0;
        if (kProduced || c < 8) {
          const uint32_t koff = c * kChunkBytes + k * 32;
          gmma_ss<typename Gmma<T>::QK_SS>(desc_at(dQ, koff), desc_at(dK(b), koff), s, !zero,
                                           std::make_index_sequence<32>{});
        } else {
          gmma_rs<typename Gmma<T>::QK_RS>(q8[k], desc_at(dK(b), 8 * kChunkBytes + k * 32), s, !zero,
                                           std::make_index_sequence<32>{});
        }
      }
      cute::warpgroup_commit_batch();
      if (i == 3) between_halves();
    }
  }
  // O[:, 256 wg : +256] += P V(page in buffer b), P from registers (pa: 4 k-steps x 4 regs)
  __device__ __forceinline__ void issue_pv_rs(const uint32_t (*pa)[4], int b) {
    cute::warpgroup_arrive();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      gmma_rs<typename Gmma<T>::PV_RS>(pa[ks], desc_at(dV(b), ks * 2048), o, true,
                                       std::make_index_sequence<128>{});
    }
    cute::warpgroup_commit_batch();
  }
  __device__ __forceinline__ void issue_pv_ss(uint32_t sPsrc, int b) {
    const uint64_t dP = make_desc(sPsrc, 16, 1024);
    cute::warpgroup_arrive();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      gmma_ss<typename Gmma<T>::PV_SS>(desc_at(dP, ks * 32), desc_at(dV(b), ks * 2048), o, true,
                                       std::make_index_sequence<128>{});
    }
    cute::warpgroup_commit_batch();
  }
};

// The online softmax of a unit's S, in registers, and P's way to the other warpgroup
template <typename T, KeySource kSrc, bool kPaired>
struct Softmax {
  static constexpr bool kSparse = kSparseOf<kSrc>;
  const DecodeParams& p;
  float (&s)[32];
  float (&o)[128];
  float* const& sM;
  uint32_t* const& sMask;
  unsigned char* const& smem;
  const uint32_t& base;
  const float& scale_log2;
  const int& row0;
  const int& wrow;
  const int& qd;
  const int& wtid;
  const int& lane;
  // kPagedFp8F16: the scale of rows wrow and wrow + 8 (scale_log2 times the inverse of the power
  // of two a bf16 Q row was scaled by on its way to fp16; scale_log2 for an fp16 q)
  const float (&row_scale)[2];
  static constexpr bool kFold = kFoldScaleOf<kSrc>;
  static constexpr bool kRowScaled = kSrc == KeySource::kPagedFp8F16;
  // scale S to the log2 domain and mask keys past each row's limit (dense) or not valid in
  // the unit's mask (sparse: written by the producer with the fill); row maxima of this unit,
  // in the log2 domain. kMask = false (dense): every key is inside every row's limit, no test.
  // kFold: S stays unscaled, its max is scaled (exponentiate applies the scale)
  template <bool kMask = true>
  __device__ __forceinline__ void mask_and_max(int tok0, int seq_len, float* rmax, int mb) {  // mb: the unit's buffer
    static_assert(kMask || !kSparse, "the sparse sources always test their validity masks");
    uint32_t valid[4];
    if constexpr (kSparse) {
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        valid[w] = kPaired ? sMask[mb * 8 + 2 * w] | (sMask[mb * 8 + 2 * w + 1] << 16) : sMask[mb * 4 + w];
      }
    }
    // bf16 seesaw: a unit whose entries are all valid (the usual case, topk within the
    // context) skips the per-key tests, the same arithmetic in the same order. With the tests
    // ptxas parks its predicates in a register around the shuffles: ~170 instructions on
    // warpgroup 0's way to kBarMax0 where these take 80. A loop of its own: one loop shared
    // with the tested one through a predicate lambda costs the dense kernels 120 instructions
    if constexpr (kSrc == KeySource::kSparse16) {
      if ((valid[0] & valid[1] & valid[2] & valid[3] & 0x55555555u) == 0x55555555u) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          float mx = -INFINITY;
#pragma unroll
          for (int n = 0; n < 8; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float& v = s[n * 4 + hr * 2 + e];
              v = v * scale_log2;
              mx = fmaxf(mx, v);
            }
          }
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
          rmax[hr] = mx;
        }
        return;
      }
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = row0 + wrow + hr * 8;
      const int limit = p.causal ? seq_len - p.s_q + row / p.heads + 1 : seq_len;
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < 8; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = n * 8 + qd * 2 + e;
          const bool ok = !kMask || (kSparse ? (valid[key >> 4] >> (2 * (key & 15))) & 1 : tok0 + key < limit);
          float& v = s[n * 4 + hr * 2 + e];
          if constexpr (kFold) v = ok ? v : -INFINITY;
          else v = ok ? v * (kRowScaled ? row_scale[hr] : scale_log2) : -INFINITY;
          mx = fmaxf(mx, v);
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
      rmax[hr] = kFold ? mx * scale_log2 : mx;  // scale_log2 > 0: the max of the scaled values
    }
  }
  // the end of the pairs of pages (pa_, pa_ + 1) from the piece's first that mask_and_max<false>
  // may take: both pages inside every row's key limit (the tile's first row has the lowest)
  // and inside the block table (so no V rows to zero either)
  __device__ __forceinline__ int untested_end(int seq_len, int pg_end) {
    const int lim0 = p.causal ? seq_len - p.s_q + row0 / p.heads + 1 : seq_len;
    const int n_full = min(max(lim0, 0) / kKeys, p.max_blocks);  // pages [0, n_full): all keys valid
    return pg_end <= n_full ? pg_end : n_full - 1;
  }
  // P = exp2(S - m) in place (kFold: exp2(S * scale_log2 - m), one FFMA); row sums
  __device__ __forceinline__ void exponentiate(const float* m, float* rsum) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < 8; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& v = s[n * 4 + hr * 2 + e];
          v = kFold ? exp2f(fmaf(v, scale_log2, -m[hr])) : exp2f(v - m[hr]);
          sum += v;
        }
      }
      rsum[hr] = sum;
    }
  }
  // P (fp32 registers, times per-row factors) -> A fragments; the m64n64 accumulator layout
  // is the A layout of four k16 steps
  __device__ __forceinline__ void pack_p(uint32_t (*pa)[4], const float* f) {
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      pa[ks][0] = pack2<T>(s[8 * ks + 0] * f[0], s[8 * ks + 1] * f[0]);
      pa[ks][1] = pack2<T>(s[8 * ks + 2] * f[1], s[8 * ks + 3] * f[1]);
      pa[ks][2] = pack2<T>(s[8 * ks + 4] * f[0], s[8 * ks + 5] * f[0]);
      pa[ks][3] = pack2<T>(s[8 * ks + 6] * f[1], s[8 * ks + 7] * f[1]);
    }
  }
  __device__ __forceinline__ void store_p(uint32_t dst, const uint32_t (*pa)[4]) {
    // one stmatrix per k16 step for its four 8x8 matrices (rows +0 / +8, columns +0 / +8: the
    // A-fragment order): lane l gives the address of row l % 16, columns 8 (l / 16). 4
    // instructions instead of 16 scalar stores, on the path to the other warpgroup's PV
    const int prow = (wtid >> 5) * 16 + (lane & 15);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      const uint32_t addr = dst + sw128_offset(prow, ks * 16 + (lane >> 4) * 8);
      cute::SM90_U32x4_STSM_N::copy(pa[ks][0], pa[ks][1], pa[ks][2], pa[ks][3], *smem_ptr<cute::uint128_t>(addr));
    }
    cutlass::arch::fence_view_async_shared();
  }
  // the running max after this warpgroup's unit (row maxima rmax): new max and the factor that
  // rescales what came before, published for the other warpgroup (sM and sScale)
  __device__ __forceinline__ void update_max(const float* rmax, float* m_new, float* scale, float* sScale) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const float m_old = sM[wrow + hr * 8];
      m_new[hr] = fmaxf(m_old, rmax[hr]);
      scale[hr] = exp2f(m_old - m_new[hr]);
    }
    __syncwarp();
    if (qd == 0) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) { sM[wrow + hr * 8] = m_new[hr]; sScale[wrow + hr * 8] = scale[hr]; }
    }
  }
  __device__ __forceinline__ void scale_o(const float* f) {
    if (__any_sync(0xffffffff, f[0] != 1.f || f[1] != 1.f)) {
#pragma unroll
      for (int n = 0; n < 32; ++n) {
        o[n * 4 + 0] *= f[0]; o[n * 4 + 1] *= f[0];
        o[n * 4 + 2] *= f[1]; o[n * 4 + 3] *= f[1];
      }
    }
  }

};

}  // namespace mla_backend::wgmma
