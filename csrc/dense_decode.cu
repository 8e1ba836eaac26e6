// Dense paged MLA decode: the planner, the host entry point, and the mma.sync m16n8k16
// kernel for 16-row tiles (rows = s_q * H <= 16: TP8/TP16 head counts pay for no padded
// MMA rows; larger tiles run on the wgmma kernel, dense_decode_sm90.cu).
// Schedule and numbers: docs/kernels/dense_decode.md.
//
// Work unit: 32 consecutive tokens of one request (half a 64-token page). The planner
// writes unit prefix sums P[0..B] and U (units per CTA); CTA c walks units [cU, cU+U),
// crossing request boundaries. A request wholly inside one CTA is written straight to
// out/lse; a request spanning CTAs leaves normalised partials (slot 0 if it is the CTA's
// first request, else slot 1) that the combine kernel merges by lse.
#include <cuda_fp8.h>

#include "dense_decode_common.cuh"
#include "ops.h"

namespace mla_backend {
namespace {

using namespace dense;
constexpr int kUnit = kUnitMma;  // tokens per work unit of this kernel
constexpr int kSmemRow = kDqk + 8;  // padded row: 1168 B = 73 16-B chunks (odd: no bank conflicts)
constexpr int kWarpsN = 4;          // warps splitting keys (S) and output columns (PV)
constexpr int kPRow = kUnit + 8;  // padded P row: 80 B = 5 chunks

// kFp8: the cache holds per-tensor-scaled float8 e4m3 (576 bytes per token). cp.async
// stages the raw bytes; at consume time every thread converts the unit into one bf16/fp16
// tile, which S and PV read exactly as in the 16-bit case. Every e4m3 value is exact in
// bf16 and fp16, so the conversion rounds nothing: kv_scale is folded into the softmax
// scale (S = kv_scale * q.k8) and into the output (O = kv_scale * P.v8) instead.
template <typename T, int kRows, bool kFp8 = false>
struct DecodeConfig {
  static constexpr int kWarpsM = kRows / 16;
  static constexpr int kWarps = kWarpsM * kWarpsN;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kStages = 2;        // 95 KiB of shared memory: two CTAs per SM
  static constexpr int kMinCtasPerSm = 2;
  static constexpr int kColsPerWarp = kDv / kWarpsN;       // 128
  static constexpr int kNTiles = kColsPerWarp / 8;          // 16
  static constexpr int kKeysPerWarp = kUnit / kWarpsN;      // 8: one n-tile of S
  static constexpr size_t kSmemQ = size_t(kRows) * kSmemRow * sizeof(T);
  static constexpr size_t kSmemTile = size_t(kUnit) * kSmemRow * sizeof(T);
  static constexpr size_t kSmemStage = kFp8 ? size_t(kUnit) * kDqk : kSmemTile;  // bytes per stage
  static constexpr size_t kSmemKV = kStages * kSmemStage + (kFp8 ? kSmemTile : 0);
  static constexpr size_t kSmemP = size_t(kRows) * kPRow * sizeof(T);
  static constexpr size_t kSmemRed = size_t(2) * kWarpsN * kRows * sizeof(float);
  static constexpr size_t kSmem = kSmemQ + kSmemKV + kSmemP + kSmemRed;
  static_assert(kKeysPerWarp == 8, "S tile per warp is one 8-key n-tile");
};

template <typename T, int kRows, bool kFp8>
__global__ void __launch_bounds__(DecodeConfig<T, kRows, kFp8>::kThreads, DecodeConfig<T, kRows, kFp8>::kMinCtasPerSm)
dense_decode_kernel(const __grid_constant__ DecodeParams p) {
  using Cfg = DecodeConfig<T, kRows, kFp8>;
  constexpr int kStages = Cfg::kStages;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  unsigned char* sStages = smem + Cfg::kSmemQ;  // kStages units: 16-bit rows, or fp8 bytes
  T* sKfp8 = reinterpret_cast<T*>(sStages + kStages * Cfg::kSmemStage);  // fp8: dequantized unit
  T* sP = reinterpret_cast<T*>(smem + Cfg::kSmemQ + Cfg::kSmemKV);
  float* sRedMax = reinterpret_cast<float*>(smem + Cfg::kSmemQ + Cfg::kSmemKV + Cfg::kSmemP);
  float* sRedSum = sRedMax + kWarpsN * kRows;

  pdl_launch_dependents();
  pdl_wait();  // the plan, q and the cache are written by earlier kernels
  const int* P = p.meta;
  const int cta = blockIdx.x;
  const int row0 = blockIdx.y * kRows;
  int u_begin, u_end, U;
  if (!cta_units(p, u_begin, u_end, U)) return;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / kWarpsN, wn = warp % kWarpsN;
  const float kv_scale = kFp8 ? (p.kv_scale_ptr != nullptr ? __ldg(p.kv_scale_ptr) : p.kv_scale_value) : 1.f;
  const float scale_log2 = p.scale_log2 * kv_scale;  // S = kv_scale * (q . k_fp8)
  const unsigned char* kv = static_cast<const unsigned char*>(p.kv);  // byte addressing
  constexpr int kElemBytes = kFp8 ? 1 : int(sizeof(T));
  constexpr int kRowChunks = kDqk * kElemBytes / 16;  // 16-byte chunks per cached token

  // ---- producer: async load of one unit's 32 tokens into a stage
  int r_load = request_of_unit(P, p.batch, u_begin);
  auto load_unit = [&](int u, int stage) {
    while (u >= __ldg(P + r_load + 1)) ++r_load;
    const int tok0 = (u - __ldg(P + r_load)) * kUnit;
    const int n_valid = min(kUnit, __ldg(p.seq_lens + r_load) - tok0);
    const int blk_idx = tok0 / kPage;
    const bool blk_ok = blk_idx < p.max_blocks;
    const int blk = blk_ok ? __ldg(p.block_table + r_load * p.bt_stride + blk_idx) : 0;
    const unsigned char* base =
        kv + (int64_t(blk) * p.kv_stride_block + int64_t(tok0 % kPage) * p.kv_stride_tok) * kElemBytes;
    unsigned char* dst = sStages + stage * Cfg::kSmemStage;
    for (int i = tid; i < kUnit * kRowChunks; i += Cfg::kThreads) {
      const int t = i / kRowChunks, ch = i % kRowChunks;
      const bool ok = blk_ok && t < n_valid;  // zero-filled otherwise (never read)
      const unsigned char* src = ok ? base + int64_t(t) * p.kv_stride_tok * kElemBytes + ch * 16 : kv;
      const int dst_off = kFp8 ? t * kDqk + ch * 16 : (t * kSmemRow + ch * 8) * int(sizeof(T));
      cp_async_16(dst + dst_off, src, ok ? 16 : 0);
    }
  };

  // ---- Q tile of request r into shared memory (plain loads; rows past `rows` are zero)
  const T* qbase = static_cast<const T*>(p.q);
  auto load_q = [&](int r) {
    for (int i = tid; i < kRows * kChunksPerRow; i += Cfg::kThreads) {
      const int m = i / kChunksPerRow, ch = i % kChunksPerRow;
      const int row = row0 + m;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (row < p.rows) {
        const int qi = row / p.heads, h = row % p.heads;
        v = __ldg(reinterpret_cast<const uint4*>(qbase + r * p.q_stride_b + qi * p.q_stride_s +
                                                 h * p.q_stride_h) + ch);
      }
      *reinterpret_cast<uint4*>(sQ + m * kSmemRow + ch * 8) = v;
    }
  };

  // prologue: STAGES-1 units in flight
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (u_begin + s < u_end) load_unit(u_begin + s, s);
    cp_async_commit();
  }

