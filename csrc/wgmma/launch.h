// The launcher of the wgmma decode kernel (decode_kernel.cuh), explicitly instantiated once
// per configuration under dense_decode/instantiations/ and sparse/instantiations/.
#pragma once

#include <cuda_runtime.h>

#include "splitkv/params.h"
#include "wgmma/config.cuh"

namespace mla_backend::wgmma {

// One 64-row tile per CTA along y; then the combine kernel unless `combine` is false (a plan
// that splits no request and leaves none empty).
template <typename T, KeySource kSrc, bool kPaired, bool kPrefetch>
void launch_decode_wgmma(const DecodeParams& p, cudaStream_t stream, bool combine);

}  // namespace mla_backend::wgmma
