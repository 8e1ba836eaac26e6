// Dense paged MLA decode (v2) for 64-row tiles (rows = s_q * H > 32): wgmma (sm_90a).
//
// A CTA is two warpgroups (256 threads) over one 64-row tile of one m-tile; the work unit
// is one 64-token page. Per page:
//   S  = Q K^T : warpgroup w computes 64 rows x keys [32w, 32w+32) over depth 576
//                (wgmma m64n32k16, Q and K read by the tensor cores from swizzled smem);
//   softmax    : row maxima exchanged through smem, P (bf16/fp16) written to smem;
//   O += P V   : warpgroup w owns output columns [256w, 256w+256) (wgmma m64n256k16,
//                V = the first 512 columns of the same K tile, read MN-major).
// The next page streams in by TMA (one thread, nine 64x64 boxes, completion on an mbarrier)
// while this one computes (two stages).
// Shared memory: Q 72 KiB + 2 x K 72 KiB + P 8 KiB + reductions = 225 KiB (one CTA/SM).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

#include <utility>

#include "dense_decode_common.cuh"

namespace mla_backend {
namespace dense {
namespace {

constexpr int kRows = 64;
constexpr int kKeys = kUnitWgmma;                    // 64 tokens per page / unit
constexpr int kThreads = 256;
constexpr int kChunkBytes = 64 * 128;                // one 64-column chunk of a 64-row tile
constexpr int kTileBytes = (kDqk / 64) * kChunkBytes;  // 9 chunks: 72 KiB
constexpr int kPBytes = kChunkBytes;                 // 64 rows x 64 keys
constexpr size_t kSmem = 3 * size_t(kTileBytes) + kPBytes + 2 * 2 * kRows * sizeof(float) + 16 + 1024;

// Byte offset of element (row, col) in a [64 x cols] tile stored as 64-column chunks of
// 128-byte rows with the 128-byte swizzle (16-byte unit index XOR row % 8), the canonical
// K-major SW128 layout of wgmma.
__device__ __forceinline__ uint32_t sw128_offset(int row, int col) {
  return (col >> 6) * kChunkBytes + row * 128 + ((((col & 63) >> 3) ^ (row & 7)) << 4) + (col & 7) * 2;
}

// wgmma shared-memory descriptor: SWIZZLE_128B, given byte offsets.
__device__ __forceinline__ uint64_t make_desc(uint32_t smem_byte_addr, uint32_t lbo, uint32_t sbo) {
  uint64_t d = 0;
  d |= uint64_t((smem_byte_addr & 0x3FFFF) >> 4);
  d |= uint64_t(lbo >> 4) << 16;
  d |= uint64_t(sbo >> 4) << 32;
  d |= uint64_t(1) << 62;  // layout type 1: 128-byte swizzle
  return d;
}

template <typename T> struct Gmma;
template <> struct Gmma<__nv_bfloat16> {
  using QK = cute::SM90::GMMA::MMA_64x32x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>;
  using PV = cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::MN>;
};
template <> struct Gmma<__half> {
  using QK = cute::SM90::GMMA::MMA_64x32x16_F32F16F16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>;
  using PV = cute::SM90::GMMA::MMA_64x256x16_F32F16F16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::MN>;
};

template <typename Op, size_t... I>
__device__ __forceinline__ void gmma_call(uint64_t da, uint64_t db, float* d, bool accumulate,
                                          std::index_sequence<I...>) {
  Op::fma(da, db, d[I]..., accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

template <int N>
__device__ __forceinline__ void fence_regs(float* d) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void mbar_init(uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar));
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t phase) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar), "r"(phase) : "memory");
}
// One 64-column x 64-token box of page `blk` into a swizzled 8 KiB chunk.
__device__ __forceinline__ void tma_load_box(uint32_t dst, const CUtensorMap* map, int col, int blk,
                                             uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(0), "r"(blk), "r"(bar) : "memory");
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) dense_decode_wgmma_kernel(const __grid_constant__ DecodeParams p,
                                                                       const __grid_constant__ CUtensorMap kv_map) {
  extern __shared__ unsigned char smem_raw[];
  // SW128 atoms must start on 1024-byte boundaries
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  const uint32_t sQ = base;
  const uint32_t sK0 = base + kTileBytes;
  const uint32_t sP = base + 3 * kTileBytes;
  float* sMax = reinterpret_cast<float*>(smem + 3 * kTileBytes + kPBytes);  // [2][64]
  float* sSum = sMax + 2 * kRows;                                             // [2][64]

  const uint32_t bar0 = sP + kPBytes + 4 * kRows * sizeof(float);              // 2 mbarriers
  if (threadIdx.x == 0) {
    mbar_init(bar0);
    mbar_init(bar0 + 8);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  pdl_launch_dependents();
  pdl_wait();  // the plan, q and the cache are written by earlier kernels
  const int* P = p.meta;
  const int total = __ldg(P + p.batch);
  const int U = __ldg(P + p.batch + 1);
  const int cta = blockIdx.x;
  const int u_begin = cta * U;
  if (u_begin >= total) return;
  const int u_end = min(u_begin + U, total);
  const int row0 = blockIdx.y * kRows;

  const int tid = threadIdx.x, lane = tid & 31;
  const int wg = tid >> 7;             // warpgroup: key half for S, column half for PV
  const int wtid = tid & 127;
  const int wrow = (wtid >> 5) * 16 + (lane >> 2);  // this thread's rows: wrow, wrow + 8
  const int qd = lane & 3;
  const T* kv = static_cast<const T*>(p.kv);

  // Page of unit u: (request, page index); the consumer recomputes it for masking.
  int r_load = request_of_unit(P, p.batch, u_begin);
  auto load_unit = [&](int u, int stage) {  // thread 0 only
    while (u >= __ldg(P + r_load + 1)) ++r_load;
    const int blk_idx = u - __ldg(P + r_load);
    const uint32_t bar = bar0 + stage * 8;
    if (blk_idx < p.max_blocks) {
      const int blk = __ldg(p.block_table + r_load * p.bt_stride + blk_idx);
      mbar_expect_tx(bar, kTileBytes);
#pragma unroll
      for (int j = 0; j < kDqk / 64; ++j) tma_load_box(sK0 + stage * kTileBytes + j * kChunkBytes, &kv_map, j * 64, blk, bar);
    } else {
      mbar_arrive(bar);  // nothing to load: the consumer zeroes the whole page
    }
  };

  const T* qbase = static_cast<const T*>(p.q);
  auto load_q = [&](int r) {
    for (int i = tid; i < kRows * kChunksPerRow; i += kThreads) {
      const int m = i / kChunksPerRow, c = i % kChunksPerRow;
      const int row = row0 + m;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (row < p.rows) {
        const int qi = row / p.heads, h = row % p.heads;
        v = __ldg(reinterpret_cast<const uint4*>(qbase + r * p.q_stride_b + qi * p.q_stride_s +
                                                 h * p.q_stride_h) + c);
      }
      *reinterpret_cast<uint4*>(smem + sw128_offset(m, c * 8)) = v;
    }
  };

  if (tid == 0) load_unit(u_begin, 0);
  __syncthreads();      // barriers initialised before anyone waits on them
  uint32_t phases = 0;  // bit s: parity of stage s's next completion
  int r_cur = request_of_unit(P, p.batch, u_begin);
  load_q(r_cur);

  float o[128];
  float m_run[2], l_run[2];
  auto reset_state = [&]() {
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    m_run[0] = m_run[1] = -INFINITY;
    l_run[0] = l_run[1] = 0.f;
  };
  reset_state();

  auto epilogue = [&](int r) {
    float l0 = l_run[0], l1 = l_run[1];
    l0 += __shfl_xor_sync(0xffffffff, l0, 1); l0 += __shfl_xor_sync(0xffffffff, l0, 2);
    l1 += __shfl_xor_sync(0xffffffff, l1, 1); l1 += __shfl_xor_sync(0xffffffff, l1, 2);
    if (qd == 0) { sSum[wg * kRows + wrow] = l0; sSum[wg * kRows + wrow + 8] = l1; }
    __syncthreads();
    const float lt[2] = {sSum[wrow] + sSum[kRows + wrow], sSum[wrow + 8] + sSum[kRows + wrow + 8]};
    __syncthreads();  // sSum is read before the next epilogue writes it
    const int Pr = __ldg(P + r), Pr1 = __ldg(P + r + 1);
    const bool split = (Pr / U) != ((Pr1 - 1) / U);
    const int slot = Pr <= u_begin ? 0 : 1;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = row0 + wrow + hr * 8;
      if (row >= p.rows) continue;
      const float inv_l = lt[hr] > 0.f ? 1.f / lt[hr] : 0.f;
      const float lse_row = lt[hr] > 0.f ? (m_run[hr] + __log2f(lt[hr])) * kLn2 : -INFINITY;
      if (!split) {
        T* out = static_cast<T*>(p.out) + (int64_t(r) * p.rows + row) * kDv + wg * 256;
#pragma unroll
        for (int n = 0; n < 32; ++n) {
          *reinterpret_cast<uint32_t*>(out + n * 8 + qd * 2) =
              Mma<T>::pack(o[n * 4 + hr * 2] * inv_l, o[n * 4 + hr * 2 + 1] * inv_l);
        }
        if (wg == 0 && qd == 0) p.lse[int64_t(r) * p.rows + row] = lse_row;
      } else {
        const int64_t prow = (int64_t(cta) * 2 + slot) * p.rows + row;
        float* po = p.part_out + prow * kDv + wg * 256;
#pragma unroll
        for (int n = 0; n < 32; ++n) {
          *reinterpret_cast<float2*>(po + n * 8 + qd * 2) =
              make_float2(o[n * 4 + hr * 2] * inv_l, o[n * 4 + hr * 2 + 1] * inv_l);
        }
        if (wg == 0 && qd == 0) p.part_lse[prow] = lse_row;
      }
    }
  };

  int stage = 0;
  for (int u = u_begin; u < u_end; ++u) {
    if (u >= __ldg(P + r_cur + 1)) {
      epilogue(r_cur);
      while (u >= __ldg(P + r_cur + 1)) ++r_cur;
      load_q(r_cur);
      reset_state();
    }
    const uint32_t sK = sK0 + stage * kTileBytes;
    const int tok0 = (u - __ldg(P + r_cur)) * kKeys;
    const int seq_len = __ldg(p.seq_lens + r_cur);
    mbar_wait(bar0 + stage * 8, (phases >> stage) & 1);
    phases ^= 1u << stage;
    // Tokens past seq_len (last page) or a page with no block-table entry: zero the rows so
    // that 0-probability keys contribute 0, not 0 * NaN.
    const int n_valid = (u - __ldg(P + r_cur)) < p.max_blocks ? min(kKeys, seq_len - tok0) : 0;
    if (n_valid < kKeys) {
      for (int i = tid; i < (kKeys - n_valid) * kChunksPerRow; i += kThreads) {
        const int t = n_valid + i / kChunksPerRow, c = i % kChunksPerRow;
        *reinterpret_cast<uint4*>(smem + (sK - base) + sw128_offset(t, c * 8)) = make_uint4(0, 0, 0, 0);
      }
    }
    fence_proxy_async();  // st.shared writes (Q, zeroed rows) -> visible to the tensor cores
    __syncthreads();      // every warpgroup finished page u-1: its stage can be refilled
    if (tid == 0 && u + 1 < u_end) load_unit(u + 1, stage ^ 1);

    // ---- S = Q K^T: 64 rows x 32 keys [32 wg, 32 wg + 32), depth 576 = 36 k-steps
    float s[16] = {};
    cute::warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < kDqk / 16; ++kk) {
      const uint32_t koff = (kk >> 2) * kChunkBytes + (kk & 3) * 32;
      const uint64_t da = make_desc(sQ + koff, 16, 1024);
      const uint64_t db = make_desc(sK + wg * 32 * 128 + koff, 16, 1024);
      gmma_call<typename Gmma<T>::QK>(da, db, s, kk > 0, std::make_index_sequence<16>{});
    }
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<0>();
    fence_regs<16>(s);

    // scale to the log2 domain, mask, row maxima over this warpgroup's 32 keys
    float rmax[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = row0 + wrow + hr * 8;
      const int limit = p.causal ? seq_len - p.s_q + row / p.heads + 1 : seq_len;
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < 4; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = tok0 + wg * 32 + n * 8 + qd * 2 + e;
          float& v = s[n * 4 + hr * 2 + e];
          v = key < limit ? v * p.scale_log2 : -INFINITY;
          mx = fmaxf(mx, v);
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
      rmax[hr] = mx;
    }
    if (qd == 0) { sMax[wg * kRows + wrow] = rmax[0]; sMax[wg * kRows + wrow + 8] = rmax[1]; }
    __syncthreads();
    float alpha[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int lr = wrow + hr * 8;
      const float mx = fmaxf(m_run[hr], fmaxf(sMax[lr], sMax[kRows + lr]));
      const float m_use = mx == -INFINITY ? 0.f : mx;  // nothing seen yet: avoid inf - inf
      alpha[hr] = exp2f(m_run[hr] - m_use);
      m_run[hr] = mx;
      float psum = 0.f;
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const float p0 = exp2f(s[n * 4 + hr * 2] - m_use), p1 = exp2f(s[n * 4 + hr * 2 + 1] - m_use);
        psum += p0 + p1;
        *reinterpret_cast<uint32_t*>(smem + (sP - base) + sw128_offset(lr, wg * 32 + n * 8 + qd * 2)) =
            Mma<T>::pack(p0, p1);
      }
      l_run[hr] = l_run[hr] * alpha[hr] + psum;
    }
    // the running max rarely moves after the first pages: skip the 128 multiplies then
    if (__any_sync(0xffffffff, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int n = 0; n < 32; ++n) {
        o[n * 4 + 0] *= alpha[0]; o[n * 4 + 1] *= alpha[0];
        o[n * 4 + 2] *= alpha[1]; o[n * 4 + 3] *= alpha[1];
      }
    }
    fence_proxy_async();
    __syncthreads();  // P complete; sMax reads done

    // ---- O[:, 256 wg : 256 wg + 256] += P V, depth 64 keys = 4 k-steps
    fence_regs<128>(o);
    cute::warpgroup_arrive();
