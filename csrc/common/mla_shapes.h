// MLA sizes every kernel shares (DeepSeek V2 / V3 / V3.2 latent attention).
#pragma once

namespace mla_backend {

constexpr int kDqk = 576;                     // q and k per head: 512 latent + 64 rope values
constexpr int kDv = 512;                      // v and out per head: the latent values
constexpr int kPage = 64;                     // tokens per page of the paged cache
constexpr int kChunksPerRow = kDqk * 2 / 16;  // 72 16-byte chunks per 16-bit token
constexpr float kLn2 = 0.69314718055994530942f;

}  // namespace mla_backend
