// Sparse, 64-row tiles: fp8_ds_mla cache, two row tiles as a 2-CTA cluster (H > 64).
#include "wgmma/launch.cuh"

namespace mla_backend::wgmma {

template bool launch_decode_wgmma<__nv_bfloat16, KeySource::kSparseDsMla, true, false>(
    const DecodeParams& p, cudaStream_t stream, bool combine);

}  // namespace mla_backend::wgmma
