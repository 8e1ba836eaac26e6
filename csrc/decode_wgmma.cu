// MLA decode for 64-row tiles with wgmma (sm_90a): two consumer warpgroups alternating
// 64-key units ("seesaw"; the idea is FlashMLA's, this code is ours). One kernel template,
// four key sources:
//   kPagedTma   dense paged decode, 16-bit cache: TMA loads whole 64-token pages (256 threads);
//   kPagedFp8   dense paged decode, per-tensor fp8 e4m3 cache (576 bytes per token),
//   kSparse16   sparse (DSA) decode / prefill over a bf16 cache, and
//   kSparseDsMla                 ... over the 656-byte fp8_ds_mla cache: for these three a
//               third, producer warpgroup copies the 64 tokens of each unit (a page's, or the
//               listed slots) with cp.async (384 threads) and, for the fp8 caches, converts
//               them to 16-bit values in shared memory (fp8_ds_mla: in registers, see the
//               split schedule below), so the consumers see the same tile as from a 16-bit
//               cache.
//
// A CTA works on one 64-row tile; its unit of work is 64 keys (a page, or 64 list entries).
// Units of a request piece go in pairs: warpgroup 0 owns even units (buffer K0), warpgroup 1
// odd units (buffer K1). Warpgroup w holds output columns [256w, 256w + 256).
//   S        : each warpgroup computes S = Q K^T for its own unit, 64 rows x 64 keys over
//              576 (wgmma m64n64k16; Q chunks 0-7 from smem, the rope chunk 8 from
//              registers, since its smem holds the second P buffer).
//   softmax  : warpgroup 0 first, then warpgroup 1 on top of its running max; the max and
//              the rescale factors go through smem (named barriers SM0, SM1).
//   PV       : each warpgroup multiplies its own P from registers (RS) by its half of its own
//              unit's V, and the other's P (smem, after barriers P0 / P1) by its half of the
//              other unit's V.
// Each half of a K buffer (chunks 0-3 = V left, 4-8 = V right + rope) is released as soon as
// its last reader's wgmma retires (kPagedTma: its TMA refill is issued; with a producer: the
// producer's "empty" mbarrier is signalled; P0 then lives in K0's rope chunk, see kFills), so
// the next pair of units streams in while this pair computes.
// Shared memory: Q 72 KiB + 2 x K 72 KiB + one P buffer 8 KiB + scalars = 225 KiB.
// fp8_ds_mla runs a split schedule instead (kSplitOf): one unit at a time, warpgroup 0
// computes S, the softmax and O's left half, warpgroup 1 only O's right half, and the
// producer (RegFp8Producer, 128 registers) loads and converts in registers, not through
// shared memory. With two row tiles (H > 64) it runs paired: the tiles are a 2-CTA cluster
// and each converts half of every unit for both (kPaired).
// H <= 16 over a bf16 cache runs a kernel of its own further down (sparse_narrow_kernel): keys
// as the MMA's M dimension, so the MMA work is the heads' rather than a padded 64-row tile's.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

#include <type_traits>
#include <utility>

#include "dense_decode_common.cuh"

namespace mla_backend {
namespace dense {
namespace {

// Where a unit's keys come from (see the file comment).
enum class KeySource { kPagedTma, kPagedFp8, kSparse16, kSparseDsMla };

constexpr int kRows = 64;
constexpr int kKeys = kUnitWgmma;                    // 64 keys per unit
constexpr int kConsumerThreads = 256;                // two warpgroups
constexpr int kChunkBytes = 64 * 128;                // one 64-column chunk of a 64-row tile
constexpr int kTileBytes = (kDqk / 64) * kChunkBytes;  // 9 chunks: 72 KiB
constexpr int kPBytes = kChunkBytes;                 // 64 rows x 64 keys
constexpr int kHalfL = 4 * kChunkBytes;             // chunks 0-3: V columns 0-255
// Q, K0, K1, P0; sM, sScale0, sScale1, sSum[2] (5 x 64 floats); 18 mbarriers; the sparse key
// masks (2 buffers x 8 words, 4 used unless paired); alignment slack
constexpr size_t kSmem = 3 * size_t(kTileBytes) + kPBytes + 5 * kRows * sizeof(float) + 18 * 8 + 16 * 4 + 1024;
static_assert(kSmem <= 232448, "more shared memory than an sm_90 block can have");
// Sparse: the producer warpgroup keeps few registers, the consumers take the rest
// (2 x 224 + 56 = 3 x 168, the launch's 168 per thread; at 224 ptxas neither spills nor
// serializes the wgmmas, which it does at 232 with Q's rope chunk held in registers).
constexpr int kProducerRegs = 56;
constexpr int kConsumerRegs = 224;
// fp8_ds_mla with the split schedule (kSplitOf): warpgroup 0 computes S, the softmax and
// the left half of O, warpgroup 1 only the right half of O; neither needs 224, and the
// producer gets enough to convert from registers (docs/kernels/sparse_decode.md, v15)
// (at 200 warpgroup 0 spilled; 224 / 160 / 120 measured the same as these)
constexpr int kSplitWg0Regs = 208;
constexpr int kSplitWg1Regs = 168;
constexpr int kSplitProducerRegs = 504 - kSplitWg0Regs - kSplitWg1Regs;
constexpr float kNoMax = -1e30f;  // running-max start: finite, so no inf - inf

// Byte offset of element (row, col) in a [64 x cols] tile stored as 64-column chunks of
// 128-byte rows with the 128-byte swizzle (16-byte unit index XOR row % 8), the canonical
// K-major SW128 layout of wgmma.
__device__ __forceinline__ uint32_t sw128_offset(int row, int col) {
  return (col >> 6) * kChunkBytes + row * 128 + ((((col & 63) >> 3) ^ (row & 7)) << 4) + (col & 7) * 2;
}

// Byte offset of raw (fp8) 16-byte unit k of row `row` in a staging chunk: the units of a
// row are rotated by row % 8 (as the 128-byte swizzle does), so the 8 rows a warp stages or
// reads at the same k fall in 8 different bank groups; unswizzled they all hit one, and
// every raw copy and read took 4x the shared-memory wavefronts it needs
// (docs/kernels/sparse_decode.md, v12).
__device__ __forceinline__ uint32_t raw_offset(int row, int k) { return row * 128 + ((k ^ (row & 7)) << 4); }

// wgmma shared-memory descriptor: SWIZZLE_128B, given byte offsets.
__device__ __forceinline__ uint64_t make_desc(uint32_t smem_byte_addr, uint32_t lbo, uint32_t sbo) {
  uint64_t d = 0;
  d |= uint64_t((smem_byte_addr & 0x3FFFF) >> 4);
  d |= uint64_t(lbo >> 4) << 16;
  d |= uint64_t(sbo >> 4) << 32;
  d |= uint64_t(1) << 62;  // layout type 1: 128-byte swizzle
  return d;
}

// The descriptor of byte `off` past the one of `d`: only the start address field (bits 0-13,
// address >> 4) moves, and shared-memory addresses stay below 2^18 bytes, so the low word's
// add never carries into the LBO field. Descriptors built once per buffer and offset per
// k-step this way cost one uniform add per operand; built from each address (make_desc per
// wgmma) they cost ~10 uniform instructions per wgmma, ~14% of the bf16 sparse kernel's
// instructions (docs/kernels/sparse_decode.md, v31).
__device__ __forceinline__ uint64_t desc_at(uint64_t d, uint32_t off) {
  const uint32_t lo = static_cast<uint32_t>(d) + (off >> 4);
  return (d & 0xFFFFFFFF00000000ull) | lo;
}

#ifdef MLA_TIMELINE
// Diagnostic builds only: globaltimer stamps per CTA into part_out (unused by plans that
// split no request), 64 slots of u64 per CTA (scripts/timeline_sparse.py reads them).
__device__ __forceinline__ uint64_t tl_now() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#define TL(slot) (reinterpret_cast<uint64_t*>(p.part_out)[int64_t(blockIdx.x + gridDim.x * blockIdx.y) * 64 + (slot)] = tl_now())
#else
#define TL(slot) ((void)0)
#endif

namespace G = cute::SM90::GMMA;
template <typename T> struct Gmma;
template <> struct Gmma<__nv_bfloat16> {
  using QK_SS = G::MMA_64x64x16_F32BF16BF16_SS<G::Major::K, G::Major::K>;
  using QK_RS = G::MMA_64x64x16_F32BF16BF16_RS<G::Major::K, G::Major::K>;
  using PV_SS = G::MMA_64x256x16_F32BF16BF16_SS<G::Major::K, G::Major::MN>;
  using PV_RS = G::MMA_64x256x16_F32BF16BF16_RS<G::Major::K, G::Major::MN>;
};
template <> struct Gmma<__half> {
  using QK_SS = G::MMA_64x64x16_F32F16F16_SS<G::Major::K, G::Major::K>;
  using QK_RS = G::MMA_64x64x16_F32F16F16_RS<G::Major::K, G::Major::K>;
  using PV_SS = G::MMA_64x256x16_F32F16F16_SS<G::Major::K, G::Major::MN>;
  using PV_RS = G::MMA_64x256x16_F32F16F16_RS<G::Major::K, G::Major::MN>;
};

template <typename Op, size_t... I>
__device__ __forceinline__ void gmma_ss(uint64_t da, uint64_t db, float* d, bool accumulate,
                                        std::index_sequence<I...>) {
  Op::fma(da, db, d[I]..., accumulate ? G::ScaleOut::One : G::ScaleOut::Zero);
}
template <typename Op, size_t... I>
__device__ __forceinline__ void gmma_rs(const uint32_t* a, uint64_t db, float* d, bool accumulate,
                                        std::index_sequence<I...>) {
  Op::fma(a[0], a[1], a[2], a[3], db, d[I]..., accumulate ? G::ScaleOut::One : G::ScaleOut::Zero);
}

__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Named barriers (id 0 is __syncthreads): both warpgroups, 256 threads ...
constexpr int kBarMax0 = 1;    // warpgroup 0's max / scale published
constexpr int kBarMax1 = 2;    // warpgroup 1's max / scale published
constexpr int kBarP0 = 3;      // P0 in smem
constexpr int kBarP1 = 4;      // P1 in smem
constexpr int kBarWg0 = 5;     // ... and one warpgroup's 128 threads (ids 5, 6)
constexpr int kBarConsumers = 7;  // both consumer warpgroups where a producer runs beside them


template <int N>
__device__ __forceinline__ void fence_regs(float* d) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// true when the phase of the given parity has completed (does not block)
__device__ __forceinline__ bool mbar_test(uint32_t bar, uint32_t phase) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(bar), "r"(phase) : "memory");
  return done != 0;
}
// 16-byte async copy to a shared-memory address; src_bytes = 0 zero-fills without reading
__device__ __forceinline__ void cp_async_16s(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// the mbarrier gets one arrival (counted in its init) when this thread's cp.asyncs so far land
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
template <int N>
__device__ __forceinline__ void set_max_regs_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void set_max_regs_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t phase) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar), "r"(phase) : "memory");
}
// ---- 2-CTA clusters (kPaired): the peer's shared memory and barriers
// this CTA's rank in its cluster
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// shared::cluster address of `addr` (a shared::cta address) in CTA `rank` of the cluster
__device__ __forceinline__ uint32_t map_to_rank(uint32_t addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
// every thread of both CTAs: shared memory and barriers of both are ready / no longer used
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// Writes to the peer CTA's shared memory that count their bytes on the peer's mbarrier
// (complete_tx): the peer's waiters see them without a fence or a release on this side (a
// release at cluster scope is a GPU-wide memory barrier here, which would also wait for this
// thread's memory operations in flight).
// A bulk copy of `bytes` (16-byte multiple) from this CTA's shared memory to a shared::cluster
// address (the async proxy: no registers; the source must be fenced to the async proxy).
__device__ __forceinline__ void bulk_copy_s2cluster(uint32_t dst, uint32_t src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "r"(src), "r"(bytes), "r"(bar)
               : "memory");
}
// one 32-bit store (the mask words)
__device__ __forceinline__ void st_async_b32(uint32_t addr, uint32_t v, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n" ::"r"(addr), "r"(v),
               "r"(bar)
               : "memory");
}
// an arrival on the peer's barrier (shared::cluster address)
__device__ __forceinline__ void mbar_arrive_remote(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// One 64-column x 64-token box of page `blk` into a swizzled 8 KiB chunk.
__device__ __forceinline__ void tma_load_box(uint32_t dst, const CUtensorMap* map, int col, int blk,
                                             uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(0), "r"(blk), "r"(bar) : "memory");
}
// One 64-column x 64-head box of q[b, s] (heads from `head`) into a swizzled 8 KiB chunk.
__device__ __forceinline__ void tma_load_q_box(uint32_t dst, const CUtensorMap* map, int col, int head, int s, int b,
                                               uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(head), "r"(s), "r"(b), "r"(bar) : "memory");
}

