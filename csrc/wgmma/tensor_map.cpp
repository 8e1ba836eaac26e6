// TMA tensor maps (see tensor_map.h).
#include "wgmma/tensor_map.h"

#include "common/launch.h"
#include "common/mla_shapes.h"

namespace mla_backend::wgmma {

using splitkv::DecodeParams;

namespace {

// cuTensorMapEncodeTiled from the driver the runtime uses (no link against libcuda)
using EncodeTiled = decltype(&cuTensorMapEncodeTiled);

EncodeTiled tensor_map_encoder() {
  static EncodeTiled encode = nullptr;
  if (encode == nullptr) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status;
    MLA_CHECK_CUDA(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &status));
    STD_TORCH_CHECK(status == cudaDriverEntryPointSuccess && fn != nullptr,
                    "mla_decode: cuTensorMapEncodeTiled not found");
    encode = reinterpret_cast<EncodeTiled>(fn);
  }
  return encode;
}

// One part of the sparse query: `width` columns at `base`, heads / query tokens / batch
// entries at strides_el (elements). A dimension of size 1 is never stepped over, so its
// stride only has to be valid (torch may report any value there).
CUtensorMap make_q_part_map(const DecodeParams& p, const void* base, int width, const int64_t (&strides_el)[3],
                            int box_rows, const char* name) {
  const int64_t sizes[3] = {p.heads, p.group_s_q, p.batch / p.group_s_q};
  cuuint64_t dims[4] = {cuuint64_t(width), 0, 0, 0};
  cuuint64_t strides[3];
  int64_t packed = width;  // elements spanned by the dimensions inside this one, packed
  for (int i = 0; i < 3; ++i) {
    dims[i + 1] = cuuint64_t(sizes[i]);
    strides[i] = cuuint64_t(sizes[i] == 1 ? packed : strides_el[i]) * 2;
    packed *= sizes[i];
  }
  const cuuint32_t box[4] = {64, cuuint32_t(box_rows), 1, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  CUtensorMap map;
  const CUresult r = tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(base), dims,
                                          strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                          CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  STD_TORCH_CHECK(r == CUDA_SUCCESS, "sparse_mla_decode: cuTensorMapEncodeTiled failed for ", name, " with error ",
                  int(r), " (", name, " must be 16-byte aligned with nonzero 16-byte multiple strides)");
  return map;
}

// One part of the dense query: `width` columns at `base`, heads / query tokens / batch entries
// at strides_el (elements; a dimension of size 1 is never stepped over, as in make_q_part_map)
CUtensorMap make_dense_q_part_map(const DecodeParams& p, const void* base, int width, const int64_t (&strides_el)[3],
                                  bool bf16, const char* name) {
  const int64_t sizes[3] = {p.heads, p.s_q, p.batch};
  cuuint64_t dims[4] = {cuuint64_t(width), 0, 0, 0};
  cuuint64_t strides[3];
  int64_t packed = width;
  for (int i = 0; i < 3; ++i) {
    dims[i + 1] = cuuint64_t(sizes[i]);
    strides[i] = cuuint64_t(sizes[i] == 1 ? packed : strides_el[i]) * 2;
    packed *= sizes[i];
  }
  const int box_heads = p.heads < 64 ? p.heads : 64;
  const cuuint32_t box[4] = {64, cuuint32_t(box_heads), cuuint32_t(64 / box_heads), 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  CUtensorMap map;
  const CUresult r = tensor_map_encoder()(&map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                                          4, const_cast<void*>(base), dims, strides, box, elem_strides,
                                          CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  STD_TORCH_CHECK(r == CUDA_SUCCESS, "mla_decode: cuTensorMapEncodeTiled failed for ", name, " with error ", int(r),
                  " (", name, " must be 16-byte aligned with 16-byte multiple strides)");
  return map;
}

}  // namespace

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
  STD_TORCH_CHECK(r == CUDA_SUCCESS, "mla_decode: cuTensorMapEncodeTiled failed with error ", int(r),
                  " (kv_cache must be 16-byte aligned with 16-byte multiple strides)");
  return map;
}

CUtensorMap make_kv_map_fp8(const DecodeParams& p) {
  CUtensorMap map;
  const cuuint64_t dims[3] = {cuuint64_t(kDqk), cuuint64_t(kPage), cuuint64_t(p.num_blocks)};
  const cuuint64_t strides[2] = {cuuint64_t(p.kv_stride_tok), cuuint64_t(p.kv_stride_block)};
  const cuuint32_t box[3] = {128, 64, 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<void*>(p.kv), dims,
                                          strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                          CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  STD_TORCH_CHECK(r == CUDA_SUCCESS, "mla_decode: cuTensorMapEncodeTiled failed for the fp8 cache with error ", int(r),
                  " (kv_cache must be 16-byte aligned with 16-byte multiple strides)");
  return map;
}

QMaps make_q_maps(const DecodeParams& p, int box_rows) {
  const int64_t nope_strides[3] = {p.q_stride_h, p.q_stride_s, p.q_stride_b};
  const int64_t pe_strides[3] = {p.qpe_stride_h, p.qpe_stride_s, p.qpe_stride_b};
  return {make_q_part_map(p, p.q, kDv, nope_strides, box_rows, "q"),
          make_q_part_map(p, p.q_pe, kDqk - kDv, pe_strides, box_rows, "q_pe")};
}

QMaps make_dense_q_maps(const DecodeParams& p, bool bf16) {
  STD_TORCH_CHECK(dense_q_by_tma(p), "mla_decode: no Q tensor map for H = ", p.heads, " (see dense_q_by_tma)");
  const int64_t nope_strides[3] = {p.q_stride_h, p.q_stride_s, p.q_stride_b};
  const int64_t pe_strides[3] = {p.qpe_stride_h, p.qpe_stride_s, p.qpe_stride_b};
  return {make_dense_q_part_map(p, p.q, kDv, nope_strides, bf16, "q"),
          make_dense_q_part_map(p, p.q_pe, kDqk - kDv, pe_strides, bf16, "q_pe")};
}

}  // namespace mla_backend::wgmma
