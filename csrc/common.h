// Shared helpers for mla_backend CUDA sources.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#define MLA_CHECK_CUDA(expr)                                                       \
  do {                                                                             \
    cudaError_t err__ = (expr);                                                    \
    TORCH_CHECK(err__ == cudaSuccess, "CUDA error: ", cudaGetErrorString(err__),   \
                " at " __FILE__ ":", __LINE__);                                    \
  } while (0)

#define MLA_CHECK_LAUNCH() MLA_CHECK_CUDA(cudaGetLastError())

namespace mla_backend {

inline int device_sm_count(int device) {
  int n = 0;
  MLA_CHECK_CUDA(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  return n;
}

}  // namespace mla_backend
