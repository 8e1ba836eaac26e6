// Host helpers: CUDA error checks and kernel launches with programmatic dependent launch.
#pragma once

#include <cuda_runtime.h>
#include <torch/headeronly/util/Exception.h>

#include <mutex>
#include <utility>
#include <vector>

#define MLA_CHECK_CUDA(expr)                                                         \
  do {                                                                               \
    cudaError_t err__ = (expr);                                                      \
    STD_TORCH_CHECK(err__ == cudaSuccess, "CUDA error: ", cudaGetErrorString(err__), \
                    " at " __FILE__ ":", __LINE__);                                  \
  } while (0)

namespace mla_backend {

// Programmatic dependent launch (sm_90): a kernel launched this way may start while the
// previous kernel in the stream finishes; it must call cudaGridDependencySynchronize() before
// touching anything that kernel wrote, and may call cudaTriggerProgrammaticLaunchCompletion()
// to let the next kernel start early. `cluster`: the cluster's CTAs along x, y, z (1, 1, 1:
// no cluster).
template <typename... KArgs, typename... Args>
inline void launch_pdl_clustered(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                 dim3 cluster, Args&&... args) {
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  attr[1].id = cudaLaunchAttributeClusterDimension;
  attr[1].val.clusterDim.x = cluster.x;
  attr[1].val.clusterDim.y = cluster.y;
  attr[1].val.clusterDim.z = cluster.z;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = cluster.x * cluster.y * cluster.z > 1 ? 2 : 1;
  MLA_CHECK_CUDA(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

// Whether every cluster (`cluster` CTAs) of a launch of `kernel` (block, smem) with
// `clusters` of them fits on the current GPU at once (cudaOccupancyMaxActiveClusters, asked
// once per kernel, device and cluster shape). A cluster takes SMs of one GPC, and GPCs may
// hold odd SM counts: a grid of one CTA per SM launched as clusters can leave a cluster for a
// second wave.
template <typename... KArgs>
inline bool clusters_fit_at_once(void (*kernel)(KArgs...), dim3 block, size_t smem, dim3 cluster, int clusters) {
  struct Asked {
    const void* kernel;
    int dev;
    unsigned x, y, z;
    int max_active;
  };
  static std::mutex mu;
  static std::vector<Asked> asked;  // a few entries: one per clustered kernel and device
  int dev = 0;
  MLA_CHECK_CUDA(cudaGetDevice(&dev));
  const void* key = reinterpret_cast<const void*>(kernel);
  {
    const std::lock_guard<std::mutex> lock(mu);
    for (const Asked& a : asked) {
      if (a.kernel == key && a.dev == dev && a.x == cluster.x && a.y == cluster.y && a.z == cluster.z)
        return clusters <= a.max_active;
    }
  }
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = cluster.x;
  attr.val.clusterDim.y = cluster.y;
  attr.val.clusterDim.z = cluster.z;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = cluster;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int n = 0;
  MLA_CHECK_CUDA(cudaOccupancyMaxActiveClusters(&n, kernel, &cfg));
  const std::lock_guard<std::mutex> lock(mu);
  asked.push_back({key, dev, cluster.x, cluster.y, cluster.z, n});
  return clusters <= n;
}

template <typename... KArgs, typename... Args>
inline void launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       Args&&... args) {
  launch_pdl_clustered(kernel, grid, block, smem, stream, dim3(1, 1, 1), std::forward<Args>(args)...);
}

}  // namespace mla_backend
