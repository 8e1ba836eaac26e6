// Dense paged decode: the launcher of the mma.sync kernel the entry point (mla_decode.cu)
// dispatches to for up to 16 rows, one explicit instantiation each under instantiations/ (the
// wgmma kernel's launcher: wgmma/launch.h).
#pragma once

#include <cuda_runtime.h>

#include "splitkv/params.h"

namespace mla_backend::dense_decode {

using splitkv::DecodeParams;

// How the cache stores a token.
enum class KvFormat {
  k16,   // 576 values of q's dtype
  kFp8,  // 576 float8 e4m3, one per-tensor scale (vLLM "fp8")
};

// rows = s_q * H <= 16: the mma.sync kernel on 16-row tiles (mma_kernel.cuh), then the
// combine. T: q's type.
template <typename T, KvFormat kFmt>
void launch_mma_decode(const DecodeParams& p, cudaStream_t stream);

}  // namespace mla_backend::dense_decode
