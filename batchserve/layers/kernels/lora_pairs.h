// The LoRA kernel's bfloat16 shrink and expand by AVX512-BF16's pair dot products (lora_tiles.h's Avx512Bf16
// path): 32 products an instruction, x, A and B read as stored, nothing widened.
#pragma once

#include <cstdint>
#include <cstring>

#include "lora_vectors.h"

#ifdef BATCHSERVE_ISA_AVX512_BF16
namespace lora_vectors {

// One run of 32 values of shrink_block_pairs: the tile's x and J rows of A under `mask` (zeros past a row's end)
template <int N, int J>
BATCHSERVE_BF16_TARGET inline void pairs_pass(__m512 (&acc)[J][N], const c10::BFloat16* const* x,
                                              const c10::BFloat16* a, int64_t in, int64_t k, __mmask32 mask) {
  __m512bh xv[N];
  for (int t = 0; t < N; ++t) xv[t] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x[t] + k);
  for (int jj = 0; jj < J; ++jj) {
    const auto w = (__m512bh)_mm512_maskz_loadu_epi16(mask, a + jj * in + k);
    for (int t = 0; t < N; ++t) acc[jj][t] = _mm512_dpbf16_ps(acc[jj][t], xv[t], w);
  }
}

// shrink_block on bfloat16 rows by pair dot products: x's rows read where they are (no widened copy), the last,
// shorter run of 32 loaded under a mask
template <int N, int J>
BATCHSERVE_BF16_TARGET void shrink_block_pairs(const c10::BFloat16* const* x, const c10::BFloat16* a,
                                               const c10::BFloat16* next, int64_t in, float* u, int64_t u_stride) {
  __m512 acc[J][N];
  for (int jj = 0; jj < J; ++jj)
    for (int t = 0; t < N; ++t) acc[jj][t] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= in; k += 32) {
    for (int jj = 0; jj < J; ++jj) __builtin_prefetch(next + jj * in + k, 0, 3);  // 32 values: one line
    pairs_pass<N, J>(acc, x, a, in, k, ~__mmask32(0));
  }
  if (k < in) pairs_pass<N, J>(acc, x, a, in, k, (__mmask32(1) << (in - k)) - 1);
  store_sums<Avx512Bf16, N, J>(acc, u, u_stride);
}

// shrink on bfloat16 rows by pair dot products (Avx512Bf16), blocked as shrink is
template <int N>
void shrink_pairs(const c10::BFloat16* const* x, const c10::BFloat16* a, int64_t used, int64_t in, float* u,
                  int64_t u_stride) {
  constexpr int J = kRowBlock<N>;
  int64_t j = 0;
  for (; j + J <= used; j += J) {
    const auto* next = a + (j + 2 * J <= used ? j + J : j) * in;
    shrink_block_pairs<N, J>(x, a + j * in, next, in, u + j, u_stride);
  }
  for (; j < used; ++j) shrink_block_pairs<N, 1>(x, a + j * in, a + j * in, in, u + j, u_stride);
}

