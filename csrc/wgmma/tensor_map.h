// TMA tensor maps (host): the paged cache for the dense kPagedTma source, q for the sparse
// sources.
#pragma once

#include <cuda.h>

#include "splitkv/params.h"

namespace mla_backend::wgmma {

// The paged cache as [num_blocks][64][576] 16-bit values with the cache's own strides (a
// layer's view of a cross-layer buffer works), 64x64 boxes, 128-byte swizzle.
CUtensorMap make_kv_map(const splitkv::DecodeParams& p, bool bf16);

// The sparse query (bf16) in its two parts, each [B, s_q, H, width] with its own strides
// (p.q / p.q_stride_*: the 512 latent columns, p.q_pe / p.qpe_stride_*: the 64 rope columns;
// one whole tensor is the pair q, q + 512), 64-column x box_rows-head boxes, 128-byte
// swizzle: a box past H reads zeros. Q chunks 0-7 come from `nope`, chunk 8 from `pe`.
struct QMaps {
  CUtensorMap nope;
  CUtensorMap pe;
};
QMaps make_q_maps(const splitkv::DecodeParams& p, int box_rows);

}  // namespace mla_backend::wgmma
