// Sparse, H <= 16 over a bf16 cache: the narrow kernel with 16-head tiles.
#include "sparse/narrow_kernel.cuh"

namespace mla_backend::sparse {

template void launch_sparse_narrow<16>(const DecodeParams& p, cudaStream_t stream, bool combine);

}  // namespace mla_backend::sparse