  int r_cur = request_of_unit(P, p.batch, u_begin);
  load_q(r_cur);

  // per-thread state: rows g = lane/4 and g + 8 of this warp's 16-row group
  const int g = lane >> 2, qd = lane & 3;
  const int lrow0 = wm * 16 + g, lrow1 = lrow0 + 8;  // local rows in the tile
  float o[Cfg::kNTiles][4];
  float m_run[2], l_run[2];
  auto reset_state = [&]() {
#pragma unroll
    for (int n = 0; n < Cfg::kNTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    m_run[0] = m_run[1] = -INFINITY;
    l_run[0] = l_run[1] = 0.f;
  };
  reset_state();

  auto epilogue = [&](int r) {
    // row sums: quad, then across the kWarpsN key-splitting warps
    float l0 = l_run[0], l1 = l_run[1];
    l0 += __shfl_xor_sync(0xffffffff, l0, 1); l0 += __shfl_xor_sync(0xffffffff, l0, 2);
    l1 += __shfl_xor_sync(0xffffffff, l1, 1); l1 += __shfl_xor_sync(0xffffffff, l1, 2);
    if (qd == 0) { sRedSum[wn * kRows + lrow0] = l0; sRedSum[wn * kRows + lrow1] = l1; }
    __syncthreads();
    float lt[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < kWarpsN; ++j) { lt[0] += sRedSum[j * kRows + lrow0]; lt[1] += sRedSum[j * kRows + lrow1]; }
    __syncthreads();  // sRedSum is read before the next epilogue writes it
    const int Pr = __ldg(P + r), Pr1 = __ldg(P + r + 1);
    const bool split = (Pr / U) != ((Pr1 - 1) / U);
    const int slot = Pr <= u_begin ? 0 : 1;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = row0 + (hr ? lrow1 : lrow0);
      if (row >= p.rows) continue;
      const float inv_l = lt[hr] > 0.f ? kv_scale / lt[hr] : 0.f;  // O = kv_scale * P.v
      const float lse_row = lt[hr] > 0.f ? (m_run[hr] + __log2f(lt[hr])) * kLn2 : -INFINITY;
      if (!split) {
        T* out = static_cast<T*>(p.out) + (int64_t(r) * p.rows + row) * kDv;
#pragma unroll
        for (int n = 0; n < Cfg::kNTiles; ++n) {
          const int col = wn * Cfg::kColsPerWarp + n * 8 + qd * 2;
          *reinterpret_cast<uint32_t*>(out + col) =
              Mma<T>::pack(o[n][hr * 2] * inv_l, o[n][hr * 2 + 1] * inv_l);
        }
        if (wn == 0 && qd == 0) p.lse[int64_t(r) * p.rows + row] = lse_row;
      } else {
        const int64_t prow = (int64_t(cta) * 2 + slot) * p.rows + row;
        float* po = p.part_out + prow * kDv;
#pragma unroll
        for (int n = 0; n < Cfg::kNTiles; ++n) {
          const int col = wn * Cfg::kColsPerWarp + n * 8 + qd * 2;
          *reinterpret_cast<float2*>(po + col) = make_float2(o[n][hr * 2] * inv_l, o[n][hr * 2 + 1] * inv_l);
        }
        if (wn == 0 && qd == 0) p.part_lse[prow] = lse_row;
      }
    }
  };

