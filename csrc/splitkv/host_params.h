// DecodeParams from the op's tensors (host; the entry points in dense_decode/ and sparse/).
#pragma once

#include "common/torch_abi.h"
#include "splitkv/params.h"

namespace mla_backend::splitkv {

// The fields every entry point (dense and sparse) fills alike: q, the cache, the plan's
// buffers, out / lse, the grid and the softmax scale in the log2 domain.
inline DecodeParams decode_params(const Tensor& q, const Tensor& kv_cache, const Tensor& metadata,
                                  Tensor& partial_out, Tensor& partial_lse, Tensor& out,
                                  Tensor& lse, int64_t num_ctas, double softmax_scale) {
  DecodeParams p;
  p.q = q.data_ptr();
  p.q_stride_b = q.stride(0); p.q_stride_s = q.stride(1); p.q_stride_h = q.stride(2);
  p.q_pe = static_cast<const char*>(q.data_ptr()) + 512 * q.element_size();
  p.qpe_stride_b = p.q_stride_b; p.qpe_stride_s = p.q_stride_s; p.qpe_stride_h = p.q_stride_h;
  p.kv = kv_cache.data_ptr();
  p.meta = metadata.const_data_ptr<int>();
  p.part_out = partial_out.mutable_data_ptr();  // float32 or 16-bit: the entry point checks which
  p.part_lse = partial_lse.mutable_data_ptr<float>();
  p.out = out.data_ptr();
  p.lse = lse.mutable_data_ptr<float>();
  p.num_ctas = int(num_ctas);
  p.scale_log2 = float(softmax_scale * 1.4426950408889634);
  return p;
}

}  // namespace mla_backend::splitkv
