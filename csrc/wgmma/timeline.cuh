// Diagnostic builds only (MLA_BACKEND_NVCC_FLAGS=-DMLA_TIMELINE): TL(slot) stores a
// %globaltimer stamp per CTA into part_out (unused by plans that split no request), 64 slots
// of u64 per CTA, to be read from the plan's partial buffer after a call. Needs `p` (the
// DecodeParams) in scope. Other builds: nothing.
#pragma once

#include "common/ptx.cuh"

#ifdef MLA_TIMELINE
#define TL(slot) \
  (reinterpret_cast<uint64_t*>(p.part_out)[int64_t(blockIdx.x + gridDim.x * blockIdx.y) * 64 + (slot)] = globaltimer())
#else
#define TL(slot) ((void)0)
#endif