  int stage = 0;
  for (int u = u_begin; u < u_end; ++u) {
    if (u >= __ldg(P + r_cur + 1)) {
      epilogue(r_cur);
      while (u >= __ldg(P + r_cur + 1)) ++r_cur;
      load_q(r_cur);  // sQ is free: every warp passed the epilogue's barriers
      reset_state();
    }
    cp_async_wait<kStages - 2>();
    __syncthreads();  // unit u landed; every warp finished unit u-1 (its stage is reusable)
    {
      const int un = u + kStages - 1;
      if (un < u_end) load_unit(un, (stage + kStages - 1) % kStages);
      cp_async_commit();
    }
    const T* sK = reinterpret_cast<const T*>(sStages + stage * Cfg::kSmemStage);
    if constexpr (kFp8) {
      // convert the staged unit: 16 e4m3 values per chunk -> 16 values of T (exact)
      const unsigned char* src = sStages + stage * Cfg::kSmemStage;
      for (int i = tid; i < kUnit * (kDqk / 16); i += Cfg::kThreads) {
        const int t = i / (kDqk / 16), ch = i % (kDqk / 16);
        const uint4 raw = *reinterpret_cast<const uint4*>(src + t * kDqk + ch * 16);
        const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
        uint32_t packed[8];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(
                static_cast<__nv_fp8x2_storage_t>((w[j] >> (16 * h)) & 0xFFFF), __NV_E4M3);
            const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&hr));
            packed[j * 2 + h] = Mma<T>::pack(f.x, f.y);  // exact
          }
        }
        uint4* out = reinterpret_cast<uint4*>(sKfp8 + t * kSmemRow + ch * 16);
        out[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
        out[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
      }
      __syncthreads();
      sK = sKfp8;
    }
    const int tok0 = (u - __ldg(P + r_cur)) * kUnit;
    const int seq_len = __ldg(p.seq_lens + r_cur);

