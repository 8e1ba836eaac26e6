// The launcher of the wgmma decode kernel (decode_kernel.cuh), explicitly instantiated once
// per configuration under dense_decode/instantiations/ and sparse/instantiations/.
#pragma once

#include <cuda_runtime.h>

#include "splitkv/params.h"
#include "wgmma/config.cuh"

namespace mla_backend::wgmma {

// One 64-row tile per CTA (grid: the plan's CTAs and the row tiles, see kTileFastestOf); then
// the combine kernel unless `combine` is false (a plan that splits no request and leaves none
// empty). Returns false, having launched nothing, only where kPaired and the pairs do not all
// fit on the GPU at once: the caller then runs the unpaired kernel.
template <typename T, KeySource kSrc, bool kPaired, bool kPrefetch>
bool launch_decode_wgmma(const DecodeParams& p, cudaStream_t stream, bool combine);

}  // namespace mla_backend::wgmma
