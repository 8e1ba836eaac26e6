// Pieces shared by the decode kernels (csrc/decode_mma.cuh: mma.sync, 16- to 64-row tiles;
// csrc/decode_wgmma.cu: wgmma, 64-row tiles; dense and sparse): parameters, small device helpers, the
// planner and the combine kernel. Schedule: docs/kernels/dense_decode.md.
#pragma once

#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "common.h"

namespace mla_backend {
namespace dense {

constexpr int kDqk = 576;
constexpr int kDv = 512;
constexpr int kPage = 64;
constexpr int kChunksPerRow = kDqk * 2 / 16;  // 72 16-byte chunks per token
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
  const float* kv_scale_ptr;  // fp8 cache: per-tensor scale on the device, or nullptr ...
  float kv_scale_value;       // ... then this value
  float scale_log2;
  bool causal;
  // Sparse (DSA) attention: request r of the plan is query group r = (b, s) = (r / group_s_q,
  // r % group_s_q) with `rows` = H query rows; its keys are the cache slots listed in
  // indices[b, s, 0 .. len) (len = min(topk_length[b], topk), or topk), slot = block * 64 +
  // offset; a slot outside [0, num_slots) is skipped. Dense: indices == nullptr, group_s_q 1.
  const int* indices = nullptr;
  int64_t idx_stride_b = 0, idx_stride_s = 0;
  const int* topk_length = nullptr;
  int topk = 0;
  int group_s_q = 1;
  int64_t num_slots = 0;
  // Uniform sparse plans (see plan_start): units per request (0: the plan is in meta) and
  // units per CTA
  int uniform_units = 0;
  int units_per_cta = 0;
};

// The fields every decode entry point (dense and sparse) fills alike: q, the cache, the
// plan's buffers, out / lse, the grid and the softmax scale in the log2 domain.
inline DecodeParams decode_params(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& metadata,
                                  at::Tensor& partial_out, at::Tensor& partial_lse, at::Tensor& out,
                                  at::Tensor& lse, int64_t num_ctas, double softmax_scale) {
  DecodeParams p;
  p.q = q.data_ptr();
  p.q_stride_b = q.stride(0); p.q_stride_s = q.stride(1); p.q_stride_h = q.stride(2);
  p.kv = kv_cache.data_ptr();
  p.meta = metadata.data_ptr<int>();
  p.part_out = partial_out.data_ptr<float>();
  p.part_lse = partial_lse.data_ptr<float>();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.num_ctas = int(num_ctas);
  p.scale_log2 = float(softmax_scale * 1.4426950408889634);
  return p;
}

// Sparse: the index list of query group r and its length (entries past it, and slots outside
// [0, num_slots), are skipped like -1; the wgmma producer checks them).
__device__ __forceinline__ const int* sparse_group_indices(const DecodeParams& p, int r) {
  return p.indices + int64_t(r / p.group_s_q) * p.idx_stride_b + int64_t(r % p.group_s_q) * p.idx_stride_s;
}
__device__ __forceinline__ int sparse_group_len(const DecodeParams& p, int r) {
  return p.topk_length != nullptr ? min(max(__ldg(p.topk_length + r / p.group_s_q), 0), p.topk) : p.topk;
}

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

// 16 e4m3 values (one 16-byte chunk) -> 16 values of T (8 packed pairs), each rounded once
// from the float32 product value * `scale`, as formats.py dequantizes. (A bit-level
// conversion with one conversion-pipe instruction per pair instead of two, but 9
// instructions instead of 6, was 15-25% slower: the producer is bound by its instruction
// count, not by that pipe; docs/kernels/sparse_decode.md, v5.)
template <typename T>
__device__ __forceinline__ void convert_e4m3x16(uint4 raw, float scale, uint32_t* packed) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __half2_raw hr =
          __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>((w[j] >> (16 * h)) & 0xFFFF), __NV_E4M3);
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&hr));
      packed[j * 2 + h] = Mma<T>::pack(f.x * scale, f.y * scale);
    }
  }
}
// max that returns NaN when either input is (fmaxf returns the other one)
__device__ __forceinline__ float fmax_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
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

// The plan's schedule: P[r] = the first unit of request r (P[batch] = all units), U = units
// per CTA. A plan from the planner kernel keeps P[0..batch] and U in p.meta. A uniform sparse
// plan (every request topk entries: no topk_length) has P[r] = r * uniform_units and U from
// the host: no planner launch, and no chain of dependent loads of P (log2(batch) of them to
// find a CTA's first request) before a CTA's first copy. kMaybeUniform: the caller may run a
// uniform plan (the sparse kernels, the merge kernel); the dense kernels never do.
template <bool kMaybeUniform>
__device__ __forceinline__ int plan_start(const DecodeParams& p, int r) {
  return kMaybeUniform && p.uniform_units > 0 ? r * p.uniform_units : __ldg(p.meta + r);
}