template <KeySource kSrc> constexpr int kThreadsOf = kSrc == KeySource::kPagedTma ? 256 : 384;
// With a producer, each K buffer is filled in two halves (h = 0: chunks 0-3, h = 1: chunks
// 4-8, the rope chunk included), each with a "full" and an "empty" mbarrier. P0 lives in K0's
// rope chunk once S of its unit is done (its only smem reader, warpgroup 1's PV with V0's
// right half, is also the last reader of that half), P1 in a buffer of its own: so every
// half is released by its own last reader and K1's right half right after warpgroup 1's PV.
constexpr int kFills = 4;
// The bf16 sparse source converts nothing: its copies announce themselves on the "full"
// mbarrier as they land (cp.async.mbarrier.arrive.noinc, 128 arrivals), plus one plain
// arrival per producer warp after its lane 0 wrote the unit's mask (release for that store),
// so the producer never waits for its own copies. The fp8 sources wait, convert, announce.
template <KeySource kSrc> constexpr bool kLandArrivesOf = kSrc == KeySource::kSparse16;
__device__ __forceinline__ int fill_id(int b, int h) { return 2 * b + h; }
template <KeySource kSrc> constexpr bool kFp8Of = kSrc == KeySource::kPagedFp8 || kSrc == KeySource::kSparseDsMla;
// fp8_ds_mla runs the split schedule: one unit at a time, warpgroup 0 S + softmax + O's left
// half, warpgroup 1 O's right half, the producer converting from registers (RegFp8Producer)
template <KeySource kSrc> constexpr bool kSplitOf = kSrc == KeySource::kSparseDsMla;
// Sparse sources: each piece's Q comes by TMA (q_map; heads past H zero-filled as out of
// bounds), issued by one thread on its own mbarrier (kQBar), so the 72 KiB stay off the
// load/store path the producer keeps busy (docs/kernels/sparse_decode.md, v22)
template <KeySource kSrc> constexpr bool kQTmaOf = kSrc == KeySource::kSparse16 || kSrc == KeySource::kSparseDsMla;
constexpr int kQBar = 16;
static_assert(2 * kFills <= kQBar && kQBar < 18, "the Q mbarrier must not overlap the fills'");

// The producer warpgroup of the seesaw sources (kPagedFp8, kSparse16). Thread t of its 128 handles list entry t / 2
// of every unit (its slot, validity and, fp8, the columns it converts; the bf16 source copies
// whole lines through copy_rows). Fills run in the order the consumers release parts of the K
// buffers (unit pair a, b: K0 left, K0 right, K1 right, K1 left; the bf16 source K0 left, K1
// right, K0 right, K1 left; see kFills and the consumer loop), each
// after the previous occupant's release ("empty" mbarrier: one arrival per warp of the
// releasing warpgroup). K0 goes first: warpgroup 0's S of the next pair needs it, and K1's
// left half is released only when that S is half issued (release_k1_left). A fill's copies are issued, then the previous fill
// is finished (cp.async landed; fp8: converted) and announced on its "full" mbarrier (128
// arrivals); a fill whose buffer is still busy first finishes the one before it, so a
// consumer never waits on a fill the producer holds back. T: the tile's element type (the
// fp8 cache is converted to it). fp8_ds_mla has its own producer (RegFp8Producer).
template <typename T, KeySource kSrc>
struct KeyProducer {
  static_assert(kSrc == KeySource::kPagedFp8 || kSrc == KeySource::kSparse16, "fp8_ds_mla: RegFp8Producer");
  const DecodeParams& p;
  const unsigned char* kv;
  uint32_t kbuf0, bars_full, bars_empty;
  // sparse: [2 buffers][4 words]: bit 2j of word w = entry 16w + j of the unit is valid;
  uint32_t* masks;
  int tk, part, warp, lane;
  uint32_t used = 0, empty_phase = 0;  // bit fill_id(b, h): that part filled before / parity

  __device__ uint32_t kbuf(int b) const { return kbuf0 + b * kTileBytes; }
  // this thread's entry and part (tk, part), re-derived where the fp8 copies and
  // conversions use them: the offsets ptxas derived from tk and part once and kept across
  // the producer loop spilled the 56-register producer
  __device__ __forceinline__ void fresh_ids(int& e, int& q) const {
    uint32_t t;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
    e = int((t & 127) >> 1);
    q = int(t & 1);
  }
  __device__ const unsigned char* token_row(int slot) const {
    const unsigned s = unsigned(slot);  // callers pass slot >= 0: unsigned division is cheaper
    return kv + (int64_t(s / kPage) * p.kv_stride_block + int64_t(s % kPage) * p.kv_stride_tok) *
                    (kSrc == KeySource::kSparse16 ? 2 : 1);
  }

  struct Fill {
    int b = -1, h = 0;
  };

  // bf16 source: copies 16-byte units [0, kUnits) at byte src_off of each of the warp's 16
  // entry rows to dst_of(entry, unit). 8 lanes share an entry, each taking every 8th unit, so
  // one copy instruction reads whole 128-byte lines of 4 entries (one whose 32 lanes read 32
  // different lines costs L1 and L2 a request per line, 8x more). Each entry's row offset
  // comes from its owner threads (entry e: lanes 2e, 2e + 1 of the warp) by shuffle, computed
  // there once per fill (done per lane and entry, the address math and its stride reloads
  // lengthened each fill's issue, v9), and all of it before the fill's empty wait
  // (gather_rows): after the release only the copies are left, which the consumers' next S
  // waits on (docs/kernels/sparse_decode.md, v42).
  struct RowOffs {
    uint32_t v[4];   // entry 4 j + lane / 8's row offset from kv in 16-byte units (0: none)
    uint32_t valid;  // the warp's ballot: bit 2 e set when entry e has a row
  };
  __device__ __forceinline__ RowOffs gather_rows(int slot) const {
    // 32 bits of 16-byte units: ops checks that the cache spans under 64 GiB
    const uint32_t row16 = slot >= 0 ? uint32_t((token_row(slot) - kv) >> 4) : 0u;
    uint32_t ln;  // re-read, not hoisted: lane-derived values kept live would spill the producer
    asm volatile("mov.u32 %0, %%laneid;" : "=r"(ln));
    RowOffs r;
#pragma unroll
    for (int j = 0; j < 4; ++j) r.v[j] = __shfl_sync(0xffffffff, row16, 2 * (j * 4 + ln / 8));
    r.valid = __ballot_sync(0xffffffff, slot >= 0);
    return r;
  }
  template <int kUnits, typename DstOf>
  __device__ __forceinline__ void copy_rows(const RowOffs& r, int src_off, DstOf dst_of) const {
    static_assert(kUnits % 8 == 0, "whole 128-byte lines");
    uint32_t ln;
    asm volatile("mov.u32 %0, %%laneid;" : "=r"(ln));
    // every copy of an entry at an immediate offset from one base; a copy of no entry reads
    // nothing at kv (a per-copy `ok ? 16 u : 0` cost 13.5 instructions per copy where ~3 do, v25)
    const unsigned char* base = kv + src_off + (ln % 8) * 16;
    const uint32_t mine = r.valid >> (2 * (ln / 8));  // bit 8 j: entry 4 j + ln / 8
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int e = j * 4 + ln / 8;
      const unsigned char* row = base + (uint64_t(r.v[j]) << 4);
      const int nbytes = (mine >> (8 * j)) & 1 ? 16 : 0;
#pragma unroll
      for (int k = 0; k < kUnits / 8; ++k) {
        cp_async_16s(dst_of(16 * warp + e, ln % 8 + 8 * k), row + 8 * 16 * k, nbytes);
      }
    }
  }

  // The 128-byte lines of half h of this thread's entry row to L2 (h = 0: lines 0-3, h = 1:
  // lines 4-8; part 0 takes the first 2 or 3, part 1 the rest). Issued before the fill's
  // release wait, so where the rows come from DRAM the copies after the release find them in
  // L2 or on their way (docs/kernels/sparse_decode.md, v55). A pair ahead, the lines were
  // evicted before use (v54).
  __device__ __forceinline__ void prefetch_half(int slot, int h) const {
    if (slot < 0) return;
    const unsigned char* row = token_row(slot) + (h ? 512 + 384 * part : 256 * part);
    const int n = h && !part ? 3 : 2;
#pragma unroll
    for (int l = 0; l < 3; ++l)
      if (l < n) asm volatile("prefetch.global.L2 [%0];" ::"l"(row + 128 * l));
  }
  // half h of buffer b from cache slot `slot` (-1: zeros, masked): h = 0 chunks 0-3, h = 1
  // chunks 4-8 (see kFills)
  __device__ Fill issue(int b, int h, int slot, Fill& pending) {
    return issue_to(fill_id(b, h), kbuf(b), b, h, slot, pending);
  }
  // the same into any part: barriers `bit`, chunk c of the tile at dst + c * kChunkBytes (only
  // the half's chunks are written), mask words masks[4 b ..] (fp8: finish() converts in
  // kbuf(b)). The sparse kernel for H <= 16 keeps the halves in rings of their own.
  __device__ __forceinline__ Fill issue_to(int bit, uint32_t dst, int b, int h, int slot, Fill& pending) {
    RowOffs roffs{};
    if constexpr (kSrc == KeySource::kSparse16) roffs = gather_rows(slot);
    if ((used >> bit) & 1) {
      const uint32_t bar = bars_empty + bit * 8;
      const uint32_t ph = (empty_phase >> bit) & 1;
      // lane 0 decides for its warp: the finish step synchronises the warp
      const bool ready = __shfl_sync(0xffffffff, mbar_test(bar, ph), 0);
      if (!ready && pending.b >= 0) {
        cp_async_wait<0>();
        finish(pending);
        pending.b = -1;
      }
      mbar_wait(bar, ph);
      empty_phase ^= 1u << bit;
    }
    used |= 1u << bit;
    if constexpr (kSrc == KeySource::kSparse16) {  // dense fp8 masks by position (seq_len, causal)
      if (lane == 0) masks[b * 4 + warp] = roffs.valid;
    }
    Fill f;
    f.b = b; f.h = h;
    const bool rope_here = h == 1;
    if constexpr (kSrc == KeySource::kSparse16) {
      // 16-byte units [0, 32) (h = 0), [32, 64) (h = 1) and the rope's [64, 72)
      copy_rows<32>(roffs, 512 * h, [&](int e, int u) { return dst + sw128_offset(e, (32 * h + u) * 8); });
      if (rope_here) copy_rows<8>(roffs, 1024, [&](int e, int u) { return dst + sw128_offset(e, (64 + u) * 8); });
    } else {
      // 128 e4m3 values staged raw: units 0-3 in chunk 4h + 1, units 4-7 in chunk 4h + 3, at
      // this entry's 128-byte row (see finish). Each thread copies what it converts:
      // copy_rows' whole-line copies were measured slower here (docs/kernels/sparse_decode.md,
      // v4).
      const bool ok = slot >= 0;
      const unsigned char* row = ok ? token_row(slot) : kv;
      const int nbytes = ok ? 16 : 0;
      int e, pt;
      fresh_ids(e, pt);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint32_t stage = dst + (4 * h + 1 + 2 * (j >> 2)) * kChunkBytes + raw_offset(e, pt * 4 + (j & 3));
        cp_async_16s(stage, row + h * 256 + pt * 128 + j * 16, nbytes);
      }
      if (rope_here) {  // rope: 64 e4m3 at byte 512, staged raw in chunk 8's row (units 2 part, 2 part + 1)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          cp_async_16s(dst + 8 * kChunkBytes + raw_offset(e, pt * 2 + j), row + 512 + pt * 32 + j * 16, nbytes);
        }
      }
    }
    if constexpr (kLandArrivesOf<kSrc>) {
      const uint32_t full = bars_full + bit * 8;
      cp_async_arrive_noinc(full);
      if (lane == 0) mbar_arrive(full);  // after the mask store above
      f.b = -1;                          // nothing left to finish
    } else {
      cp_async_commit();
    }
    return f;
  }

  // the fill's copies have landed (caller waited): dequantize, publish to the async proxy,
  // announce
  __device__ void finish(const Fill& f) {
    if constexpr (kFp8Of<kSrc>) {
      // raw units j < 4 sit in chunk 4h+1 and become columns of chunk 4h + 2*part; units
      // j >= 4 sit in chunk 4h+3 and become columns of chunk 4h + 2*part + 1 (per-tensor fp8,
      // h = 1: the raw rope in chunk 8 becomes chunk 8). An entry's 128-byte row in each chunk
      // belongs to its two threads (one warp): the warp reads all its raw units before any
      // lands on a raw row.
      const uint32_t dst = kbuf(f.b);
      unsigned char* gen = reinterpret_cast<unsigned char*>(__cvta_shared_to_generic(dst));
      int e, pt;
      fresh_ids(e, pt);
      auto raw_at = [&](int j) {
        return *reinterpret_cast<const uint4*>(gen + (4 * f.h + 1 + 2 * (j >> 2)) * kChunkBytes +
                                               raw_offset(e, pt * 4 + (j & 3)));
      };
      auto put_at = [&](int col, uint4 raw) {
        uint32_t v[8];
        convert_e4m3x16<T>(raw, 1.f, v);  // exact: kv_scale is folded into S and O
        *reinterpret_cast<uint4*>(gen + sw128_offset(e, col)) = make_uint4(v[0], v[1], v[2], v[3]);
        *reinterpret_cast<uint4*>(gen + sw128_offset(e, col + 8)) = make_uint4(v[4], v[5], v[6], v[7]);
      };
      auto put = [&](int j, uint4 raw) { put_at(256 * f.h + pt * 128 + j * 16, raw); };
#pragma unroll
      for (int j = 0; j < 4; ++j) put(j, raw_at(j));  // to chunks 4h, 4h+2: no raw there
      uint4 hi[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) hi[j] = raw_at(4 + j);
      __syncwarp();  // every raw unit of the warp's rows is in registers or already used
#pragma unroll
      for (int j = 0; j < 4; ++j) put(4 + j, hi[j]);
      if (kSrc == KeySource::kPagedFp8 && f.h == 1) {  // rope, raw in chunk 8
        uint4 rope[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          rope[j] = *reinterpret_cast<const uint4*>(gen + 8 * kChunkBytes + raw_offset(e, pt * 2 + j));
        }
        __syncwarp();
#pragma unroll
        for (int j = 0; j < 2; ++j) put_at(512 + pt * 32 + j * 16, rope[j]);
      }
    }
    fence_proxy_async();
    mbar_arrive(bars_full + fill_id(f.b, f.h) * 8);
  }
};

