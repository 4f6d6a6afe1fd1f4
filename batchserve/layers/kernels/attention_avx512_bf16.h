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

// One K row against the query (q: head_dim / 32 vectors of bf16): 16 partial sums.
template <int NP>
BF16_TARGET inline __m512 dot_bf16(const __m512bh* q, const bf16_t* k) {
  __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], load_bh(k));
  for (int c = 1; c < NP; ++c) d = _mm512_dpbf16_ps(d, q[c], load_bh(k + 32 * c));
  return d;
}

// The same for a row that may not be read (valid false: the masked loads touch no memory, and the sums are 0).
template <int NP>
BF16_TARGET inline __m512 dot_bf16_masked(const __m512bh* q, const bf16_t* k, bool valid) {
  const __mmask32 row = valid ? ~__mmask32{0} : __mmask32{0};
  __m512 d = _mm512_setzero_ps();
  for (int c = 0; c < NP; ++c) d = _mm512_dpbf16_ps(d, q[c], (__m512bh)_mm512_maskz_loadu_epi16(row, k + 32 * c));
  return d;
}

// Four K rows, `rows` of them valid (rows from there on are not read: they may be garbage, or past the pool),
// reduced as sum16's first two levels.
template <int NP>
BF16_TARGET inline __m512 dot4_bf16(const __m512bh* q, const bf16_t* k, int64_t token_stride, int64_t rows) {
  __m512 d[4];
  if (rows >= 4) {
    d[0] = dot_bf16<NP>(q, k);
    d[1] = dot_bf16<NP>(q, k + token_stride);
    d[2] = dot_bf16<NP>(q, k + 2 * token_stride);
    d[3] = dot_bf16<NP>(q, k + 3 * token_stride);
  } else {
    d[0] = dot_bf16_masked<NP>(q, k, rows > 0);
    d[1] = dot_bf16_masked<NP>(q, k + token_stride, rows > 1);
    d[2] = dot_bf16_masked<NP>(q, k + 2 * token_stride, rows > 2);
    d[3] = _mm512_setzero_ps();
  }
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(d[0], d[1]), _mm512_unpackhi_ps(d[0], d[1]));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(d[2], d[3]), _mm512_unpackhi_ps(d[2], d[3]));
  const __m512d a = _mm512_castps_pd(t0), b = _mm512_castps_pd(t1);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
}

// Scores of one query (qb: its head_dim values in bf16) against the first `n` tokens of a tile, times `scale`;
// lanes >= n are 0. The sums of sum16, four tokens at a time (so that few registers are live).
template <int NP>
BF16_TARGET inline __m512 score_tile_bf16(const uint16_t* qb, const bf16_t* k_tile, int64_t token_stride, int64_t n,
                                          float scale) {
  __m512bh q[NP];
  for (int c = 0; c < NP; ++c) q[c] = load_bh(qb + 32 * c);
  __m512 u[4];
  for (int j = 0; j < 4; ++j) u[j] = dot4_bf16<NP>(q, k_tile + 4 * j * token_stride, token_stride, n - 4 * j);
  __m512 w[2];
  for (int j = 0; j < 2; ++j)
    w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], 0xDD));
  const __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
  return _mm512_mul_ps(s, _mm512_set1_ps(scale));
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
