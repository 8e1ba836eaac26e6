// Dense paged decode for up to 16 query rows (rows = s_q * H <= 16: TP8 / TP16 head counts),
// with mma.sync m16n8k16 on 16-row tiles, so few heads pay for no padded MMA rows; more rows
// go to the wgmma kernel (wgmma/). Over a 16-bit or a per-tensor fp8 cache.
//
// Work unit: 32 consecutive key positions of one request (half a 64-token page); the plan and
// the partials are the split-KV ones (splitkv/params.h). Per unit, each of the four warps
// multiplies Q's 16 rows by all 32 keys over a quarter of the depth (its Q fragments stay in
// registers for the whole request), the four partial S tiles are added up through shared
// memory, and every warp runs the same online softmax in registers; P's A fragments are S's
// accumulators, and each warp multiplies P by its 128 output columns of V.
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
constexpr int kWarps = 4;            // S: each warp one quarter of the depth; PV: one of the columns
constexpr int kKSteps = kDqk / 16 / kWarps;  // 9 k-steps of 16: a warp's depth slice of S
// S partials, lane-major: lane l of every warp holds S at the same 16 (row, key) places, so
// warp w's 16 floats of lane l sit together (padded to 20: conflict-free 16-byte accesses)
constexpr int kSLane = 20;

