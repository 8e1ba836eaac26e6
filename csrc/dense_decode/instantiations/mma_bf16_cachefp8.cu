// Dense decode, up to 16 rows: q bf16, per-tensor fp8 cache.
#include "dense_decode/mma_kernel.cuh"

namespace mla_backend::dense_decode {

template void launch_mma_decode<__nv_bfloat16, KvFormat::kFp8>(const DecodeParams& p, cudaStream_t stream);

}  // namespace mla_backend::dense_decode
