// The host entry points registered in torch_bindings.cpp: dense decode
// (dense_decode/mla_decode.cu) and sparse decode / prefill (sparse/sparse_mla.cu).
#pragma once

#include <optional>

#include "common/torch_abi.h"

namespace mla_backend {

void plan_decode(const Tensor& seq_lens, Tensor& metadata, int64_t num_ctas, int64_t min_units,
                 int64_t unit_tokens, int64_t whole_extra, int64_t align_extra, int64_t restart_pad,
                 int64_t lpt_extra, int64_t one_unit_max);

// Bytes per value of the dense decode kernels' split partial O: 2 (q's dtype, the default), or
// 4 in a float32 build (MLA_BACKEND_16BIT_PARTIALS=0, splitkv/params.h)
int64_t dense_partial_bytes();

void mla_decode(const Tensor& q, const std::optional<Tensor>& q_pe, const Tensor& kv_cache,
                const Tensor& block_table, const Tensor& seq_lens, const Tensor& metadata, Tensor& partial_out,
                Tensor& partial_lse, Tensor& out, Tensor& lse, int64_t num_ctas,
                int64_t rows_per_cta, double softmax_scale, bool causal,
                const std::optional<Tensor>& kv_scale, double kv_scale_value, bool fp16_operands);

void plan_sparse_decode(const std::optional<Tensor>& topk_length, Tensor& metadata,
                        int64_t q_tokens_per_req, int64_t topk, int64_t num_ctas, int64_t min_units,
                        int64_t unit_tokens);

void sparse_mla_decode(const Tensor& q, const std::optional<Tensor>& q_pe, const Tensor& kv_cache,
                       const Tensor& indices, const std::optional<Tensor>& topk_length, const Tensor& metadata,
                       Tensor& partial_out, Tensor& partial_lse, Tensor& out, Tensor& lse,
                       int64_t num_ctas, int64_t rows_per_cta, double softmax_scale, bool combine,
                       int64_t uniform_units, int64_t units_per_cta);

}  // namespace mla_backend
