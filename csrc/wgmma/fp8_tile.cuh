// kPagedFp8: a page's raw e4m3 bytes land by TMA in the odd chunks of a K buffer (and the
// rope in chunk 8), 128 bytes a row with the tile's 128-byte swizzle; the warpgroup whose S
// reads the page first converts them in place, one raw chunk at a time, so S starts on the
// first chunks while the rest are converted. Op: the wgmmas' operand type. q's type
// (kPagedFp8), or fp16 whatever q's type (kPagedFp8F16): every e4m3 value is an fp16 value,
// one conversion instruction per pair where bf16 takes four, and a bf16 Q is then converted
// once per request piece, each row scaled by a power of two of its own (q_rows_to_f16).
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/convert.cuh"
#include "wgmma/config.cuh"

namespace mla_backend::wgmma {

// 16 e4m3 values -> 16 values of Op (8 packed pairs), exactly
template <typename Op>
__device__ __forceinline__ void convert_raw16(uint4 raw, uint32_t* v) {
  if constexpr (std::is_same_v<Op, __half>) convert_e4m3x16_to_f16(raw, v);
  else convert_e4m3x16<Op>(raw, 1.f, v);
}

// Raw chunk `rc` (odd, 1-7: values 128 (rc / 2) .. + 127 of every token) of the tile at generic
// `tile` -> chunks rc - 1 and rc as Op. Thread wtid of the warpgroup takes row wtid / 2 and raw
// units 4 part .. 4 part + 3 (part = wtid % 2), which become all of chunk rc - 1 + part's row.
// Both threads of a row are in one warp: they read before either stores over the raw row.
// Part 1 takes its units in another order (j ^ 2) so the two parts' accesses fall in
// different bank groups.
template <typename Op>
__device__ __forceinline__ void convert_raw_chunk(unsigned char* tile, int rc, int wtid) {
  const int row = wtid >> 1, part = wtid & 1, sw = row & 7;
  const unsigned char* src = tile + rc * kChunkBytes + row * 128;
  unsigned char* dst = tile + (rc - 1 + part) * kChunkBytes + row * 128;
  uint4 raw[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int jj = j ^ (2 * part);
    raw[j] = *reinterpret_cast<const uint4*>(src + (((4 * part + jj) ^ sw) << 4));
  }
  __syncwarp();
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int jj = j ^ (2 * part);
    uint32_t v[8];
    convert_raw16<Op>(raw[j], v);  // exact: kv_scale is applied to S and O
    *reinterpret_cast<uint4*>(dst + (((2 * jj) ^ sw) << 4)) = make_uint4(v[0], v[1], v[2], v[3]);
    *reinterpret_cast<uint4*>(dst + (((2 * jj + 1) ^ sw) << 4)) = make_uint4(v[4], v[5], v[6], v[7]);
  }
}

// The rope chunk 8: its raw 64 values in units 0-3 of each row (4-7 are the box's zero fill
// past the token's 576 bytes) -> 64 values of Op in place. Row wtid / 2, raw units 2 part,
// 2 part + 1 -> units 4 part .. 4 part + 3.
template <typename Op>
__device__ __forceinline__ void convert_raw_rope(unsigned char* tile, int wtid) {
  const int row = wtid >> 1, part = wtid & 1, sw = row & 7;
  unsigned char* rrow = tile + 8 * kChunkBytes + row * 128;
  uint4 raw[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) raw[j] = *reinterpret_cast<const uint4*>(rrow + (((2 * part + j) ^ sw) << 4));
  __syncwarp();
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int u = 4 * part + 2 * j;
    uint32_t v[8];
    convert_raw16<Op>(raw[j], v);
    *reinterpret_cast<uint4*>(rrow + ((u ^ sw) << 4)) = make_uint4(v[0], v[1], v[2], v[3]);
    *reinterpret_cast<uint4*>(rrow + (((u + 1) ^ sw) << 4)) = make_uint4(v[4], v[5], v[6], v[7]);
  }
}

// Q (bf16, the 64 x 576 tile at generic `q`) -> fp16 in place, row m scaled by 2^k_m, which
// puts its largest magnitude in [2^14, 2^15) (k_m = 0 for a row of zeros): exact for every
// value of at least 2^-28 times the row's largest, so rows far apart in magnitude keep their
// own precision. 2^-k_m goes to row_inv[m], for the softmax. Thread t of the 256 takes row
// t / 4 and its 16-byte units 18 (t % 4) .. + 17 (of 72); the 4 threads of a row are adjacent
// lanes.
__device__ __forceinline__ void q_rows_to_f16(unsigned char* q, float* row_inv, int tid) {
  constexpr int kUnits = 18;
  const int row = tid >> 2, part = tid & 3, sw = row & 7;
  auto at = [&](int i) {
    const int u = kUnits * part + i;
    return reinterpret_cast<uint4*>(q + (u >> 3) * kChunkBytes + row * 128 + (((u & 7) ^ sw) << 4));
  };
  uint32_t mx = 0;  // the largest magnitude's bits (a nonnegative float's bits order as its value)
#pragma unroll
  for (int i = 0; i < kUnits; ++i) {
    const uint4 v = *at(i);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) mx = __vmaxu2(mx, w[j] & 0x7FFF7FFFu);
  }
  mx = max(mx & 0xFFFFu, mx >> 16);
  mx = max(mx, __shfl_xor_sync(0xffffffff, mx, 1));
  mx = max(mx, __shfl_xor_sync(0xffffffff, mx, 2));
  // bf16 exponent field e: the largest magnitude is in [2^(e-127), 2^(e-126)), so k = 141 - e;
  // a subnormal largest value takes k = 126 (its values stay below fp16's range either way)
  const int e = int(mx >> 7);
  const int k = mx == 0 ? 0 : min(141 - e, 126);
  const float scale = __int_as_float((127 + k) << 23), inv = __int_as_float((127 - k) << 23);
#pragma unroll
  for (int i = 0; i < kUnits; ++i) {
    const uint4 v = *at(i);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    uint32_t h[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      h[j] = pack2<__half>(__uint_as_float(w[j] << 16) * scale, __uint_as_float(w[j] & 0xFFFF0000u) * scale);
    *at(i) = make_uint4(h[0], h[1], h[2], h[3]);
  }
  if (part == 0) row_inv[row] = inv;
}

}  // namespace mla_backend::wgmma
