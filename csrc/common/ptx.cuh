// The PTX the kernels write by hand: instructions CUTLASS / CuTe have no wrapper for, or wrap
// in a form that compiles to other SASS (each checked against the CUTLASS 4.2 headers). Every
// other primitive comes from CUTLASS / CuTe or the CUDA headers at its call site.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace mla_backend {

// shared::cta address -> generic pointer (the wrappers below, the wgmma descriptors and the
// kernels' barrier arithmetic use 32-bit shared addresses; CUTLASS's barriers and CuTe's copy
// atoms take pointers)
template <typename T = void>
__device__ __forceinline__ T* smem_ptr(uint32_t addr) {
  return reinterpret_cast<T*>(__cvta_shared_to_generic(addr));
}

// cp.async.cg, 16 bytes, src_bytes of them read (0: zero-fills the destination without
// reading). Ours: CuTe's SM80_CP_ASYNC_CACHEGLOBAL_ZFILL adds .L2::128B, another instruction.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// cp.async.wait_group N. Ours: CuTe's cp_async_wait<0> emits cp.async.wait_all (other SASS).
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// mbarrier.try_wait.parity in a loop until the phase of that parity has completed. Ours:
// CUTLASS's ClusterBarrier::wait passes a suspend-time hint, which changes the SASS.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t phase) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar), "r"(phase) : "memory");
}
// mbarrier.arrive on a shared::cluster address (the peer CTA's barrier). Ours: CUTLASS's
// ClusterBarrier::arrive(cta_id, pred) maps the address with mapa on every call; the kernel
// adds a peer offset it computed once.
__device__ __forceinline__ void mbar_arrive_remote(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// bar.sync / bar.arrive on named barrier `id` (0 is __syncthreads) for `threads` threads.
// Ours: CUTLASS's NamedBarrier numbers user barriers from 8 (0-7 are reserved for CUTLASS),
// which changes the barrier ids in the SASS.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// cp.async.bulk shared::cta -> shared::cluster, `bytes` (a 16-byte multiple) completing on the
// destination CTA's mbarrier `bar` (the source must be fenced to the async proxy). Ours:
// CUTLASS / CuTe have no shared-to-cluster bulk copy.
__device__ __forceinline__ void bulk_copy_s2cluster(uint32_t dst, uint32_t src, uint32_t bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
      "r"(src), "r"(bytes), "r"(bar)
      : "memory");
}
// st.async: one 32-bit store to a shared::cluster address, completing on that CTA's mbarrier.
// Ours: CuTe's store_shared_remote maps both addresses with mapa on every call.
__device__ __forceinline__ void st_async_b32(uint32_t addr, uint32_t v, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n" ::"r"(addr), "r"(v),
               "r"(bar)
               : "memory");
}

// cp.async.bulk.tensor.3d / .4d: the TMA box at the given coordinates of `map`, completing on
// an mbarrier of this CTA. Ours: CuTe's SM90_TMA_LOAD_3D / _4D always add an L2 cache hint
// operand (.L2::cache_hint), another instruction.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
}

// %tid.x and %laneid, read by a volatile asm so the compiler cannot hoist values derived from
// them and keep them live across a loop (the producers' register budget cannot hold them).
// Ours: CUTLASS's LaneId() is a plain asm the compiler may hoist.
__device__ __forceinline__ uint32_t fresh_tid_x() {
  uint32_t t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
}
__device__ __forceinline__ uint32_t fresh_lane_id() {
  uint32_t l;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(l));
  return l;
}

// %globaltimer (ns), for the diagnostic timeline stamps of -DMLA_TIMELINE builds
// (wgmma/timeline.cuh). Ours: CUTLASS reads it only inside its synclog.
__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace mla_backend
