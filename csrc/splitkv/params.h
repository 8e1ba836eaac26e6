// The parameters of every split-KV attention kernel (dense and sparse decode, sparse
// prefill, the combine): one struct, passed by value as a __grid_constant__.
//
// A plan splits the keys of all requests into work units of a fixed number of tokens; CTA c
// takes units [cU, cU + U) (U = units per CTA), crossing request boundaries (splitkv/schedule.cuh).
// A request wholly inside one CTA is written straight to out / lse; a request spanning CTAs
// leaves normalised partials (slot 0 if it is the CTA's first request, else slot 1) that the
// combine kernel (splitkv/combine.cu) merges by lse.
#pragma once

#include <cstdint>
#include <type_traits>

// The dense decode kernels write split partial O in the output's dtype (bf16 / fp16), half the
// bytes of float32 (splitkv/partials.cuh), and the wgmma kernel stages them through shared
// memory for 16-byte stores (wgmma/staged_rows.cuh): 2, the default (H100, 2026-11-26: 1.5 to
// 11 us faster than float32 per batch-1 call, docs/notes/2026-11-26-dense-partials-bf16.md).
// Comparison builds (MLA_BACKEND_NVCC_FLAGS=-DMLA_BACKEND_16BIT_PARTIALS=N): 1 stores 16-bit
// partials from the accumulators, 0 writes float32. The op dense_partial_bytes tells Python
// which width a build writes.
#ifndef MLA_BACKEND_16BIT_PARTIALS
#define MLA_BACKEND_16BIT_PARTIALS 2
#endif

namespace mla_backend::splitkv {

constexpr bool kDense16BitPartials = MLA_BACKEND_16BIT_PARTIALS != 0;
constexpr bool kStagedPartials = MLA_BACKEND_16BIT_PARTIALS == 2;

// The partial O element type of the dense decode kernels whose output type is T: float32, or
// T itself with 16-bit partials. The sparse kernels write float32 partials in every build;
// partial lse is float32 everywhere.
template <typename T>
using DensePartial = std::conditional_t<kDense16BitPartials, T, float>;

// Tokens per work unit: the mma.sync kernel (16-row tiles) and the wgmma kernels.
constexpr int kUnitMma = 32;
constexpr int kUnitWgmma = 64;

struct DecodeParams {
  const void* q;  // query rows: columns 0..511 (the latent part) at q, ...
  int64_t q_stride_b, q_stride_s, q_stride_h;
  const void* q_pe;  // ... columns 512..575 (the rope part) at q_pe: q + 512, or a tensor apart
  int64_t qpe_stride_b, qpe_stride_s, qpe_stride_h;
  const void* kv;
  int64_t kv_stride_block, kv_stride_tok;
  int64_t num_blocks;
  const int* block_table;
  int64_t bt_stride;
  int max_blocks;
  const int* seq_lens;
  const int* meta;  // the plan: P[0..batch] (first unit of each request), U at [batch + 1]
  void* part_out;   // [2C][rows][512] float32 (dense kernels: DensePartial<T>, partials.cuh)
  float* part_lse;  // [2C][rows]
  void* out;        // [batch][rows][512]
  float* lse;       // [batch][rows]
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
  // Dense wgmma plans with an order of the requests (a longest-first plan; splitkv/planner.h):
  // request r of the plan is batch entry order[r]; nullptr: r itself (request_entry)
  const int* order = nullptr;
};

}  // namespace mla_backend::splitkv