// fp8: cp.async stages the raw bytes; at consume time every thread converts the unit into
// one fp16 tile, which S and PV read exactly as in the 16-bit case. Every e4m3 value is an
// fp16 value, so the conversion is one instruction per pair and rounds nothing: kv_scale is
// folded into the softmax scale (S = kv_scale * q.k8) and into the output (O = kv_scale *
// P.v8). The tensor cores then take fp16 operands whatever q's dtype: a bf16 q row is
// scaled by a power of two that puts its largest value in [2^14, 2^15) (exact, and fp16 then
// holds it with more mantissa bits than bf16), the power undone in the row's softmax scale;
// P is rounded to fp16, and the output to q's dtype.
// 16 e4m3 values (one 16-byte chunk) stored as 16 fp16 values (32 contiguous bytes)
__device__ __forceinline__ void store_e4m3x16(__half* dst, uint4 raw) {
  uint32_t packed[8];
  convert_e4m3x16_to_f16(raw, packed);
  uint4* out = reinterpret_cast<uint4*>(dst);
  out[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  out[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
}

template <typename T, KvFormat kFmt>
struct MmaDecodeConfig {
  static constexpr bool kConvert = kFmt != KvFormat::k16;
  using MmaT = std::conditional_t<kConvert, __half, T>;  // the tensor cores' operand type
  static constexpr int kThreads = kWarps * 32;
  // units in flight + 1; fp8 stages are 18 KiB, so three fit beside two CTAs per SM (measured
  // level with two on the H100)
  static constexpr int kStages = kConvert ? 3 : 2;
  static constexpr int kMinCtasPerSm = 2;
  // bytes of one cached token as staged, and the 16-byte chunks that load it
  static constexpr int kTokBytes = kFmt == KvFormat::k16 ? kSmemRow * int(sizeof(T)) : kDqk;
  static constexpr int kRowChunks = kFmt == KvFormat::k16 ? kDqk * int(sizeof(T)) / 16 : kDqk / 16;
  static constexpr int kColsPerWarp = kDv / kWarps;         // 128
  static constexpr int kNTiles = kColsPerWarp / 8;          // 16 n-tiles of O per warp
  static constexpr int kSTiles = kUnit / 8;                 // 4 n-tiles of S: every key of the unit
  // Q's rows; once its fragments are in registers, the same bytes hold the S partials
  static constexpr size_t kSmemQ = size_t(kRows) * kSmemRow * sizeof(T);
  static constexpr size_t kSmemS = size_t(kWarps) * 32 * kSLane * sizeof(float);
  static constexpr size_t kSmemTile = size_t(kUnit) * kSmemRow * sizeof(T);
  static constexpr size_t kSmemStage = size_t(kUnit) * kTokBytes;  // bytes per stage
  static constexpr size_t kSmemKV = kStages * kSmemStage + (kConvert ? kSmemTile : 0);
  static constexpr size_t kSmemRowScale = kRows * sizeof(float);  // bf16 q -> fp16: 2^-k per row
  static constexpr size_t kSmem = kSmemQ + kSmemKV + kSmemRowScale;
  static_assert(kKSteps * kWarps * 16 == kDqk, "the depth splits into whole k-steps per warp");
  static_assert(kSmemS <= kSmemQ, "S partials fit in Q's buffer");
  static_assert(kSmem <= 227 * 1024, "shared memory per CTA");
  static_assert(2 * (kSmem + 1024) <= 228 * 1024, "two CTAs per SM");
};

// Q's 16 bf16 rows in shared memory (row stride kSmemRow) -> fp16 in place, each row times
// 2^k so that its largest magnitude lands in [2^14, 2^15): exact for every value of at least
// 2^-28 times the row's largest (fp16's normal range from there; smaller ones round to fp16's
// subnormals). 2^-k per row to row_scale (a row of zeros, or with a non-finite largest value,
// keeps k = 0).
// Eight threads per row, nine 16-byte chunks each.
__device__ __forceinline__ void q_rows_to_f16(__nv_bfloat16* sq, float* row_scale, int tid) {
  static_assert(kRows * 8 == 128 && (kDqk / 8) % 8 == 0, "eight threads per row, whole chunks");
  constexpr int kPer = kDqk / 8 / 8;  // 9 chunks of 8 values
  const int row = tid >> 3, part = tid & 7;
  uint4* base = reinterpret_cast<uint4*>(sq + row * kSmemRow);
  uint4 v[kPer];
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    v[j] = base[part + 8 * j];
    const uint32_t w[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[e]));
      amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
  }
#pragma unroll
  for (int off = 1; off < 8; off <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, off));
  int k = 0;
  if (amax > 0.f && amax <= 3.3895314e38f) {  // finite and not zero
    const int e = int((__float_as_uint(amax) >> 23) & 0xff) - 127;  // floor(log2(amax)), normal
    k = min(14 - e, 126);
  }
  const float up = __uint_as_float(uint32_t(k + 127) << 23);  // 2^k
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    uint32_t w[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[e]));
      w[e] = pack2<__half>(f.x * up, f.y * up);
    }
    base[part + 8 * j] = make_uint4(w[0], w[1], w[2], w[3]);
  }
  if (part == 0) row_scale[row] = __uint_as_float(uint32_t(127 - k) << 23);  // 2^-k
}