    // ---- S = Q K^T for 16 rows x 8 keys per warp, depth 576
    // two independent accumulators halve the dependent mma chain (36 k-steps)
    float s[4] = {0.f, 0.f, 0.f, 0.f}, s_odd[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int kk = 0; kk < kDqk / 16; kk += 2) {
      uint32_t b[4], a0[4], a1[4];
      ldmatrix_x4(b, sK + (wn * 8 + (lane & 7)) * kSmemRow + kk * 16 + (lane >> 3) * 8);
      ldmatrix_x4(a0, sQ + (wm * 16 + (lane & 15)) * kSmemRow + kk * 16 + (lane >> 4) * 8);
      ldmatrix_x4(a1, sQ + (wm * 16 + (lane & 15)) * kSmemRow + (kk + 1) * 16 + (lane >> 4) * 8);
      Mma<T>::run(s, a0, b[0], b[1]);
      Mma<T>::run(s_odd, a1, b[2], b[3]);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) s[e] += s_odd[e];
    // scale to log2 domain and mask keys past each row's limit
    float rmax[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = row0 + (hr ? lrow1 : lrow0);
      int limit = seq_len;
      if (p.causal) limit = seq_len - p.s_q + row / p.heads + 1;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int key = tok0 + wn * 8 + qd * 2 + e;
        float& v = s[hr * 2 + e];
        v = key < limit ? v * scale_log2 : -INFINITY;
      }
      float mx = fmaxf(s[hr * 2], s[hr * 2 + 1]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
      rmax[hr] = mx;
    }
    if (qd == 0) { sRedMax[wn * kRows + lrow0] = rmax[0]; sRedMax[wn * kRows + lrow1] = rmax[1]; }
    __syncthreads();
    float alpha[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int lr = hr ? lrow1 : lrow0;
      float mx = m_run[hr];
#pragma unroll
      for (int j = 0; j < kWarpsN; ++j) mx = fmaxf(mx, sRedMax[j * kRows + lr]);
      const float m_use = mx == -INFINITY ? 0.f : mx;  // nothing seen yet: avoid inf - inf
      alpha[hr] = exp2f(m_run[hr] - m_use);
      m_run[hr] = mx;
      const float p0 = exp2f(s[hr * 2] - m_use), p1 = exp2f(s[hr * 2 + 1] - m_use);
      l_run[hr] = l_run[hr] * alpha[hr] + p0 + p1;
      *reinterpret_cast<uint32_t*>(sP + lr * kPRow + wn * 8 + qd * 2) = Mma<T>::pack(p0, p1);
    }
#pragma unroll
    for (int n = 0; n < Cfg::kNTiles; ++n) {
      o[n][0] *= alpha[0]; o[n][1] *= alpha[0]; o[n][2] *= alpha[1]; o[n][3] *= alpha[1];
    }
    __syncthreads();