// The fp8_ds_mla producer of the split schedule. Lane l of producer warp w handles entry
// (kPaired: 32 rank + 8 w + l % 8, a quarter of each half, part l / 8; otherwise 16 w + l % 16,
// a half of each half, part l / 16) of every unit and loads its raw e4m3 bytes, scale and
// rope straight into registers with plain 16-byte loads, before it waits for the part to be
// released; after the release it only converts and stores. Nothing raw goes to shared memory,
// so a refill's latency is the conversion, not the gather (docs/kernels/sparse_decode.md,
// v15). kPaired: each warp then bulk-copies its rows to the peer's tile (v19). A 16-byte
// store instruction is served 8 lanes at a time: with the entry in the low lane bits those
// are 8 rows of the 128-byte swizzle, all 8 bank groups, so the stores are conflict-free
// (entry-major lanes had 2 or 4 ways, v17).
template <bool kPaired>
struct RegFp8Producer {
  static constexpr int kPer = kPaired ? 4 : 2;          // threads per entry
  static constexpr int kWarpEntries = 32 / kPer;        // entries per producer warp
  static constexpr int kVals = 256 / kPer;              // e4m3 values per thread and half
  static constexpr int kLoads = kVals / 16;             // 16-byte loads of them
  static constexpr int kRopeLoads = 128 / kPer / 16;    // the entry's 128 rope bytes, shared
  const DecodeParams& p;
  const unsigned char* kv;
  uint32_t kbuf0, bars_full, bars_empty;
  // as KeyProducer's (bit 2j of word w = entry 16w + j); kPaired [2][8]: bit 2j of word w =
  // entry 8w + j (each producer warp's own word)
  uint32_t* masks;
  int e, part, warp, lane;
  uint32_t peer_delta;
  uint32_t used = 0, empty_phase = 0;

  struct Left { uint4 raw[kLoads]; float scale; };
  struct Right { uint4 raw[kLoads]; uint4 rope[kRopeLoads]; float scale; };

  // this thread's entry and part from its lane (see above)
  __device__ __forceinline__ static int entry_of(int rank, int wtid) {
    return kPaired ? 32 * rank + 8 * (wtid >> 5) + (wtid & 7) : 16 * (wtid >> 5) + (wtid & 15);
  }
  __device__ __forceinline__ static int part_of(int wtid) { return (wtid & 31) / kWarpEntries; }

  __device__ const unsigned char* token_row(int slot) const {
    const unsigned s = unsigned(slot);
    return kv + int64_t(s / kPage) * p.kv_stride_block + int64_t(s % kPage) * p.kv_stride_tok;
  }
  __device__ __forceinline__ static uint4 ld16(const unsigned char* src) {
    return __ldg(reinterpret_cast<const uint4*>(src));
  }
  // this thread's bytes of half h of cache slot `slot` (-1: zeros)
  __device__ __forceinline__ void load(int h, int slot, uint4* raw, uint4* rope, float& scale) const {
    if (slot >= 0) {
      const unsigned char* row = token_row(slot);
#pragma unroll
      for (int j = 0; j < kLoads; ++j) raw[j] = ld16(row + 256 * h + part * kVals + 16 * j);
      scale = __ldg(reinterpret_cast<const float*>(row + 512) + 2 * h + (part * kVals >> 7));
      if (rope != nullptr) {
#pragma unroll
        for (int j = 0; j < kRopeLoads; ++j) rope[j] = ld16(row + 528 + part * (128 / kPer) + 16 * j);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kLoads; ++j) raw[j] = make_uint4(0, 0, 0, 0);
      scale = 0.f;
      if (rope != nullptr) {
#pragma unroll
        for (int j = 0; j < kRopeLoads; ++j) rope[j] = make_uint4(0, 0, 0, 0);
      }
    }
  }
  // an L2 prefetch of this thread's share of slot `slot`'s 656-byte row (its 128-byte lines)
  __device__ __forceinline__ void prefetch_l2(int slot) const {
    if (slot < 0) return;
    const unsigned char* row = token_row(slot);
#pragma unroll
    for (int k = part; k < 7; k += kPer) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(row + (k < 6 ? 128 * k : 655)));
    }
  }
  __device__ __forceinline__ static void store16(uint32_t dst, uint32_t off, uint4 v) {
    unsigned char* gen = reinterpret_cast<unsigned char*>(__cvta_shared_to_generic(dst));
    *reinterpret_cast<uint4*>(gen + off) = v;
  }
  // part h of buffer b: wait for its release, write the unit's mask (h = 0), convert and
  // store, announce
  __device__ __forceinline__ void put(int b, int h, int slot, const uint4* raw, const uint4* rope, float scale) {
    const int bit = fill_id(b, h);
    if ((used >> bit) & 1) {
      mbar_wait(bars_empty + bit * 8, (empty_phase >> bit) & 1);
      empty_phase ^= 1u << bit;
    }
    used |= 1u << bit;
    const uint32_t full = bars_full + bit * 8;
    if (h == 0) {
      // lane l reports entry l / 2 of the warp's (held by lane l / 2): bit 2j (and 2j + 1) of
      // the word is entry j
      const bool entry_ok = __shfl_sync(0xffffffff, slot >= 0, lane >> 1);
      if constexpr (kPaired) {
        // the warp's 8 entries in the low 16 bits, in both CTAs
        const uint32_t valid = __ballot_sync(0xffffffff, lane < 16 && entry_ok);
        if (lane == 0) {
          uint32_t* word = masks + b * 8 + e / 8;
          *word = valid;
          st_async_b32(smem_addr(word) + peer_delta, valid, full + peer_delta);
        }
      } else {
        const uint32_t valid = __ballot_sync(0xffffffff, entry_ok);
        if (lane == 0) masks[b * 4 + warp] = valid;
      }
    }
    const uint32_t dst = kbuf0 + b * kTileBytes;
    // unpaired: the entry read afresh from %tid.x; held across the loop, the store offsets
    // derived from it were hoisted and spilled
    int row = e;
    if constexpr (!kPaired) {
      int t;
      asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
      row = entry_of(0, t & 127);
    }
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      uint32_t v[8];
      convert_e4m3x16<__nv_bfloat16>(raw[j], scale, v);
      const int col = 256 * h + part * kVals + 16 * j;
      store16(dst, sw128_offset(row, col), make_uint4(v[0], v[1], v[2], v[3]));
      store16(dst, sw128_offset(row, col + 8), make_uint4(v[4], v[5], v[6], v[7]));
    }
    if (rope != nullptr) {
#pragma unroll
      for (int j = 0; j < kRopeLoads; ++j) store16(dst, sw128_offset(row, 512 + part * (64 / kPer) + 8 * j), rope[j]);
    }
    fence_proxy_async();
    if constexpr (kPaired) {
      // the warp's rows of each chunk of the half are contiguous (1 KiB): once every lane's
      // stores are fenced, lane 0 copies them to the peer's tile (chunks 0-3, or 4-8 with
      // the rope), completing on the peer's "full" barrier, and expects the same from the
      // peer's counterpart warp (plus its mask word)
      constexpr int kRowBytes = kWarpEntries * 128;
      __syncwarp();
      if (lane == 0) {
        const int c0 = 4 * h, c1 = h == 0 ? 4 : 9;
        const uint32_t rows = uint32_t(e & ~(kWarpEntries - 1)) * 128;
        for (int c = c0; c < c1; ++c) {
          const uint32_t src = dst + c * kChunkBytes + rows;
          bulk_copy_s2cluster(src + peer_delta, src, kRowBytes, full + peer_delta);
        }
        mbar_expect_tx(full, kRowBytes * (c1 - c0) + (h == 0 ? 4 : 0));
      } else {
        mbar_arrive(full);
      }
    } else {
      mbar_arrive(full);
    }
  }
};

