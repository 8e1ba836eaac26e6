// The stores of split partials of O in the attention kernels' epilogues and their loads in the
// combine, for either element type (float, or 16-bit: DensePartial in params.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "common/convert.cuh"

namespace mla_backend::splitkv {

// (a, b) at dst[0], dst[1]: a float2, or a packed pair rounded to Part (dst 8- / 4-byte aligned)
template <typename Part>
__device__ __forceinline__ void store_partial2(Part* dst, float a, float b) {
  if constexpr (std::is_same_v<Part, float>) *reinterpret_cast<float2*>(dst) = make_float2(a, b);
  else *reinterpret_cast<uint32_t*>(dst) = pack2<Part>(a, b);
}

// The 16 bytes at src (16-byte aligned) as float32, through the read-only cache: 4 float32
// values, or 8 16-bit ones (v[0]: the first 4, v[1]: the next 4)
template <typename Part>
__device__ __forceinline__ void load_partials_16B(const Part* src, float4 (&v)[16 / sizeof(Part) / 4]) {
  if constexpr (std::is_same_v<Part, float>) {
    v[0] = __ldg(reinterpret_cast<const float4*>(src));
  } else {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src));
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
    float2 f[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (std::is_same_v<Part, __nv_bfloat16>)
        f[i] = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
      else
        f[i] = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
    }
    v[0] = make_float4(f[0].x, f[0].y, f[1].x, f[1].y);
    v[1] = make_float4(f[2].x, f[2].y, f[3].x, f[3].y);
  }
}

}  // namespace mla_backend::splitkv