    // ---- O += P V for 16 rows x 128 columns per warp, depth 32 keys
#pragma unroll
    for (int ks = 0; ks < kUnit / 16; ++ks) {
      uint32_t a[4];
      ldmatrix_x4(a, sP + (wm * 16 + (lane & 15)) * kPRow + ks * 16 + (lane >> 4) * 8);
#pragma unroll
      for (int n = 0; n < Cfg::kNTiles; n += 2) {
        uint32_t b[4];
        const int krow = ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        const int col = wn * Cfg::kColsPerWarp + n * 8 + (lane >> 4) * 8;
        ldmatrix_x4_trans(b, sK + krow * kSmemRow + col);
        Mma<T>::run(o[n], a, b[0], b[1]);
        Mma<T>::run(o[n + 1], a, b[2], b[3]);
      }
    }
    stage = (stage + 1) % kStages;
  }
  cp_async_wait<0>();
  epilogue(r_cur);
}

template <typename T, int kRows, bool kFp8>
void launch_decode(const DecodeParams& p, cudaStream_t stream) {
  using Cfg = DecodeConfig<T, kRows, kFp8>;
  auto kernel = dense_decode_kernel<T, kRows, kFp8>;
  MLA_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(Cfg::kSmem)));
  dim3 grid(p.num_ctas, (p.rows + kRows - 1) / kRows);
  launch_pdl(kernel, grid, dim3(Cfg::kThreads), Cfg::kSmem, stream, p);
  launch_combine<T>(p, stream);
}

__global__ void __launch_bounds__(1024) plan_decode_kernel(const int* __restrict__ seq_lens, int batch,
                                                          int* __restrict__ meta, int num_ctas, int min_units,
                                                          int unit) {
  using Scan = cub::BlockScan<int, 1024>;
  __shared__ typename Scan::TempStorage tmp;
  pdl_launch_dependents();
  pdl_wait();  // seq_lens may come from the previous kernel
  __shared__ int carry;
  if (threadIdx.x == 0) { carry = 0; meta[0] = 0; }
  __syncthreads();
  for (int base = 0; base < batch; base += 1024) {
    const int b = base + threadIdx.x;
    const int len = b < batch ? max(seq_lens[b], 0) : 0;
    int units = (len + unit - 1) / unit, incl, agg;
    Scan(tmp).InclusiveSum(units, incl, agg);
    if (b < batch) meta[b + 1] = carry + incl;
    __syncthreads();
    if (threadIdx.x == 0) carry += agg;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const int total = carry;
    meta[batch + 1] = max((total + num_ctas - 1) / num_ctas, min_units);
  }
}


}  // namespace

void plan_decode(const at::Tensor& seq_lens, at::Tensor& metadata, int64_t num_ctas, int64_t min_units,
                 int64_t unit_tokens) {
  TORCH_CHECK(seq_lens.is_cuda() && seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(),
              "plan_decode: seq_lens must be contiguous int32 on CUDA");
  TORCH_CHECK(metadata.is_cuda() && metadata.scalar_type() == at::kInt &&
                  metadata.numel() == seq_lens.numel() + 2,
              "plan_decode: metadata must be int32 [batch + 2]");
  TORCH_CHECK(num_ctas >= 1 && min_units >= 1, "plan_decode: num_ctas and min_units must be >= 1");
  TORCH_CHECK(unit_tokens == kUnitMma || unit_tokens == kUnitWgmma, "plan_decode: unit_tokens must be ",
              kUnitMma, " or ", kUnitWgmma, ", got ", unit_tokens);
  const c10::cuda::CUDAGuard guard(seq_lens.device());
  launch_pdl(plan_decode_kernel, dim3(1), dim3(1024), 0, at::cuda::getCurrentCUDAStream(),
             seq_lens.data_ptr<int>(), int(seq_lens.numel()), metadata.data_ptr<int>(), int(num_ctas), int(min_units),
             int(unit_tokens));
}