template <typename T, KvFormat kFmt>
__global__ void __launch_bounds__(MmaDecodeConfig<T, kFmt>::kThreads, MmaDecodeConfig<T, kFmt>::kMinCtasPerSm)
mma_decode_kernel(const __grid_constant__ DecodeParams p) {
  using Cfg = MmaDecodeConfig<T, kFmt>;
  using MmaT = typename Cfg::MmaT;
  constexpr int kStages = Cfg::kStages;
  // a bf16 q over an fp8 cache: its rows become fp16 in place (see store_e4m3x16)
  constexpr bool kQToF16 = Cfg::kConvert && !std::is_same_v<T, __half>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);             // q's rows as loaded
  const MmaT* sQm = reinterpret_cast<const MmaT*>(smem);  // the same rows as the MMAs read them
  float* sS = reinterpret_cast<float*>(smem);     // S partials [warp][lane][kSLane], in Q's bytes
  unsigned char* sStages = smem + Cfg::kSmemQ;   // kStages units: 16-bit rows, or fp8 bytes
  MmaT* sKfp8 = reinterpret_cast<MmaT*>(sStages + kStages * Cfg::kSmemStage);  // fp8: converted unit
  float* sRowScale = reinterpret_cast<float*>(smem + Cfg::kSmemQ + Cfg::kSmemKV);

  cudaTriggerProgrammaticLaunchCompletion();
  cudaGridDependencySynchronize();  // the plan, q and the cache are written by earlier kernels
  const int* P = p.meta;
  const int cta = blockIdx.x;
  const int row0 = blockIdx.y * kRows;
  int u_begin, u_end, U;
  if (!cta_units(p, u_begin, u_end, U)) return;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float kv_scale = Cfg::kConvert ? (p.kv_scale_ptr != nullptr ? __ldg(p.kv_scale_ptr) : p.kv_scale_value) : 1.f;
  const float scale_log2 = p.scale_log2 * kv_scale;  // S = kv_scale * (q . k_fp8)
  const unsigned char* kv = static_cast<const unsigned char*>(p.kv);  // byte addressing
  constexpr int kElemBytes = kFmt == KvFormat::k16 ? int(sizeof(T)) : 1;  // strides are in elements
  constexpr int kRowChunks = Cfg::kRowChunks;

  // ---- producer: async loads of one unit's 32 tokens into a stage. The load stream's
  // request (ld_r, holding units [ld_u0, ld_u1), ld_len keys) is kept in registers, and the
  // block id of the next unit to load is read one unit ahead (`locate`), so no copy waits on
  // a table read.
  struct UnitSrc {
    int blk, tok0, n_valid;  // block id (-1 past the table), first key, keys present (<= 32)
  };
  int ld_r = request_of_unit(P, p.batch, u_begin);
  int ld_u0 = __ldg(P + ld_r), ld_u1 = __ldg(P + ld_r + 1), ld_len = __ldg(p.seq_lens + ld_r);
  auto locate = [&](int u) {
    while (u >= ld_u1) {
      ++ld_r;
      ld_u0 = ld_u1;
      ld_u1 = __ldg(P + ld_r + 1);
      ld_len = __ldg(p.seq_lens + ld_r);
    }
    UnitSrc n;
    n.tok0 = (u - ld_u0) * kUnit;
    const int blk_idx = n.tok0 / kPage;
    n.blk = blk_idx < p.max_blocks ? __ldg(p.block_table + ld_r * p.bt_stride + blk_idx) : -1;
    n.n_valid = min(kUnit, ld_len - n.tok0);
    return n;
  };
  // an fp8 page whose token rows are contiguous: the unit is 18 KiB in one piece, copied
  // chunk i to stage byte 16 i (no per-chunk index math)
  const bool flat = Cfg::kConvert && p.kv_stride_tok == kDqk;
  auto load_unit = [&](const UnitSrc& n, int stage) {
    unsigned char* dst = sStages + stage * Cfg::kSmemStage;
    // a block id outside the cache (a bad table entry) reads as zero keys, never out of bounds
    const bool blk_ok = unsigned(n.blk) < unsigned(p.num_blocks);  // -1 (past the table) too
    const unsigned char* base =
        kv + (int64_t(n.blk) * p.kv_stride_block + int64_t(n.tok0 % kPage) * p.kv_stride_tok) * kElemBytes;
    if (flat) {
      // one base for the thread, constant offsets: every address stays inside the unit's
      // block (or, for a bad block id, inside the cache's first 18 KiB), and the chunks
      // past n_valid copy no bytes (zero-filled, never read)
      const int n_bytes = blk_ok ? n.n_valid * kDqk : 0;
      const unsigned char* src = (blk_ok ? base : kv) + tid * 16;
      const uint32_t dst0 = cute::cast_smem_ptr_to_uint(dst) + tid * 16;
#pragma unroll
      for (int k = 0; k < kUnit * kRowChunks / Cfg::kThreads; ++k) {
        constexpr int kStep = Cfg::kThreads * 16;
        cp_async_16(dst0 + k * kStep, src + k * kStep, tid * 16 + k * kStep < n_bytes ? 16 : 0);
      }
      return;
    }
    auto dst_off = [&](int t, int ch) {
      return kFmt == KvFormat::k16 ? (t * kSmemRow + ch * 8) * int(sizeof(T)) : t * Cfg::kTokBytes + ch * 16;
    };
    for (int i = tid; i < kUnit * kRowChunks; i += Cfg::kThreads) {
      const int t = i / kRowChunks, ch = i % kRowChunks;
      const bool ok = blk_ok && t < n.n_valid;  // zero-filled otherwise (past n_valid: never read)
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

  // prologue: STAGES-1 units in flight, the next one located
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (u_begin + s < u_end) load_unit(locate(u_begin + s), s);
    cute::cp_async_fence();
  }
  UnitSrc next{};
  if (u_begin + kStages - 1 < u_end) next = locate(u_begin + kStages - 1);

  // per-thread state: rows g and g + 8 of the tile. Every warp holds the whole of S (it sums
  // the four depth partials), so every warp runs the same softmax and needs no reduction
  // across warps; each keeps the running state of its 128 output columns.
  const int g = lane >> 2, qd = lane & 3;
  uint32_t qa[kKSteps][4];  // this warp's depth slice of Q as A fragments, for the whole request
  float row_scale_log2[2];  // rows g, g + 8: the softmax scale, with the row's 2^-k (kQToF16)
  float o[Cfg::kNTiles][4];
  float m_run[2], l_run[2];
  auto reset_state = [&]() {
#pragma unroll
    for (int n = 0; n < Cfg::kNTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    m_run[0] = m_run[1] = -INFINITY;
    l_run[0] = l_run[1] = 0.f;
  };

  // the computing side's request r_cur (units [cur_u0, cur_u1)), read once per request
  int r_cur = request_of_unit(P, p.batch, u_begin);
  int cur_u0 = __ldg(P + r_cur), cur_u1 = __ldg(P + r_cur + 1);
  // rows g, g + 8: the query token (row / H), for the causal limit
  int row_qi[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) row_qi[hr] = (row0 + g + hr * 8) / p.heads;
  int row_limit[2];  // keys < row_limit of r_cur: this row's keys (causal: its prefix)

  auto epilogue = [&](int r, int Pr, int Pr1) {
    float lt[2] = {l_run[0], l_run[1]};  // row sums: over the quad (each warp has every key)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      lt[hr] += __shfl_xor_sync(0xffffffff, lt[hr], 1);
      lt[hr] += __shfl_xor_sync(0xffffffff, lt[hr], 2);
    }
    const bool split = (Pr / U) != ((Pr1 - 1) / U);
    const int slot = Pr <= u_begin ? 0 : 1;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = row0 + g + hr * 8;
      if (row >= p.rows) continue;
      const float inv_l = lt[hr] != 0.f ? kv_scale / lt[hr] : 0.f;  // O = kv_scale * P.v
      const float lse_row = lt[hr] != 0.f ? (m_run[hr] + __log2f(lt[hr])) * kLn2 : -INFINITY;
      if (!split) {
        T* out = static_cast<T*>(p.out) + (int64_t(r) * p.rows + row) * kDv;
#pragma unroll
        for (int n = 0; n < Cfg::kNTiles; ++n) {
          const int col = warp * Cfg::kColsPerWarp + n * 8 + qd * 2;
          *reinterpret_cast<uint32_t*>(out + col) =
              pack2<T>(o[n][hr * 2] * inv_l, o[n][hr * 2 + 1] * inv_l);
        }
        if (warp == 0 && qd == 0) p.lse[int64_t(r) * p.rows + row] = lse_row;
      } else {
        const int64_t prow = (int64_t(cta) * 2 + slot) * p.rows + row;
        DensePartial<T>* po = static_cast<DensePartial<T>*>(p.part_out) + prow * kDv;
#pragma unroll
        for (int n = 0; n < Cfg::kNTiles; ++n) {
          const int col = warp * Cfg::kColsPerWarp + n * 8 + qd * 2;
          store_partial2(po + col, o[n][hr * 2] * inv_l, o[n][hr * 2 + 1] * inv_l);
        }
        if (warp == 0 && qd == 0) p.part_lse[prow] = lse_row;
      }
    }
  };

  bool new_request = true;
  int stage = 0;
  for (int u = u_begin; u < u_end; ++u) {
    if (u >= cur_u1) {
      epilogue(r_cur, cur_u0, cur_u1);
      while (u >= cur_u1) {
        ++r_cur;
        cur_u0 = cur_u1;
        cur_u1 = __ldg(P + r_cur + 1);
      }
      new_request = true;
    }
    cp_async_wait<kStages - 2>();
    __syncthreads();  // unit u landed; every warp finished unit u-1 (its stage, sS are reusable)
    {
      const int un = u + kStages - 1;
      if (un < u_end) {
        load_unit(next, (stage + kStages - 1) % kStages);
        if (un + 1 < u_end) next = locate(un + 1);
      }
      cute::cp_async_fence();
    }
    if (new_request) {  // the same in every thread: the barriers below are uniform
      load_q(r_cur);
      __syncthreads();
      row_scale_log2[0] = row_scale_log2[1] = scale_log2;
      const int seq_len = __ldg(p.seq_lens + r_cur);
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) row_limit[hr] = p.causal ? seq_len - p.s_q + row_qi[hr] + 1 : seq_len;
      if constexpr (kQToF16) {
        q_rows_to_f16(sQ, sRowScale, tid);
        __syncthreads();
        row_scale_log2[0] *= sRowScale[g];
        row_scale_log2[1] *= sRowScale[g + 8];
      }
#pragma unroll
      for (int j = 0; j < kKSteps; ++j)
        ldsm_x4(qa[j], sQm + (lane & 15) * kSmemRow + (warp * kKSteps + j) * 16 + (lane >> 4) * 8);
      __syncthreads();  // Q's bytes are read before they hold S partials
      reset_state();
      new_request = false;
    }
    const MmaT* sK = reinterpret_cast<const MmaT*>(sStages + stage * Cfg::kSmemStage);
    if constexpr (Cfg::kConvert) {
      // convert the staged unit: 16 e4m3 values per chunk -> 16 fp16 values (exact)
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
        store_e4m3x16(sKfp8 + (i / (kDqk / 16)) * kSmemRow + (i % (kDqk / 16)) * 16, raw[k]);
      }
      __syncthreads();
      sK = sKfp8;
    }
    const int tok0 = (u - cur_u0) * kUnit;

    // ---- S partial = Q K^T over this warp's depth slice, 16 rows x all 32 keys: four
    // independent accumulators (one per 8-key n-tile), 9 k-steps each
    float s[Cfg::kSTiles][4];
