// What the host entry points take from torch: its stable ABI only (torch/csrc/stable/, torch/
// headeronly/), so one build loads under every torch from TORCH_TARGET_VERSION (setup.py) on.
#pragma once

#include <cuda_runtime.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>
#include <torch/headeronly/util/shim_utils.h>

namespace mla_backend {

using Tensor = torch::stable::Tensor;
using torch::headeronly::ScalarType;
using DeviceGuard = torch::stable::accelerator::DeviceGuard;

// torch's current CUDA stream on the tensor's device (the stream the op is called on)
inline cudaStream_t current_stream(const Tensor& t) {
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(t.get_device_index(), &stream));
  return static_cast<cudaStream_t>(stream);
}

}  // namespace mla_backend