// Dense sources: T = bf16 or fp16 (q's type), requests are batch entries. Sparse sources:
// T = bf16, requests are query groups (DecodeParams). kPaired: see KeyProducer; launched as
// 2-CTA clusters along y (the two row tiles).
template <typename T, KeySource kSrc, bool kPaired, bool kPrefetch = false>
__global__ void __launch_bounds__(kThreadsOf<kSrc>, 1) decode_wgmma_kernel(const __grid_constant__ DecodeParams p,
                                                                         const __grid_constant__ CUtensorMap kv_map,
                                                                         const __grid_constant__ CUtensorMap q_map) {
  constexpr bool kSparse = kSrc == KeySource::kSparse16 || kSrc == KeySource::kSparseDsMla;
  constexpr bool kProduced = kSrc != KeySource::kPagedTma;  // a producer warpgroup fills K
  extern __shared__ unsigned char smem_raw[];
  // SW128 atoms must start on 1024-byte boundaries
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  const uint32_t sQ = base;
  auto sKbuf = [&](int b) { return base + (1 + b) * kTileBytes; };
  // kPagedTma: P0 in a buffer of its own, P1 in Q's rope chunk once that is in registers;
  // with a producer (fewer registers left): P0 in K0's rope chunk, dead once S of its unit is
  // done (see kFills), P1 in the buffer of its own
  const uint32_t sP0 = kProduced ? sKbuf(0) + 8 * kChunkBytes : base + 3 * kTileBytes;
  const uint32_t sP1 = kProduced ? base + 3 * kTileBytes : sQ + 8 * kChunkBytes;
  float* sM = reinterpret_cast<float*>(smem + 3 * kTileBytes + kPBytes);  // running max (log2)
  float* sScale0 = sM + kRows;
  float* sScale1 = sScale0 + kRows;
  float* sSum = sScale1 + kRows;                                           // [2][64]
  // mbarriers. kPagedTma: one per 8 KiB chunk c of buffer b, at bars + (9b + c) * 8. With a
  // producer: "full" of part h of buffer b at bars + fill_id(b, h) * 8, "empty" at
  // bars + (kFills + fill_id(b, h)) * 8.
  const uint32_t bars = base + 3 * kTileBytes + kPBytes + 5 * kRows * sizeof(float);
  uint32_t* sMask = reinterpret_cast<uint32_t*>(smem + (bars - base) + 18 * 8);  // sparse: [2][4] (kPaired [2][8])

  const int tid = threadIdx.x, lane = tid & 31;
  const int wg = tid >> 7, wtid = tid & 127;
  const int wrow = (wtid >> 5) * 16 + (lane >> 2);  // this thread's rows: wrow, wrow + 8
  const int qd = lane & 3;
  const bool wg_leader = wtid == 0;
  // kPaired: the peer CTA's shared::cluster address of x is x + peer_delta
  const uint32_t peer_delta = kPaired ? map_to_rank(base, cluster_rank() ^ 1u) - base : 0u;
  if (tid == 0) {
    if constexpr (kProduced) {
      // full: every producer thread (+ each producer warp once, see kLandArrivesOf; kPaired:
      // lane 0 of each producer warp with the bytes the peer's counterpart warp copies here)
      for (int i = 0; i < kFills; ++i) mbar_init(bars + i * 8, kLandArrivesOf<kSrc> ? 132 : 128);
      // empty: the releasing warpgroup's warps (kPaired: of both CTAs)
      for (int i = kFills; i < 2 * kFills; ++i) mbar_init(bars + i * 8, kPaired ? 8 : 4);
      if constexpr (kQTmaOf<kSrc>) mbar_init(bars + kQBar * 8, 1);
    } else {
      for (int i = 0; i < 18; ++i) mbar_init(bars + i * 8, 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if (tid == 0) TL(0);
  pdl_launch_dependents();
  pdl_wait();  // the plan, q, the indices and the cache are written by earlier kernels
  if (tid == 0) TL(1);
  // per-tensor fp8: S = kv_scale * (q . k8) and O = kv_scale * (P . v8) (read again in the
  // epilogue rather than held in a register); 1 otherwise
  auto read_kv_scale = [&] {
    return kSrc == KeySource::kPagedFp8 ? (p.kv_scale_ptr != nullptr ? __ldg(p.kv_scale_ptr) : p.kv_scale_value)
                                        : 1.f;
  };
  const float scale_log2 = p.scale_log2 * read_kv_scale();

  // the plan's schedule (the sparse kernels may run a uniform plan: see plan_start)
  auto P_at = [&](int r) { return plan_start<kSparse>(p, r); };
  auto request_of = [&](int u) { return plan_request_of_unit<kSparse>(p, u); };
  const int cta = blockIdx.x;
  const int row0 = blockIdx.y * kRows;
  int u_begin, u_end, U;
  if (!cta_units<kSparse>(p, u_begin, u_end, U)) return;  // kPaired: both CTAs (same blockIdx.x)
  if constexpr (kPaired) cluster_sync();  // both CTAs' barriers initialised
  else __syncthreads();                   // barriers initialised

  // block id of page pi of request r (0 past the block table: the page is then masked and
  // its V zeroed, see n_valid; the
  // producer copies nothing for it)
  auto block_of = [&](int r, int pi) {
    return pi < p.max_blocks ? __ldg(p.block_table + r * p.bt_stride + pi) : 0;
  };

  if constexpr (kProduced) {
    if constexpr (kSplitOf<kSrc>) {
      if (wg == 2) {  // ---- producer warpgroup of the split schedule
        set_max_regs_dec<kSplitProducerRegs>();
        using Prod = RegFp8Producer<kPaired>;
        const int entry = Prod::entry_of(int(cluster_rank()), wtid), part = Prod::part_of(wtid);
        Prod prod{p,    static_cast<const unsigned char*>(p.kv), sKbuf(0), bars, bars + kFills * 8,
                  sMask, entry, part, wtid >> 5, lane, peer_delta};
        int r = request_of(u_begin);
        for (int u = u_begin; u < u_end;) {
          while (u >= P_at(r + 1)) ++r;
          const int Pr = P_at(r);
          const int pg_begin = u - Pr, pg_end = min(u_end, P_at(r + 1)) - Pr;
          const int* list = sparse_group_indices(p, r);
          const int len = sparse_group_len(p, r);
          auto fetch = [&](int pg) {
            const int pos = pg * kKeys + entry;
            return pg < pg_end && pos < len ? __ldg(list + pos) : -1;
          };
          auto slot_from = [&](int v) { return v >= 0 && v < p.num_slots ? v : -1; };
          // unit i of the piece goes to buffer i % 2 (the consumers count the same way);
          // the left half of unit i + 1 is loaded while unit i's right half waits, the
          // index of unit i + 2 while unit i is converted
          const int n = pg_end - pg_begin;
          int slot = slot_from(fetch(pg_begin));
          int next_entry = fetch(pg_begin + 1);
          // unpaired: unit i + 2's rows are prefetched to L2 during unit i (its index loaded
          // one unit earlier); measured -1 to -6% unpaired, +0-2% paired, so paired does not
          // (docs/kernels/sparse_decode.md, v16)
          constexpr bool kL2Prefetch = !kPaired;
          int after_entry = kL2Prefetch ? fetch(pg_begin + 2) : -1;
          typename Prod::Left left;
          typename Prod::Right right;
          prod.load(0, slot, left.raw, nullptr, left.scale);
#pragma unroll 1
          for (int i = 0; i < n; ++i) {
            const int b = i & 1;
            prod.load(1, slot, right.raw, right.rope, right.scale);
            int after_next;
            if constexpr (kL2Prefetch) {
              prod.prefetch_l2(slot_from(after_entry));
              after_next = after_entry;
              after_entry = fetch(pg_begin + i + 3);
            } else {
              after_next = fetch(pg_begin + i + 2);
            }
            prod.put(b, 0, slot, left.raw, nullptr, left.scale);
            const int slot_next = slot_from(next_entry);
            if (i + 1 < n) prod.load(0, slot_next, left.raw, nullptr, left.scale);
            prod.put(b, 1, slot, right.raw, right.rope, right.scale);
            slot = slot_next;
            next_entry = after_next;
          }
          u = Pr + pg_end;
        }
        if constexpr (kPaired) cluster_sync();  // see the end of the kernel
        return;
      }
    } else if (wg == 2) {  // ---- producer warpgroup
      set_max_regs_dec<kProducerRegs>();
      KeyProducer<T, kSrc> prod{p,        static_cast<const unsigned char*>(p.kv), sKbuf(0), bars, bars + kFills * 8,
                                sMask,    wtid >> 1, wtid & 1, wtid >> 5, lane};
      typename KeyProducer<T, kSrc>::Fill pending;
      auto issue = [&](int b, int h, int slot) {
        const auto f = prod.issue(b, h, slot, pending);
        if (pending.b >= 0) {
          cp_async_wait<1>();
          prod.finish(pending);
        }
        pending = f;
      };
      // bf16 sparse: the next piece's first two entries, loaded during this piece's last pair
      // (loaded at the next piece's start, a new request's index loads stood between the last
      // pair's fills and the next piece's first; docs/kernels/sparse_decode.md, v34)
      int carry_a = -1, carry_b = -1;
      bool carried = false;
      int r = request_of(u_begin);
      for (int u = u_begin; u < u_end;) {
        while (u >= P_at(r + 1)) ++r;
        const int Pr = P_at(r);
        const int pg_begin = u - Pr, pg_end = min(u_end, P_at(r + 1)) - Pr;
        // cache slot of this thread's entry of unit pg (-1: zero-filled, masked)
        const int* list = kSparse ? sparse_group_indices(p, r) : nullptr;
        const int len = kSparse ? sparse_group_len(p, r) : __ldg(p.seq_lens + r);
        // unit pg's entry for this thread as loaded (sparse: the listed slot; dense: the
        // page's block id; -1: none), and the cache slot it names (-1: zero-filled, masked).
        // The fp8 sources check the next pair's entries only when that pair starts: a check
        // right after the load stalled their producer each pair (decode -2 to -4%). The bf16
        // source checks at once: there the later check measured up to 5% slower at v7 and
        // within the run-to-run spread at v25 (prefill, docs/kernels/sparse_decode.md).
        auto fetch = [&](int pg) {
          if constexpr (kSparse) {
            const int pos = pg * kKeys + prod.tk;
            return pos < len ? __ldg(list + pos) : -1;
          } else {  // dense: token pg * 64 + tk of the request, on its page's block
            return pg < p.max_blocks && pg * kKeys + prod.tk < len ? block_of(r, pg) : -1;
          }
        };
        auto slot_from = [&](int entry) {
          if constexpr (kSparse) return entry >= 0 && entry < p.num_slots ? entry : -1;
          else return entry >= 0 ? entry * kPage + prod.tk : -1;
        };
        // bf16 sparse over a cache larger than L2 (kPrefetch: the decode batches): the second
        // pair's entries are loaded with the first's. Loaded in the first pair's iteration,
        // they were a second index load in series before the piece's first fill, since the
        // bf16 source checks them at once. Decode at batch 32 -1.5 to -3.5%; in the other
        // instance the prefill at H = 64, 8k measured +1.5% over three calls (code generation:
        // only a CTA's first piece gains there), so that instance keeps its code (v62). The
        // else branch is the original code as it was: one form for both changed other SASS.
        constexpr bool kSecondPairEarly = kSrc == KeySource::kSparse16 && kPrefetch;
        int slot_a, slot_b, second_a = -1, second_b = -1;
        if constexpr (kSecondPairEarly) {
          const int entry_a = carried ? carry_a : fetch(pg_begin);
          const int entry_b = pg_begin + 1 < pg_end ? (carried ? carry_b : fetch(pg_begin + 1)) : -1;
          second_a = pg_begin + 2 < pg_end ? fetch(pg_begin + 2) : -1;
          second_b = pg_begin + 3 < pg_end ? fetch(pg_begin + 3) : -1;
          slot_a = slot_from(entry_a);
          slot_b = pg_begin + 1 < pg_end ? slot_from(entry_b) : -1;
        } else {
          slot_a = slot_from(carried ? carry_a : fetch(pg_begin));
          slot_b = pg_begin + 1 < pg_end ? slot_from(carried ? carry_b : fetch(pg_begin + 1)) : -1;
        }
        carried = false;
        for (int pa_ = pg_begin; pa_ < pg_end; pa_ += 2) {
          const bool has_b = pa_ + 1 < pg_end;
          // the next pair's entries (loads in flight while this pair is issued)
          constexpr bool kLateCheck = kFp8Of<kSrc>;
          auto early = [&](int entry) { return kLateCheck ? entry : slot_from(entry); };
          const bool second = kSecondPairEarly && pa_ == pg_begin;
          const int next_a = early(second ? second_a : pa_ + 2 < pg_end ? fetch(pa_ + 2) : -1);
          const int next_b = early(second ? second_b : pa_ + 3 < pg_end ? fetch(pa_ + 3) : -1);
          if constexpr (kSrc == KeySource::kSparse16) {
            if (pa_ + 2 >= pg_end && Pr + pg_end < u_end) {  // last pair, and a next piece
              const int nr = request_of(Pr + pg_end);  // it starts at that request's first unit
              const int* nlist = sparse_group_indices(p, nr);
              const int nlen = sparse_group_len(p, nr);
              carry_a = prod.tk < nlen ? __ldg(nlist + prod.tk) : -1;
              carry_b = kKeys + prod.tk < nlen ? __ldg(nlist + kKeys + prod.tk) : -1;
              carried = true;
            }
          }
          // bf16: in the order the halves are released (K0 left, K1 right, K0 right, K1 left),
          // each after a blocking wait. Polling K0 left and K1 right for whichever came free
          // first (v7-v24) executed ~18 instructions per poll, 1.7 M polls per 1024 tokens,
          // and measured no faster (docs/kernels/sparse_decode.md, v25).
          if constexpr (kSrc == KeySource::kSparse16) {
            if (wtid == 0 && pa_ == pg_begin && u == u_begin) TL(2);
            // kPrefetch: each fill's lines to L2 before its release wait (see launch_sparse_wgmma)
            if constexpr (kPrefetch) prod.prefetch_half(slot_a, 0);
            issue(0, 0, slot_a);
            if (has_b) {
              if constexpr (kPrefetch) prod.prefetch_half(slot_b, 1);
              issue(1, 1, slot_b);
            }
            if constexpr (kPrefetch) prod.prefetch_half(slot_a, 1);
            issue(0, 1, slot_a);
            if (has_b) {
              if constexpr (kPrefetch) prod.prefetch_half(slot_b, 0);
              issue(1, 0, slot_b);
            }
            if (wtid == 0 && pa_ == pg_begin && u == u_begin) TL(3);
          } else {
            // fills (b, h) = (0, 0), (0, 1), (1, 1), (1, 0) in a loop that is not unrolled:
            // unrolled, each of the 4 call sites inlined its conversions twice (~4400
            // instructions of producer code) and the producer stalled on instruction fetch
            // 13% of its time (docs/kernels/sparse_decode.md, v14)
            const int n_fills = has_b ? 4 : 2;
#pragma unroll 1
            for (int k = 0; k < n_fills; ++k) {
              const int b = k >> 1, h = (k == 1 || k == 2) ? 1 : 0;
              issue(b, h, b == 0 ? slot_a : slot_b);
            }
          }
          slot_a = kLateCheck ? slot_from(next_a) : next_a;
          slot_b = kLateCheck ? slot_from(next_b) : next_b;
        }
        u = Pr + pg_end;
      }
      if (pending.b >= 0) {
        cp_async_wait<0>();
        prod.finish(pending);
      }
      return;
    }
  }
  // consumers from here: two warpgroups, 256 threads. The split schedule instantiates this
  // once per warpgroup (wg_id a compile-time constant), each under its own register limit:
  // a shared path would have to fit the smaller one.
  auto consumers = [&](auto wg_id) {
  const int wg = wg_id;
  auto consumers_sync = [&] {
    if constexpr (kProduced) named_sync(kBarConsumers, kConsumerThreads);
    else __syncthreads();
  };

  uint32_t phases = 0;  // kPagedTma: bit (9b + c): parity of buffer b chunk c's next completion;
                        // with a producer: bit fill_id(b, h) of that part's "full" barrier
  const T* qbase = static_cast<const T*>(p.q);
  constexpr bool kQTma = kQTmaOf<kSrc>;
  const uint32_t q_bar = bars + kQBar * 8;
  uint32_t q_phase = 0;
  // kQTma: Q of query group rq -> sQ (one thread; sQ is free)
  auto load_q = [&](int rq) {
    mbar_expect_tx(q_bar, kTileBytes);
#pragma unroll
    for (int c = 0; c < kDqk / 64; ++c)
      tma_load_q_box(sQ + c * kChunkBytes, &q_map, c * 64, row0, rq % p.group_s_q, rq / p.group_s_q, q_bar);
  };

  // TMA of one half of buffer b (h = 0: chunks 0-3, h = 1: chunks 4-8), one mbarrier per
  // chunk so S can start on each as it lands
  auto load_half = [&](int b, int h, int blk) {
    const int c0 = h == 0 ? 0 : 4, c1 = h == 0 ? 4 : 9;
    for (int c = c0; c < c1; ++c) {
      const uint32_t bar = bars + (9 * b + c) * 8;
      mbar_expect_tx(bar, kChunkBytes);
      tma_load_box(sKbuf(b) + c * kChunkBytes, &kv_map, c * 64, blk, bar);
    }
  };
  // half h of buffer b is no longer read by this warpgroup (its wgmmas retired): kPagedTma,
  // TMA the next page there (if there is one); otherwise tell the producer
  auto release = [&](int b, int h, bool has_next, int next_blk) {
    if constexpr (kProduced) {
      const uint32_t empty = bars + (kFills + fill_id(b, h)) * 8;
      if (lane == 0) mbar_arrive(empty);
      if (kPaired && lane == 0) mbar_arrive_remote(empty + peer_delta);  // the peer's producer writes here too
    } else {
      if (wg_leader && has_next) load_half(b, h, next_blk);
    }
  };
  auto wait_chunk = [&](int b, int c) {
    if constexpr (kProduced) {
      // one barrier per half: chunks 0-3, 4-8
      if (c != 0 && c != 4) return;
      const int bit = fill_id(b, c >> 2);
      mbar_wait(bars + bit * 8, (phases >> bit) & 1);
      phases ^= 1u << bit;
      // cp.async wrote the half through the generic proxy and no producer thread fenced it.
      // kPaired: since v19 the peer's rows come by bulk copy (async proxy) and the local ones
      // are fenced by the producer, so this fence is redundant; it stays because the
      // benchmarked and e2e-tested build has it (without it: the same speed, v20)
      if constexpr (kLandArrivesOf<kSrc> || kPaired) fence_proxy_async();
    } else {
      const int bit = 9 * b + c;
      mbar_wait(bars + bit * 8, (phases >> bit) & 1);
      phases ^= 1u << bit;
    }
  };
  // wgmma descriptors of Q, the K buffers and this warpgroup's V columns of them (desc_at)
  // (selected, not indexed: b is a run-time value in places, and an indexed local array
  // would live in local memory)
  const uint64_t dQ = make_desc(sQ, 16, 1024);
  const uint64_t dK0 = make_desc(sKbuf(0), 16, 1024), dK1 = make_desc(sKbuf(1), 16, 1024);
  const uint64_t dV0 = make_desc(sKbuf(0) + wg * kHalfL, kChunkBytes, 1024);
  const uint64_t dV1 = make_desc(sKbuf(1) + wg * kHalfL, kChunkBytes, 1024);
  auto dK = [&](int b) { return b == 0 ? dK0 : dK1; };
  auto dV = [&](int b) { return b == 0 ? dV0 : dV1; };
  float o[128];
  float s[32];        // S of this warpgroup's current page, then its P (fp32)
  uint32_t q8[4][4];  // kPagedTma: Q rope chunk (columns 512-575) as wgmma A fragments, 4 k-steps
  float l_run[2];

  // S = Q K^T for the page in buffer b, 9 chunks of 4 k-steps, each chunk issued (one commit
  // group) once it landed; chunk 8 from registers. Buffer 0 (warpgroup 0) takes its left
  // half first, buffer 1 its right half first: the half each warpgroup refilled itself
  // arrives first. between_halves() runs after the first half's 4 groups are issued.
  // (b is a compile-time constant: a run-time chunk order would put the SS/RS choice on a
  // divergent path and ptxas would serialize the wgmmas)
  auto issue_s = [&](auto b_const, auto between_halves) {
    constexpr int b = decltype(b_const)::value;
#pragma unroll
    for (int i = 0; i < 9; ++i) {
      const int c = b == 0 ? i : (i + 4) % 9;
      wait_chunk(b, c);
      cute::warpgroup_arrive();
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const bool zero = i == 0 && k == 0;
        if (kProduced || c < 8) {
          const uint32_t koff = c * kChunkBytes + k * 32;
          gmma_ss<typename Gmma<T>::QK_SS>(desc_at(dQ, koff), desc_at(dK(b), koff), s, !zero,
                                           std::make_index_sequence<32>{});
        } else {
          gmma_rs<typename Gmma<T>::QK_RS>(q8[k], desc_at(dK(b), 8 * kChunkBytes + k * 32), s, !zero,
                                           std::make_index_sequence<32>{});
        }
      }
      cute::warpgroup_commit_batch();
      if (i == 3) between_halves();
    }
  };
  auto nothing = [] {};

  // O[:, 256 wg : +256] += P V(page in buffer b), P from registers (pa: 4 k-steps x 4 regs)
  auto issue_pv_rs = [&](const uint32_t (*pa)[4], int b) {
    cute::warpgroup_arrive();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      gmma_rs<typename Gmma<T>::PV_RS>(pa[ks], desc_at(dV(b), ks * 2048), o, true,
                                       std::make_index_sequence<128>{});
    }
    cute::warpgroup_commit_batch();
  };
  auto issue_pv_ss = [&](uint32_t sPsrc, int b) {
    const uint64_t dP = make_desc(sPsrc, 16, 1024);
    cute::warpgroup_arrive();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      gmma_ss<typename Gmma<T>::PV_SS>(desc_at(dP, ks * 32), desc_at(dV(b), ks * 2048), o, true,
                                       std::make_index_sequence<128>{});
    }
    cute::warpgroup_commit_batch();
  };
  // rows >= n_valid of a page's V (chunks 0-7) hold whatever the cache has there: zero them
  // (a producer zero-fills the entries it does not copy)
  auto zero_tail = [&](int b, int n_valid) {
    if constexpr (!kProduced) {
      if (n_valid >= kKeys) return;
      for (int i = wtid; i < (kKeys - n_valid) * 64; i += 128) {
        const int t = n_valid + i / 64, c = i % 64;  // 8 chunks x 8 16-byte units per row
        *reinterpret_cast<uint4*>(smem + (sKbuf(b) - base) + sw128_offset(t, c * 8)) = make_uint4(0, 0, 0, 0);
      }
      fence_proxy_async();
      named_sync(kBarWg0 + wg, 128);
    }
  };
  // scale S to the log2 domain and mask keys past each row's limit (dense) or not valid in
  // the unit's mask (sparse: written by the producer with the fill); row maxima of this unit
  auto mask_and_max = [&](int tok0, int seq_len, float* rmax, int mb) {  // mb: the unit's buffer
    uint32_t valid[4];
    if constexpr (kSparse) {
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        valid[w] = kPaired ? sMask[mb * 8 + 2 * w] | (sMask[mb * 8 + 2 * w + 1] << 16) : sMask[mb * 4 + w];
      }
    }
    // bf16 seesaw: a unit whose entries are all valid (the usual case, topk within the
    // context) skips the per-key tests, the same arithmetic in the same order. With the tests
    // ptxas parked its predicates in a register around the shuffles: ~170 instructions on
    // warpgroup 0's way to kBarMax0 where these take 80 (docs/kernels/sparse_decode.md, v49).
    // A loop of its own: one loop shared with the tested one through a predicate lambda cost
    // the dense kernels 120 more instructions
    if constexpr (kSrc == KeySource::kSparse16) {
      if ((valid[0] & valid[1] & valid[2] & valid[3] & 0x55555555u) == 0x55555555u) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          float mx = -INFINITY;
#pragma unroll
          for (int n = 0; n < 8; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float& v = s[n * 4 + hr * 2 + e];
              v = v * scale_log2;
              mx = fmaxf(mx, v);
            }
          }
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
          rmax[hr] = mx;
        }
        return;
      }
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = row0 + wrow + hr * 8;
      const int limit = p.causal ? seq_len - p.s_q + row / p.heads + 1 : seq_len;
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < 8; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = n * 8 + qd * 2 + e;
          const bool ok = kSparse ? (valid[key >> 4] >> (2 * (key & 15))) & 1 : tok0 + key < limit;
          float& v = s[n * 4 + hr * 2 + e];
          v = ok ? v * scale_log2 : -INFINITY;
          mx = fmaxf(mx, v);
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
      rmax[hr] = mx;
    }
  };
  // P = exp2(S - m) in place; row sums
  auto exponentiate = [&](const float* m, float* rsum) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < 8; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& v = s[n * 4 + hr * 2 + e];
          v = exp2f(v - m[hr]);
          sum += v;
        }
      }
      rsum[hr] = sum;
    }
  };
  // P (fp32 registers, times per-row factors) -> A fragments; the m64n64 accumulator layout
  // is the A layout of four k16 steps
  auto pack_p = [&](uint32_t (*pa)[4], const float* f) {
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      pa[ks][0] = Mma<T>::pack(s[8 * ks + 0] * f[0], s[8 * ks + 1] * f[0]);
      pa[ks][1] = Mma<T>::pack(s[8 * ks + 2] * f[1], s[8 * ks + 3] * f[1]);
      pa[ks][2] = Mma<T>::pack(s[8 * ks + 4] * f[0], s[8 * ks + 5] * f[0]);
      pa[ks][3] = Mma<T>::pack(s[8 * ks + 6] * f[1], s[8 * ks + 7] * f[1]);
    }
  };
  auto store_p = [&](uint32_t dst, const uint32_t (*pa)[4]) {
    if constexpr (kSparse) {
      // one stmatrix per k16 step for its four 8x8 matrices (rows +0 / +8, columns +0 / +8:
      // the A-fragment order): lane l gives the address of row l % 16, columns 8 (l / 16).
      // 4 instructions where 16 scalar stores were, on the path to the other warpgroup's PV
      // (docs/kernels/sparse_decode.md, v27); the dense kernels keep the scalar stores
      const int prow = (wtid >> 5) * 16 + (lane & 15);
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        const uint32_t addr = dst + sw128_offset(prow, ks * 16 + (lane >> 4) * 8);
        asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
                     "r"(pa[ks][0]), "r"(pa[ks][1]), "r"(pa[ks][2]), "r"(pa[ks][3])
                     : "memory");
      }
      fence_proxy_async();
      return;
    }
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      const int col = ks * 16 + qd * 2;
      *reinterpret_cast<uint32_t*>(smem + (dst - base) + sw128_offset(wrow, col)) = pa[ks][0];
      *reinterpret_cast<uint32_t*>(smem + (dst - base) + sw128_offset(wrow + 8, col)) = pa[ks][1];
      *reinterpret_cast<uint32_t*>(smem + (dst - base) + sw128_offset(wrow, col + 8)) = pa[ks][2];
      *reinterpret_cast<uint32_t*>(smem + (dst - base) + sw128_offset(wrow + 8, col + 8)) = pa[ks][3];
    }
    fence_proxy_async();
  };
  // the running max after this warpgroup's unit (row maxima rmax): new max and the factor that
  // rescales what came before, published for the other warpgroup (sM and sScale)
  auto update_max = [&](const float* rmax, float* m_new, float* scale, float* sScale) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const float m_old = sM[wrow + hr * 8];
      m_new[hr] = fmaxf(m_old, rmax[hr]);
      scale[hr] = exp2f(m_old - m_new[hr]);
    }
    __syncwarp();
    if (qd == 0) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) { sM[wrow + hr * 8] = m_new[hr]; sScale[wrow + hr * 8] = scale[hr]; }
    }
  };
  auto scale_o = [&](const float* f) {
    if (__any_sync(0xffffffff, f[0] != 1.f || f[1] != 1.f)) {
#pragma unroll
      for (int n = 0; n < 32; ++n) {
        o[n * 4 + 0] *= f[0]; o[n * 4 + 1] *= f[0];
        o[n * 4 + 2] *= f[1]; o[n * 4 + 3] *= f[1];
      }
    }
  };

  // ---- the CTA's unit range, one request piece at a time
  int r = request_of(u_begin);
  for (int u = u_begin; u < u_end;) {
    while (u >= P_at(r + 1)) ++r;
    const int Pr = P_at(r);
    const int pg_begin = u - Pr, pg_end = min(u_end, P_at(r + 1)) - Pr;  // page indices
    const int seq_len = kSparse ? 0 : __ldg(p.seq_lens + r);
    // dense prologue: first pages of the piece (both buffers are free: the previous piece
    // ended with a CTA barrier after every wgmma retired)
    if (!kProduced && wg_leader) {
      const int pg = pg_begin + wg;
      if (pg < pg_end) {
        const int blk = block_of(r, pg);
        load_half(wg, 0, blk);
        load_half(wg, 1, blk);
      }
    }
    if constexpr (kQTma) {  // the previous piece ended with a consumer barrier: sQ is free
      if (tid == 0) load_q(r);
      if (tid < kRows) sM[tid] = kNoMax;
      if (!kSplitOf<kSrc> || wg == 0) mbar_wait(q_bar, q_phase);  // split: only warpgroup 0 reads Q
      if (wtid == 0 && u == u_begin) TL(4 + wg);
      q_phase ^= 1;
      consumers_sync();
    } else {
    // Q tile -> smem (cp.async: every copy in flight at once, rows past `rows` zero-filled;
    // plain loads stalled each store on its load), the running max reset
    for (int i = tid; i < kRows * kChunksPerRow; i += kConsumerThreads) {
      const int m = i / kChunksPerRow, c = i % kChunksPerRow;
      const int row = row0 + m;
      const T* src = qbase;
      if (row < p.rows) {
        const int qi = row / p.heads, h = row % p.heads;
        // dense: request r = batch entry; sparse: group r = (b, s), qi = 0
        src += int64_t(r / p.group_s_q) * p.q_stride_b + int64_t(r % p.group_s_q + qi) * p.q_stride_s +
               int64_t(h) * p.q_stride_h + c * 8;
      }
      cp_async_16s(base + sw128_offset(m, c * 8), src, row < p.rows ? 16 : 0);
    }
    cp_async_commit();
    if (tid < kRows) sM[tid] = kNoMax;
    cp_async_wait<0>();
    fence_proxy_async();
    consumers_sync();
    }
    if constexpr (!kProduced) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {  // Q rope chunk -> registers (A fragments)
        const int row = (wtid >> 5) * 16 + (lane & 15);
        ldmatrix_x4(q8[kk], smem + sw128_offset(row, 512 + kk * 16 + (lane >> 4) * 8));
      }
      __syncthreads();  // chunk 8 of sQ is now free for P1
    }
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    l_run[0] = l_run[1] = 0.f;

    if constexpr (kSplitOf<kSrc>) {
      // ---- split schedule, one unit at a time (unit i in buffer i % 2). Warpgroup 0: S,
      // the softmax, P to sP with its scale, O's left half (P from registers); warpgroup 1:
      // O's right half from sP. The running max lives in warpgroup 0's registers.
      const int n = pg_end - pg_begin;
      const uint32_t sP = sP1;
      if (wg == 0) {
        float m_run[2] = {kNoMax, kNoMax};
        // S of the unit in buffer b, chunk by chunk as its halves land; between() after the
        // left half's 4 groups (the previous unit's PV, issued before, then has retired)
        auto issue_s_split = [&](int b, auto between) {
#pragma unroll
          for (int c = 0; c < 9; ++c) {
            wait_chunk(b, c);
            cute::warpgroup_arrive();
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              const uint32_t koff = c * kChunkBytes + k * 32;
              gmma_ss<typename Gmma<T>::QK_SS>(desc_at(dQ, koff), desc_at(dK(b), koff),
                                               s, c != 0 || k != 0, std::make_index_sequence<32>{});
            }
            cute::warpgroup_commit_batch();
            if (c == 3) between();
          }
        };
        if (n > 0) issue_s_split(0, nothing);
        uint32_t pfrag[4][4];
#pragma unroll 1
        for (int i = 0; i < n; ++i) {
          const int b = i & 1;
          cute::warpgroup_wait<0>();
          fence_regs<32>(s);
          fence_regs<128>(o);
          float rmax[2], m_new[2], scale[2], rsum[2];
          mask_and_max(0, 0, rmax, b);
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            m_new[hr] = fmaxf(m_run[hr], rmax[hr]);
            scale[hr] = exp2f(m_run[hr] - m_new[hr]);
            m_run[hr] = m_new[hr];
          }
          exponentiate(m_new, rsum);
          const float one[2] = {1.f, 1.f};
          pack_p(pfrag, one);
          if (i > 0) named_sync(kBarP1, 256);  // warpgroup 1 is done with sP and sScale0
          if (qd == 0) { sScale0[wrow] = scale[0]; sScale0[wrow + 8] = scale[1]; }
          store_p(sP, pfrag);
          named_arrive(kBarP0, 256);
          scale_o(scale);
          l_run[0] = l_run[0] * scale[0] + rsum[0];
          l_run[1] = l_run[1] * scale[1] + rsum[1];
          fence_regs<128>(o);
          issue_pv_rs(pfrag, b);
          if (i + 1 < n) {
            // the next unit's S behind this PV; the PV retires during its left half, then
            // this unit's left half is released
            issue_s_split(b ^ 1, [&] {
              cute::warpgroup_wait<4>();
              release(b, 0, false, 0);
            });
          } else {
            cute::warpgroup_wait<0>();
            release(b, 0, false, 0);
          }
        }
        cute::warpgroup_wait<0>();
        fence_regs<128>(o);
        if (qd == 0) { sM[wrow] = m_run[0]; sM[wrow + 8] = m_run[1]; }
      } else {
#pragma unroll 1
        for (int i = 0; i < n; ++i) {
          const int b = i & 1;
          named_sync(kBarP0, 256);  // P of unit i and its scale are in smem
          const float scale[2] = {sScale0[wrow], sScale0[wrow + 8]};
          scale_o(scale);
          fence_regs<128>(o);
          issue_pv_ss(sP, b);
          cute::warpgroup_wait<0>();
          fence_regs<128>(o);
          if (i + 1 < n) named_arrive(kBarP1, 256);
          release(b, 1, false, 0);
        }
      }
    } else {
    // this warpgroup's first page
    if (pg_begin + wg < pg_end) {
      if (wg == 0) issue_s(std::integral_constant<int, 0>{}, nothing);
      else issue_s(std::integral_constant<int, 1>{}, nothing);
      cute::warpgroup_wait<0>();
      fence_regs<32>(s);
    }

    // The max handshake (kBarMax0, kBarMax1) carries only what the other warpgroup needs: each
    // warpgroup announces its max as soon as it is published, and warpgroup 1 takes its row
    // maxima before it waits. Each wait sat on the chain that ends in K0 right's refill
    // (sparse prefill H = 128 -6% in cycles, docs/kernels/sparse_decode.md, v44; with v45's and
    // v49's order, dense decode up to -6.5%, docs/kernels/dense_decode.md).
    for (int pa_ = pg_begin; pa_ < pg_end; pa_ += 2) {
      if (wtid == 0 && wg == 0) {
        const int k = 8 + (u - u_begin + pa_ - pg_begin) / 2;
        if (k < 56) TL(k);
      }
      const int pb = pa_ + 1;  // warpgroup 1's page
      const bool has_b = pb < pg_end;
      // block ids of the next pair, read now so the load latency hides behind this pair
      int blk_a2 = 0, blk_b2 = 0;
      if (!kProduced && wg_leader) {
        if (pa_ + 2 < pg_end) blk_a2 = block_of(r, pa_ + 2);
        if (pb + 2 < pg_end) blk_b2 = block_of(r, pb + 2);
      }
      if (wg == 0) {
        // ---- softmax of page pa_ on top of the running max
        float rmax[2], m_new[2], scale0[2], rsum[2];
        mask_and_max(pa_ * kKeys, seq_len, rmax, 0);
        update_max(rmax, m_new, scale0, sScale0);
        named_arrive(kBarMax0, 256);
        {
          // ptxas hoisted 24 of the exponentials above the arrive (~190 cycles of MUFU on the
          // chain it starts). Reading back the published scale (only this warpgroup writes
          // sScale0) and adding back - scale, an exact 0, to the max keeps them below it: the
          // load cannot pass the barrier, nor the exponentials the load (v49)
          __syncwarp();
          const float back = *reinterpret_cast<volatile float*>(sScale0 + wrow);
          const float zero = back - scale0[0];
          m_new[0] += zero;
          m_new[1] += zero;
        }
        exponentiate(m_new, rsum);
        scale_o(scale0);
        l_run[0] = l_run[0] * scale0[0] + rsum[0];
        l_run[1] = l_run[1] * scale0[1] + rsum[1];
        const int n_valid = pa_ < p.max_blocks ? min(kKeys, seq_len - pa_ * kKeys) : 0;
        zero_tail(0, n_valid);
        uint32_t pfrag[4][4];
        const float one[2] = {1.f, 1.f};
        pack_p(pfrag, one);
        fence_regs<128>(o);
        issue_pv_rs(pfrag, 0);
        cute::warpgroup_wait<0>();
        fence_regs<128>(o);
        named_sync(kBarMax1, 256);
        // left half of K0 is done (S and both its PV readers are warpgroup 0's)
        release(0, 0, pa_ + 2 < pg_end, blk_a2);
        const float scale1[2] = {sScale1[wrow], sScale1[wrow + 8]};
        pack_p(pfrag, scale1);  // P0 rescaled to warpgroup 1's max, for its PV
        store_p(sP0, pfrag);
        named_arrive(kBarP0, 256);
        scale_o(scale1);
        l_run[0] *= scale1[0];
        l_run[1] *= scale1[1];
        if (has_b) {
          named_sync(kBarP1, 256);
          fence_regs<128>(o);
          issue_pv_ss(sP1, 1);
        }
        // the PV with page b retires first: then buffer 1's left half can be refilled
        auto release_k1_left = [&] {
          if (!has_b) return;
          cute::warpgroup_wait<4>();  // all but the 4 chunk groups of S issued after it
          release(1, 0, pb + 2 < pg_end, blk_b2);
        };
        if (pa_ + 2 < pg_end) {
          issue_s(std::integral_constant<int, 0>{}, release_k1_left);
        } else if (has_b) {
          cute::warpgroup_wait<0>();
          release(1, 0, pb + 2 < pg_end, blk_b2);
        }
        cute::warpgroup_wait<0>();
        fence_regs<128>(o);
        fence_regs<32>(s);
      } else {
        float rmax[2], m_new[2], scale1[2], rsum[2] = {0.f, 0.f};
        if (has_b) mask_and_max(pb * kKeys, seq_len, rmax, 1);  // needs nothing of warpgroup 0's
        named_sync(kBarMax0, 256);
        const float scale0[2] = {sScale0[wrow], sScale0[wrow + 8]};
        if (!has_b) rmax[0] = rmax[1] = -INFINITY;
        update_max(rmax, m_new, scale1, sScale1);  // on top of warpgroup 0's new max
        named_arrive(kBarMax1, 256);
        const float both[2] = {scale0[0] * scale1[0], scale0[1] * scale1[1]};
        // P1 is stored and signalled before this warpgroup scales its O (warpgroup 0's PV with
        // P1 releases K1's left half when it retires; v45)
        uint32_t pfrag[4][4];
        if (has_b) {
          exponentiate(m_new, rsum);
          const int n_valid = pb < p.max_blocks ? min(kKeys, seq_len - pb * kKeys) : 0;
          zero_tail(1, n_valid);
          const float one[2] = {1.f, 1.f};
          pack_p(pfrag, one);
          store_p(sP1, pfrag);
          named_arrive(kBarP1, 256);
        }
        scale_o(both);
        l_run[0] = l_run[0] * both[0] + rsum[0];
        l_run[1] = l_run[1] * both[1] + rsum[1];
        if (has_b) {
          fence_regs<128>(o);
          issue_pv_rs(pfrag, 1);
        }
        named_sync(kBarP0, 256);
        fence_regs<128>(o);
        issue_pv_ss(sP0, 0);
        if (has_b) {
          cute::warpgroup_wait<1>();
          release(1, 1, pb + 2 < pg_end, blk_b2);
        }
        cute::warpgroup_wait<0>();
        fence_regs<128>(o);
        release(0, 1, pa_ + 2 < pg_end, blk_a2);
        if (pb + 2 < pg_end) {
          issue_s(std::integral_constant<int, 1>{}, nothing);
          cute::warpgroup_wait<0>();
          fence_regs<32>(s);
        }
      }
    }

    }  // seesaw schedule

    if (wtid == 0) TL(56 + wg);
    // ---- epilogue of the piece: row sums of both warpgroups, then out / partial
    float l0 = l_run[0], l1 = l_run[1];
    l0 += __shfl_xor_sync(0xffffffff, l0, 1); l0 += __shfl_xor_sync(0xffffffff, l0, 2);
    l1 += __shfl_xor_sync(0xffffffff, l1, 1); l1 += __shfl_xor_sync(0xffffffff, l1, 2);
    if (qd == 0) { sSum[wg * kRows + wrow] = l0; sSum[wg * kRows + wrow + 8] = l1; }
    consumers_sync();
    const float lt[2] = {sSum[wrow] + sSum[kRows + wrow], sSum[wrow + 8] + sSum[kRows + wrow + 8]};
    const float mt[2] = {sM[wrow], sM[wrow + 8]};
    const int Pr1 = P_at(r + 1);
    const bool split = (Pr / U) != ((Pr1 - 1) / U);
    const float kv_scale = read_kv_scale();
    const int slot = Pr <= u_begin ? 0 : 1;
    if (kSparse && !split) {
      // a whole request: O (bf16) through sQ (free: this piece's S are done) into rows of 1024
      // bytes, 16-byte units XOR-swizzled by row % 8, with one stmatrix per 4 n-blocks; then
      // the 256 consumer threads store it with 16-byte coalesced stores. Stored from the
      // accumulator layout, each 4-byte store spanned 8 rows (8 lines per instruction) and
      // the epilogue took ~5 us per piece (scripts/timeline_sparse.py,
      // docs/kernels/sparse_decode.md, v33).
      auto staged = [&](int m, int unit) { return uint32_t(m * 1024 + ((unit ^ (m & 7)) << 4)); };
      const int srow = (wtid >> 5) * 16 + (lane & 7);  // row of the matrix this lane addresses
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const float inv_l = lt[hr] != 0.f ? 1.f / lt[hr] : 0.f;
        const int mrow = srow + hr * 8;
#pragma unroll
        for (int g = 0; g < 8; ++g) {  // n-blocks 4g .. 4g + 3: matrix j = lane / 8
          const int unit = wg * 32 + 4 * g + (lane >> 3);
          const uint32_t addr = sQ + staged(mrow, unit);
          uint32_t v[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int n = 4 * g + j;
            v[j] = Mma<T>::pack(o[n * 4 + hr * 2] * inv_l, o[n * 4 + hr * 2 + 1] * inv_l);
          }
          asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v[0]),
                       "r"(v[1]), "r"(v[2]), "r"(v[3])
                       : "memory");
        }
        const int row = row0 + wrow + hr * 8;
        if (wg == 0 && qd == 0 && row < p.rows)
          p.lse[int64_t(r) * p.rows + row] = lt[hr] != 0.f ? (mt[hr] + __log2f(lt[hr])) * kLn2 : -INFINITY;
      }
      consumers_sync();
      const int ctid = wg * 128 + wtid;
