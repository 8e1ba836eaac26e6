// The definition of launch_decode_wgmma (launch.h), for the instantiation files.
#pragma once

#include <cuda_bf16.h>

#include <type_traits>

#include "common/launch.h"
#include "splitkv/combine.h"
#include "wgmma/decode_kernel.cuh"
#include "wgmma/launch.h"
#include "wgmma/tensor_map.h"

namespace mla_backend::wgmma {

template <typename T, KeySource kSrc, bool kPaired, bool kPrefetch>
bool launch_decode_wgmma(const DecodeParams& p, cudaStream_t stream, bool combine) {
  auto kernel = decode_wgmma_kernel<T, kSrc, kPaired, kPrefetch>;
  MLA_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem)));
  const int m_tiles = (p.rows + kRows - 1) / kRows;
  // (the plan's CTA, the row tile); the dense 16-bit kernel takes the row tile fastest
  // (kTileFastestOf)
  constexpr bool kTileFastest = kTileFastestOf<kSrc>;
  const dim3 grid = kTileFastest ? dim3(m_tiles, p.num_ctas) : dim3(p.num_ctas, m_tiles);
  STD_TORCH_CHECK(!kPaired || m_tiles % 2 == 0, "mla_decode: a paired launch needs an even number of row tiles, got ",
                  m_tiles);
  CUtensorMap kv_map{};  // the producer sources copy keys without a tensor map
  QMaps q_maps{};
  if constexpr (kSrc == KeySource::kPagedTma) kv_map = make_kv_map(p, std::is_same_v<T, __nv_bfloat16>);
  if constexpr (kPerTensorFp8Of<kSrc>) kv_map = make_kv_map_fp8(p);
  if constexpr (kQTmaOf<kSrc>) q_maps = make_q_maps(p, kRows);
  if constexpr (kDenseQTmaOf<kSrc>) {  // otherwise the kernel copies Q with cp.async (dense_q_by_tma)
    if (dense_q_by_tma(p)) q_maps = make_dense_q_maps(p, std::is_same_v<T, __nv_bfloat16>);
  }
  // Clusters along the row tile. fp8_ds_mla's paired tiles share each page's conversion, so
  // they run only as clusters, and only where every pair fits at once (else nothing is launched
  // and the caller runs the unpaired kernel). The bf16 sparse kernel's two tiles of a query
  // group share nothing, but as a cluster the two CTAs that gather the same keys at about the
  // same time sit in one GPC (H = 128 -2 to -5%). The dense kernels' two tiles do the same
  // (16-bit cache, H s_q = 128: -5 to -19% per layer on two H100s with the tiles in y; with the
  // tile-fastest order the cluster still takes ~2% off batch 1); clusters of 4 or 8 of its
  // tiles left CTAs for a second wave. Those cluster only where every pair fits at once.
  const dim3 block(kThreadsOf<kSrc>);
  const int pairs = m_tiles / 2 * p.num_ctas;
  dim3 cluster(1, 1, 1);
  if constexpr (kPaired) {
    if (!clusters_fit_at_once(kernel, block, kSmem, dim3(1, 2, 1), pairs)) return false;
    cluster.y = 2;
  }
  if constexpr (kSrc == KeySource::kSparse16) {
    if (m_tiles == 2 && clusters_fit_at_once(kernel, block, kSmem, dim3(1, 2, 1), pairs)) cluster.y = 2;
  }
  if constexpr (kTileFastest) {
    if (m_tiles == 2 && clusters_fit_at_once(kernel, block, kSmem, dim3(2, 1, 1), pairs)) cluster.x = 2;
  }
  launch_pdl_clustered(kernel, grid, block, kSmem, stream, cluster, p, kv_map, q_maps);
  if (combine) splitkv::launch_combine<T, PartialOf<T, kSrc>>(p, stream);
  return true;
}

}  // namespace mla_backend::wgmma
