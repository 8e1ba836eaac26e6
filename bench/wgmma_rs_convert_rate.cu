// Tensor-core rate of fp16 wgmmas whose A operand comes from registers, converted there from
// raw e4m3 bytes in shared memory, against the shared-memory (SS) forms the decode kernels use
// (docs/notes/2026-11-27-fp8-operand-measurements.md). Rate only: the data is arbitrary (no NaN
// codes). One CTA per SM, two warpgroups (as the seesaw's consumers), each issuing its own
// stream of 36 k16 steps per unit, with 1 or 3 wgmma groups in flight.
//   ss_n256     m64n256k16 SS (the decode kernels' O += P V)
//   ss_n64      m64n64k16 SS (their S = Q K^T)
//   rs_n64      m64n64k16 RS, A loaded as fp16 from shared memory without regard to bank
//               conflicts (a bound on the load form, not a reference)
//   rs_n64_e4m3 m64n64k16 RS, A converted from raw e4m3: one 16-byte load per row per 4 k-steps,
//               then cvt.rn.f16x2.e4m3x2 (the S^T = K Q^T form, Q's depth permuted to match)
// Build (sm_90a; CUTLASS headers as setup.py finds them, e.g. the cutlass_library wheel's
// source/include):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -Icsrc -I<cutlass include> -o wgmma_rs_convert_rate bench/wgmma_rs_convert_rate.cu
// Run:  ./wgmma_rs_convert_rate [iters=2000]   (prints the table twice)
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cute/arch/mma_sm90_gmma.hpp>

#include <cstdio>
#include <cstdlib>

#include "common/convert.cuh"
#include "wgmma/gmma.cuh"
#include "wgmma/smem_layout.cuh"

using namespace mla_backend;
using namespace mla_backend::wgmma;
namespace G = cute::SM90::GMMA;
using SS256 = G::MMA_64x256x16_F32F16F16_SS<G::Major::K, G::Major::K>;
using SS64 = G::MMA_64x64x16_F32F16F16_SS<G::Major::K, G::Major::K>;
using RS64 = G::MMA_64x64x16_F32F16F16_RS<G::Major::K, G::Major::K>;

constexpr int kSteps = 36;                 // k16 steps per unit: a 576-deep S
constexpr int kTileA = 64 * 64 * 2;        // one 64x64 fp16 chunk (8 KiB)
constexpr int kMicroSmem = 9 * kTileA * 2 + 64 * 576 + 1024;  // A tile, B tile (9 chunks each), raw page