#pragma unroll 4
      for (int k = 0; k < kRows * 64 / kConsumerThreads; ++k) {
        const int i = k * kConsumerThreads + ctid, m = i >> 6, unit = i & 63;
        if (row0 + m >= p.rows) continue;
        const uint4 val = *reinterpret_cast<const uint4*>(smem + (sQ - base) + staged(m, unit));
        *reinterpret_cast<uint4*>(static_cast<T*>(p.out) + (int64_t(r) * p.rows + row0 + m) * kDv + unit * 8) = val;
      }
      fence_proxy_async();  // sQ: generic accesses here, the next piece's Q by TMA
    } else {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = row0 + wrow + hr * 8;
      if (row >= p.rows) continue;
      const float inv_l = lt[hr] != 0.f ? kv_scale / lt[hr] : 0.f;  // kv_scale: O = kv_scale * P.v8
      const float lse_row = lt[hr] != 0.f ? (mt[hr] + __log2f(lt[hr])) * kLn2 : -INFINITY;
      if (!split) {
        T* out = static_cast<T*>(p.out) + (int64_t(r) * p.rows + row) * kDv + wg * 256;
#pragma unroll
        for (int n = 0; n < 32; ++n) {
          *reinterpret_cast<uint32_t*>(out + n * 8 + qd * 2) =
              Mma<T>::pack(o[n * 4 + hr * 2] * inv_l, o[n * 4 + hr * 2 + 1] * inv_l);
        }
        if (wg == 0 && qd == 0) p.lse[int64_t(r) * p.rows + row] = lse_row;
      } else {
        const int64_t prow = (int64_t(cta) * 2 + slot) * p.rows + row;
        float* po = p.part_out + prow * kDv + wg * 256;
#pragma unroll
        for (int n = 0; n < 32; ++n) {
          *reinterpret_cast<float2*>(po + n * 8 + qd * 2) =
              make_float2(o[n * 4 + hr * 2] * inv_l, o[n * 4 + hr * 2 + 1] * inv_l);
        }
        if (wg == 0 && qd == 0) p.part_lse[prow] = lse_row;
      }
    }
    }  // staged or direct stores
    consumers_sync();  // sM, sSum, sQ (and, kPagedTma, both K buffers) are reused by the next piece
    if (tid == 0) TL(58);
    u = Pr + pg_end;
  }
  };  // consumers
  if constexpr (kSplitOf<kSrc>) {
    if (wg == 0) {
      set_max_regs_inc<kSplitWg0Regs>();
      consumers(std::integral_constant<int, 0>{});
    } else {
      set_max_regs_dec<kSplitWg1Regs>();
      consumers(std::integral_constant<int, 1>{});
    }
  } else {
    if constexpr (kProduced) set_max_regs_inc<kConsumerRegs>();
    consumers(wg);
  }
  // kPaired: no CTA leaves while the peer may still write to its shared memory or arrive on
  // its barriers
  if constexpr (kPaired) cluster_sync();
}

