// A trivial op that proves the build runs on the device: out = alpha * x in float32.
#include "common.h"

namespace mla_backend {

__global__ void probe_scale_kernel(const float* __restrict__ x, float* __restrict__ out,
                                   float alpha, int64_t n) {
  int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = alpha * x[i];
}

at::Tensor probe_scale(const at::Tensor& x, double alpha) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "probe_scale: x must be a contiguous float32 CUDA tensor");
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty_like(x);
  const int64_t n = x.numel();
  if (n == 0) return out;
  const int threads = 256;
  const int64_t blocks = (n + threads - 1) / threads;
  probe_scale_kernel<<<blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<float>(), out.data_ptr<float>(), static_cast<float>(alpha), n);
  MLA_CHECK_LAUNCH();
  return out;
}

}  // namespace mla_backend
