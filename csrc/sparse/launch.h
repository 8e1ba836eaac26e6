// Sparse (DSA) attention: the launcher of the narrow kernel for H <= 16 (narrow_kernel.cuh),
// explicitly instantiated under instantiations/ (the 64-row kernel's: wgmma/launch.h).
#pragma once

#include <cuda_runtime.h>

#include "splitkv/params.h"

namespace mla_backend::sparse {

using splitkv::DecodeParams;

// H <= 16 over a bf16 cache: one tile of kN heads per CTA, keys as the MMA's M dimension
template <int kN>
void launch_sparse_narrow(const DecodeParams& p, cudaStream_t stream, bool combine);

}  // namespace mla_backend::sparse
