// Dense decode, up to 16 rows: q fp16, cache fp16.
#include "dense_decode/mma_kernel.cuh"

namespace mla_backend::dense_decode {

template void launch_mma_decode<__half, KvFormat::k16>(const DecodeParams& p, cudaStream_t stream);

}  // namespace mla_backend::dense_decode