// kInFlight: wgmma groups a warpgroup keeps in flight (wait<kInFlight> after each commit);
// RS modes keep kInFlight + 1 register buffers of A
template <int kMode, int kInFlight>
__global__ void __launch_bounds__(256, 1) micro(int iters, float* out) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int tid = threadIdx.x, wg = tid / 128, wtid = tid % 128;
  for (int i = tid; i < kMicroSmem - 1024; i += 256) smem[i] = (unsigned char)((i * 37 + 11) & 0x77);  // no NaN codes
  __syncthreads();
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t sA = base, sB = base + 9 * kTileA;
  const uint64_t dA = make_desc(sA, 16, 1024), dB = make_desc(sB, 16, 1024);
  constexpr int kAcc = kMode == 0 ? 128 : 32;
  float acc[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
  // the RS fragment rows of this thread: 16 w + lane / 4 and + 8; its 4-byte share of each
  // 16-byte group: lane % 4
  const int warp = wtid / 32, lane = wtid % 32;
  const int r0 = 16 * warp + lane / 4, q = lane % 4;
  const unsigned char* raw0 = smem + 18 * kTileA + r0 * 576;
  const unsigned char* raw1 = raw0 + 8 * 576;
  constexpr int kBufs = kInFlight + 1;
  static_assert(4 % kBufs == 0, "buffers must divide the 4 k-steps of a load");
  uint32_t a[kBufs][4];
  for (int it = 0; it < iters; ++it) {
#pragma unroll 1
    for (int k4 = 0; k4 < kSteps / 4; ++k4) {
      uint4 w0 = make_uint4(0, 0, 0, 0), w1 = w0;
      if constexpr (kMode == 3) {  // 4 k-steps' bytes of rows r0, r1
        w0 = *reinterpret_cast<const uint4*>(raw0 + 64 * k4 + 16 * q);
        w1 = *reinterpret_cast<const uint4*>(raw1 + 64 * k4 + 16 * q);
      }
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const int k = 4 * k4 + kk;
        uint32_t* ak = a[kk % kBufs];
        if constexpr (kMode == 2) {  // fp16 fragments straight from the A tile (layout ignored)
          const uint32_t* src = reinterpret_cast<const uint32_t*>(smem + (k % 9) * kTileA + r0 * 128 + 16 * q);
          ak[0] = src[0]; ak[1] = src[8 * 32]; ak[2] = src[1]; ak[3] = src[8 * 32 + 1];
        } else if constexpr (kMode == 3) {
          const uint32_t ws0[4] = {w0.x, w0.y, w0.z, w0.w}, ws1[4] = {w1.x, w1.y, w1.z, w1.w};
          const uint32_t x0 = ws0[kk], x1 = ws1[kk];
          const __half2_raw p0 = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x0 & 0xFFFF), __NV_E4M3);
          const __half2_raw p1 = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x1 & 0xFFFF), __NV_E4M3);
          const __half2_raw p2 = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x0 >> 16), __NV_E4M3);
          const __half2_raw p3 = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x1 >> 16), __NV_E4M3);
          ak[0] = uint32_t(p0.x) | (uint32_t(p0.y) << 16);
          ak[1] = uint32_t(p1.x) | (uint32_t(p1.y) << 16);
          ak[2] = uint32_t(p2.x) | (uint32_t(p2.y) << 16);
          ak[3] = uint32_t(p3.x) | (uint32_t(p3.y) << 16);
        }
        fence_regs<kAcc>(acc);
        cute::warpgroup_arrive();
        const uint32_t koff = (k / 4) * kTileA + (k % 4) * 32;  // k16 step inside the 64-col chunks
        if constexpr (kMode == 0) {
          gmma_ss<SS256>(desc_at(dA, koff % (9 * kTileA)), desc_at(dB, koff % (9 * kTileA)), acc, true,
                         std::make_index_sequence<kAcc>{});
        } else if constexpr (kMode == 1) {
          gmma_ss<SS64>(desc_at(dA, koff), desc_at(dB, koff), acc, true, std::make_index_sequence<kAcc>{});
        } else {
          gmma_rs<RS64>(ak, desc_at(dB, koff), acc, true, std::make_index_sequence<kAcc>{});
        }
        cute::warpgroup_commit_batch();
        cute::warpgroup_wait<kInFlight>();  // the oldest buffer's wgmma is done: its A registers are free
        fence_regs<kAcc>(acc);
      }
    }
  }
  cute::warpgroup_wait<0>();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kAcc; ++i) s += acc[i];
  if (s == 12345.f) out[blockIdx.x * 256 + tid] = s;  // keeps the work alive
  (void)wg;
}

template <int kMode, int kInFlight>
double run(int iters, int sms, float* out) {
  auto k = micro<kMode, kInFlight>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kMicroSmem);
  k<<<sms, 256, kMicroSmem>>>(2, out);  // warm-up
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0);
  k<<<sms, 256, kMicroSmem>>>(iters, out);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0.f;
  cudaEventElapsedTime(&ms, e0, e1);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) { printf("mode %d: %s\n", kMode, cudaGetErrorString(err)); return 0; }
  const double n = kMode == 0 ? 256 : 64;
  const double flops = 2.0 * 64 * n * 16 * kSteps * double(iters) * 2 /* warpgroups */ * sms;
  return flops / (ms * 1e-3) / 1e12;
}

int main(int argc, char** argv) {
  const int iters = argc > 1 ? atoi(argv[1]) : 2000;
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* out = nullptr;
  cudaMalloc(&out, sms * 256 * sizeof(float));
  for (int rep = 0; rep < 2; ++rep) {
    printf("TF/s (fp16 wgmma, %d CTAs x 2 warpgroups, %d units of 36 k-steps each):\n", sms, iters);
    printf("  in flight:      1       3\n");
    printf("  ss_n256      %6.1f  %6.1f\n", run<0, 1>(iters, sms, out), run<0, 3>(iters, sms, out));
    printf("  ss_n64       %6.1f  %6.1f\n", run<1, 1>(iters, sms, out), run<1, 3>(iters, sms, out));
    printf("  rs_n64       %6.1f  %6.1f\n", run<2, 1>(iters, sms, out), run<2, 3>(iters, sms, out));
    printf("  rs_n64_e4m3  %6.1f  %6.1f\n", run<3, 1>(iters, sms, out), run<3, 3>(iters, sms, out));
  }
  return 0;
}
