// The host entry points registered in torch_bindings.cpp: dense decode
// (dense_decode/mla_decode.cu) and sparse decode / prefill (sparse/sparse_mla.cu).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace mla_backend {

void plan_decode(const at::Tensor& seq_lens, at::Tensor& metadata, int64_t num_ctas, int64_t min_units,
                 int64_t unit_tokens);

void mla_decode(const at::Tensor& q, const std::optional<at::Tensor>& q_pe, const at::Tensor& kv_cache,
                const at::Tensor& block_table,
                const at::Tensor& seq_lens, const at::Tensor& metadata, at::Tensor& partial_out,
                at::Tensor& partial_lse, at::Tensor& out, at::Tensor& lse, int64_t num_ctas,
                int64_t rows_per_cta, double softmax_scale, bool causal,
                const std::optional<at::Tensor>& kv_scale, double kv_scale_value);

void plan_sparse_decode(const std::optional<at::Tensor>& topk_length, at::Tensor& metadata,
                        int64_t q_tokens_per_req, int64_t topk, int64_t num_ctas, int64_t min_units,
                        int64_t unit_tokens);

void sparse_mla_decode(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& indices,
                       const std::optional<at::Tensor>& topk_length, const at::Tensor& metadata,
                       at::Tensor& partial_out, at::Tensor& partial_lse, at::Tensor& out, at::Tensor& lse,
                       int64_t num_ctas, int64_t rows_per_cta, double softmax_scale, bool combine,
                       int64_t uniform_units, int64_t units_per_cta);

}  // namespace mla_backend
