// Dense decode, 64-row tiles, per-tensor fp8 cache with row tiles in pairs: each pair a 2-CTA
// cluster that converts each page once (KeyProducer's kPaired). A unit of its own, so the
// unpaired instantiations keep their code.
#include "wgmma/launch.cuh"

namespace mla_backend::wgmma {

template bool launch_decode_wgmma<__nv_bfloat16, KeySource::kPagedFp8, true, false>(
    const DecodeParams& p, cudaStream_t stream, bool combine);
template bool launch_decode_wgmma<__half, KeySource::kPagedFp8, true, false>(
    const DecodeParams& p, cudaStream_t stream, bool combine);

}  // namespace mla_backend::wgmma
