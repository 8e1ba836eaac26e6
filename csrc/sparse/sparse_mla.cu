// Sparse (DSA, DeepSeek-V3.2) MLA attention: the host entry points plan_sparse_decode and
// sparse_mla_decode (ops.h) and the dispatch to the kernels. Every query token attends to the
// cache slots its index list names. One op serves decode ([B, s_q, H] queries, indices [B,
// s_q, topk]) and prefill (mla_backend.ops passes [T, H] queries as T groups of one token):
// each (batch entry, query token) is one request of the split-KV plan, its keys the entries
// of its index list, its rows the H heads, on one or two 64-row tiles of the wgmma kernel
// (wgmma/), or, for H <= 16 over a bf16 cache, on the narrow kernel (narrow_kernel.cuh).
#include <cuda_bf16.h>

#include "common/mla_shapes.h"
#include "ops.h"
#include "splitkv/host_params.h"
#include "sparse/launch.h"
#include "splitkv/planner.h"
#include "wgmma/launch.h"

namespace mla_backend {
namespace sparse {
namespace {

// 65536 rows of 1152 bytes are 75 MB, 1.5x the H100's 50 MB L2
constexpr int kPrefetchMinSlots = 1 << 16;

// The kernel for H = p.rows heads over a bf16 (fp8_ds_mla false) or fp8_ds_mla cache
void launch_sparse(const DecodeParams& p, bool fp8_ds_mla, bool combine, cudaStream_t stream) {
  using wgmma::KeySource;
  using wgmma::kRows;
  using wgmma::launch_decode_wgmma;
  // fp8_ds_mla with two row tiles (H > 64): the tiles share each unit's conversion
  // (kPaired), where every pair fits on the GPU at once; otherwise the unpaired kernel
  if (fp8_ds_mla && p.rows > kRows &&
      launch_decode_wgmma<__nv_bfloat16, KeySource::kSparseDsMla, true, false>(p, stream, combine))
    return;
  if (fp8_ds_mla) launch_decode_wgmma<__nv_bfloat16, KeySource::kSparseDsMla, false, false>(p, stream, combine);
  else if (p.rows <= 16) launch_sparse_narrow<16>(p, stream, combine);
  // bf16, one row tile (H <= 64), a cache too large for L2: the producer prefetches each
  // fill's rows to L2 before its release wait. Where the rows sit in L2 there is nothing to
  // gain, and with two co-placed tiles gathering the same rows it costs 2-6%; an
  // instantiation of its own keeps the other schedules' code as it is.
  else if (p.rows <= kRows && p.num_slots >= kPrefetchMinSlots)
    launch_decode_wgmma<__nv_bfloat16, KeySource::kSparse16, false, true>(p, stream, combine);
  else launch_decode_wgmma<__nv_bfloat16, KeySource::kSparse16, false, false>(p, stream, combine);
}

}  // namespace
}  // namespace sparse

using splitkv::DecodeParams;
using splitkv::kUnitWgmma;

void plan_sparse_decode(const std::optional<Tensor>& topk_length, Tensor& metadata,
                        int64_t q_tokens_per_req, int64_t topk, int64_t num_ctas, int64_t min_units,
                        int64_t unit_tokens) {
  STD_TORCH_CHECK(metadata.is_cuda() && metadata.scalar_type() == ScalarType::Int && metadata.is_contiguous() &&
                      metadata.numel() >= 2,
                  "plan_sparse_decode: metadata must be contiguous int32 [groups + 2] on CUDA");
  const int64_t groups = metadata.numel() - 2;
  STD_TORCH_CHECK(q_tokens_per_req >= 1 && groups % q_tokens_per_req == 0 && topk >= 1 && num_ctas >= 1 &&
                      min_units >= 1,
                  "plan_sparse_decode: bad sizes");
  STD_TORCH_CHECK(unit_tokens == kUnitWgmma, "plan_sparse_decode: unit_tokens must be ", kUnitWgmma, ", got ",
                  unit_tokens);
  if (topk_length.has_value()) {
    STD_TORCH_CHECK(topk_length->is_cuda() && topk_length->scalar_type() == ScalarType::Int &&
                        topk_length->is_contiguous() && topk_length->numel() * q_tokens_per_req == groups,
                    "plan_sparse_decode: topk_length must be contiguous int32 [batch] on CUDA");
  }
  const DeviceGuard guard(metadata.get_device_index());
  splitkv::launch_planner(topk_length.has_value() ? topk_length->const_data_ptr<int>() : nullptr, int(groups),
                          int(q_tokens_per_req), int(topk), metadata.mutable_data_ptr<int>(), int(num_ctas),
                          int(min_units), int(unit_tokens), -1, -1, -1, -1, -1, current_stream(metadata));
}

void sparse_mla_decode(const Tensor& q, const std::optional<Tensor>& q_pe, const Tensor& kv_cache,
                       const Tensor& indices, const std::optional<Tensor>& topk_length, const Tensor& metadata,
                       Tensor& partial_out, Tensor& partial_lse, Tensor& out, Tensor& lse,
                       int64_t num_ctas, int64_t rows_per_cta, double softmax_scale, bool combine,
                       int64_t uniform_units, int64_t units_per_cta) {
  // mla_backend.ops validates shapes and dtypes; re-check what memory safety needs.
  // q: whole rows [B, s_q, H, 576], or their latent part [B, s_q, H, 512] with q_pe the rope part
  STD_TORCH_CHECK(q.dim() == 4 && q.size(3) == (q_pe.has_value() ? kDv : kDqk) && q.stride(3) == 1 &&
                      q.scalar_type() == ScalarType::BFloat16,
                  "sparse_mla_decode: bad q");
  STD_TORCH_CHECK(!q_pe.has_value() ||
                      (q_pe->dim() == 4 && q_pe->size(0) == q.size(0) && q_pe->size(1) == q.size(1) &&
                       q_pe->size(2) == q.size(2) && q_pe->size(3) == kDqk - kDv && q_pe->stride(3) == 1 &&
                       q_pe->scalar_type() == q.scalar_type() && q_pe->get_device_index() == q.get_device_index()),
                  "sparse_mla_decode: bad q_pe");
  const bool ds = kv_cache.scalar_type() == ScalarType::Byte;
  const int64_t tok_width = ds ? 656 : kDqk;
  STD_TORCH_CHECK((kv_cache.dim() == 3 || kv_cache.dim() == 2) && kv_cache.size(-1) == tok_width &&
                      kv_cache.stride(-1) == 1 && (ds || kv_cache.scalar_type() == ScalarType::BFloat16),
                  "sparse_mla_decode: bad kv_cache");
  STD_TORCH_CHECK(kv_cache.dim() == 2 || kv_cache.size(1) == kPage, "sparse_mla_decode: pages must hold 64 tokens");
  const int64_t batch = q.size(0), s_q = q.size(1), heads = q.size(2);
  STD_TORCH_CHECK(indices.dim() == 3 && indices.size(0) == batch && indices.size(1) == s_q &&
                      indices.stride(2) == 1 && indices.scalar_type() == ScalarType::Int,
                  "sparse_mla_decode: bad indices");
  STD_TORCH_CHECK(!topk_length.has_value() || (topk_length->numel() == batch && topk_length->is_contiguous() &&
                                               topk_length->scalar_type() == ScalarType::Int),
                  "sparse_mla_decode: bad topk_length");
  STD_TORCH_CHECK(out.is_contiguous() && lse.is_contiguous(), "sparse_mla_decode: out/lse must be contiguous");
  const int64_t groups = batch * s_q;
  STD_TORCH_CHECK(metadata.numel() == groups + 2 && partial_out.size(0) == 2 * num_ctas &&
                      partial_out.size(1) == heads && partial_lse.size(0) == 2 * num_ctas &&
                      partial_out.scalar_type() == ScalarType::Float,
                  "sparse_mla_decode: plan buffers do not match q (partial_out: float32 [2 * num_ctas, H, 512])");
  // uniform plan (uniform_units > 0): every group has its topk entries, ceil(topk / 64) units,
  // and the kernels take the schedule from these two numbers rather than from metadata
  const int64_t topk_units = (indices.size(2) + kUnitWgmma - 1) / kUnitWgmma;
  STD_TORCH_CHECK(uniform_units == 0 || (uniform_units == topk_units && !topk_length.has_value() &&
                                         units_per_cta >= 1 && units_per_cta <= groups * topk_units),
                  "sparse_mla_decode: a uniform plan needs uniform_units = ceil(topk / 64), no topk_length and "
                  "1 <= units_per_cta <= all units");
  if (groups == 0) return;
  const DeviceGuard guard(q.get_device_index());
  DecodeParams p =
      splitkv::decode_params(q, kv_cache, metadata, partial_out, partial_lse, out, lse, num_ctas, softmax_scale);
  if (q_pe.has_value()) {  // the rope columns apart: the kernels read them through a tensor map of their own
    p.q_pe = q_pe->data_ptr();
    p.qpe_stride_b = q_pe->stride(0); p.qpe_stride_s = q_pe->stride(1); p.qpe_stride_h = q_pe->stride(2);
  }
  if (kv_cache.dim() == 3) {  // paged: slot = block * 64 + offset
    p.kv_stride_block = kv_cache.stride(0); p.kv_stride_tok = kv_cache.stride(1);
    p.num_slots = kv_cache.size(0) * kPage;
  } else {  // flat [S, width]: slot = row
    p.kv_stride_block = kv_cache.stride(0) * kPage; p.kv_stride_tok = kv_cache.stride(0);
    p.num_slots = kv_cache.size(0);
  }
  p.num_blocks = 0;
  p.block_table = nullptr; p.bt_stride = 0; p.max_blocks = 0; p.seq_lens = nullptr;
  p.batch = int(groups); p.s_q = 1; p.heads = int(heads); p.rows = int(heads);
  p.kv_scale_ptr = nullptr; p.kv_scale_value = 1.f;
  p.causal = false;
  p.indices = indices.const_data_ptr<int>();
  p.idx_stride_b = indices.stride(0); p.idx_stride_s = indices.stride(1);
  p.topk_length = topk_length.has_value() ? topk_length->const_data_ptr<int>() : nullptr;
  p.topk = int(indices.size(2));
  p.group_s_q = int(s_q);
  p.uniform_units = int(uniform_units);
  p.units_per_cta = int(units_per_cta);
  cudaStream_t stream = current_stream(q);
  STD_TORCH_CHECK(rows_per_cta == 64, "sparse_mla_decode: rows_per_cta must be 64, got ", rows_per_cta);
  // combine == false: the plan proved that no group spans CTAs and none is empty (uniform
  // topk, CTA ranges of whole groups), so every output is written by the attention kernel
  sparse::launch_sparse(p, ds, combine, stream);
}

}  // namespace mla_backend
