// Sparse, 64-row tiles: bf16 cache larger than L2, one row tile (each fill's rows prefetched to L2).
#include "wgmma/launch.cuh"

namespace mla_backend::wgmma {

template bool launch_decode_wgmma<__nv_bfloat16, KeySource::kSparse16, false, true>(
    const DecodeParams& p, cudaStream_t stream, bool combine);

}  // namespace mla_backend::wgmma