void mla_decode(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                const at::Tensor& seq_lens, const at::Tensor& metadata, at::Tensor& partial_out,
                at::Tensor& partial_lse, at::Tensor& out, at::Tensor& lse, int64_t num_ctas,
                int64_t rows_per_cta, double softmax_scale, bool causal,
                const std::optional<at::Tensor>& kv_scale, double kv_scale_value) {
  // Shapes and dtypes were validated by mla_backend.ops; re-check what memory safety needs.
  TORCH_CHECK(q.dim() == 4 && q.size(3) == kDqk && q.stride(3) == 1, "mla_decode: bad q");
  const bool fp8 = kv_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(kv_cache.dim() == 3 && kv_cache.size(1) == kPage && kv_cache.size(2) == kDqk &&
                  kv_cache.stride(2) == 1 && (fp8 || kv_cache.scalar_type() == q.scalar_type()),
              "mla_decode: bad kv_cache");
  TORCH_CHECK(!fp8 || rows_per_cta == 16, "mla_decode: an fp8 cache runs on 16-row tiles");
  TORCH_CHECK(!kv_scale.has_value() || (kv_scale->is_cuda() && kv_scale->scalar_type() == at::kFloat &&
                                        kv_scale->numel() == 1),
              "mla_decode: kv_scale must be a 1-element float32 CUDA tensor");
  TORCH_CHECK(out.is_contiguous() && lse.is_contiguous(), "mla_decode: out/lse must be contiguous");
  const int64_t batch = q.size(0), rows = q.size(1) * q.size(2);
  TORCH_CHECK(metadata.numel() == batch + 2 && partial_out.size(0) == 2 * num_ctas &&
                  partial_out.size(1) == rows && partial_lse.size(0) == 2 * num_ctas,
              "mla_decode: plan buffers do not match q");
  if (batch == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  DecodeParams p;
  p.q = q.data_ptr();
  p.q_stride_b = q.stride(0); p.q_stride_s = q.stride(1); p.q_stride_h = q.stride(2);
  p.kv = kv_cache.data_ptr();
  p.kv_stride_block = kv_cache.stride(0); p.kv_stride_tok = kv_cache.stride(1);
  p.num_blocks = kv_cache.size(0);
  p.block_table = block_table.data_ptr<int>();
  p.bt_stride = block_table.stride(0);
  p.max_blocks = int(block_table.size(1));
  p.seq_lens = seq_lens.data_ptr<int>();
  p.meta = metadata.data_ptr<int>();
  p.part_out = partial_out.data_ptr<float>();
  p.part_lse = partial_lse.data_ptr<float>();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.batch = int(batch); p.s_q = int(q.size(1)); p.heads = int(q.size(2)); p.rows = int(rows);
  p.num_ctas = int(num_ctas);
  p.kv_scale_ptr = kv_scale.has_value() ? kv_scale->data_ptr<float>() : nullptr;
  p.kv_scale_value = float(kv_scale_value);
  p.scale_log2 = float(softmax_scale * 1.4426950408889634);
  p.causal = causal;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || q.scalar_type() == at::kHalf, "mla_decode: q must be bf16 or fp16");
  if (rows_per_cta == 16) {
    if (fp8) {
      if (bf16) launch_decode<__nv_bfloat16, 16, true>(p, stream); else launch_decode<__half, 16, true>(p, stream);
    } else {
      if (bf16) launch_decode<__nv_bfloat16, 16, false>(p, stream); else launch_decode<__half, 16, false>(p, stream);
    }
  } else if (rows_per_cta == 64) {
    dense::launch_decode_wgmma(p, bf16, stream);
  } else {
    TORCH_CHECK(false, "mla_decode: rows_per_cta must be 16 or 64, got ", rows_per_cta);
  }
}

}  // namespace mla_backend
