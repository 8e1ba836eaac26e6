// Precision of S = q . k over a 576-deep row, k in e4m3 (its exact values), three ways on wgmma
// (docs/notes/2026-11-27-fp8-operand-measurements.md):
//   bf16  q bf16, k converted to bf16 (exact), m64n64k16 (the decode kernels' S);
//   f8 1  q split under a per-row power of two s into hi = e4m3(q s), lo = e4m3(q s - hi), so
//         hi + lo = q s exactly for a bf16 q of the row's range, and m64n64k32 e4m3 wgmmas
//         hi.k and lo.k into one accumulator;
//   f8 2  the same into two accumulators, added in fp32 at the end.
// Reference in double. One warpgroup, one 64 x 64 tile per case, four draws per case. Prints
// the largest |S - ref| relative to its row's sum |q||k|, and the largest |lse - lse_ref| over
// rows (softmax scale 576^-0.5).
// Build (as bench/wgmma_rs_convert_rate.cu):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -Icsrc -I<cutlass include> -o wgmma_fp8_s_precision bench/wgmma_fp8_s_precision.cu
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <cute/arch/mma_sm90_gmma.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "wgmma/gmma.cuh"
#include "wgmma/smem_layout.cuh"

using namespace mla_backend::wgmma;
using F8 = G::MMA_64x64x32_F32E4M3E4M3_SS_TN<>;
using B16 = G::MMA_64x64x16_F32BF16BF16_SS<G::Major::K, G::Major::K>;
constexpr int D = 576, DP = 640;           // depth, padded to 5 chunks of 128 bytes (fp8)
constexpr int kF8Tile = 64 * DP;           // one fp8 64 x 640 tile, SW128 chunks of 128 bytes
constexpr int kB16Tile = 64 * D * 2;       // one bf16 64 x 576 tile (9 chunks of 64 columns)

__host__ __device__ inline int f8_off(int row, int col) {  // byte (row, col) of an fp8 SW128 tile
  return (col >> 7) * 8192 + row * 128 + ((((col & 127) >> 4) ^ (row & 7)) << 4) + (col & 15);
}
__host__ __device__ inline int b16_off(int row, int col) {  // as sw128_offset
  return (col >> 6) * 8192 + row * 128 + ((((col & 63) >> 3) ^ (row & 7)) << 4) + (col & 7) * 2;
}

// mode 0: bf16; 1: fp8 one accumulator; 2: fp8 two accumulators. in: tiles (mode 0: qb, kb;
// else qhi, qlo, k8); out [64][64] fp32 (S times 1 / row scale for fp8)
__global__ void s_kernel(int mode, const unsigned char* tiles, const float* inv_row_scale, float* out) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int tid = threadIdx.x;
  const int bytes = mode == 0 ? 2 * kB16Tile : 3 * kF8Tile;
  for (int i = tid; i < bytes; i += 128) smem[i] = tiles[i];
  __syncthreads();
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  float a[32], b[32];
  for (int i = 0; i < 32; ++i) a[i] = b[i] = 0.f;
  fence_regs<32>(a);
  fence_regs<32>(b);
  cute::warpgroup_arrive();
  if (mode == 0) {
    const uint64_t dq = make_desc(base, 16, 1024), dk = make_desc(base + kB16Tile, 16, 1024);
    for (int c = 0; c < 9; ++c)
      for (int k = 0; k < 4; ++k) {
        const uint32_t off = c * 8192 + k * 32;
        gmma_ss<B16>(desc_at(dq, off), desc_at(dk, off), a, c || k, std::make_index_sequence<32>{});
      }
  } else {
    const uint64_t dh = make_desc(base, 16, 1024), dl = make_desc(base + kF8Tile, 16, 1024),
                   dk = make_desc(base + 2 * kF8Tile, 16, 1024);
    for (int c = 0; c < 5; ++c)
      for (int k = 0; k < 4; ++k) {
        const uint32_t off = c * 8192 + k * 32;
        gmma_ss<F8>(desc_at(dh, off), desc_at(dk, off), a, c || k, std::make_index_sequence<32>{});
        if (mode == 1) gmma_ss<F8>(desc_at(dl, off), desc_at(dk, off), a, true, std::make_index_sequence<32>{});
        else gmma_ss<F8>(desc_at(dl, off), desc_at(dk, off), b, c || k, std::make_index_sequence<32>{});
      }
  }
  cute::warpgroup_commit_batch();
  cute::warpgroup_wait<0>();
  fence_regs<32>(a);
  fence_regs<32>(b);
  const int w = tid / 32, l = tid % 32, r0 = 16 * w + l / 4, q = l % 4;
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 4; ++j) {
      const int row = r0 + (j >= 2 ? 8 : 0), col = 8 * i + 2 * q + (j & 1);
      const float v = mode == 2 ? a[4 * i + j] + b[4 * i + j] : a[4 * i + j];
      out[row * 64 + col] = mode == 0 ? v : v * inv_row_scale[row];
    }
}

static float e4m3_val(unsigned char c) {
  __nv_fp8_e4m3 x; x.__x = c; return float(x);
}
static unsigned char to_e4m3(float v) { return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3); }

