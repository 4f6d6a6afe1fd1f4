// The "avx512_bf16" attention path's decode pieces (decode_avx512_bf16.cpp; its prefill is prefill_avx512.cpp's, K/V
// widened to float32): bfloat16 K/V read as they are, by AVX512-BF16 (vdpbf16ps).
// Q.K: the query, rounded to bf16 once per sequence (a bf16 model's query already is), dotted with each K row by
// vdpbf16ps (pairs of products summed in float32), 16 tokens reduced as in sum16; the scale is applied to the float32
// scores. P.V: the softmax weights, rounded to bf16, paired token by token (p[t], p[t+1]) against V rows t and t+1
// interleaved (vpunpck{l,h}wd), so one vdpbf16ps adds two tokens into 16 float32 accumulators. The interleave leaves
// the accumulators' lanes in a fixed permuted order of d, undone once at the output. The softmax denominator sums the
// rounded weights, so the weights applied to V sum to 1.
// Decode runs in three passes per sequence instead of an online softmax (see decode_items_bf16), and asks for the
// scattered blocks ahead of use (RowPrefetcher).
// On the Xeon this was written on, vdpbf16ps retires at half the multiply-adds per cycle of float32 FMA, so the
// arithmetic alone is no faster than widening: the gain comes from the passes and the prefetching. Only for CPUs with avx512_bf16 (checked before a call: bf16_dot_supported()); compiled per function
// for that target, so the library still builds and runs on CPUs without it.
#pragma once

#include "isa.h"

#include "attention_avx512.h"

#ifdef BATCHSERVE_ISA_AVX512_BF16
#define BATCHSERVE_BF16_DOT 1
#define BF16_TARGET BATCHSERVE_BF16_TARGET

#include <cstring>

namespace {

using bf16_t = c10::BFloat16;

// 32 bf16 values (memcpy: GCC 12 otherwise takes a detour through the stack when a __m512i becomes a __m512bh).
BF16_TARGET inline __m512bh load_bh(const void* p) {
  __m512bh v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Scores of G query heads that share one kv head's K (qb: their queries in bf16, head_dim values apart) against the
// first `n` tokens of a tile, times `scale` -> s[g]; lanes >= n are 0. Each K row is loaded once for the G heads. A
// head's dot product with a row is NP vdpbf16ps (16 partial sums), and 16 rows' sums are reduced as in sum16, four
// rows at a time; rows from `n` on are not read (they may be garbage, or past the pool).
template <int NP, int G>
BF16_TARGET inline void score_tiles_bf16(const uint16_t* qb, const bf16_t* k_tile, int64_t token_stride, int64_t n,
                                         float scale, __m512* s) {
  __m512bh q[G][NP];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NP; ++c) q[g][c] = load_bh(qb + g * NP * 32 + 32 * c);
  __m512 u[G][4];  // each four rows' sums
  for (int j = 0; j < 4; ++j) {
    const bf16_t* k = k_tile + 4 * j * token_stride;
    const int64_t rows = n - 4 * j;
    __m512 d[G][4];  // sums of the four rows
    for (int r = 0; r < 4; ++r) {
      if (rows < 4 && r == 3) {  // a part tile's fourth row of four is never valid
        for (int g = 0; g < G; ++g) d[g][r] = _mm512_setzero_ps();
        continue;
      }
      __m512bh kv[NP];
      const __mmask32 row = rows > r ? ~__mmask32{0} : __mmask32{0};  // masked loads touch no memory
      for (int c = 0; c < NP; ++c)
        kv[c] = rows >= 4 ? load_bh(k + r * token_stride + 32 * c)
                          : (__m512bh)_mm512_maskz_loadu_epi16(row, k + r * token_stride + 32 * c);
      for (int g = 0; g < G; ++g) {
        d[g][r] = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[g][0], kv[0]);
        for (int c = 1; c < NP; ++c) d[g][r] = _mm512_dpbf16_ps(d[g][r], q[g][c], kv[c]);
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(d[g][0], d[g][1]), _mm512_unpackhi_ps(d[g][0], d[g][1]));
      const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(d[g][2], d[g][3]), _mm512_unpackhi_ps(d[g][2], d[g][3]));
      const __m512d a = _mm512_castps_pd(t0), b = _mm512_castps_pd(t1);
      u[g][j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
  }
  for (int g = 0; g < G; ++g) {
    __m512 w[2];
    for (int j = 0; j < 2; ++j)
      w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(u[g][2 * j], u[g][2 * j + 1], 0x88),
                           _mm512_shuffle_f32x4(u[g][2 * j], u[g][2 * j + 1], 0xDD));
    const __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
    s[g] = _mm512_mul_ps(t, _mm512_set1_ps(scale));
  }
}

// The query rounded to bf16: 32 values a vector.
template <int NP>
BF16_TARGET inline void query_to_bf16(const float* q, uint16_t* qb) {
  for (int c = 0; c < NP; ++c)
    _mm512_storeu_si512(qb + 32 * c,
                        (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 32 * c + 16), _mm512_loadu_ps(q + 32 * c)));
}

// out[d] = acc[d] * inv in natural order. Vectors 2c and 2c + 1 of acc hold d = 32c + {0-3, 8-11, 16-19, 24-27} and
// 32c + {4-7, 12-15, 20-23, 28-31} (vpunpck{l,h}wd work within 128-bit lanes).
template <int NC>
BF16_TARGET inline void unpermute_store(const float* acc, float inv, float* out) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512 scale = _mm512_set1_ps(inv);
  for (int c = 0; c < NC / 2; ++c) {
    const __m512 a = _mm512_loadu_ps(acc + 32 * c), b = _mm512_loadu_ps(acc + 32 * c + 16);
    _mm512_storeu_ps(out + 32 * c, _mm512_mul_ps(_mm512_permutex2var_ps(a, first, b), scale));
    _mm512_storeu_ps(out + 32 * c + 16, _mm512_mul_ps(_mm512_permutex2var_ps(a, second, b), scale));
  }
}

}  // namespace

#endif  // AVX-512, and avx512bf16 in this compiler
