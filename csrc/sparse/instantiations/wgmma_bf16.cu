// Sparse, 64-row tiles: bf16 cache.
#include "wgmma/launch.cuh"

namespace mla_backend::wgmma {

template bool launch_decode_wgmma<__nv_bfloat16, KeySource::kSparse16, false, false>(
    const DecodeParams& p, cudaStream_t stream, bool combine);

}  // namespace mla_backend::wgmma