// ---- H <= 16 over a bf16 cache: keys as the MMA's M dimension (the "narrow" kernel) ----
// The 64-row kernel pads H <= 16 to 64 rows, 4x the MMA work of the heads it serves, so its
// H = 16 prefill costs as much as H = 64 (~2.0 us per unit, where the copy alone takes 1.25:
// bench/gather_ceiling.cu). Here S^T = K Q^T (wgmma m64nNk16, N = kN = 16 heads: M = the
// unit's 64 keys, A = the keys as the producer lays them out) and
// O^T = V^T P^T (M = 512 value columns in 8 tiles, A = the same keys read M-major, B = P^T
// from shared memory): the MMA work is the heads'. Warpgroup w takes the piece's units
// i = w (mod 2) with its own running max, sums and O^T (8 tiles x kN / 2 floats); the two
// never wait on each other inside a piece and merge at its end, through Q's shared memory.
// The producer is the bf16 seesaw's (KeyProducer). A unit's left half (chunks 0-3: V columns
// 0-255) and right half (chunks 4-8) live in rings of their own, 3 and 2 slots, taken in the
// order of the CTA's units (unit g: left slot g % 3, right slot g % 2), so the next unit's
// left half is in flight while both right slots are in use (2 left slots measured 4% slower
// at H = 16). The layout is written for any kN that is a multiple of 8; kN = 32 (H 17-32)
// passed the gpu tests but decoded up to 60% slower than the 64-row kernel at batch <= 32,
// so only kN = 16 is built. docs/kernels/sparse_decode.md, v37.
constexpr int kNarrowLeft = 3;
constexpr int kNarrowLeftBytes = 4 * kChunkBytes;   // 32 KiB
constexpr int kNarrowRightBytes = 5 * kChunkBytes;  // 40 KiB
template <int kN>
struct NarrowLayout {
  static constexpr int kQChunk = kN * 128;                              // one 64-column chunk of Q
  static constexpr int kOffR = (kDqk / 64) * kQChunk;                   // after Q (a 1 KiB multiple)
  static constexpr int kOffL = kOffR + 2 * kNarrowRightBytes;
  static constexpr int kOffP = kOffL + kNarrowLeft * kNarrowLeftBytes;  // P^T of each warpgroup
  static constexpr int kOffRed = kOffP + 2 * kQChunk;                   // maxima [2 wg][2][4 warps][kN]
  static constexpr int kOffSum = kOffRed + 2 * 2 * 4 * kN * 4;          // sums [2 wg][4 warps][kN]
  static constexpr int kOffM1 = kOffSum + 2 * 4 * kN * 4;               // warpgroup 1's max [kN]
  static constexpr int kOffBars = kOffM1 + kN * 4;                      // full, empty: left slots, right
  static constexpr int kOffMask = kOffBars + (kQBar + 1) * 8;           // [left slot][4 words]
  static constexpr size_t kSmem = size_t(kOffMask) + kNarrowLeft * 4 * 4 + 1024;
  static_assert(kSmem <= 232448, "more shared memory than an sm_90 block can have");
  static_assert(2 * (kNarrowLeft + 2) <= kQBar, "the Q mbarrier must not overlap the rings'");
  // the merge moves half of warpgroup 1's O^T (2 kN floats per thread) through sQ, then out
  // goes through it as bf16 [kN][512]
  static_assert(2 * kN * 128 * 4 <= kOffR && kDv * kN * 2 <= kOffR, "merge and out go through Q");
};
template <int kN> struct NarrowMma;
template <> struct NarrowMma<16> {
  using QK = G::MMA_64x16x16_F32BF16BF16_SS<G::Major::K, G::Major::K>;
  using PV = G::MMA_64x16x16_F32BF16BF16_SS<G::Major::MN, G::Major::K>;
};