// U, the plan's units per CTA
template <bool kMaybeUniform>
__device__ __forceinline__ int plan_units_per_cta(const DecodeParams& p) {
  return kMaybeUniform && p.uniform_units > 0 ? p.units_per_cta : __ldg(p.meta + p.batch + 1);
}

// This CTA's units [u_begin, u_end) under the plan (CTA blockIdx.x of every m-tile takes
// units [cU, cU + U)); false when it has none.
template <bool kMaybeUniform = false>
__device__ __forceinline__ bool cta_units(const DecodeParams& p, int& u_begin, int& u_end, int& U) {
  const int total = plan_start<kMaybeUniform>(p, p.batch);
  U = plan_units_per_cta<kMaybeUniform>(p);
  u_begin = blockIdx.x * U;
  u_end = min(u_begin + U, total);
  return u_begin < total;
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
template <bool kMaybeUniform>
__device__ __forceinline__ int plan_request_of_unit(const DecodeParams& p, int u) {
  return kMaybeUniform && p.uniform_units > 0 ? u / p.uniform_units : request_of_unit(p.meta, p.batch, u);
}

// The request pieces of units [u_begin, u_end) in order: fn(r, Pr, pg_begin, pg_end) with Pr =
// P[r] and the piece's units of request r at [pg_begin, pg_end) (counted from Pr).
template <bool kMaybeUniform, typename Fn>
__device__ __forceinline__ void for_each_piece(const DecodeParams& p, int u_begin, int u_end, Fn&& fn) {
  int r = plan_request_of_unit<kMaybeUniform>(p, u_begin);
  for (int u = u_begin; u < u_end;) {
    while (u >= plan_start<kMaybeUniform>(p, r + 1)) ++r;
    const int Pr = plan_start<kMaybeUniform>(p, r);
    const int pg_begin = u - Pr, pg_end = min(u_end, plan_start<kMaybeUniform>(p, r + 1)) - Pr;
    fn(r, Pr, pg_begin, pg_end);
    u = Pr + pg_end;
  }
}

// Merge the partials of requests that span CTAs; zero out requests with no keys.
// One 128-thread block per (row, request): warp g takes splits c = first + g (mod 4), each
// lane 16 columns (4 float4 per split), so 16 loads per lane are in flight; the warps'
// sums meet in shared memory. Blocks of unsplit requests exit at once.
// With more requests than CTAs (by_cta), blockIdx.y = c < num_ctas takes the one request that
// starts in CTA c's range and continues past it, if there is one (every split request starts
// in exactly one CTA), and the blocks after those zero the empty requests, one per thread:
// fewer blocks to launch (a launched block costs about as much as a unit of merging here).
constexpr int kCombineWarps = 4;
constexpr int kCombineThreads = 32 * kCombineWarps;

template <typename T>
__global__ void __launch_bounds__(kCombineThreads) dense_decode_combine_kernel(const __grid_constant__ DecodeParams p,
                                                                               bool by_cta) {
  __shared__ float4 s_acc[kCombineWarps - 1][4][32];
  __shared__ float s_red[kCombineWarps];
  pdl_wait();  // the decode kernel's partials
  const int row = blockIdx.x;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  auto P_at = [&](int r) { return plan_start<true>(p, r); };
  const int U = plan_units_per_cta<true>(p);
  int r = blockIdx.y;
  if (by_cta) {
    if (int(blockIdx.y) >= p.num_ctas) {  // empty requests: out = 0, lse = -inf
      const int rz = (int(blockIdx.y) - p.num_ctas) * kCombineThreads + tid;
      if (rz < p.batch && P_at(rz) == P_at(rz + 1)) {
        uint4* o = reinterpret_cast<uint4*>(static_cast<T*>(p.out) + (int64_t(rz) * p.rows + row) * kDv);
#pragma unroll 8
        for (int k = 0; k < kDv * int(sizeof(T)) / 16; ++k) o[k] = make_uint4(0u, 0u, 0u, 0u);
        p.lse[int64_t(rz) * p.rows + row] = -INFINITY;
      }
      return;
    }
    const int c = blockIdx.y, c_end = (c + 1) * U;
    if (c_end >= P_at(p.batch)) return;  // nothing continues past CTA c
    r = plan_request_of_unit<true>(p, c_end - 1);
    if (P_at(r) < c * U || P_at(r + 1) <= c_end) return;  // starts earlier, or ends in c
  }
  const int Pr = P_at(r), Pr1 = P_at(r + 1);
  T* out = static_cast<T*>(p.out) + (int64_t(r) * p.rows + row) * kDv;
  if (Pr == Pr1) {  // zero-length request (or no unit): out = 0, lse = -inf
    *reinterpret_cast<uint2*>(out + tid * 4) = make_uint2(Mma<T>::pack(0.f, 0.f), Mma<T>::pack(0.f, 0.f));
    if (tid == 0) p.lse[int64_t(r) * p.rows + row] = -INFINITY;
    return;
  }
  const int first = Pr / U, last = (Pr1 - 1) / U;
  if (first == last) return;  // written directly by its CTA
  auto slot_row = [&](int c) {
    const int slot = (c == first && Pr != c * U) ? 1 : 0;
    return (int64_t(c) * 2 + slot) * p.rows + row;
  };
  auto block_reduce = [&](float v, bool is_max) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float w = __shfl_xor_sync(0xffffffff, v, o);
      v = is_max ? fmax_nan(v, w) : v + w;
    }
    if (lane == 0) s_red[warp] = v;
    __syncthreads();
    v = s_red[0];
#pragma unroll
    for (int i = 1; i < kCombineWarps; ++i) v = is_max ? fmax_nan(v, s_red[i]) : v + s_red[i];
    __syncthreads();
    return v;
  };
  // max and sum of exp over the splits' lse, all threads striding over splits (a NaN lse, a
  // NaN in the keys, makes the row NaN: the max keeps it)
  float mx = -INFINITY;
  for (int c = first + tid; c <= last; c += 32 * kCombineWarps) mx = fmax_nan(mx, __ldg(p.part_lse + slot_row(c)));
  mx = block_reduce(mx, true);
  float wsum = 0.f;
  if (mx != -INFINITY)
    for (int c = first + tid; c <= last; c += 32 * kCombineWarps) wsum += __expf(__ldg(p.part_lse + slot_row(c)) - mx);
  wsum = block_reduce(wsum, false);
  float4 acc[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
  if (mx != -INFINITY) {
#pragma unroll 4
    for (int c = first + warp; c <= last; c += kCombineWarps) {
      const int64_t pr = slot_row(c);
      const float w = __expf(__ldg(p.part_lse + pr) - mx);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float4 v = __ldg(reinterpret_cast<const float4*>(p.part_out + pr * kDv + k * 128 + lane * 4));
        acc[k].x += w * v.x; acc[k].y += w * v.y; acc[k].z += w * v.z; acc[k].w += w * v.w;
      }
    }
  }
  if (warp > 0) {
#pragma unroll
    for (int k = 0; k < 4; ++k) s_acc[warp - 1][k][lane] = acc[k];
  }
  __syncthreads();
  if (warp != 0) return;
  const float inv = wsum != 0.f ? 1.f / wsum : 0.f;  // 0: no split had a key
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#pragma unroll
    for (int g = 0; g < kCombineWarps - 1; ++g) {
      const float4 v = s_acc[g][k][lane];
      acc[k].x += v.x; acc[k].y += v.y; acc[k].z += v.z; acc[k].w += v.w;
    }
    *reinterpret_cast<uint2*>(out + k * 128 + lane * 4) =
        make_uint2(Mma<T>::pack(acc[k].x * inv, acc[k].y * inv), Mma<T>::pack(acc[k].z * inv, acc[k].w * inv));
  }
  if (lane == 0) p.lse[int64_t(r) * p.rows + row] = wsum != 0.f ? mx + __logf(wsum) : -INFINITY;
}

// Launchers (host): tokens per work unit are 32 for the mma.sync kernel, 64 for wgmma.
constexpr int kUnitMma = 32;
constexpr int kUnitWgmma = 64;
void launch_decode_wgmma(const DecodeParams& p, bool bf16, bool fp8, cudaStream_t stream);
void launch_sparse_wgmma(const DecodeParams& p, bool fp8_ds_mla, bool combine, cudaStream_t stream);

template <typename T>
inline void launch_combine(const DecodeParams& p, cudaStream_t stream) {
  const int by_cta_blocks = p.num_ctas + (p.batch + kCombineThreads - 1) / kCombineThreads;
  const bool by_cta = by_cta_blocks < p.batch;
  launch_pdl(dense_decode_combine_kernel<T>, dim3(p.rows, by_cta ? by_cta_blocks : p.batch), dim3(kCombineThreads), 0,
             stream, p, by_cta);
}

}  // namespace dense
}  // namespace mla_backend
