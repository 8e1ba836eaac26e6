// TMA tensor maps (host): the paged cache for the dense kPagedTma source, q for the sparse
// sources.
#pragma once

#include <cuda.h>

#include "splitkv/params.h"

namespace mla_backend::wgmma {

// The paged cache as [num_blocks][64][576] 16-bit values with the cache's own strides (a
// layer's view of a cross-layer buffer works), 64x64 boxes, 128-byte swizzle.
CUtensorMap make_kv_map(const splitkv::DecodeParams& p, bool bf16);

// The sparse q [B, s_q, H, 576] (bf16) with its own strides, 64-column x box_rows-head boxes,
// 128-byte swizzle: a box past H reads zeros.
CUtensorMap make_q_map(const splitkv::DecodeParams& p, int box_rows);

}  // namespace mla_backend::wgmma
