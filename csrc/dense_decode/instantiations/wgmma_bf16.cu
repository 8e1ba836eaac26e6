// Dense decode, 64-row tiles, q bf16: the bf16 cache and the per-tensor fp8 cache (pages by
// TMA; the fp8 bytes converted by the consumers). One translation unit for both: compiled alone,
// the 16-bit kernel comes out 8 instructions longer (the optimizer's choices depend on what else
// the unit holds).
#include "wgmma/launch.cuh"

namespace mla_backend::wgmma {

template bool launch_decode_wgmma<__nv_bfloat16, KeySource::kPagedTma, false, false>(
    const DecodeParams& p, cudaStream_t stream, bool combine);
template bool launch_decode_wgmma<__nv_bfloat16, KeySource::kPagedFp8, false, false>(
    const DecodeParams& p, cudaStream_t stream, bool combine);
template bool launch_decode_wgmma<__nv_bfloat16, KeySource::kPagedFp8F16, false, false>(
    const DecodeParams& p, cudaStream_t stream, bool combine);

}  // namespace mla_backend::wgmma
