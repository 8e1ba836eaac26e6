// The combine kernel: merges the partials of requests that span CTAs, by lse, into out / lse,
// and writes out = 0, lse = -inf for requests with no keys. Launched after every split-KV
// attention kernel whose plan may split a request.
#pragma once

#include <cuda_runtime.h>

#include "splitkv/params.h"

namespace mla_backend::splitkv {

// T: the type of out (bf16 or fp16); Part: the type of the partial O rows (float, or T: see
// splitkv/partials.cuh)
template <typename T, typename Part = float>
void launch_combine(const DecodeParams& p, cudaStream_t stream);

}  // namespace mla_backend::splitkv