#pragma unroll
    for (int n = 0; n < Cfg::kSTiles; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
    const int k0 = warp * kKSteps;  // first k-step of the slice
#pragma unroll
    for (int n = 0; n < Cfg::kSTiles; ++n) {
#pragma unroll
      for (int j = 0; j + 1 < kKSteps; j += 2) {  // two k-steps per ldmatrix
        uint32_t b[4];
        ldsm_x4(b, sK + (n * 8 + (lane & 7)) * kSmemRow + (k0 + j) * 16 + (lane >> 3) * 8);
        mma_16816<MmaT>(s[n], qa[j], b[0], b[1]);
        mma_16816<MmaT>(s[n], qa[j + 1], b[2], b[3]);
      }
    }
    static_assert(kKSteps % 2 == 1 && Cfg::kSTiles % 2 == 0, "one odd k-step, n-tiles in pairs");
#pragma unroll
    for (int n = 0; n < Cfg::kSTiles; n += 2) {  // the last k-step for two n-tiles per ldmatrix
      uint32_t b[4];
      ldsm_x4(b, sK + (n * 8 + (lane & 7) + (lane >> 4) * 8) * kSmemRow + (k0 + kKSteps - 1) * 16 +
                     ((lane >> 3) & 1) * 8);
      mma_16816<MmaT>(s[n], qa[kKSteps - 1], b[0], b[1]);
      mma_16816<MmaT>(s[n + 1], qa[kKSteps - 1], b[2], b[3]);
    }
    // the four partials through shared memory: each warp adds up every key of S
    static_assert(Cfg::kSTiles == 4, "one 16-byte vector per n-tile");
#pragma unroll
    for (int n = 0; n < Cfg::kSTiles; ++n)
      *reinterpret_cast<float4*>(sS + (warp * 32 + lane) * kSLane + n * 4) = make_float4(s[n][0], s[n][1], s[n][2], s[n][3]);
    __syncthreads();
#pragma unroll
    for (int n = 0; n < Cfg::kSTiles; ++n) {
      float4 t = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float4 v = *reinterpret_cast<const float4*>(sS + (w * 32 + lane) * kSLane + n * 4);
        t.x += v.x;
        t.y += v.y;
        t.z += v.z;
        t.w += v.w;
      }
      s[n][0] = t.x;
      s[n][1] = t.y;
      s[n][2] = t.z;
      s[n][3] = t.w;
    }

    // scale to log2 domain, mask keys past each row's limit, online softmax in registers
    float alpha[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int limit = row_limit[hr] - tok0;  // keys of the unit the row sees: [0, limit)
      float mx = m_run[hr];
#pragma unroll
      for (int n = 0; n < Cfg::kSTiles; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& v = s[n][hr * 2 + e];
          v = n * 8 + qd * 2 + e < limit ? v * row_scale_log2[hr] : -INFINITY;
          mx = fmaxf(mx, v);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
      const float m_use = mx == -INFINITY ? 0.f : mx;  // nothing seen yet: avoid inf - inf
      alpha[hr] = exp2f(m_run[hr] - m_use);
      m_run[hr] = mx;
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < Cfg::kSTiles; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& v = s[n][hr * 2 + e];
          v = exp2f(v - m_use);
          sum += v;
        }
      l_run[hr] = l_run[hr] * alpha[hr] + sum;
    }