template <int kN>
__global__ void __launch_bounds__(384, 1) sparse_narrow_kernel(const __grid_constant__ DecodeParams p,
                                                               const __grid_constant__ CUtensorMap q_map) {
  using T = __nv_bfloat16;
  using L = NarrowLayout<kN>;
  using QK = typename NarrowMma<kN>::QK;
  using PV = typename NarrowMma<kN>::PV;
  constexpr int kRings = kNarrowLeft + 2;  // barrier bit: left slot s, right slot kNarrowLeft + s
  constexpr int kHd = kN / 4;              // heads per thread
  constexpr int kAcc = kN / 2;             // accumulator floats per thread and 64-row tile
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  const uint32_t sQ = base;
  // chunk c of unit g's tile: c < 4 in its left slot, c >= 4 in its right slot; these are the
  // addresses of chunk 0 of each, as KeyProducer::issue_to and the descriptors count
  auto left_at = [&](int g) { return base + L::kOffL + (g % kNarrowLeft) * kNarrowLeftBytes; };
  auto right_at = [&](int g) { return base + L::kOffR + (g & 1) * kNarrowRightBytes - 4 * kChunkBytes; };
  float* sXfer = reinterpret_cast<float*>(smem);  // end of a piece: O^T halves, then bf16 out
  float* sRed = reinterpret_cast<float*>(smem + L::kOffRed);
  float* sSumW = reinterpret_cast<float*>(smem + L::kOffSum);
  float* sM1 = reinterpret_cast<float*>(smem + L::kOffM1);
  const uint32_t bars = base + L::kOffBars;
  uint32_t* sMask = reinterpret_cast<uint32_t*>(smem + L::kOffMask);

  const int tid = threadIdx.x, lane = tid & 31;
  const int wg = tid >> 7, wtid = tid & 127, warp = wtid >> 5;
  const int qd = lane & 3;
  if (tid == 0) {
    for (int i = 0; i < kRings; ++i) mbar_init(bars + i * 8, 132);  // see kLandArrivesOf
    for (int i = kRings; i < 2 * kRings; ++i) mbar_init(bars + i * 8, 4);
    mbar_init(bars + kQBar * 8, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  pdl_launch_dependents();
  pdl_wait();  // the plan, q, the indices and the cache are written by earlier kernels
  const int cta = blockIdx.x;
  int u_begin, u_end, U;
  if (!cta_units<true>(p, u_begin, u_end, U)) return;
  __syncthreads();  // barriers initialised

  if (wg == 2) {  // ---- producer warpgroup: the CTA's units in order, left half first
    set_max_regs_dec<kProducerRegs>();
    KeyProducer<T, KeySource::kSparse16> prod{p,    static_cast<const unsigned char*>(p.kv), 0u, bars,
                                              bars + kRings * 8, sMask, wtid >> 1, wtid & 1, warp, lane};
    typename KeyProducer<T, KeySource::kSparse16>::Fill pending;  // the bf16 fills announce themselves
    for_each_piece<true>(p, u_begin, u_end, [&](int r, int Pr, int pg_begin, int pg_end) {
      const int* list = sparse_group_indices(p, r);
      const int len = sparse_group_len(p, r);
      auto slot_of = [&](int pg) {
        const int pos = pg * kKeys + prod.tk;
        const int v = pg < pg_end && pos < len ? __ldg(list + pos) : -1;
        return v >= 0 && v < p.num_slots ? v : -1;
      };
      int slot_next = slot_of(pg_begin);
#pragma unroll 1
      for (int pg = pg_begin; pg < pg_end; ++pg) {
        const int g = Pr + pg - u_begin;  // the unit's index in the CTA
        const int slot = slot_next;
        slot_next = slot_of(pg + 1);  // in flight while this unit's copies are issued
        prod.issue_to(g % kNarrowLeft, left_at(g), g % kNarrowLeft, 0, slot, pending);
        prod.issue_to(kNarrowLeft + (g & 1), right_at(g), g % kNarrowLeft, 1, slot, pending);
      }
    });
    return;
  }

  // ---- consumers: warpgroup wg takes units i = wg (mod 2) of each piece
  set_max_regs_inc<kConsumerRegs>();
  const float scale_log2 = p.scale_log2;
  const uint32_t q_bar = bars + kQBar * 8;
  uint32_t q_phase = 0;
  int red_par = 0;
  const uint32_t sP = base + L::kOffP + wg * L::kQChunk;
  const uint64_t dQ = make_desc(sQ, 16, 1024);
  const uint64_t dP = make_desc(sP, 16, 1024);
  // this thread's accumulator elements: S^T s[4j + 2hr + e] and O^T tile t o[kAcc t + 4j + 2hr
  // + e] are key / value column 16 warp + lane / 4 + 8 hr of the tile, head 8j + 2 qd + e; its
  // heads hd = 2j + e
  auto head_of = [&](int hd) { return 8 * (hd >> 1) + 2 * qd + (hd & 1); };
  auto acc_of = [&](int hd, int hr) { return 4 * (hd >> 1) + 2 * hr + (hd & 1); };
  float o[8 * kAcc], s[kAcc], m_run[kHd], l_run[kHd];
  // ring slot `bit`'s use number `use` has landed
  auto wait_full = [&](int bit, int use) {
    mbar_wait(bars + bit * 8, use & 1);
    fence_proxy_async();  // cp.async wrote it through the generic proxy
  };
  auto release = [&](int bit) {
    if (lane == 0) mbar_arrive(bars + (kRings + bit) * 8);
  };
  auto wg0_sync = [&] { named_sync(kBarWg0, 128); };
  // S^T over chunks [c0, c1) of the unit whose chunk 0 descriptor is dK, one commit group
  // (chunk bounds compile-time: the loops unroll into one straight wgmma sequence)
  auto s_chunks = [&](uint64_t dK, auto c0_, auto c1_) {
    constexpr int c0 = decltype(c0_)::value, c1 = decltype(c1_)::value;
    cute::warpgroup_arrive();
#pragma unroll
    for (int c = c0; c < c1; ++c)
#pragma unroll
      for (int k = 0; k < 4; ++k)
        gmma_ss<QK>(desc_at(dK, c * kChunkBytes + k * 32), desc_at(dQ, c * L::kQChunk + k * 32), s,
                    c != 0 || k != 0, std::make_index_sequence<kAcc>{});
    cute::warpgroup_commit_batch();
  };
  // O^T tiles [t0, t0 + 4) += V^T P^T (tile t: value columns 64t .. 64t + 63, chunk t of the
  // unit whose chunk 0 descriptor is dV), one commit group
  auto pv_tiles = [&](uint64_t dV, auto t0_) {
    constexpr int t0 = decltype(t0_)::value;
    cute::warpgroup_arrive();
#pragma unroll
    for (int t = t0; t < t0 + 4; ++t)
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
        gmma_ss<PV>(desc_at(dV, t * kChunkBytes + ks * 2048), desc_at(dP, ks * 32), o + kAcc * t, true,
                    std::make_index_sequence<kAcc>{});
    cute::warpgroup_commit_batch();
  };

  for_each_piece<true>(p, u_begin, u_end, [&](int r, int Pr, int pg_begin, int pg_end) {
    if (tid == 0) {  // the previous piece's last reads of sQ are behind a barrier tid 0 passed
      mbar_expect_tx(q_bar, (kDqk / 64) * L::kQChunk);
#pragma unroll
      for (int c = 0; c < kDqk / 64; ++c)
        tma_load_q_box(sQ + c * L::kQChunk, &q_map, c * 64, 0, r % p.group_s_q, r / p.group_s_q, q_bar);
    }
#pragma unroll
    for (int i = 0; i < 8 * kAcc; ++i) o[i] = 0.f;
#pragma unroll
    for (int hd = 0; hd < kHd; ++hd) { m_run[hd] = kNoMax; l_run[hd] = 0.f; }
    mbar_wait(q_bar, q_phase);
    q_phase ^= 1;

    const int n = pg_end - pg_begin;
#pragma unroll 1
    for (int i = wg; i < n; i += 2) {
      const int g = Pr + pg_begin + i - u_begin;
      const int lbit = g % kNarrowLeft, rbit = kNarrowLeft + (g & 1);
      const uint64_t dKL = make_desc(left_at(g), 16, 1024), dKR = make_desc(right_at(g), 16, 1024);
      const uint64_t dVL = make_desc(left_at(g), kChunkBytes, 1024), dVR = make_desc(right_at(g), kChunkBytes, 1024);
      // S^T = K Q^T, the left half's chunks as soon as they land
      wait_full(lbit, g / kNarrowLeft);
      s_chunks(dKL, std::integral_constant<int, 0>{}, std::integral_constant<int, 4>{});
      wait_full(rbit, g >> 1);
      s_chunks(dKR, std::integral_constant<int, 4>{}, std::integral_constant<int, 9>{});
      cute::warpgroup_wait<0>();
      fence_regs<kAcc>(s);

      // softmax over the unit's keys (the M dimension: lanes, then the 4 warps)
      const uint32_t valid = sMask[lbit * 4 + warp];  // bit 2j: key 16 warp + j of the unit
      const int key = lane >> 2;
      const bool ok[2] = {bool((valid >> (2 * key)) & 1), bool((valid >> (2 * key + 16)) & 1)};
      float mx[kHd];
#pragma unroll
      for (int hd = 0; hd < kHd; ++hd) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          float& v = s[acc_of(hd, hr)];
          v = ok[hr] ? v * scale_log2 : -INFINITY;
        }
        mx[hd] = fmaxf(s[acc_of(hd, 0)], s[acc_of(hd, 1)]);
        mx[hd] = fmaxf(mx[hd], __shfl_xor_sync(0xffffffff, mx[hd], 4));
        mx[hd] = fmaxf(mx[hd], __shfl_xor_sync(0xffffffff, mx[hd], 8));
        mx[hd] = fmaxf(mx[hd], __shfl_xor_sync(0xffffffff, mx[hd], 16));
      }
      float* red = sRed + (wg * 2 + red_par) * 4 * kN;  // double-buffered: the next unit's
      red_par ^= 1;                                     // writes come after its own barrier
      if (lane < 4) {
#pragma unroll
        for (int hd = 0; hd < kHd; ++hd) red[warp * kN + head_of(hd)] = mx[hd];
      }
      named_sync(kBarWg0 + wg, 128);
      float sc[kHd];
      bool rescale = false;
#pragma unroll
      for (int hd = 0; hd < kHd; ++hd) {
        const int h = head_of(hd);
        const float umax = fmaxf(fmaxf(red[h], red[kN + h]), fmaxf(red[2 * kN + h], red[3 * kN + h]));
        const float m_new = fmaxf(m_run[hd], umax);
        sc[hd] = exp2f(m_run[hd] - m_new);
        rescale |= sc[hd] != 1.f;
        m_run[hd] = m_new;
        float psum = 0.f;
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          float& v = s[acc_of(hd, hr)];
          v = exp2f(v - m_new);
          psum += v;
          // P^T (B operand, K-major: row = head, column = key)
          *reinterpret_cast<T*>(smem + (sP - base) + sw128_offset(h, 16 * warp + key + 8 * hr)) =
              __float2bfloat16(v);
        }
        l_run[hd] = l_run[hd] * sc[hd] + psum;
      }
      fence_proxy_async();
      if (__any_sync(0xffffffff, rescale)) {
#pragma unroll
        for (int t = 0; t < 8; ++t)
#pragma unroll
          for (int hd = 0; hd < kHd; ++hd)
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) o[kAcc * t + acc_of(hd, hr)] *= sc[hd];
      }
      named_sync(kBarWg0 + wg, 128);  // all of P^T is in smem
      // O^T += V^T P^T, tile t = value columns 64t .. 64t + 63 (chunk t of the unit), the left
      // half's tiles first: that half is released as they retire
      fence_regs<8 * kAcc>(o);
      pv_tiles(dVL, std::integral_constant<int, 0>{});
      pv_tiles(dVR, std::integral_constant<int, 4>{});
      cute::warpgroup_wait<1>();
      release(lbit);
      cute::warpgroup_wait<0>();
      fence_regs<8 * kAcc>(o);
      release(rbit);
    }

    // ---- end of the piece: sums over keys; warpgroup 1's O^T to warpgroup 0 through sQ in
    // two halves; warpgroup 0 merges and writes out (bf16 through sQ) or the partial
    float lw[kHd];
#pragma unroll
    for (int hd = 0; hd < kHd; ++hd) {
      lw[hd] = l_run[hd];
      lw[hd] += __shfl_xor_sync(0xffffffff, lw[hd], 4);
      lw[hd] += __shfl_xor_sync(0xffffffff, lw[hd], 8);
      lw[hd] += __shfl_xor_sync(0xffffffff, lw[hd], 16);
    }
    if (lane < 4) {
#pragma unroll
      for (int hd = 0; hd < kHd; ++hd) sSumW[(wg * 4 + warp) * kN + head_of(hd)] = lw[hd];
    }
    if (wg == 1 && warp == 0 && lane < 4) {
#pragma unroll
      for (int hd = 0; hd < kHd; ++hd) sM1[head_of(hd)] = m_run[hd];
    }
    constexpr int kHalf = 4 * kAcc;  // floats of O^T per thread in one transfer
    named_sync(kBarConsumers, kConsumerThreads);  // every S of the piece is done: sQ is free
    if (wg == 1) {
#pragma unroll
      for (int i = 0; i < kHalf; ++i) sXfer[i * 128 + wtid] = o[i];
    }
    float f0[kHd], f1[kHd], inv[kHd];
    if (wg == 0) {
#pragma unroll
      for (int hd = 0; hd < kHd; ++hd) {
        const int h = head_of(hd);
        float l0 = 0.f, l1 = 0.f;
#pragma unroll
        for (int w = 0; w < 4; ++w) { l0 += sSumW[w * kN + h]; l1 += sSumW[(4 + w) * kN + h]; }
        const float m1 = sM1[h], m = fmaxf(m_run[hd], m1);
        f0[hd] = exp2f(m_run[hd] - m);
        f1[hd] = exp2f(m1 - m);
        const float lt = l0 * f0[hd] + l1 * f1[hd];
        inv[hd] = lt != 0.f ? 1.f / lt : 0.f;
        l_run[hd] = lt;
        m_run[hd] = m;
      }
    }
    auto merge = [&](int i0) {
#pragma unroll
      for (int i = i0; i < i0 + kHalf; ++i) {
        const int a = i % kAcc, hd = 2 * (a >> 2) + (a & 1);  // a = 4j + 2hr + e
        o[i] = (o[i] * f0[hd] + sXfer[(i - i0) * 128 + wtid] * f1[hd]) * inv[hd];
      }
    };
    named_sync(kBarConsumers, kConsumerThreads);  // the first half is in sQ
    if (wg == 0) merge(0);
    named_sync(kBarConsumers, kConsumerThreads);  // ... and read
    if (wg == 1) {
#pragma unroll
      for (int i = kHalf; i < 2 * kHalf; ++i) sXfer[(i - kHalf) * 128 + wtid] = o[i];
      fence_proxy_async();  // sQ: generic writes here, the next piece's Q by TMA
    }
    named_sync(kBarConsumers, kConsumerThreads);  // the second half is in sQ; warpgroup 1 goes on
    if (wg == 0) {
      merge(kHalf);
      const int Pr1 = plan_start<true>(p, r + 1);
      const bool split = (Pr / U) != ((Pr1 - 1) / U);
      const int slot = Pr <= u_begin ? 0 : 1;
      auto col_of = [&](int i) { return 64 * (i / kAcc) + 16 * warp + (lane >> 2) + 8 * ((i >> 1) & 1); };
      auto head_at = [&](int i) { const int a = i % kAcc; return head_of(2 * (a >> 2) + (a & 1)); };
      if (warp == 0 && lane < 4) {
#pragma unroll
        for (int hd = 0; hd < kHd; ++hd) {
          const int h = head_of(hd);
          if (h >= p.rows) continue;
          const float lse = l_run[hd] != 0.f ? (m_run[hd] + __log2f(l_run[hd])) * kLn2 : -INFINITY;
          if (!split) p.lse[int64_t(r) * p.rows + h] = lse;
          else p.part_lse[(int64_t(cta) * 2 + slot) * p.rows + h] = lse;
        }
      }
      if (split) {
#pragma unroll
        for (int i = 0; i < 8 * kAcc; ++i) {
          const int h = head_at(i);
          if (h < p.rows) p.part_out[((int64_t(cta) * 2 + slot) * p.rows + h) * kDv + col_of(i)] = o[i];
        }
      } else {
        unsigned char* stage = smem;  // [head][512] bf16, 16-byte units XOR-swizzled by head % 8
        wg0_sync();                   // the second half is read
#pragma unroll
        for (int i = 0; i < 8 * kAcc; ++i) {
          const int h = head_at(i), col = col_of(i);
          *reinterpret_cast<T*>(stage + h * 1024 + (((col >> 3) ^ (h & 7)) << 4) + (col & 7) * 2) =
              __float2bfloat16(o[i]);
        }
        wg0_sync();
        for (int i = wtid; i < p.rows * 64; i += 128) {  // 16-byte coalesced stores
          const int h = i >> 6, unit = i & 63;
          const uint4 val = *reinterpret_cast<const uint4*>(stage + h * 1024 + ((unit ^ (h & 7)) << 4));
          *reinterpret_cast<uint4*>(static_cast<T*>(p.out) + (int64_t(r) * p.rows + h) * kDv + unit * 8) = val;
        }
      }
      fence_proxy_async();  // sQ: generic accesses here, the next piece's Q by TMA (tid 0)
      wg0_sync();
    }
  });
}

