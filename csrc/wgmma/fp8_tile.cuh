// kPagedFp8: a page's raw e4m3 bytes land by TMA in the odd chunks of a K buffer (and the
// rope in chunk 8), 128 bytes a row with the tile's 128-byte swizzle; the warpgroup whose S
// reads the page first converts them in place to q's type, one raw chunk at a time, so S
// starts on the first chunks while the rest are converted.
#pragma once

#include <cstdint>

#include "common/convert.cuh"
#include "wgmma/config.cuh"

namespace mla_backend::wgmma {

// Raw chunk `rc` (odd, 1-7: values 128 (rc / 2) .. + 127 of every token) of the tile at generic
// `tile` -> chunks rc - 1 and rc as T. Thread wtid of the warpgroup takes row wtid / 2 and raw
// units 4 part .. 4 part + 3 (part = wtid % 2), which become all of chunk rc - 1 + part's row.
// Both threads of a row are in one warp: they read before either stores over the raw row.
// Part 1 takes its units in another order (j ^ 2) so the two parts' accesses fall in
// different bank groups.
template <typename T>
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
    convert_e4m3x16<T>(raw[j], 1.f, v);  // exact: kv_scale is applied to S and O
    *reinterpret_cast<uint4*>(dst + (((2 * jj) ^ sw) << 4)) = make_uint4(v[0], v[1], v[2], v[3]);
    *reinterpret_cast<uint4*>(dst + (((2 * jj + 1) ^ sw) << 4)) = make_uint4(v[4], v[5], v[6], v[7]);
  }
}

// The rope chunk 8: its raw 64 values in units 0-3 of each row (4-7 are the box's zero fill
// past the token's 576 bytes) -> 64 values of T in place. Row wtid / 2, raw units 2 part,
// 2 part + 1 -> units 4 part .. 4 part + 3.
template <typename T>
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
    convert_e4m3x16<T>(raw[j], 1.f, v);
    *reinterpret_cast<uint4*>(rrow + ((u ^ sw) << 4)) = make_uint4(v[0], v[1], v[2], v[3]);
    *reinterpret_cast<uint4*>(rrow + (((u + 1) ^ sw) << 4)) = make_uint4(v[4], v[5], v[6], v[7]);
  }
}

}  // namespace mla_backend::wgmma
