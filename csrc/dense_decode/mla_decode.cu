// Dense paged MLA decode: the host entry points plan_decode and mla_decode (ops.h) and the
// dispatch to the kernels: the mma.sync kernel for 16-row tiles (mma_kernel.cuh; rows = s_q *
// H <= 16) and the wgmma kernel for 64-row tiles (wgmma/), each over a 16-bit or a
// per-tensor fp8 cache.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>

#include "common/mla_shapes.h"
#include "dense_decode/launch.h"
#include "ops.h"
#include "splitkv/host_params.h"
#include "splitkv/planner.h"
#include "wgmma/launch.h"

namespace mla_backend {

using dense_decode::KvFormat;
using dense_decode::launch_mma_decode;
using splitkv::DecodeParams;
using splitkv::kUnitMma;
using splitkv::kUnitWgmma;

void plan_decode(const Tensor& seq_lens, Tensor& metadata, int64_t num_ctas, int64_t min_units,
                 int64_t unit_tokens, int64_t whole_extra, int64_t align_extra, int64_t restart_pad,
                 int64_t lpt_extra, int64_t one_unit_max) {
  STD_TORCH_CHECK(seq_lens.is_cuda() && seq_lens.scalar_type() == ScalarType::Int && seq_lens.is_contiguous(),
                  "plan_decode: seq_lens must be contiguous int32 on CUDA");
  // lpt_extra >= 0: the plan and an order of the requests (splitkv/planner.h), wgmma plans only
  STD_TORCH_CHECK(lpt_extra == -1 || (unit_tokens == kUnitWgmma && lpt_extra >= 0 && lpt_extra <= 1024),
                  "plan_decode: lpt_extra must be -1, or in [0, 1024] with unit_tokens ", kUnitWgmma, ", got ",
                  lpt_extra, " with unit_tokens ", unit_tokens);
  const int64_t meta_len = (lpt_extra >= 0 ? 2 * seq_lens.numel() : seq_lens.numel()) + 2;
  STD_TORCH_CHECK(metadata.is_cuda() && metadata.scalar_type() == ScalarType::Int &&
                      metadata.is_contiguous() && metadata.numel() == meta_len,
                  "plan_decode: metadata must be contiguous int32 [", lpt_extra >= 0 ? "2 * batch + 2" : "batch + 2",
                  "]");
  STD_TORCH_CHECK(num_ctas >= 1 && min_units >= 1, "plan_decode: num_ctas and min_units must be >= 1");
  STD_TORCH_CHECK(whole_extra >= -1 && whole_extra <= INT_MAX, "plan_decode: whole_extra must be >= -1, got ",
                  whole_extra);
  STD_TORCH_CHECK(unit_tokens == kUnitMma || unit_tokens == kUnitWgmma, "plan_decode: unit_tokens must be ",
                  kUnitMma, " or ", kUnitWgmma, ", got ", unit_tokens);
  // aligned plans pad requests: only the wgmma kernel clamps its pieces to a request's keys
  STD_TORCH_CHECK(align_extra == -1 || (unit_tokens == kUnitWgmma && align_extra >= 0 && align_extra <= 1024),
                  "plan_decode: align_extra must be -1, or in [0, 1024] with unit_tokens ", kUnitWgmma, ", got ",
                  align_extra, " with unit_tokens ", unit_tokens);
  STD_TORCH_CHECK(restart_pad == -1 || (unit_tokens == kUnitWgmma && restart_pad >= 0 && restart_pad <= 255),
                  "plan_decode: restart_pad must be -1, or in [0, 255] with unit_tokens ", kUnitWgmma, ", got ",
                  restart_pad, " with unit_tokens ", unit_tokens);
  STD_TORCH_CHECK(one_unit_max >= -1 && one_unit_max <= INT_MAX, "plan_decode: one_unit_max must be >= -1, got ",
                  one_unit_max);
  const DeviceGuard guard(seq_lens.get_device_index());
  splitkv::launch_planner(seq_lens.const_data_ptr<int>(), int(seq_lens.numel()), 1, INT_MAX,
                          metadata.mutable_data_ptr<int>(), int(num_ctas), int(min_units), int(unit_tokens),
                          int(whole_extra), int(align_extra), int(restart_pad), int(lpt_extra),
                          int(one_unit_max), current_stream(seq_lens));
}

int64_t dense_partial_bytes() { return splitkv::kDense16BitPartials ? 2 : 4; }

void mla_decode(const Tensor& q, const std::optional<Tensor>& q_pe, const Tensor& kv_cache,
                const Tensor& block_table, const Tensor& seq_lens, const Tensor& metadata, Tensor& partial_out,
                Tensor& partial_lse, Tensor& out, Tensor& lse, int64_t num_ctas,
                int64_t rows_per_cta, double softmax_scale, bool causal,
                const std::optional<Tensor>& kv_scale, double kv_scale_value, bool fp16_operands) {
  // mla_backend.ops validates shapes and dtypes; re-check what memory safety needs.
  // q: whole rows [B, s_q, H, 576], or their latent part [B, s_q, H, 512] with q_pe the rope part
  STD_TORCH_CHECK(q.dim() == 4 && q.size(3) == (q_pe.has_value() ? kDv : kDqk) && q.stride(3) == 1,
                  "mla_decode: bad q");
  STD_TORCH_CHECK(!q_pe.has_value() ||
                      (q_pe->dim() == 4 && q_pe->size(0) == q.size(0) && q_pe->size(1) == q.size(1) &&
                       q_pe->size(2) == q.size(2) && q_pe->size(3) == kDqk - kDv && q_pe->stride(3) == 1 &&
                       q_pe->scalar_type() == q.scalar_type() && q_pe->get_device_index() == q.get_device_index()),
                  "mla_decode: bad q_pe");
  const bool fp8 = kv_cache.scalar_type() == ScalarType::Float8_e4m3fn;
  STD_TORCH_CHECK(kv_cache.dim() == 3 && kv_cache.size(1) == kPage && kv_cache.size(2) == kDqk &&
                      kv_cache.stride(2) == 1 && (fp8 || kv_cache.scalar_type() == q.scalar_type()),
                  "mla_decode: bad kv_cache");
  STD_TORCH_CHECK(!kv_scale.has_value() || (kv_scale->is_cuda() && kv_scale->scalar_type() == ScalarType::Float &&
                                            kv_scale->numel() == 1),
                  "mla_decode: kv_scale must be a 1-element float32 CUDA tensor");
  STD_TORCH_CHECK(out.is_contiguous() && lse.is_contiguous(), "mla_decode: out/lse must be contiguous");
  const int64_t batch = q.size(0), rows = q.size(1) * q.size(2);
  // metadata: the plan, or the plan and an order of the requests (2 * batch + 2: wgmma plans)
  const bool ordered = metadata.numel() == 2 * batch + 2 && batch > 0;
  STD_TORCH_CHECK(!ordered || rows_per_cta == 64, "mla_decode: a plan with an order of the requests is for the "
                  "64-row kernel; rows_per_cta is ", rows_per_cta);
  STD_TORCH_CHECK((metadata.numel() == batch + 2 || ordered) && partial_out.size(0) == 2 * num_ctas &&
                      partial_out.size(1) == rows && partial_lse.size(0) == 2 * num_ctas,
                  "mla_decode: plan buffers do not match q");
  // the partial O rows as this build's kernels write them (splitkv::DensePartial)
  const ScalarType part_type = splitkv::kDense16BitPartials ? q.scalar_type() : ScalarType::Float;
  STD_TORCH_CHECK(partial_out.scalar_type() == part_type, "mla_decode: partial_out must be ",
                  torch::headeronly::toString(part_type), ": this build writes ",
                  splitkv::kDense16BitPartials ? "16-bit split partials in q's dtype" : "float32 split partials",
                  " (dense_partial_bytes() = ", dense_partial_bytes(), "); got ",
                  torch::headeronly::toString(partial_out.scalar_type()));
  if (batch == 0) return;
  const DeviceGuard guard(q.get_device_index());
  DecodeParams p =
      splitkv::decode_params(q, kv_cache, metadata, partial_out, partial_lse, out, lse, num_ctas, softmax_scale);
  if (q_pe.has_value()) {
    p.q_pe = q_pe->data_ptr();
    p.qpe_stride_b = q_pe->stride(0); p.qpe_stride_s = q_pe->stride(1); p.qpe_stride_h = q_pe->stride(2);
  }
  p.kv_stride_block = kv_cache.stride(0); p.kv_stride_tok = kv_cache.stride(1);
  p.num_blocks = kv_cache.size(0);
  p.block_table = block_table.const_data_ptr<int>();
  p.bt_stride = block_table.stride(0);
  p.max_blocks = int(block_table.size(1));
  p.seq_lens = seq_lens.const_data_ptr<int>();
  if (ordered) p.order = metadata.const_data_ptr<int>() + batch + 2;
  p.batch = int(batch); p.s_q = int(q.size(1)); p.heads = int(q.size(2)); p.rows = int(rows);
  p.kv_scale_ptr = kv_scale.has_value() ? kv_scale->const_data_ptr<float>() : nullptr;
  p.kv_scale_value = float(kv_scale_value);
  p.causal = causal;
  cudaStream_t stream = current_stream(q);
  const bool bf16 = q.scalar_type() == ScalarType::BFloat16;
  STD_TORCH_CHECK(bf16 || q.scalar_type() == ScalarType::Half, "mla_decode: q must be bf16 or fp16");
  if (rows_per_cta == 16) {
    if (fp8) {
      if (bf16) launch_mma_decode<__nv_bfloat16, KvFormat::kFp8>(p, stream);
      else launch_mma_decode<__half, KvFormat::kFp8>(p, stream);
    } else {
      if (bf16) launch_mma_decode<__nv_bfloat16, KvFormat::k16>(p, stream);
      else launch_mma_decode<__half, KvFormat::k16>(p, stream);
    }
  } else if (rows_per_cta == 64) {
    using wgmma::KeySource;
    // per-tensor fp8: the tiles converted to q's type, or (fp16_operands, a bf16 q) to fp16 with
    // Q converted once per piece; an fp16 q is fp16 either way
    if (fp8) {
      if (bf16 && fp16_operands)
        wgmma::launch_decode_wgmma<__nv_bfloat16, KeySource::kPagedFp8F16, false, false>(p, stream, true);
      else if (bf16) wgmma::launch_decode_wgmma<__nv_bfloat16, KeySource::kPagedFp8, false, false>(p, stream, true);
      else wgmma::launch_decode_wgmma<__half, KeySource::kPagedFp8, false, false>(p, stream, true);
    } else {
      if (bf16) wgmma::launch_decode_wgmma<__nv_bfloat16, KeySource::kPagedTma, false, false>(p, stream, true);
      else wgmma::launch_decode_wgmma<__half, KeySource::kPagedTma, false, false>(p, stream, true);
    }
  } else {
    STD_TORCH_CHECK(false, "mla_decode: rows_per_cta must be 16 or 64, got ", rows_per_cta);
  }
}

}  // namespace mla_backend