// expand_block on bfloat16 by pair dot products: u rounded to bfloat16 (as the torch code's shrink is), each pair of
// rank rows (j, j + 1) of a panel is one load of 32 values (a panel's rows follow each other), interleaved into
// column pairs by one permute, and every row of the tile takes it in one dot product with its (u_j, u_j+1): half the
// multiplies of the float32 expand and no widening of B. An odd rank's last row is loaded alone (zeros beside it).
// Per column, lane c sums its pairs in j's order, whatever the tile.
template <int N, int C>
BATCHSERVE_BF16_TARGET void expand_pairs_block(const c10::BFloat16* ub, int64_t ub_stride, const c10::BFloat16* b,
                                               int64_t rank, int64_t c, int64_t last, const c10::BFloat16* next,
                                               __m512 scale, c10::BFloat16* const* y, int64_t pitch) {
  // element 2c of the result: row j's column c (the load's first 16 values); 2c + 1: row j + 1's (its last 16)
  alignas(64) static constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                           8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  const c10::BFloat16* base[C];
  for (int cc = 0; cc < C; ++cc) base[cc] = b + (c / kLoraPanel + cc) * rank * kLoraPanel;
  __m512 acc[N][C];
  for (int t = 0; t < N; ++t)
    for (int cc = 0; cc < C; ++cc) acc[t][cc] = _mm512_setzero_ps();
  for (int64_t j = 0; j < rank; j += 2) {
    if (next != nullptr) prefetch_lines(next + j * C * kLoraPanel, 2 * C * kLoraPanel);
    const __mmask32 rows = j + 1 < rank ? ~__mmask32(0) : __mmask32(0xFFFF);
    __m512bh w[C];
    for (int cc = 0; cc < C; ++cc)
      w[cc] = (__m512bh)_mm512_permutexvar_epi16(interleave, _mm512_maskz_loadu_epi16(rows, base[cc] + j * kLoraPanel));
    for (int t = 0; t < N; ++t) {
      int32_t pair;
      std::memcpy(&pair, ub + t * ub_stride + j, sizeof(pair));
      const auto ut = (__m512bh)_mm512_set1_epi32(pair);
      for (int cc = 0; cc < C; ++cc) acc[t][cc] = _mm512_dpbf16_ps(acc[t][cc], ut, w[cc]);
    }
  }
  for (int t = 0; t < N; ++t)
    for (int cc = 0; cc < C; ++cc) {
      const int64_t col = c + cc * kLoraPanel;
      c10::BFloat16* p = y[t] + col / kLoraPanel * pitch;
      const int64_t width = cc + 1 < C ? kLoraPanel : last;
      store_n<Avx512>(p, _mm512_fmadd_ps(scale, acc[t][cc], load_n<Avx512>(p, width)), width);
    }
}

// expand on bfloat16 by pair dot products: ub holds each row's shrink rounded to bfloat16, an even count of values
// (a zero after an odd rank's last)
template <int N>
void expand_pairs(const c10::BFloat16* ub, int64_t ub_stride, const c10::BFloat16* b_slot, const LoraArgs& args,
                  int64_t i, int64_t rank, float scale, c10::BFloat16* const* y) {
  const auto s = _mm512_set1_ps(scale);
  constexpr int C = kColBlock<N>;
  constexpr int64_t kBlockWidth = C * kLoraPanel;
  const LoraSlice& slice = args.slices[i];
  const c10::BFloat16* b = b_slot + rank * slice.packed;
  const int64_t first = args.swiglu_panels ? i * kLoraPanel : slice.offset;
  const int64_t pitch = args.swiglu_panels ? args.num_slices * kLoraPanel : kLoraPanel;
  c10::BFloat16* ys[N];
  for (int t = 0; t < N; ++t) ys[t] = y[t] + first;
  int64_t c = 0;
  for (; c + kBlockWidth <= slice.size; c += kBlockWidth) {
    const auto* next = c + 2 * kBlockWidth <= slice.size ? b + (c + kBlockWidth) * rank : nullptr;
    expand_pairs_block<N, C>(ub, ub_stride, b, rank, c, kLoraPanel, next, s, ys, pitch);
  }
  for (; c < slice.size; c += kLoraPanel)
    expand_pairs_block<N, 1>(ub, ub_stride, b, rank, c, std::min(kLoraPanel, slice.size - c), nullptr, s, ys, pitch);
}

// The tile's shrink u [N, rank] rounded to bfloat16 (nearest even, as c10::BFloat16 rounds) into ub, each row's
// values followed by a zero where the rank is odd, so that the expand reads whole pairs
template <int N>
void round_shrink(const float* u, int64_t u_stride, int64_t rank, c10::BFloat16* ub, int64_t ub_stride) {
  for (int t = 0; t < N; ++t) {
    for (int64_t j = 0; j < rank; ++j) ub[t * ub_stride + j] = c10::BFloat16(u[t * u_stride + j]);
    if (rank % 2 != 0) ub[t * ub_stride + rank] = c10::BFloat16(0.f);
  }
}
}  // namespace lora_vectors
#endif