#pragma unroll
    for (int n = 0; n < Cfg::kNTiles; ++n) {
      o[n][0] *= alpha[0]; o[n][1] *= alpha[0]; o[n][2] *= alpha[1]; o[n][3] *= alpha[1];
    }

    // ---- O += P V for 16 rows x 128 columns per warp, depth 32 keys; P's A fragments are
    // S's accumulators of two adjacent n-tiles
#pragma unroll
    for (int ks = 0; ks < kUnit / 16; ++ks) {
      uint32_t a[4];
      a[0] = pack2<MmaT>(s[2 * ks][0], s[2 * ks][1]);
      a[1] = pack2<MmaT>(s[2 * ks][2], s[2 * ks][3]);
      a[2] = pack2<MmaT>(s[2 * ks + 1][0], s[2 * ks + 1][1]);
      a[3] = pack2<MmaT>(s[2 * ks + 1][2], s[2 * ks + 1][3]);
#pragma unroll
      for (int n = 0; n < Cfg::kNTiles; n += 2) {
        uint32_t b[4];
        const int krow = ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        const int col = warp * Cfg::kColsPerWarp + n * 8 + (lane >> 4) * 8;
        ldsm_x4_trans(b, sK + krow * kSmemRow + col);
        mma_16816<MmaT>(o[n], a, b[0], b[1]);
        mma_16816<MmaT>(o[n + 1], a, b[2], b[3]);
      }
    }
    stage = (stage + 1) % kStages;
  }
  cp_async_wait<0>();
  epilogue(r_cur, cur_u0, cur_u1);
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