#pragma unroll
    for (int ks = 0; ks < kKeys / 16; ++ks) {
      const uint64_t da = make_desc(sP + ks * 32, 16, 1024);
      // V is MN-major: 64 columns contiguous (swizzled), next 64 columns 8 KiB on (LBO),
      // next 8 keys 1 KiB on (SBO); 16 keys per k-step = 2 KiB.
      const uint64_t db = make_desc(sK + wg * 4 * kChunkBytes + ks * 16 * 128, kChunkBytes, 1024);
      gmma_call<typename Gmma<T>::PV>(da, db, o, true, std::make_index_sequence<128>{});
    }
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<0>();
    fence_regs<128>(o);
    stage ^= 1;
  }
  epilogue(r_cur);
}

// Tensor map of the paged cache as [num_blocks][64][576] with the cache's own strides (a
// layer's view of a cross-layer buffer works), 64x64 boxes, 128-byte swizzle.
CUtensorMap make_kv_map(const DecodeParams& p, bool bf16) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (encode == nullptr) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status;
    MLA_CHECK_CUDA(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &status));
    TORCH_CHECK(status == cudaDriverEntryPointSuccess && fn != nullptr, "mla_decode: cuTensorMapEncodeTiled not found");
    encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }
  CUtensorMap map;
  const cuuint64_t dims[3] = {cuuint64_t(kDqk), cuuint64_t(kPage), cuuint64_t(p.num_blocks)};
  const cuuint64_t strides[2] = {cuuint64_t(p.kv_stride_tok) * 2, cuuint64_t(p.kv_stride_block) * 2};
  const cuuint32_t box[3] = {64, 64, 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = encode(&map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3,
                            const_cast<void*>(p.kv), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "mla_decode: cuTensorMapEncodeTiled failed with error ", int(r),
              " (kv_cache must be 16-byte aligned with 16-byte multiple strides)");
  return map;
}

template <typename T>
void launch_wgmma(const DecodeParams& p, cudaStream_t stream) {
  auto kernel = dense_decode_wgmma_kernel<T>;
  MLA_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem)));
  dim3 grid(p.num_ctas, (p.rows + kRows - 1) / kRows);
  const CUtensorMap map = make_kv_map(p, std::is_same_v<T, __nv_bfloat16>);
  launch_pdl(kernel, grid, dim3(kThreads), kSmem, stream, p, map);
  launch_combine<T>(p, stream);
}

}  // namespace

void launch_decode_wgmma(const DecodeParams& p, bool bf16, cudaStream_t stream) {
  if (bf16) launch_wgmma<__nv_bfloat16>(p, stream); else launch_wgmma<__half>(p, stream);
}

}  // namespace dense
}  // namespace mla_backend
