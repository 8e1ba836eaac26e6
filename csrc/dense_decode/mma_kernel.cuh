// Dense paged decode for up to 16 query rows (rows = s_q * H <= 16: TP8 / TP16 head counts),
// with mma.sync m16n8k16 on 16-row tiles, so few heads pay for no padded MMA rows; more rows
// go to the wgmma kernel (wgmma/). Over a 16-bit or a per-tensor fp8 cache.
//
// Work unit: 32 consecutive key positions of one request (half a 64-token page); the plan and
// the partials are the split-KV ones (splitkv/params.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>
#include <cute/arch/util.hpp>

#include <type_traits>

#include "common/convert.cuh"
#include "common/launch.h"
#include "common/mla_shapes.h"
#include "common/ptx.cuh"
#include "dense_decode/launch.h"
#include "splitkv/combine.h"
#include "splitkv/partials.cuh"
#include "splitkv/schedule.cuh"

namespace mla_backend::dense_decode {
namespace mma {

using namespace splitkv;

// ldmatrix .x4 (.trans) of four 8x8 b16 matrices, lane l giving the address of row l % 8 of
// matrix l / 8, and mma.sync m16n8k16 with fp32 accumulators in place (CuTe's atoms)
__device__ __forceinline__ void ldsm_x4(uint32_t* r, const void* p) {
  cute::SM75_U32x4_LDSM_N::copy(*static_cast<const cute::uint128_t*>(p), r[0], r[1], r[2], r[3]);
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t* r, const void* p) {
  cute::SM75_U16x8_LDSM_T::copy(*static_cast<const cute::uint128_t*>(p), r[0], r[1], r[2], r[3]);
}
template <typename T>
using MmaAtom = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, cute::SM80_16x8x16_F32BF16BF16F32_TN,
                                   cute::SM80_16x8x16_F32F16F16F32_TN>;
template <typename T>
__device__ __forceinline__ void mma_16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  MmaAtom<T>::fma(c[0], c[1], c[2], c[3], a[0], a[1], a[2], a[3], b0, b1, c[0], c[1], c[2], c[3]);
}

constexpr int kRows = 16;            // query rows per CTA
constexpr int kUnit = kUnitMma;      // tokens per work unit of this kernel
constexpr int kSmemRow = kDqk + 8;   // padded row: 1168 B = 73 16-B chunks (odd: no bank conflicts)
constexpr int kWarpsN = 4;           // warps splitting keys (S) and output columns (PV)
constexpr int kPRow = kUnit + 8;     // padded P row: 80 B = 5 chunks

// fp8: cp.async stages the raw bytes; at consume time every thread converts the unit into
// one bf16/fp16 tile, which S and PV read exactly as in the 16-bit case. Every e4m3 value is
// exact in bf16 and fp16, so the conversion rounds nothing: kv_scale is folded into the
// softmax scale (S = kv_scale * q.k8) and into the output (O = kv_scale * P.v8) instead.
// 16 e4m3 values (one 16-byte chunk; convert_e4m3x16) stored as 32 contiguous bytes of
// shared memory
template <typename T>
__device__ __forceinline__ void store_e4m3x16(T* dst, uint4 raw, float scale) {
  uint32_t packed[8];
  convert_e4m3x16<T>(raw, scale, packed);
  uint4* out = reinterpret_cast<uint4*>(dst);
  out[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  out[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
}

template <typename T, KvFormat kFmt>
struct MmaDecodeConfig {
  static constexpr bool kConvert = kFmt != KvFormat::k16;
  static constexpr int kWarpsM = kRows / 16;
  static constexpr int kWarps = kWarpsM * kWarpsN;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kStages = 2;  // <= 100 KiB of shared memory: two CTAs per SM
  static constexpr int kMinCtasPerSm = 2;
  // bytes of one cached token as staged, and the 16-byte chunks that load it
  static constexpr int kTokBytes = kFmt == KvFormat::k16 ? kSmemRow * int(sizeof(T)) : kDqk;
  static constexpr int kRowChunks = kFmt == KvFormat::k16 ? kDqk * int(sizeof(T)) / 16 : kDqk / 16;
  static constexpr int kColsPerWarp = kDv / kWarpsN;       // 128
  static constexpr int kNTiles = kColsPerWarp / 8;          // 16
  static constexpr int kKeysPerWarp = kUnit / kWarpsN;      // 8: one n-tile of S
  static constexpr size_t kSmemQ = size_t(kRows) * kSmemRow * sizeof(T);
  static constexpr size_t kSmemTile = size_t(kUnit) * kSmemRow * sizeof(T);
  static constexpr size_t kSmemStage = size_t(kUnit) * kTokBytes;  // bytes per stage
  static constexpr size_t kSmemKV = kStages * kSmemStage + (kConvert ? kSmemTile : 0);
  static constexpr size_t kSmemP = size_t(kRows) * kPRow * sizeof(T);
  static constexpr size_t kSmemRed = size_t(2) * kWarpsN * kRows * sizeof(float);
  static constexpr size_t kSmem = kSmemQ + kSmemKV + kSmemP + kSmemRed;
  static_assert(kKeysPerWarp == 8, "S tile per warp is one 8-key n-tile");
  static_assert(kSmem <= 227 * 1024, "shared memory per CTA");
  static_assert(2 * (kSmem + 1024) <= 228 * 1024, "two CTAs per SM");
};

template <typename T, KvFormat kFmt>
__global__ void __launch_bounds__(MmaDecodeConfig<T, kFmt>::kThreads, MmaDecodeConfig<T, kFmt>::kMinCtasPerSm)
mma_decode_kernel(const __grid_constant__ DecodeParams p) {
  using Cfg = MmaDecodeConfig<T, kFmt>;
  constexpr bool kFp8 = kFmt == KvFormat::kFp8;
  constexpr int kStages = Cfg::kStages;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  unsigned char* sStages = smem + Cfg::kSmemQ;  // kStages units: 16-bit rows, or fp8 bytes
  T* sKfp8 = reinterpret_cast<T*>(sStages + kStages * Cfg::kSmemStage);  // fp8: dequantized unit
  T* sP = reinterpret_cast<T*>(smem + Cfg::kSmemQ + Cfg::kSmemKV);
  float* sRedMax = reinterpret_cast<float*>(smem + Cfg::kSmemQ + Cfg::kSmemKV + Cfg::kSmemP);
  float* sRedSum = sRedMax + kWarpsN * kRows;

  cudaTriggerProgrammaticLaunchCompletion();
  cudaGridDependencySynchronize();  // the plan, q and the cache are written by earlier kernels
  const int* P = p.meta;
  const int cta = blockIdx.x;
  const int row0 = blockIdx.y * kRows;
  int u_begin, u_end, U;
  if (!cta_units(p, u_begin, u_end, U)) return;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / kWarpsN, wn = warp % kWarpsN;
  const float kv_scale = kFp8 ? (p.kv_scale_ptr != nullptr ? __ldg(p.kv_scale_ptr) : p.kv_scale_value) : 1.f;
  const float scale_log2 = p.scale_log2 * kv_scale;  // S = kv_scale * (q . k_fp8)
  const unsigned char* kv = static_cast<const unsigned char*>(p.kv);  // byte addressing
  constexpr int kElemBytes = kFmt == KvFormat::k16 ? int(sizeof(T)) : 1;  // strides are in elements
  constexpr int kRowChunks = Cfg::kRowChunks;


  // ---- producer: async load of one unit's 32 tokens into a stage
  int r_load = request_of_unit(P, p.batch, u_begin);
  auto load_unit = [&](int u, int stage) {
    while (u >= __ldg(P + r_load + 1)) ++r_load;
    const int tok0 = (u - __ldg(P + r_load)) * kUnit;
    unsigned char* dst = sStages + stage * Cfg::kSmemStage;
    auto dst_off = [&](int t, int ch) {
      return kFmt == KvFormat::k16 ? (t * kSmemRow + ch * 8) * int(sizeof(T)) : t * Cfg::kTokBytes + ch * 16;
    };
    const int n_valid = min(kUnit, __ldg(p.seq_lens + r_load) - tok0);
    const int blk_idx = tok0 / kPage;
    const int blk = blk_idx < p.max_blocks ? __ldg(p.block_table + r_load * p.bt_stride + blk_idx) : -1;
    // a block id outside the cache (a bad table entry) reads as zero keys, never out of bounds
    const bool blk_ok = unsigned(blk) < unsigned(p.num_blocks);  // -1 (past the table) too
    const unsigned char* base =
        kv + (int64_t(blk) * p.kv_stride_block + int64_t(tok0 % kPage) * p.kv_stride_tok) * kElemBytes;
    for (int i = tid; i < kUnit * kRowChunks; i += Cfg::kThreads) {
      const int t = i / kRowChunks, ch = i % kRowChunks;
      const bool ok = blk_ok && t < n_valid;  // zero-filled otherwise (past n_valid: never read)
      const unsigned char* src = ok ? base + int64_t(t) * p.kv_stride_tok * kElemBytes + ch * 16 : kv;
      cp_async_16(cute::cast_smem_ptr_to_uint(dst + dst_off(t, ch)), src, ok ? 16 : 0);
    }
  };

  // ---- Q tile of request r into shared memory (plain loads; rows past `rows` are zero). The
  // latent and the rope columns are separate loops: their sources may be separate tensors,
  // and 64 and 8 chunks per row keep the index math to shifts.
  auto load_q_part = [&](int r, const T* src0, int64_t sb, int64_t ss, int64_t sh, auto chunks, int col0) {
    constexpr int kC = decltype(chunks)::value;
    for (int i = tid; i < kRows * kC; i += Cfg::kThreads) {
      const int m = i / kC, ch = i % kC;
      const int row = row0 + m;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (row < p.rows) {
        const int qi = row / p.heads, h = row % p.heads;
        const int64_t off = int64_t(r / p.group_s_q) * sb + int64_t(r % p.group_s_q + qi) * ss + int64_t(h) * sh;
        v = __ldg(reinterpret_cast<const uint4*>(src0 + off) + ch);
      }
      *reinterpret_cast<uint4*>(sQ + m * kSmemRow + col0 + ch * 8) = v;
    }
  };
  auto load_q = [&](int r) {
    load_q_part(r, static_cast<const T*>(p.q), p.q_stride_b, p.q_stride_s, p.q_stride_h, cute::Int<kDv / 8>{}, 0);
    load_q_part(r, static_cast<const T*>(p.q_pe), p.qpe_stride_b, p.qpe_stride_s, p.qpe_stride_h,
                cute::Int<(kDqk - kDv) / 8>{}, kDv);
  };

  // prologue: STAGES-1 units in flight
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (u_begin + s < u_end) load_unit(u_begin + s, s);
    cute::cp_async_fence();
  }

  int r_cur = request_of_unit(P, p.batch, u_begin);
  load_q(r_cur);

  // per-thread state: rows g = lane/4 and g + 8 of this warp's 16-row group
  const int g = lane >> 2, qd = lane & 3;
  const int lrow0 = wm * 16 + g, lrow1 = lrow0 + 8;  // local rows in the tile
  float o[Cfg::kNTiles][4];
  float m_run[2], l_run[2];
  auto reset_state = [&]() {
#pragma unroll
    for (int n = 0; n < Cfg::kNTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    m_run[0] = m_run[1] = -INFINITY;
    l_run[0] = l_run[1] = 0.f;
  };
  reset_state();

  auto epilogue = [&](int r) {
    // row sums: quad, then across the kWarpsN key-splitting warps
    float l0 = l_run[0], l1 = l_run[1];
    l0 += __shfl_xor_sync(0xffffffff, l0, 1); l0 += __shfl_xor_sync(0xffffffff, l0, 2);
    l1 += __shfl_xor_sync(0xffffffff, l1, 1); l1 += __shfl_xor_sync(0xffffffff, l1, 2);
    if (qd == 0) { sRedSum[wn * kRows + lrow0] = l0; sRedSum[wn * kRows + lrow1] = l1; }
    __syncthreads();
    float lt[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < kWarpsN; ++j) { lt[0] += sRedSum[j * kRows + lrow0]; lt[1] += sRedSum[j * kRows + lrow1]; }
    __syncthreads();  // sRedSum is read before the next epilogue writes it
    const int Pr = __ldg(P + r), Pr1 = __ldg(P + r + 1);
    const bool split = (Pr / U) != ((Pr1 - 1) / U);
    const int slot = Pr <= u_begin ? 0 : 1;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = row0 + (hr ? lrow1 : lrow0);
      if (row >= p.rows) continue;
      const float inv_l = lt[hr] != 0.f ? kv_scale / lt[hr] : 0.f;  // O = kv_scale * P.v
      const float lse_row = lt[hr] != 0.f ? (m_run[hr] + __log2f(lt[hr])) * kLn2 : -INFINITY;
      if (!split) {
        T* out = static_cast<T*>(p.out) + (int64_t(r) * p.rows + row) * kDv;
#pragma unroll
        for (int n = 0; n < Cfg::kNTiles; ++n) {
          const int col = wn * Cfg::kColsPerWarp + n * 8 + qd * 2;
          *reinterpret_cast<uint32_t*>(out + col) =
              pack2<T>(o[n][hr * 2] * inv_l, o[n][hr * 2 + 1] * inv_l);
        }
        if (wn == 0 && qd == 0) p.lse[int64_t(r) * p.rows + row] = lse_row;
      } else {
        const int64_t prow = (int64_t(cta) * 2 + slot) * p.rows + row;
        DensePartial<T>* po = static_cast<DensePartial<T>*>(p.part_out) + prow * kDv;
#pragma unroll
        for (int n = 0; n < Cfg::kNTiles; ++n) {
          const int col = wn * Cfg::kColsPerWarp + n * 8 + qd * 2;
          store_partial2(po + col, o[n][hr * 2] * inv_l, o[n][hr * 2 + 1] * inv_l);
        }
        if (wn == 0 && qd == 0) p.part_lse[prow] = lse_row;
      }
    }
  };

  int stage = 0;
  for (int u = u_begin; u < u_end; ++u) {
    if (u >= __ldg(P + r_cur + 1)) {
      epilogue(r_cur);
      while (u >= __ldg(P + r_cur + 1)) ++r_cur;
      load_q(r_cur);  // sQ is free: every warp passed the epilogue's barriers
      reset_state();
    }
    cp_async_wait<kStages - 2>();
    __syncthreads();  // unit u landed; every warp finished unit u-1 (its stage is reusable)
    {
      const int un = u + kStages - 1;
      if (un < u_end) load_unit(un, (stage + kStages - 1) % kStages);
      cute::cp_async_fence();
    }
    const T* sK = reinterpret_cast<const T*>(sStages + stage * Cfg::kSmemStage);
    if constexpr (kFmt == KvFormat::kFp8) {
      // convert the staged unit: 16 e4m3 values per chunk -> 16 values of T (exact)
      const unsigned char* src = sStages + stage * Cfg::kSmemStage;
      // every chunk a thread converts is read before the first store: the compiler keeps each
      // shared-memory load behind the stores before it, which would serialise the loop
      constexpr int kChunks = kUnit * (kDqk / 16), kPer = kChunks / Cfg::kThreads;
      static_assert(kChunks % Cfg::kThreads == 0, "whole chunks per thread");
      uint4 raw[kPer];
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        const int i = tid + k * Cfg::kThreads;
        raw[k] = *reinterpret_cast<const uint4*>(src + (i / (kDqk / 16)) * kDqk + (i % (kDqk / 16)) * 16);
      }
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        const int i = tid + k * Cfg::kThreads;
        store_e4m3x16<T>(sKfp8 + (i / (kDqk / 16)) * kSmemRow + (i % (kDqk / 16)) * 16, raw[k], 1.f);
      }
      __syncthreads();
      sK = sKfp8;
    }
    const int tok0 = (u - __ldg(P + r_cur)) * kUnit;
    const int seq_len = __ldg(p.seq_lens + r_cur);

    // ---- S = Q K^T for 16 rows x 8 keys per warp, depth 576
    // two independent accumulators halve the dependent mma chain (36 k-steps)
    float s[4] = {0.f, 0.f, 0.f, 0.f}, s_odd[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int kk = 0; kk < kDqk / 16; kk += 2) {
      uint32_t b[4], a0[4], a1[4];
      ldsm_x4(b, sK + (wn * 8 + (lane & 7)) * kSmemRow + kk * 16 + (lane >> 3) * 8);
      ldsm_x4(a0, sQ + (wm * 16 + (lane & 15)) * kSmemRow + kk * 16 + (lane >> 4) * 8);
      ldsm_x4(a1, sQ + (wm * 16 + (lane & 15)) * kSmemRow + (kk + 1) * 16 + (lane >> 4) * 8);
      mma_16816<T>(s, a0, b[0], b[1]);
      mma_16816<T>(s_odd, a1, b[2], b[3]);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) s[e] += s_odd[e];
    // scale to log2 domain and mask keys past each row's limit
    float rmax[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = row0 + (hr ? lrow1 : lrow0);
      int limit = seq_len;
      if (p.causal) limit = seq_len - p.s_q + row / p.heads + 1;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int key = tok0 + wn * 8 + qd * 2 + e;
        float& v = s[hr * 2 + e];
        v = key < limit ? v * scale_log2 : -INFINITY;
      }
      float mx = fmaxf(s[hr * 2], s[hr * 2 + 1]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
      rmax[hr] = mx;
    }
    if (qd == 0) { sRedMax[wn * kRows + lrow0] = rmax[0]; sRedMax[wn * kRows + lrow1] = rmax[1]; }
    __syncthreads();
    float alpha[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int lr = hr ? lrow1 : lrow0;
      float mx = m_run[hr];
#pragma unroll
      for (int j = 0; j < kWarpsN; ++j) mx = fmaxf(mx, sRedMax[j * kRows + lr]);
      const float m_use = mx == -INFINITY ? 0.f : mx;  // nothing seen yet: avoid inf - inf
      alpha[hr] = exp2f(m_run[hr] - m_use);
      m_run[hr] = mx;
      const float p0 = exp2f(s[hr * 2] - m_use), p1 = exp2f(s[hr * 2 + 1] - m_use);
      l_run[hr] = l_run[hr] * alpha[hr] + p0 + p1;
      *reinterpret_cast<uint32_t*>(sP + lr * kPRow + wn * 8 + qd * 2) = pack2<T>(p0, p1);
    }
#pragma unroll
    for (int n = 0; n < Cfg::kNTiles; ++n) {
      o[n][0] *= alpha[0]; o[n][1] *= alpha[0]; o[n][2] *= alpha[1]; o[n][3] *= alpha[1];
    }
    __syncthreads();

    // ---- O += P V for 16 rows x 128 columns per warp, depth 32 keys
#pragma unroll
    for (int ks = 0; ks < kUnit / 16; ++ks) {
      uint32_t a[4];
      ldsm_x4(a, sP + (wm * 16 + (lane & 15)) * kPRow + ks * 16 + (lane >> 4) * 8);
#pragma unroll
      for (int n = 0; n < Cfg::kNTiles; n += 2) {
        uint32_t b[4];
        const int krow = ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        const int col = wn * Cfg::kColsPerWarp + n * 8 + (lane >> 4) * 8;
        ldsm_x4_trans(b, sK + krow * kSmemRow + col);
        mma_16816<T>(o[n], a, b[0], b[1]);
        mma_16816<T>(o[n + 1], a, b[2], b[3]);
      }
    }
    stage = (stage + 1) % kStages;
  }
  cp_async_wait<0>();
  epilogue(r_cur);
}

}  // namespace mma

template <typename T, KvFormat kFmt>
void launch_mma_decode(const DecodeParams& p, cudaStream_t stream) {
  using namespace mma;
  using Cfg = MmaDecodeConfig<T, kFmt>;
  auto kernel = mma_decode_kernel<T, kFmt>;
  MLA_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(Cfg::kSmem)));
  dim3 grid(p.num_ctas, (p.rows + kRows - 1) / kRows);
  launch_pdl(kernel, grid, dim3(Cfg::kThreads), Cfg::kSmem, stream, p);
  launch_combine<T, DensePartial<T>>(p, stream);
}

}  // namespace mla_backend::dense_decode
