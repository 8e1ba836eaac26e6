// Pieces shared by the dense decode kernels (csrc/dense_decode.cu: mma.sync, rows <= 32;
// csrc/dense_decode_sm90.cu: wgmma, 64-row tiles): parameters, small device helpers, the
// planner and the combine kernel. Schedule: docs/kernels/dense_decode.md.
#pragma once

#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.h"

namespace mla_backend {
namespace dense {

constexpr int kDqk = 576;
constexpr int kDv = 512;
constexpr int kPage = 64;
constexpr int kSmemRow = kDqk + 8;        // padded row: 1168 B = 73 16-B chunks (odd: no bank conflicts)
constexpr int kChunksPerRow = kDqk * 2 / 16;  // 72 16-byte chunks per token
constexpr int kWarpsN = 4;                // warps splitting keys (S) and output columns (PV)
constexpr float kLn2 = 0.69314718055994530942f;

struct DecodeParams {
  const void* q;
  int64_t q_stride_b, q_stride_s, q_stride_h;
  const void* kv;
  int64_t kv_stride_block, kv_stride_tok;
  int64_t num_blocks;
  const int* block_table;
  int64_t bt_stride;
  int max_blocks;
  const int* seq_lens;
  const int* meta;  // P[0..B], U at [B+1]
  float* part_out;  // [2C][rows][512]
  float* part_lse;  // [2C][rows]
  void* out;        // [B][rows][512]
  float* lse;       // [B][rows]
  int batch, s_q, heads, rows, num_ctas;
  float scale_log2;
  bool causal;
};

template <typename T> struct Mma;

template <> struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float x, float y) {
    __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

template <> struct Mma<__half> {
  static __device__ __forceinline__ void run(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float x, float y) {
    __half2 v = __floats2half2_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// 16-byte async copy; src_bytes = 0 zero-fills the destination without reading.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
               "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Request owning unit u: the last r with P[r] <= u (skips empty requests).
__device__ __forceinline__ int request_of_unit(const int* P, int batch, int u) {
  int lo = 0, hi = batch;  // P[lo] <= u < P[hi] holds for u < P[batch]
  while (hi - lo > 1) {
    int mid = (lo + hi) >> 1;
    if (__ldg(P + mid) <= u) lo = mid; else hi = mid;
  }
  return lo;
}

// Merge the partials of requests that span CTAs; zero out requests with no keys.
template <typename T>
__global__ void __launch_bounds__(128) dense_decode_combine_kernel(const __grid_constant__ DecodeParams p) {
  const int row = blockIdx.x, r = blockIdx.y;
  const int* P = p.meta;
  const int U = __ldg(P + p.batch + 1);
  const int Pr = __ldg(P + r), Pr1 = __ldg(P + r + 1);
  T* out = static_cast<T*>(p.out) + (int64_t(r) * p.rows + row) * kDv;
  const int col = threadIdx.x * 4;
  if (Pr == Pr1) {  // zero-length request (or no unit): out = 0, lse = -inf
    *reinterpret_cast<uint2*>(out + col) = make_uint2(Mma<T>::pack(0.f, 0.f), Mma<T>::pack(0.f, 0.f));
    if (threadIdx.x == 0) p.lse[int64_t(r) * p.rows + row] = -INFINITY;
    return;
  }
  const int first = Pr / U, last = (Pr1 - 1) / U;
  if (first == last) return;  // written directly by its CTA
  auto slot_row = [&](int c) {
    const int slot = (c == first && Pr != c * U) ? 1 : 0;
    return (int64_t(c) * 2 + slot) * p.rows + row;
  };
  float mx = -INFINITY;
  for (int c = first; c <= last; ++c) mx = fmaxf(mx, p.part_lse[slot_row(c)]);
  float acc[4] = {0.f, 0.f, 0.f, 0.f}, wsum = 0.f;
  if (mx != -INFINITY) {
    for (int c = first; c <= last; ++c) {
      const int64_t pr = slot_row(c);
      const float w = __expf(p.part_lse[pr] - mx);
      wsum += w;
      const float4 v = *reinterpret_cast<const float4*>(p.part_out + pr * kDv + col);
      acc[0] += w * v.x; acc[1] += w * v.y; acc[2] += w * v.z; acc[3] += w * v.w;
    }
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  *reinterpret_cast<uint2*>(out + col) =
      make_uint2(Mma<T>::pack(acc[0] * inv, acc[1] * inv), Mma<T>::pack(acc[2] * inv, acc[3] * inv));
  if (threadIdx.x == 0) p.lse[int64_t(r) * p.rows + row] = wsum > 0.f ? mx + __logf(wsum) : -INFINITY;
}

// Launchers (host): tokens per work unit are 32 for the mma.sync kernel, 64 for wgmma.
constexpr int kUnitMma = 32;
constexpr int kUnitWgmma = 64;
void launch_decode_wgmma(const DecodeParams& p, bool bf16, cudaStream_t stream);

template <typename T>
inline void launch_combine(const DecodeParams& p, cudaStream_t stream) {
  dense_decode_combine_kernel<T><<<dim3(p.rows, p.batch), 128, 0, stream>>>(p);
  MLA_CHECK_LAUNCH();
}

}  // namespace dense
}  // namespace mla_backend
