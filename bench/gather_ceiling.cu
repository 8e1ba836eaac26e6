// The gather ceiling of the sparse prefill: how fast one CTA per SM can pull random 1152-byte
// key rows (576 bf16) out of L2 / HBM into shared memory with 16-byte cp.async, nothing
// computed. The sparse prefill kernels (ours and FlashMLA's) do this plus the MMAs; this
// program measures the copy alone, for a given number of rows in flight per SM, so their
// times can be read against it (docs/kernels/sparse_decode.md, "gather ceiling").
//
// Build (sm_90a, static cudart):  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a \
//     -o gather_ceiling bench/gather_ceiling.cu
// Run:  ./gather_ceiling [tokens=4096] [topk=2048]   (prints one line per configuration)
//
// Layout and lanes as in the prefill's producer: a unit is R rows x 72 16-byte pieces, stored
// as 9 column blocks of R x 128 bytes with the 128-byte swizzle; 8 lanes share a row, so one
// copy instruction reads whole 128-byte lines of 4 rows. Each thread keeps at most S units in
// flight (cp.async.wait_group): no thread waits for another, so this is an upper bound for a
// pipeline with S units of buffer.
// Modes: 0 = each CTA its own tokens (H <= 64: a key read once per token); 1 = 2-CTA clusters,
// both CTAs the same tokens in the same order (H = 128 with the two 64-row tiles co-placed:
// every key read twice, at about the same time); 2 = the same without clusters.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                          \
  do {                                                                                    \
    cudaError_t e_ = (x);                                                                 \
    if (e_ != cudaSuccess) {                                                              \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

constexpr int kRowBytes = 1152;  // 576 bf16
constexpr int kPieces = kRowBytes / 16;

__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

template <int kThreads, int R, int S>
__global__ void __launch_bounds__(kThreads, 1)
    gather_kernel(const unsigned char* __restrict__ kv, const int* __restrict__ idx, int tokens, int topk,
                  int mode, int* sink) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  constexpr int kUnitBytes = R * kRowBytes;
  constexpr int kWarps = kThreads / 32;
  constexpr int kRowsPerWarp = R / kWarps;  // rows of a unit per warp, 4 per instruction
  static_assert(kRowsPerWarp % 4 == 0, "4 rows per copy instruction");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // mode 0: one stream of tokens per CTA; modes 1, 2: one per CTA pair
  const int stream = mode == 0 ? blockIdx.x : blockIdx.x / 2;
  const int streams = mode == 0 ? gridDim.x : gridDim.x / 2;
  const int units_per_token = topk / R;
  int n = 0;  // units issued by this CTA
  for (int t = stream; t < tokens; t += streams) {
    const int* list = idx + int64_t(t) * topk;
    for (int u = 0; u < units_per_token; ++u, ++n) {
      if (n >= S) cp_async_wait<S - 1>();  // the unit issued S ago has landed: reuse its buffer
      const uint32_t buf = base + (n % S) * kUnitBytes;
#pragma unroll
      for (int j = 0; j < kRowsPerWarp / 4; ++j) {
        const int r = warp * kRowsPerWarp + j * 4 + lane / 8;
        const int slot = __ldg(list + u * R + r);
        const unsigned char* row = kv + int64_t(slot) * kRowBytes + (lane % 8) * 16;
#pragma unroll
        for (int k = 0; k < kPieces / 8; ++k) {
          // piece p = lane % 8 + 8 k sits in column block k, 16-byte column lane % 8
          const uint32_t dst = buf + k * (R * 128) + r * 128 + (((lane % 8) ^ (r & 7)) << 4);
          cp_async_16(dst, row + k * 128);
        }
      }
      asm volatile("cp.async.commit_group;\n" ::);
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(sink, reinterpret_cast<const int*>(smem)[lane]);
}

struct Config {
  int threads, rows, stages;
  void (*fn)(const unsigned char*, const int*, int, int, int, int*);
};

template <int T, int R, int S>
Config make() {
  return {T, R, S, gather_kernel<T, R, S>};
}

int main(int argc, char** argv) {
  const int tokens = argc > 1 ? std::atoi(argv[1]) : 4096;
  const int topk = argc > 2 ? std::atoi(argv[2]) : 2048;
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  std::printf("# %s, %d SMs, L2 %d MB, tokens %d, topk %d, %d-byte rows\n", prop.name, sms,
              prop.l2CacheSize >> 20, tokens, topk, kRowBytes);
  std::printf("%8s %4s %7s %4s %6s %10s %8s %12s %14s\n", "s_kv", "mode", "threads", "rows", "stages",
              "KB_flight", "us", "TB/s(rows)", "us/unit64/CTA");
  const std::vector<Config> configs = {
      make<128, 64, 1>(), make<128, 64, 2>(), make<128, 64, 3>(), make<128, 32, 2>(),
      make<128, 32, 4>(), make<128, 32, 6>(), make<256, 64, 2>(), make<256, 64, 3>(),
  };
  int* sink;
  CHECK(cudaMalloc(&sink, sizeof(int)));
  for (const int s_kv : {8192, 32768, 131072}) {
    unsigned char* kv;
    int* idx;
    CHECK(cudaMalloc(&kv, size_t(s_kv) * kRowBytes));
    CHECK(cudaMemset(kv, 1, size_t(s_kv) * kRowBytes));
    std::vector<int> h(size_t(tokens) * topk);
    uint64_t x = 0x9E3779B97F4A7C15ull ^ uint64_t(s_kv);
    for (auto& v : h) {  // uniform in [0, s_kv), with repeats, as bench/sparse.py draws them
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      v = int((x >> 33) % uint64_t(s_kv));
    }
    CHECK(cudaMalloc(&idx, h.size() * sizeof(int)));
    CHECK(cudaMemcpy(idx, h.data(), h.size() * sizeof(int), cudaMemcpyHostToDevice));
    for (const int mode : {0, 1, 2}) {
      for (const Config& c : configs) {
        const int smem = c.rows * kRowBytes * c.stages;
        CHECK(cudaFuncSetAttribute(c.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        cudaLaunchConfig_t lc = {};
        lc.gridDim = dim3(sms / 2 * 2);
        lc.blockDim = dim3(c.threads);
        lc.dynamicSmemBytes = smem;
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = mode == 1 ? 2 : 1;
        attr[0].val.clusterDim.y = 1;
        attr[0].val.clusterDim.z = 1;
        lc.attrs = attr;
        lc.numAttrs = 1;
        auto launch = [&] { CHECK(cudaLaunchKernelEx(&lc, c.fn, (const unsigned char*)kv, (const int*)idx,
                                                     tokens, topk, mode, sink)); };
        for (int i = 0; i < 3; ++i) launch();
        CHECK(cudaDeviceSynchronize());
        std::vector<float> ms;
        cudaEvent_t a, b;
        CHECK(cudaEventCreate(&a));
        CHECK(cudaEventCreate(&b));
        for (int i = 0; i < 9; ++i) {
          CHECK(cudaEventRecord(a));
          launch();
          CHECK(cudaEventRecord(b));
          CHECK(cudaEventSynchronize(b));
          float t;
          CHECK(cudaEventElapsedTime(&t, a, b));
          ms.push_back(t);
        }
        std::sort(ms.begin(), ms.end());
        const double us = ms[ms.size() / 2] * 1e3;
        const double copies = mode == 0 ? 1.0 : 2.0;  // modes 1, 2 read every row twice
        const double bytes = copies * double(tokens) * topk * kRowBytes;
        const int ctas = sms / 2 * 2;
        const double units64 = copies * double(tokens) * topk / 64 / ctas;  // per CTA
        std::printf("%8d %4d %7d %4d %6d %10d %8.1f %12.2f %14.3f\n", s_kv, mode, c.threads, c.rows,
                    c.stages, smem / 1024, us, bytes / us * 1e-6, us / units64);
        CHECK(cudaEventDestroy(a));
        CHECK(cudaEventDestroy(b));
      }
    }
    CHECK(cudaFree(kv));
    CHECK(cudaFree(idx));
  }
  return 0;
}
