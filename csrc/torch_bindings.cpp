// Registers every kernel as torch.ops.mla_backend.* through torch's stable ABI (the C shim),
// so one build loads under every torch from TORCH_TARGET_VERSION (setup.py) on. No pybind11:
// the module is built with the limited Python API (_C.abi3.so) and loaded with
// torch.ops.load_library.
#include <torch/csrc/stable/library.h>

#include "ops.h"

STABLE_TORCH_LIBRARY(mla_backend, m) {
  m.def(
      "plan_decode(Tensor seq_lens, Tensor(a!) metadata, int num_ctas, int min_units, int unit_tokens, "
      "int whole_extra, int align_extra, int restart_pad, int lpt_extra, int one_unit_max) -> ()");
  m.def("dense_partial_bytes() -> int");
  m.def(
      "mla_decode(Tensor q, Tensor? q_pe, Tensor kv_cache, Tensor block_table, Tensor seq_lens, Tensor metadata, "
      "Tensor(a!) partial_out, Tensor(b!) partial_lse, Tensor(c!) out, Tensor(d!) lse, "
      "int num_ctas, int rows_per_cta, float softmax_scale, bool causal, Tensor? kv_scale, "
      "float kv_scale_value, bool fp16_operands) -> ()");
  m.def(
      "plan_sparse_decode(Tensor? topk_length, Tensor(a!) metadata, int q_tokens_per_req, int topk, "
      "int num_ctas, int min_units, int unit_tokens) -> ()");
  m.def(
      "sparse_mla_decode(Tensor q, Tensor? q_pe, Tensor kv_cache, Tensor indices, Tensor? topk_length, "
      "Tensor metadata, Tensor(a!) partial_out, Tensor(b!) partial_lse, Tensor(c!) out, Tensor(d!) lse, int num_ctas, "
      "int rows_per_cta, float softmax_scale, bool combine, int uniform_units, int units_per_cta) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(mla_backend, CUDA, m) {
  m.impl("plan_decode", TORCH_BOX(&mla_backend::plan_decode));
  m.impl("mla_decode", TORCH_BOX(&mla_backend::mla_decode));
  m.impl("plan_sparse_decode", TORCH_BOX(&mla_backend::plan_sparse_decode));
  m.impl("sparse_mla_decode", TORCH_BOX(&mla_backend::sparse_mla_decode));
}

// a build constant: no tensor argument, so no device to dispatch on
STABLE_TORCH_LIBRARY_IMPL(mla_backend, CompositeExplicitAutograd, m) {
  m.impl("dense_partial_bytes", TORCH_BOX(&mla_backend::dense_partial_bytes));
}
