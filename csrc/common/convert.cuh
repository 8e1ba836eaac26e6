// Conversions to 16-bit values: two floats to a packed pair, 16 fp8 e4m3 values to 8 pairs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace mla_backend {

// (x, y) rounded to T (bf16 or fp16), packed in one 32-bit register (x in the low half)
template <typename T>
__device__ __forceinline__ uint32_t pack2(float x, float y);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float x, float y) {
  __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float x, float y) {
  __half2 v = __floats2half2_rn(x, y);
  return *reinterpret_cast<uint32_t*>(&v);
}

// e4m3 pair k (0..7) of a 16-byte chunk (bytes 2k and 2k + 1) as an fp16 pair: exact (every
// e4m3 value is an fp16 value), one conversion instruction
__device__ __forceinline__ __half2_raw e4m3_pair_to_f16(const uint4& raw, int k) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  return __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>((w[k / 2] >> (16 * (k % 2))) & 0xFFFF),
                                    __NV_E4M3);
}

// 16 e4m3 values (one 16-byte chunk) -> 16 values of T (8 packed pairs), each rounded once
// from the float32 product value * `scale`, as formats.py dequantizes. (A bit-level
// conversion with one conversion-pipe instruction per pair instead of two, but 9
// instructions instead of 6, is slower: the producers are bound by their instruction count,
// not by that pipe.)
template <typename T>
__device__ __forceinline__ void convert_e4m3x16(uint4 raw, float scale, uint32_t* packed) {
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const __half2_raw hr = e4m3_pair_to_f16(raw, k);
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&hr));
    packed[k] = pack2<T>(f.x * scale, f.y * scale);
  }
}

// 16 e4m3 values -> 16 fp16 values (8 packed pairs), exactly: no float round trip
__device__ __forceinline__ void convert_e4m3x16_to_f16(uint4 raw, uint32_t* packed) {
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const __half2_raw hr = e4m3_pair_to_f16(raw, k);
    packed[k] = uint32_t(hr.x) | (uint32_t(hr.y) << 16);
  }
}

}  // namespace mla_backend
