// Paged prefill attention on the "avx512_bf16" path, for a bfloat16 pool: prefill_avx512.cpp's tiles and online
// softmax, with both products by vdpbf16ps on the bf16 values as stored (attention_avx512_bf16.h).
#include "attention_avx512_bf16.h"

#ifdef BATCHSERVE_BF16_DOT

namespace {

// softmax_update, with the weights stored as bf16 (pb: 16 of them) and the denominator summing them as rounded.
BF16_TARGET inline void softmax_update_bf16(__m512 s, int64_t n, float& m, __m512& l, float& corr, uint16_t* pb) {
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  const float new_max = std::max(m, _mm512_mask_reduce_max_ps(valid, s));
  const __m512 correction = exp512(_mm512_set1_ps(m - new_max));
  const __m512 e = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(s, _mm512_set1_ps(new_max))));
  const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(e);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb), rounded);
  l = _mm512_fmadd_ps(l, correction, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16)));
  corr = _mm512_cvtss_f32(correction);
  m = new_max;
}

// acc[h] = acc[h] * corr[h] + sum_t p[h][t] * v[t] for HC queries reading the same V tile, two tokens per
// vdpbf16ps; the accumulators (acc_store, HC * NC vectors) are in the permuted order (see unpermute_store). An odd
// last token is paired with zeros: the row after it may be garbage (NaN) or outside the pool.
template <int NC, int HC>
BF16_TARGET inline void accumulate_values_bf16(const bf16_t* v_tile, int64_t token_stride, int64_t n,
                                               const uint16_t* pb, const float* corr, float* acc_store) {
  constexpr int NP = NC / 2;
  __m512 acc[HC][NC];
  for (int h = 0; h < HC; ++h) {
    const __m512 c = _mm512_set1_ps(corr[h]);
    for (int j = 0; j < NC; ++j) acc[h][j] = _mm512_mul_ps(_mm512_loadu_ps(acc_store + (h * NC + j) * 16), c);
  }
  for (int64_t t = 0; t < n; t += 2) {
    const bf16_t* v0 = v_tile + t * token_stride;
    const bool pair = t + 1 < n;
    __m512i lo[NP], hi[NP];
    for (int c = 0; c < NP; ++c) {
      const __m512i a = _mm512_loadu_si512(reinterpret_cast<const void*>(v0 + 32 * c));
      const __m512i b = pair ? _mm512_loadu_si512(reinterpret_cast<const void*>(v0 + token_stride + 32 * c))
                             : _mm512_setzero_si512();
      lo[c] = _mm512_unpacklo_epi16(a, b);
      hi[c] = _mm512_unpackhi_epi16(a, b);
    }
    for (int h = 0; h < HC; ++h) {
      // (p[t], p[t + 1]) as one 32-bit broadcast; p[n] is 0 (softmax_update_bf16 zeroes the lanes from n on)
      int32_t p_pair;
      std::memcpy(&p_pair, pb + h * 16 + t, sizeof p_pair);
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(p_pair);
      for (int c = 0; c < NP; ++c) {
        acc[h][2 * c] = _mm512_dpbf16_ps(acc[h][2 * c], pp, (__m512bh)lo[c]);
        acc[h][2 * c + 1] = _mm512_dpbf16_ps(acc[h][2 * c + 1], pp, (__m512bh)hi[c]);
      }
    }
  }
  for (int h = 0; h < HC; ++h)
    for (int j = 0; j < NC; ++j) _mm512_storeu_ps(acc_store + (h * NC + j) * 16, acc[h][j]);
}

template <int NC>
BF16_TARGET void accumulate_group_bf16(const bf16_t* v_tile, int64_t token_stride, int64_t n, const uint16_t* pb,
                                       const float* corr, float* acc_store, int64_t heads) {
  constexpr int kChunk = NC <= 4 ? 4 : 2;
  int64_t h = 0;
  for (; h + kChunk <= heads; h += kChunk)
    accumulate_values_bf16<NC, kChunk>(v_tile, token_stride, n, pb + h * 16, corr + h, acc_store + h * NC * 16);
  const int64_t rest = heads - h;
  pb += h * 16, corr += h, acc_store += h * NC * 16;
  if (rest == 3) accumulate_values_bf16<NC, 3>(v_tile, token_stride, n, pb, corr, acc_store);
  if (rest == 2) accumulate_values_bf16<NC, 2>(v_tile, token_stride, n, pb, corr, acc_store);
  if (rest == 1) accumulate_values_bf16<NC, 1>(v_tile, token_stride, n, pb, corr, acc_store);
}

// prefill_tile on the bf16 dot-product path.
template <int NC>
BF16_TARGET void prefill_tile_bf16(const float* q, int64_t q_stride, const bf16_t* k_cache, const bf16_t* v_cache,
                                   const int64_t* table, int64_t first_pos, int64_t rows, int64_t kv_head,
                                   int64_t token_stride, int64_t block_size, float scale, float* out,
                                   int64_t out_stride) {
  constexpr int64_t D = NC * 16;
  constexpr int NP = NC / 2;
  alignas(64) float acc[16 * D], m[16], corr[16];
  alignas(64) uint16_t pb[16 * 16], qb[16 * D];
  __m512 l[16];
  for (int64_t r = 0; r < rows; ++r) {
    query_to_bf16<NP>(q + r * q_stride, qb + r * D);
    m[r] = -1e30f;
    l[r] = _mm512_setzero_ps();
  }
  std::fill(acc, acc + rows * D, 0.f);
  const int64_t block_stride = block_size * token_stride;
  const int64_t num_keys = first_pos + rows;
  for (int64_t start = 0, n = 0; start < num_keys; start += n) {
    const int64_t in_block = start % block_size;
    n = std::min<int64_t>({16, block_size - in_block, num_keys - start});
    const int64_t offset = table[start / block_size] * block_stride + in_block * token_stride + kv_head * D;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t visible = std::min<int64_t>(n, first_pos + r - start + 1);  // causal: keys up to the row's own
      if (visible <= 0) {  // the whole tile is in this row's future: it contributes nothing
        corr[r] = 1.f;
        std::fill(pb + r * 16, pb + r * 16 + 16, uint16_t{0});
        continue;
      }
      softmax_update_bf16(score_tile_bf16<NP>(qb + r * D, k_cache + offset, token_stride, visible, scale), visible,
                          m[r], l[r], corr[r], pb + r * 16);
    }
    accumulate_group_bf16<NC>(v_cache + offset, token_stride, n, pb, corr, acc, rows);
  }
  for (int64_t r = 0; r < rows; ++r)
    unpermute_store<NC>(acc + r * D, 1.f / _mm512_reduce_add_ps(l[r]), out + r * out_stride);
}

}  // namespace

bool prefill_attention_avx512_bf16(const PagedArgs<c10::BFloat16>& a) {
  return with_vectors_per_head(a.head_dim, [&](auto nc) {
    constexpr int64_t D = decltype(nc)::value * 16;
    const int64_t group = a.num_heads / a.num_kv_heads;
    for_each_prefill_tile(a, [&](int64_t seq, int64_t row, int64_t head, int64_t rows, int64_t first_pos) {
      prefill_tile_bf16<decltype(nc)::value>(a.q + row * a.q_stride + head * D, a.q_stride, a.k_cache, a.v_cache,
                                             a.tables + seq * a.max_blocks, first_pos, rows, head / group,
                                             a.num_kv_heads * D, a.block_size, a.scale,
                                             a.out + (row * a.num_heads + head) * D, a.num_heads * D);
    });
  });
}

#endif  // BATCHSERVE_BF16_DOT