// Tensor map of the paged cache as [num_blocks][64][576] with the cache's own strides (a
// layer's view of a cross-layer buffer works), 64x64 boxes, 128-byte swizzle.

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (encode == nullptr) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status;
    MLA_CHECK_CUDA(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &status));
    TORCH_CHECK(status == cudaDriverEntryPointSuccess && fn != nullptr, "mla_decode: cuTensorMapEncodeTiled not found");
    encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }
  return encode;
}

CUtensorMap make_kv_map(const DecodeParams& p, bool bf16) {
  const auto encode = tensor_map_encoder();
  CUtensorMap map;
  const cuuint64_t dims[3] = {cuuint64_t(kDqk), cuuint64_t(kPage), cuuint64_t(p.num_blocks)};
  const cuuint64_t strides[2] = {cuuint64_t(p.kv_stride_tok) * 2, cuuint64_t(p.kv_stride_block) * 2};
  const cuuint32_t box[3] = {64, 64, 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = encode(&map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3,
                            const_cast<void*>(p.kv), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "mla_decode: cuTensorMapEncodeTiled failed with error ", int(r),
              " (kv_cache must be 16-byte aligned with 16-byte multiple strides)");
  return map;
}

// Tensor map of the sparse q [B, s_q, H, 576] (bf16) with its own strides, 64-column x
// 64-head boxes, 128-byte swizzle: a box past H reads zeros. A dimension of size 1 is never
// stepped over, so its stride only has to be valid (torch may report any value there).
CUtensorMap make_q_map(const DecodeParams& p, int box_rows = kRows) {
  const int64_t sizes[3] = {p.heads, p.group_s_q, p.batch / p.group_s_q};
  const int64_t strides_el[3] = {p.q_stride_h, p.q_stride_s, p.q_stride_b};
  cuuint64_t dims[4] = {cuuint64_t(kDqk), 0, 0, 0};
  cuuint64_t strides[3];
  int64_t packed = kDqk;  // elements spanned by the dimensions inside this one, packed
  for (int i = 0; i < 3; ++i) {
    dims[i + 1] = cuuint64_t(sizes[i]);
    strides[i] = cuuint64_t(sizes[i] == 1 ? packed : strides_el[i]) * 2;
    packed *= sizes[i];
  }
  const cuuint32_t box[4] = {64, cuuint32_t(box_rows), 1, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  CUtensorMap map;
  const CUresult r = tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(p.q), dims,
                                          strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                          CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "sparse_mla_decode: cuTensorMapEncodeTiled failed for q with error ", int(r),
              " (q must be 16-byte aligned with nonzero 16-byte multiple strides)");
  return map;
}

template <typename T, KeySource kSrc, bool kPaired = false, bool kPrefetch = false>
void launch_wgmma(const DecodeParams& p, cudaStream_t stream, bool combine = true) {
  auto kernel = decode_wgmma_kernel<T, kSrc, kPaired, kPrefetch>;
  MLA_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem)));
  dim3 grid(p.num_ctas, (p.rows + kRows - 1) / kRows);
  TORCH_CHECK(!kPaired || grid.y == 2, "mla_decode: a paired launch needs exactly two row tiles");
  CUtensorMap kv_map{}, q_map{};  // the producer sources copy keys without a tensor map
  if constexpr (kSrc == KeySource::kPagedTma) kv_map = make_kv_map(p, std::is_same_v<T, __nv_bfloat16>);
  if constexpr (kQTmaOf<kSrc>) q_map = make_q_map(p);
  // bf16 sparse with two row tiles: the tiles of a query group run as a 2-CTA cluster
  // although they share nothing, so the two CTAs that gather the same keys at about the same
  // time sit in one GPC (H = 128 -2 to -5%, docs/kernels/sparse_decode.md, v25)
  const bool co_place = kSrc == KeySource::kSparse16 && grid.y == 2;
  launch_pdl_clustered(kernel, grid, dim3(kThreadsOf<kSrc>), kSmem, stream, kPaired || co_place ? 2 : 1, p, kv_map,
                       q_map);
  if (combine) launch_combine<T>(p, stream);
}

// H <= 16 over a bf16 cache: one tile of kN heads per CTA, keys as the MMA's M dimension
template <int kN>
void launch_sparse_narrow(const DecodeParams& p, cudaStream_t stream, bool combine) {
  const auto kernel = sparse_narrow_kernel<kN>;
  constexpr size_t smem = NarrowLayout<kN>::kSmem;
  MLA_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const CUtensorMap q_map = make_q_map(p, kN);
  launch_pdl(kernel, dim3(p.num_ctas), dim3(384), smem, stream, p, q_map);
  if (combine) launch_combine<__nv_bfloat16>(p, stream);
}

}  // namespace

void launch_decode_wgmma(const DecodeParams& p, bool bf16, bool fp8, cudaStream_t stream) {
  if (fp8) {
    if (bf16) launch_wgmma<__nv_bfloat16, KeySource::kPagedFp8>(p, stream);
    else launch_wgmma<__half, KeySource::kPagedFp8>(p, stream);
  } else {
    if (bf16) launch_wgmma<__nv_bfloat16, KeySource::kPagedTma>(p, stream);
    else launch_wgmma<__half, KeySource::kPagedTma>(p, stream);
  }
}

// 65536 rows of 1152 bytes are 75 MB, 1.5x the H100's 50 MB L2
constexpr int kPrefetchMinSlots = 1 << 16;

void launch_sparse_wgmma(const DecodeParams& p, bool fp8_ds_mla, bool combine, cudaStream_t stream) {
  // fp8_ds_mla with two row tiles (H > 64): the tiles share each unit's conversion (kPaired)
  if (fp8_ds_mla && p.rows > kRows) launch_wgmma<__nv_bfloat16, KeySource::kSparseDsMla, true>(p, stream, combine);
  else if (fp8_ds_mla) launch_wgmma<__nv_bfloat16, KeySource::kSparseDsMla, false>(p, stream, combine);
  else if (p.rows <= 16) launch_sparse_narrow<16>(p, stream, combine);
  // bf16, one row tile (H <= 64), a cache too large for L2: the producer prefetches each
  // fill's rows to L2 before its release wait. Where the rows sit in L2 there is nothing to
  // gain, and with two co-placed tiles gathering the same rows it cost 2-6%; an instantiation
  // of its own keeps the other schedules' code as it was (docs/kernels/sparse_decode.md, v55).
  else if (p.rows <= kRows && p.num_slots >= kPrefetchMinSlots)
    launch_wgmma<__nv_bfloat16, KeySource::kSparse16, false, true>(p, stream, combine);
  else launch_wgmma<__nv_bfloat16, KeySource::kSparse16, false>(p, stream, combine);
}

}  // namespace dense
}  // namespace mla_backend
