// The wgmma instructions of the kernels (CuTe's SM90 GMMA atoms) and the register fence
// that keeps accumulators out of reach of the compiler while a wgmma runs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

#include <utility>

namespace mla_backend::wgmma {

namespace G = cute::SM90::GMMA;

// S = Q K^T (m64n64k16, both K-major) and O += P V (m64n256k16, V MN-major), A from shared
// memory (SS) or registers (RS)
template <typename T> struct Gmma;
template <> struct Gmma<__nv_bfloat16> {
  using QK_SS = G::MMA_64x64x16_F32BF16BF16_SS<G::Major::K, G::Major::K>;
  using QK_RS = G::MMA_64x64x16_F32BF16BF16_RS<G::Major::K, G::Major::K>;
  using PV_SS = G::MMA_64x256x16_F32BF16BF16_SS<G::Major::K, G::Major::MN>;
  using PV_RS = G::MMA_64x256x16_F32BF16BF16_RS<G::Major::K, G::Major::MN>;
};
template <> struct Gmma<__half> {
  using QK_SS = G::MMA_64x64x16_F32F16F16_SS<G::Major::K, G::Major::K>;
  using QK_RS = G::MMA_64x64x16_F32F16F16_RS<G::Major::K, G::Major::K>;
  using PV_SS = G::MMA_64x256x16_F32F16F16_SS<G::Major::K, G::Major::MN>;
  using PV_RS = G::MMA_64x256x16_F32F16F16_RS<G::Major::K, G::Major::MN>;
};

// one wgmma of atom Op on a flat accumulator array d (I: 0 .. its length - 1)
template <typename Op, size_t... I>
__device__ __forceinline__ void gmma_ss(uint64_t da, uint64_t db, float* d, bool accumulate,
                                        std::index_sequence<I...>) {
  Op::fma(da, db, d[I]..., accumulate ? G::ScaleOut::One : G::ScaleOut::Zero);
}
template <typename Op, size_t... I>
__device__ __forceinline__ void gmma_rs(const uint32_t* a, uint64_t db, float* d, bool accumulate,
                                        std::index_sequence<I...>) {
  Op::fma(a[0], a[1], a[2], a[3], db, d[I]..., accumulate ? G::ScaleOut::One : G::ScaleOut::Zero);
}

// N accumulator registers: no compiler-generated access moves across this point
template <int N>
__device__ __forceinline__ void fence_regs(float* d) {
#pragma unroll
  for (int i = 0; i < N; ++i) cute::warpgroup_fence_operand(d[i]);
}

}  // namespace mla_backend::wgmma
