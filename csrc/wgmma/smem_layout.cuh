// Addressing of the 64-row tiles in shared memory: the 128-byte swizzle wgmma reads, the
// rotated layout of raw fp8 staging, and wgmma shared-memory descriptors.
#pragma once

#include <cstdint>

#include "wgmma/config.cuh"

namespace mla_backend::wgmma {

// Byte offset of element (row, col) in a [64 x cols] tile stored as 64-column chunks of
// 128-byte rows with the 128-byte swizzle (16-byte unit index XOR row % 8), the canonical
// K-major SW128 layout of wgmma.
__device__ __forceinline__ uint32_t sw128_offset(int row, int col) {
  return (col >> 6) * kChunkBytes + row * 128 + ((((col & 63) >> 3) ^ (row & 7)) << 4) + (col & 7) * 2;
}

// Byte offset of raw (fp8) 16-byte unit k of row `row` in a staging chunk: the units of a
// row are rotated by row % 8 (as the 128-byte swizzle does), so the 8 rows a warp stages or
// reads at the same k fall in 8 different bank groups (unrotated they all hit one: 4x the
// shared-memory wavefronts).
__device__ __forceinline__ uint32_t raw_offset(int row, int k) { return row * 128 + ((k ^ (row & 7)) << 4); }

// wgmma shared-memory descriptor: SWIZZLE_128B, given byte offsets.
__device__ __forceinline__ uint64_t make_desc(uint32_t smem_byte_addr, uint32_t lbo, uint32_t sbo) {
  uint64_t d = 0;
  d |= uint64_t((smem_byte_addr & 0x3FFFF) >> 4);
  d |= uint64_t(lbo >> 4) << 16;
  d |= uint64_t(sbo >> 4) << 32;
  d |= uint64_t(1) << 62;  // layout type 1: 128-byte swizzle
  return d;
}

// The descriptor of byte `off` past the one of `d`: only the start address field (bits 0-13,
// address >> 4) moves, and shared-memory addresses stay below 2^18 bytes, so the low word's
// add never carries into the LBO field. Descriptors built once per buffer and offset per
// k-step this way cost one uniform add per operand; built from each address (make_desc per
// wgmma) they cost ~10 uniform instructions per wgmma, ~14% of the bf16 sparse kernel's.
__device__ __forceinline__ uint64_t desc_at(uint64_t d, uint32_t off) {
  const uint32_t lo = static_cast<uint32_t>(d) + (off >> 4);
  return (d & 0xFFFFFFFF00000000ull) | lo;
}

}  // namespace mla_backend::wgmma