int main() {
  std::mt19937 rng(1234);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> code(0, 255);
  const char* names[] = {"randn q, randn k", "q x 1e3", "every e4m3 code in k", "q rows 1e-4..1e2 per element",
                         "q x 1e-3, k tiny codes"};
  unsigned char *d_tiles; float *d_out, *d_inv;
  cudaMalloc(&d_tiles, 3 * kF8Tile + 2 * kB16Tile); cudaMalloc(&d_out, 64 * 64 * 4); cudaMalloc(&d_inv, 64 * 4);
  const int smem = 3 * kF8Tile + 2048;
  cudaFuncSetAttribute(s_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 2 * kB16Tile + 2048);
  printf("%-32s %12s %12s %12s | %10s %10s %10s\n", "case", "relS bf16", "relS f8 1acc", "relS f8 2acc", "lse bf16", "lse f8 1", "lse f8 2");
  for (int cs = 0; cs < 5; ++cs) {
    for (int rep = 0; rep < 4; ++rep) {
      std::vector<float> qv(64 * D), kv(64 * D);
      std::vector<unsigned char> k8(64 * D);
      for (int t = 0; t < 64; ++t)
        for (int d = 0; d < D; ++d) {
          unsigned char c;
          if (cs == 2) { do c = code(rng); while ((c & 0x7F) == 0x7F); }
          else if (cs == 4) { c = (unsigned char)(code(rng) & 0x8F); }  // exponent 0-1: subnormals and the smallest normals
          else c = to_e4m3(nd(rng) * 100.f);
          k8[t * D + d] = c; kv[t * D + d] = e4m3_val(c);
        }
      for (int r = 0; r < 64; ++r)
        for (int d = 0; d < D; ++d) {
          float x = nd(rng);
          if (cs == 1) x *= 1e3f;
          if (cs == 3) x *= powf(10.f, -4.f + 6.f * float((r * 131 + d * 7) % 97) / 96.f);
          if (cs == 4) x *= 1e-3f;
          qv[r * D + d] = __bfloat162float(__float2bfloat16(x));  // q is bf16
        }
      // tiles
      std::vector<unsigned char> t16(2 * kB16Tile, 0), t8(3 * kF8Tile, 0);
      std::vector<float> inv(64);
      for (int r = 0; r < 64; ++r) {
        float amax = 0.f;
        for (int d = 0; d < D; ++d) amax = fmaxf(amax, fabsf(qv[r * D + d]));
        const int e = amax > 0.f ? int(floorf(log2f(448.f / amax))) : 0;
        const float s = ldexpf(1.f, e);
        inv[r] = ldexpf(1.f, -e);
        for (int d = 0; d < D; ++d) {
          const __nv_bfloat16 qb = __float2bfloat16(qv[r * D + d]);
          memcpy(&t16[b16_off(r, d)], &qb, 2);
          const float xs = qv[r * D + d] * s;  // exact: power of two
          const unsigned char hi = to_e4m3(xs);
          const unsigned char lo = to_e4m3(xs - e4m3_val(hi));
          t8[f8_off(r, d)] = hi;
          t8[kF8Tile + f8_off(r, d)] = lo;
        }
      }
      for (int t = 0; t < 64; ++t)
        for (int d = 0; d < D; ++d) {
          const __nv_bfloat16 kb = __float2bfloat16(kv[t * D + d]);
          memcpy(&t16[kB16Tile + b16_off(t, d)], &kb, 2);
          t8[2 * kF8Tile + f8_off(t, d)] = k8[t * D + d];
        }
      double rel[3] = {0, 0, 0}, dlse[3] = {0, 0, 0};
      std::vector<float> s(64 * 64);
      for (int mode = 0; mode < 3; ++mode) {
        const std::vector<unsigned char>& src = mode == 0 ? t16 : t8;
        cudaMemcpy(d_tiles, src.data(), src.size(), cudaMemcpyHostToDevice);
        cudaMemcpy(d_inv, inv.data(), 64 * 4, cudaMemcpyHostToDevice);
        s_kernel<<<1, 128, mode == 0 ? 2 * kB16Tile + 2048 : smem>>>(mode, d_tiles, d_inv, d_out);
        cudaError_t err = cudaDeviceSynchronize();
        if (err != cudaSuccess) { printf("error %s\n", cudaGetErrorString(err)); return 1; }
        cudaMemcpy(s.data(), d_out, 64 * 64 * 4, cudaMemcpyDeviceToHost);
        for (int r = 0; r < 64; ++r) {
          std::vector<double> ref(64);
          double mx = -1e300, mr = -1e300;
          const double sc = 1.0 / sqrt(576.0);
          for (int t = 0; t < 64; ++t) {
            double acc = 0, mag = 0;
            for (int d = 0; d < D; ++d) { acc += double(qv[r * D + d]) * kv[t * D + d]; mag += fabs(double(qv[r * D + d]) * kv[t * D + d]); }
            ref[t] = acc;
            if (mag > 0) rel[mode] = fmax(rel[mode], fabs(s[r * 64 + t] - acc) / mag);
            mx = fmax(mx, acc * sc); mr = fmax(mr, double(s[r * 64 + t]) * sc);
          }
          double se = 0, sr = 0;
          for (int t = 0; t < 64; ++t) { se += exp(double(s[r * 64 + t]) * sc - mr); sr += exp(ref[t] * sc - mx); }
          dlse[mode] = fmax(dlse[mode], fabs((mr + log(se)) - (mx + log(sr))));
        }
      }
      printf("%-32s %12.3e %12.3e %12.3e | %10.2e %10.2e %10.2e\n", rep == 0 ? names[cs] : "", rel[0], rel[1], rel[2], dlse[0], dlse[1], dlse[2]);
    }
  }
  return 0;
}
