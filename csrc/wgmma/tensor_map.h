// TMA tensor maps (host): the paged cache for the dense TMA-page sources (kTmaPagesOf), q for
// the sparse sources and (kDenseQTmaOf builds) for the dense ones.
#pragma once

#include <cuda.h>

#include "splitkv/params.h"

#if defined(__CUDACC__)
#define MLA_TENSOR_MAP_HD __host__ __device__
#else
#define MLA_TENSOR_MAP_HD
#endif

namespace mla_backend::wgmma {

// The paged cache as [num_blocks][64][576] 16-bit values with the cache's own strides (a
// layer's view of a cross-layer buffer works), 64x64 boxes, 128-byte swizzle.
CUtensorMap make_kv_map(const splitkv::DecodeParams& p, bool bf16);

// The same cache holding per-tensor fp8 e4m3 bytes, for kPagedFp8(F16): 128-byte x 64-token
// boxes (two 64-column chunks of raw values each; the box at byte 512 ends past the token's 576
// bytes and reads zeros there), 128-byte swizzle.
CUtensorMap make_kv_map_fp8(const splitkv::DecodeParams& p);

// The sparse query (bf16) in its two parts, each [B, s_q, H, width] with its own strides
// (p.q / p.q_stride_*: the 512 latent columns, p.q_pe / p.qpe_stride_*: the 64 rope columns;
// one whole tensor is the pair q, q + 512), 64-column x box_rows-head boxes, 128-byte
// swizzle: a box past H reads zeros. Q chunks 0-7 come from `nope`, chunk 8 from `pe`.
struct QMaps {
  CUtensorMap nope;
  CUtensorMap pe;
};
QMaps make_q_maps(const splitkv::DecodeParams& p, int box_rows);

// Whether the dense kernel loads Q by TMA (make_dense_q_maps; host and kernel decide alike):
// a 64-row tile is one box of whole heads (H a multiple of 64: 64 heads of one query token;
// H dividing 64: all H heads of 64 / H query tokens), and each part's strides over its
// dimensions longer than 1 are nonzero. Otherwise the kernel copies Q with cp.async.
MLA_TENSOR_MAP_HD inline bool dense_q_by_tma(const splitkv::DecodeParams& p) {
  const bool steps = (p.heads == 1 || (p.q_stride_h > 0 && p.qpe_stride_h > 0)) &&
                     (p.s_q == 1 || (p.q_stride_s > 0 && p.qpe_stride_s > 0)) &&
                     (p.batch == 1 || (p.q_stride_b > 0 && p.qpe_stride_b > 0));
  return steps && p.heads > 0 && (p.heads % 64 == 0 || 64 % p.heads == 0);
}
// The dense query (bf16 or fp16; only where dense_q_by_tma) in its two parts, each
// [batch, s_q, H, width] at its own strides, 64-column x 64-row boxes (64 heads x 1 token, or
// H heads x 64 / H tokens), 128-byte swizzle: rows past the tensor read zeros. The tile at
// row0 is the box at (head row0 % H, token row0 / H).
QMaps make_dense_q_maps(const splitkv::DecodeParams& p, bool bf16);

}  // namespace mla_backend::wgmma
