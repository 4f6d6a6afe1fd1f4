// Paged decode attention for CPU: one query token per sequence attends over its context, read in place through
// its block table (no gather into a padded copy). Online softmax one tile of tokens at a time; the query heads that
// share a kv head are done back to back so K/V come from L1.
// With AVX-512 and float32 K/V, head_dim in {32, 64, 128}, a vectorized path scores 16 tokens at once (a transpose-add
// reduction instead of one horizontal sum per token) and reads every kv head of a tile in one pass; other cases take
// the portable loop, parallel over (sequence, kv head) pairs. With bfloat16 K/V on a CPU with AVX512-BF16, the
// "avx512_bf16" path does both products with vdpbf16ps on the bf16 values as stored instead of widening them (see
// its section). Which path runs is the caller's `path` argument (Python picks it once from the CPU's flags).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec_math.h"

namespace {

template <typename scalar_t>
void decode_attention_impl(const float* q, const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* tables,
                           const int64_t* seq_lens, float* out, int64_t num_seqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                           float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t block_stride = block_size * token_stride;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(group * head_dim), m(group), l(group), scores(group * block_size), kv(head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
      const float* q_seq = q + (seq * num_heads + kv_head * group) * head_dim;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -1e30f);  // finite: exp(m - max) must be 0, not NaN
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t len = seq_lens[seq];
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t n = std::min(block_size, len - start);
        const scalar_t* k_block = k_cache + tables[seq * max_blocks + start / block_size] * block_stride +
                                  kv_head * head_dim;
        const scalar_t* v_block = v_cache + (k_block - k_cache);
        for (int64_t t = 0; t < n; ++t) {
          const scalar_t* k = k_block + t * token_stride;
          for (int64_t d = 0; d < head_dim; ++d) kv[d] = static_cast<float>(k[d]);
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = q_seq + g * head_dim;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * kv[d];
            scores[g * block_size + t] = s * scale;
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          float* sg = scores.data() + g * block_size;
          float block_max = m[g];
          for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, sg[t]);
          const float correction = std::exp(m[g] - block_max);
          float* ag = acc.data() + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) ag[d] *= correction;
          m[g] = block_max;
          float block_sum = 0.f;
#pragma omp simd reduction(+ : block_sum)
          for (int64_t t = 0; t < n; ++t) {  // vectorized exp (libmvec): the kernel's hottest loop otherwise
            sg[t] = std::exp(sg[t] - block_max);
            block_sum += sg[t];
          }
          l[g] = l[g] * correction + block_sum;
        }
        for (int64_t t = 0; t < n; ++t) {
          const scalar_t* v = v_block + t * token_stride;
          for (int64_t d = 0; d < head_dim; ++d) kv[d] = static_cast<float>(v[d]);
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * block_size + t];
            float* ag = acc.data() + g * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * kv[d];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* o = out + (seq * num_heads + kv_head * group + g) * head_dim;
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < head_dim; ++d) o[d] = acc[g * head_dim + d] * inv;
      }
    }
  });
}

#if defined(__AVX512F__)

// Lane i of the result = sum of the 16 lanes of v[i]. Pairs are interleaved and added four times (within 128-bit
// lanes twice, then across them twice), so each level halves the vector count; the order comes out natural.
inline __m512 sum16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int j = 0; j < 8; ++j)
    t[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {
    const __m512d a = _mm512_castps_pd(t[2 * j]), b = _mm512_castps_pd(t[2 * j + 1]);
    u[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int j = 0; j < 2; ++j)
    w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

// 16 K/V values as floats: float caches load as they are, bfloat16 ones widen (a bfloat16 is a float's upper half).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// Scores of one query (qv: head_dim / 16 vectors, already scaled) against the first `n` tokens of a tile; lanes >= n
// are 0.
template <int NC, typename T>
inline __m512 score_tile(const __m512* qv, const T* k_tile, int64_t token_stride, int64_t n) {
  __m512 dots[16];
  for (int t = 0; t < 16; ++t) {
    if (t < n) {
      const T* k = k_tile + t * token_stride;
      __m512 d = _mm512_mul_ps(qv[0], load16(k));
      for (int c = 1; c < NC; ++c) d = _mm512_fmadd_ps(qv[c], load16(k + 16 * c), d);
      dots[t] = d;
    } else {
      dots[t] = _mm512_setzero_ps();
    }
  }
  return sum16(dots);
}

// Scores of the `group` query heads sharing one kv head (qs: their scaled queries, head after head) against the
// first `n` tokens of a tile, into scores[0..group): each K row is loaded, and widened from bf16, once for all of
// them. The same products in the same order as score_tile, so the same scores. Lanes >= n are 0.
constexpr int64_t kMaxGroup = 16;

template <int NC, typename T>
inline void score_group(const float* qs, int64_t group, const T* k_tile, int64_t token_stride, int64_t n,
                        __m512* scores) {
  __m512 dots[kMaxGroup][16];
  for (int t = 0; t < 16; ++t) {
    if (t < n) {
      const T* k = k_tile + t * token_stride;
      __m512 kv[NC];
      for (int c = 0; c < NC; ++c) kv[c] = load16(k + 16 * c);
      for (int64_t g = 0; g < group; ++g) {
        const float* q = qs + g * NC * 16;
        __m512 d = _mm512_mul_ps(_mm512_loadu_ps(q), kv[0]);
        for (int c = 1; c < NC; ++c) d = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), kv[c], d);
        dots[g][t] = d;
      }
    } else {
      for (int64_t g = 0; g < group; ++g) dots[g][t] = _mm512_setzero_ps();
    }
  }
  for (int64_t g = 0; g < group; ++g) scores[g] = sum16(dots[g]);
}

// Online softmax over one tile of scores, the first `n` lanes valid: p = exp(s - new max) (0 beyond n), and the
// factor `corr` that rescales what was accumulated under the old max. `l` keeps per-lane partial sums.
inline void softmax_update(__m512 s, int64_t n, float& m, __m512& l, float& corr, float* p) {
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  const float new_max = std::max(m, _mm512_mask_reduce_max_ps(valid, s));
  const __m512 correction = exp512(_mm512_set1_ps(m - new_max));
  const __m512 e = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(s, _mm512_set1_ps(new_max))));
  _mm512_storeu_ps(p, e);
  l = _mm512_fmadd_ps(l, correction, e);
  corr = _mm512_cvtss_f32(correction);
  m = new_max;
}

// acc[h] = acc[h] * corr[h] + sum_t p[h][t] * v[t] for HC queries reading the same V tile (the query heads of one kv
// head, or the query rows of one prefill tile): each V row is loaded once for all of them, and the HC * NC
// accumulators are independent FMA chains (one chain per query would wait on FMA latency).
template <int NC, int HC, typename T>
inline void accumulate_values(const T* v_tile, int64_t token_stride, int64_t n, const float* p, const float* corr,
                              float* acc_store) {
  __m512 acc[HC][NC];
  for (int h = 0; h < HC; ++h) {
    const __m512 c = _mm512_set1_ps(corr[h]);
    for (int j = 0; j < NC; ++j) acc[h][j] = _mm512_mul_ps(_mm512_loadu_ps(acc_store + (h * NC + j) * 16), c);
  }
  for (int64_t t = 0; t < n; ++t) {
    __m512 v[NC];
    for (int j = 0; j < NC; ++j) v[j] = load16(v_tile + t * token_stride + 16 * j);
    for (int h = 0; h < HC; ++h) {
      const __m512 pt = _mm512_set1_ps(p[h * 16 + t]);
      for (int j = 0; j < NC; ++j) acc[h][j] = _mm512_fmadd_ps(pt, v[j], acc[h][j]);
    }
  }
  for (int h = 0; h < HC; ++h)
    for (int j = 0; j < NC; ++j) _mm512_storeu_ps(acc_store + (h * NC + j) * 16, acc[h][j]);
}

// `heads` such queries, in chunks of at most 16 accumulator registers.
template <int NC, typename T>
void accumulate_group(const T* v_tile, int64_t token_stride, int64_t n, const float* p, const float* corr,
                      float* acc_store, int64_t heads) {
  constexpr int kChunk = NC <= 4 ? 4 : 2;
  int64_t h = 0;
  for (; h + kChunk <= heads; h += kChunk)
    accumulate_values<NC, kChunk>(v_tile, token_stride, n, p + h * 16, corr + h, acc_store + h * NC * 16);
  const int64_t rest = heads - h;
  p += h * 16, corr += h, acc_store += h * NC * 16;
  if (rest == 3) accumulate_values<NC, 3>(v_tile, token_stride, n, p, corr, acc_store);
  if (rest == 2) accumulate_values<NC, 2>(v_tile, token_stride, n, p, corr, acc_store);
  if (rest == 1) accumulate_values<NC, 1>(v_tile, token_stride, n, p, corr, acc_store);
}

// ---- The bf16 dot-product path ("avx512_bf16"): bfloat16 K/V read as they are, by AVX512-BF16 (vdpbf16ps) ----
// Q.K: the query, rounded to bf16 once per sequence (a bf16 model's query already is), dotted with each K row by
// vdpbf16ps (pairs of products summed in float32), 16 tokens reduced as in sum16; the scale is applied to the float32
// scores. P.V: the softmax weights, rounded to bf16, paired token by token (p[t], p[t+1]) against V rows t and t+1
// interleaved (vpunpck{l,h}wd), so one vdpbf16ps adds two tokens into 16 float32 accumulators. The interleave leaves
// the accumulators' lanes in a fixed permuted order of d, undone once at the output. The softmax denominator sums the
// rounded weights, so the weights applied to V sum to 1.
// Decode runs in three passes per sequence instead of an online softmax (see decode_items_bf16), and asks for the
// scattered blocks ahead of use (RowPrefetcher); prefill keeps the online softmax of prefill_tile.
// On the Xeon this was written on, vdpbf16ps retires one per ~2 cycles (half the multiply-adds per cycle of float32
// FMA), so the arithmetic alone is no faster than widening: the gain measured there comes from the passes and the
// prefetching. Only for CPUs with avx512_bf16 (checked before a call: bf16_dot_supported()); compiled per function
// for that target, so the library still builds and runs on CPUs without it.
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 10)
#define BATCHSERVE_BF16_DOT 1
#define BF16_TARGET __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl")))

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

// P.V of HC query heads over a whole sequence's V rows of one kv head (v_head: that head's slice of the pool),
// pb: the heads' bf16 weights by position, rows `p_stride` apart -> acc (HC * NC vectors, in the permuted order of
// unpermute_store). Two tokens per vdpbf16ps; a block's odd last token is paired with zeros (the next row may be
// garbage, NaN, or outside the pool). The accumulators stay in registers for the whole sequence.
template <int NC, int HC>
BF16_TARGET void values_bf16(const bf16_t* v_head, const int64_t* table, int64_t len, int64_t block_size,
                             int64_t block_stride, int64_t token_stride, const uint16_t* pb, int64_t p_stride,
                             float* acc_out) {
  constexpr int NP = NC / 2;
  __m512 acc[HC][NC];
  for (int h = 0; h < HC; ++h)
    for (int j = 0; j < NC; ++j) acc[h][j] = _mm512_setzero_ps();
  for (int64_t start = 0; start < len; start += block_size) {
    const int64_t n = std::min(block_size, len - start);
    const bf16_t* v = v_head + table[start / block_size] * block_stride;
    const uint16_t* p = pb + start;
    for (int64_t t = 0; t < n; t += 2, v += 2 * token_stride, p += 2) {
      const bool pair = t + 1 < n;
      __m512i lo[NP], hi[NP];
      for (int c = 0; c < NP; ++c) {
        const __m512i a = _mm512_loadu_si512(v + 32 * c);
        const __m512i b = pair ? _mm512_loadu_si512(v + token_stride + 32 * c) : _mm512_setzero_si512();
        lo[c] = _mm512_unpacklo_epi16(a, b);
        hi[c] = _mm512_unpackhi_epi16(a, b);
      }
      for (int h = 0; h < HC; ++h) {
        int32_t p_pair = p[h * p_stride];  // (p[t], p[t + 1]) as one 32-bit broadcast
        if (pair) std::memcpy(&p_pair, p + h * p_stride, sizeof p_pair);
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(p_pair);
        for (int c = 0; c < NP; ++c) {
          acc[h][2 * c] = _mm512_dpbf16_ps(acc[h][2 * c], pp, (__m512bh)lo[c]);
          acc[h][2 * c + 1] = _mm512_dpbf16_ps(acc[h][2 * c + 1], pp, (__m512bh)hi[c]);
        }
      }
    }
  }
  for (int h = 0; h < HC; ++h)
    for (int j = 0; j < NC; ++j) _mm512_storeu_ps(acc_out + (h * NC + j) * 16, acc[h][j]);
}

// values_bf16 for `heads` query heads, in chunks of at most 16 accumulator registers.
template <int NC>
BF16_TARGET void values_group_bf16(const bf16_t* v_head, const int64_t* table, int64_t len, int64_t block_size,
                                   int64_t block_stride, int64_t token_stride, const uint16_t* pb, int64_t p_stride,
                                   float* acc_out, int64_t heads) {
  constexpr int kChunk = NC <= 4 ? 4 : 2;
  const auto run = [&](auto hc, int64_t h) {
    values_bf16<NC, decltype(hc)::value>(v_head, table, len, block_size, block_stride, token_stride,
                                         pb + h * p_stride, p_stride, acc_out + h * NC * 16);
  };
  int64_t h = 0;
  for (; h + kChunk <= heads; h += kChunk) run(std::integral_constant<int, kChunk>{}, h);
  if (heads - h == 3) run(std::integral_constant<int, 3>{}, h);
  if (heads - h == 2) run(std::integral_constant<int, 2>{}, h);
  if (heads - h == 1) run(std::integral_constant<int, 1>{}, h);
}

// The work items of decode_attention_bf16 this thread claims from `next` (positions in `order`), until none is left
// (a function of its own: a lambda would not carry the target). A decode query sees its whole context at once, so
// its softmax needs no online rescaling: (1) every score of the sequence, and their max; (2) the weights
// exp(s - max) in bf16, and their sum; (3) P.V with the accumulators in registers from the first token to the last.
template <int NC>
BF16_TARGET void decode_items_bf16(std::atomic<int64_t>& next, const int64_t* order, int64_t num_items,
                                   const float* q, const bf16_t* k_cache, const bf16_t* v_cache,
                                   const int64_t* tables, const int64_t* seq_lens, float* out, int64_t num_heads,
                                   int64_t num_kv_heads, int64_t block_size, int64_t max_blocks, int64_t splits,
                                   float scale) {
  constexpr int64_t D = NC * 16;
  constexpr int NP = NC / 2;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * D;
  const int64_t block_stride = block_size * token_stride;
  const int64_t heads_per_item = num_kv_heads / splits;
  const int64_t item_heads = heads_per_item * group;
  std::vector<float> scores, acc(item_heads * D), maxes(item_heads * 16);
  std::vector<uint16_t> qb(item_heads * D), pb;
  std::vector<float> sums(item_heads);
  for (int64_t claimed; (claimed = next.fetch_add(1, std::memory_order_relaxed)) < num_items;) {
    const int64_t item = order[claimed];
    const int64_t seq = item / splits, first_kv = item % splits * heads_per_item;
    const int64_t first_head = first_kv * group;
    const int64_t len = seq_lens[seq];
    const int64_t stride = (len + 31) / 16 * 16;  // per head, room for a whole last vector
    if (static_cast<int64_t>(scores.size()) < item_heads * stride) {
      scores.resize(item_heads * stride);
      pb.resize(item_heads * stride);
    }
    const int64_t* table = tables + seq * max_blocks;
    for (int64_t h = 0; h < item_heads; ++h) {
      query_to_bf16<NP>(q + (seq * num_heads + first_head + h) * D, &qb[h * D]);
      _mm512_storeu_ps(&maxes[h * 16], _mm512_set1_ps(-3.0e38f));
    }
    // (1) scores, a block at a time (its kv heads are one run of memory). The pool's blocks are scattered, which the
    // hardware prefetchers do not foresee: the next block's K is asked for (into L1) and its V (into L2, for (3)), a
    // slice per tile and head, spread over the block's work. Asked for all at a block's start, the same lines took
    // longer: a layer of 64 sequences x 250 tokens from memory 0.89-0.93 -> 0.78-0.84 ms spread (2 threads, Intel
    // Xeon with AMX).
    const int64_t row_bytes = heads_per_item * D * 2;
    const auto first_row = [&](const bf16_t* pool, int64_t start) {  // of the block holding token `start`
      return pool + table[start / block_size] * block_stride + first_kv * D;
    };
    prefetch_rows(first_row(k_cache, 0), std::min(block_size, len), token_stride * 2, row_bytes);
    prefetch_rows<_MM_HINT_T1>(first_row(v_cache, 0), std::min(block_size, len), token_stride * 2, row_bytes);
    for (int64_t start = 0; start < len; start += block_size) {
      const int64_t n = std::min(block_size, len - start);
      const int64_t base = table[start / block_size] * block_stride + first_kv * D;
      const int64_t next_rows = std::clamp<int64_t>(len - start - block_size, 0, block_size);
      const int64_t steps = (n + 15) / 16 * item_heads;
      RowPrefetcher next_k(next_rows ? first_row(k_cache, start + block_size) : k_cache, next_rows, token_stride * 2,
                           row_bytes, steps);
      RowPrefetcher<_MM_HINT_T1> next_v(next_rows ? first_row(v_cache, start + block_size) : v_cache, next_rows,
                                        token_stride * 2, row_bytes, steps);
      for (int64_t i = 0; i < n; i += 16) {
        const int64_t m = std::min<int64_t>(16, n - i);
        const __mmask16 valid = static_cast<__mmask16>((1u << m) - 1);
        for (int64_t h = 0; h < item_heads; ++h) {
          next_k.step();
          next_v.step();
          const __m512 s = score_tile_bf16<NP>(&qb[h * D], k_cache + base + i * token_stride + h / group * D,
                                               token_stride, m, scale);
          _mm512_storeu_ps(&scores[h * stride + start + i], s);
          float* mx = &maxes[h * 16];
          _mm512_storeu_ps(mx, _mm512_mask_max_ps(_mm512_loadu_ps(mx), valid, _mm512_loadu_ps(mx), s));
        }
      }
    }
    // (2) weights, rounded to bf16 as (3) uses them; the sum is of the rounded weights
    for (int64_t h = 0; h < item_heads; ++h) {
      const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_loadu_ps(&maxes[h * 16])));
      __m512 sum = _mm512_setzero_ps();
      for (int64_t i = 0; i < len; i += 16) {
        const __mmask16 valid = static_cast<__mmask16>(len - i >= 16 ? 0xFFFFu : (1u << (len - i)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(_mm512_loadu_ps(&scores[h * stride + i]), mx)));
        const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&pb[h * stride + i]), rounded);
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16)));
      }
      sums[h] = _mm512_reduce_add_ps(sum);
    }
    // (3) P.V, one kv head at a time
    for (int64_t kv = 0; kv < heads_per_item; ++kv)
      values_group_bf16<NC>(v_cache + (first_kv + kv) * D, table, len, block_size, block_stride, token_stride,
                            &pb[kv * group * stride], stride, &acc[kv * group * D], group);
    for (int64_t h = 0; h < item_heads; ++h)
      unpermute_store<NC>(&acc[h * D], 1.f / sums[h], out + (seq * num_heads + first_head + h) * D);
  }
}

// decode_attention_avx512's work split, on the bf16 dot-product path.
template <int NC>
void decode_attention_bf16(const float* q, const bf16_t* k_cache, const bf16_t* v_cache, const int64_t* tables,
                           const int64_t* seq_lens, float* out, int64_t num_seqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t splits = num_seqs < 4 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t num_items = num_seqs * splits;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  // Items are claimed one at a time, longest context first: the threads end together however the lengths are
  // spread, and a thread the OS preempts holds up only the item it is on (the other takes the rest).
  std::vector<int64_t> order(num_items);
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return seq_lens[a / splits] > seq_lens[b / splits]; });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    if (begin < end)
      decode_items_bf16<NC>(next, order.data(), num_items, q, k_cache, v_cache, tables, seq_lens, out, num_heads,
                            num_kv_heads, block_size, max_blocks, splits, scale);
  });
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

#endif  // avx512bf16 in this compiler

// NC = head_dim / 16 vectors per head. A work item is one sequence with all its kv heads, so each 16-token tile is
// read as one contiguous run of memory; with fewer sequences than 4 per thread, an item is one (sequence, kv head)
// so that both threads have work. Items are dealt to threads round-robin: a batch lists its sequences oldest (longest
// context) first, and contiguous runs of items would give one thread the long contexts and the other the short ones.
template <int NC, typename T>
void decode_attention_avx512(const float* q, const T* k_cache, const T* v_cache, const int64_t* tables,
                             const int64_t* seq_lens, float* out, int64_t num_seqs, int64_t num_heads,
                             int64_t num_kv_heads, int64_t block_size, int64_t max_blocks, float scale) {
  constexpr int64_t D = NC * 16;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * D;
  const int64_t block_stride = block_size * token_stride;
  const int64_t splits = num_seqs < 4 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t heads_per_item = num_kv_heads / splits;
  const bool grouped = group <= kMaxGroup;
  const int64_t num_items = num_seqs * splits;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc_store(num_heads * D), m(num_heads), p(num_heads * 16), corr(num_heads), qs(num_heads * D);
    std::vector<__m512> l(num_heads);  // per-lane partial sums of the softmax denominator
    __m512 scores[kMaxGroup];
    for (int64_t worker = begin; worker < end; ++worker)
    for (int64_t item = worker; item < num_items; item += threads) {
      const int64_t seq = item / splits, first_kv = item % splits * heads_per_item;
      const int64_t first_head = first_kv * group, last_head = first_head + heads_per_item * group;
      const float* q_seq = q + seq * num_heads * D;
      for (int64_t h = first_head; h < last_head; ++h)  // scaled once per sequence, not per tile
        for (int c = 0; c < NC; ++c)
          _mm512_storeu_ps(qs.data() + h * D + 16 * c,
                           _mm512_mul_ps(_mm512_loadu_ps(q_seq + h * D + 16 * c), _mm512_set1_ps(scale)));
      std::fill(acc_store.begin(), acc_store.end(), 0.f);
      std::fill(m.begin(), m.end(), -1e30f);  // finite: exp(m - max) must be 0, not NaN
      std::fill(l.begin(), l.end(), _mm512_setzero_ps());
      const int64_t len = seq_lens[seq];
      for (int64_t start = 0, n = 0; start < len; start += n) {
        // A tile: up to 16 tokens of one block.
        const int64_t in_block = start % block_size;
        n = std::min<int64_t>({16, block_size - in_block, len - start});
        const int64_t offset =
            tables[seq * max_blocks + start / block_size] * block_stride + in_block * token_stride;
        // the next tile's K and V asked for during this one's kv heads (the pool's blocks are scattered, which the
        // hardware prefetchers do not foresee), a few lines a kv head (see RowPrefetcher)
        const int64_t next = start + n, next_in_block = next % block_size;
        const int64_t next_rows = std::max<int64_t>(0, std::min<int64_t>({16, block_size - next_in_block, len - next}));
        const int64_t next_offset = next_rows ? tables[seq * max_blocks + next / block_size] * block_stride +
                                                    next_in_block * token_stride + first_kv * D
                                              : 0;
        const int64_t row_bytes = heads_per_item * D * sizeof(T), steps = 2 * heads_per_item;
        RowPrefetcher next_k(k_cache + next_offset, next_rows, token_stride * sizeof(T), row_bytes, steps);
        RowPrefetcher next_v(v_cache + next_offset, next_rows, token_stride * sizeof(T), row_bytes, steps);
        for (int64_t kv_head = first_kv; kv_head < first_kv + heads_per_item && grouped; ++kv_head) {
          next_k.step();
          next_v.step();
          const int64_t h0 = kv_head * group;
          score_group<NC>(qs.data() + h0 * D, group, k_cache + offset + kv_head * D, token_stride, n, scores);
          for (int64_t g = 0; g < group; ++g)
            softmax_update(scores[g], n, m[h0 + g], l[h0 + g], corr[h0 + g], p.data() + (h0 + g) * 16);
        }
        for (int64_t h = first_head; h < last_head && !grouped; ++h) {
          __m512 qv[NC];
          for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_ps(qs.data() + h * D + 16 * c);
          const __m512 s = score_tile<NC>(qv, k_cache + offset + h / group * D, token_stride, n);
          softmax_update(s, n, m[h], l[h], corr[h], p.data() + h * 16);
        }
        for (int64_t kv_head = first_kv; kv_head < first_kv + heads_per_item; ++kv_head) {
          next_k.step();
          next_v.step();
          const int64_t h = kv_head * group;
          accumulate_group<NC>(v_cache + offset + kv_head * D, token_stride, n, p.data() + h * 16, corr.data() + h,
                               acc_store.data() + h * D, group);
        }
      }
      for (int64_t h = first_head; h < last_head; ++h) {
        float* o = out + (seq * num_heads + h) * D;
        const float inv = 1.f / _mm512_reduce_add_ps(l[h]);
        for (int64_t d = 0; d < D; ++d) o[d] = acc_store[h * D + d] * inv;
      }
    }
  });
}

// Prefill tiles: up to 16 consecutive query rows of one sequence and one head, at positions first_pos.. (their keys
// are 0..position, this step's included, all read from the pool through the block table).
template <int NC, typename T>
void prefill_tile(const float* q, int64_t q_stride, const T* k_cache, const T* v_cache, const int64_t* table,
                  int64_t first_pos, int64_t rows, int64_t kv_head, int64_t token_stride, int64_t block_size,
                  float scale, float* out, int64_t out_stride) {
  constexpr int64_t D = NC * 16;
  alignas(64) float acc[16 * D], p[16 * 16], m[16], corr[16], q_scaled[16 * D];
  __m512 l[16];
  for (int64_t r = 0; r < rows; ++r) {
    for (int c = 0; c < NC; ++c)
      _mm512_store_ps(q_scaled + r * D + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(q + r * q_stride + 16 * c),
                                                               _mm512_set1_ps(scale)));
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
        _mm512_storeu_ps(p + r * 16, _mm512_setzero_ps());
        continue;
      }
      __m512 qv[NC];
      for (int c = 0; c < NC; ++c) qv[c] = _mm512_load_ps(q_scaled + r * D + 16 * c);
      softmax_update(score_tile<NC>(qv, k_cache + offset, token_stride, visible), visible, m[r], l[r], corr[r],
                     p + r * 16);
    }
    accumulate_group<NC>(v_cache + offset, token_stride, n, p, corr, acc, rows);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / _mm512_reduce_add_ps(l[r]);
    for (int64_t d = 0; d < D; ++d) out[r * out_stride + d] = acc[r * D + d] * inv;
  }
}

// Every sequence's query rows in tiles of 16, one tile x head per work item. Items are dealt to threads round-robin:
// a tile's cost grows with its position, and neighbouring items cost about the same. kBf16Dot: the tiles take the
// bf16 dot-product path (T is bfloat16).
template <int NC, typename T, bool kBf16Dot = false>
void prefill_attention_avx512(const float* q, int64_t q_stride, const T* k_cache, const T* v_cache,
                              const int64_t* tables, int64_t max_blocks, const int64_t* seq_lens,
                              const int64_t* query_starts, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                              int64_t block_size, float scale, float* out) {
  constexpr int64_t D = NC * 16;
  const int64_t group = num_heads / num_kv_heads;
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (sequence, first query row)
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t row = query_starts[s]; row < query_starts[s + 1]; row += 16) tiles.emplace_back(s, row);
  const int64_t num_items = static_cast<int64_t>(tiles.size()) * num_heads;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t worker = begin; worker < end; ++worker) {
      for (int64_t item = worker; item < num_items; item += threads) {
        const auto [seq, row] = tiles[item / num_heads];
        const int64_t head = item % num_heads;
        const int64_t rows = std::min<int64_t>(16, query_starts[seq + 1] - row);
        const int64_t first_pos = seq_lens[seq] - (query_starts[seq + 1] - row);
#ifdef BATCHSERVE_BF16_DOT
        if constexpr (kBf16Dot) {
          prefill_tile_bf16<NC>(q + row * q_stride + head * D, q_stride, k_cache, v_cache, tables + seq * max_blocks,
                                first_pos, rows, head / group, num_kv_heads * D, block_size, scale,
                                out + (row * num_heads + head) * D, num_heads * D);
          continue;
        }
#endif
        prefill_tile<NC, T>(q + row * q_stride + head * D, q_stride, k_cache, v_cache, tables + seq * max_blocks,
                         first_pos, rows, head / group, num_kv_heads * D, block_size, scale,
                         out + (row * num_heads + head) * D, num_heads * D);
      }
    }
  });
}

// True when the vectorized path took the call (head_dim 32, 64 or 128); bf16_dot: a bfloat16 pool takes the bf16
// dot-product path (a float32 pool is computed as without it).
template <typename T>
bool try_decode_attention_avx512(const float* q, const T* k_cache, const T* v_cache, const int64_t* tables,
                                 const int64_t* seq_lens, float* out, int64_t num_seqs, int64_t num_heads,
                                 int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                                 float scale, bool bf16_dot) {
  const auto run = [&](auto nc) {
#ifdef BATCHSERVE_BF16_DOT
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (bf16_dot) {
        decode_attention_bf16<decltype(nc)::value>(q, k_cache, v_cache, tables, seq_lens, out, num_seqs, num_heads,
                                                   num_kv_heads, block_size, max_blocks, scale);
        return true;
      }
    }
#endif
    decode_attention_avx512<decltype(nc)::value, T>(q, k_cache, v_cache, tables, seq_lens, out, num_seqs, num_heads,
                                                    num_kv_heads, block_size, max_blocks, scale);
    return true;
  };
  if (head_dim == 32) return run(std::integral_constant<int, 2>{});
  if (head_dim == 64) return run(std::integral_constant<int, 4>{});
  if (head_dim == 128) return run(std::integral_constant<int, 8>{});
  return false;
}

#endif  // __AVX512F__

// The paths a call may ask for, best first: "avx512_bf16" (bfloat16 K/V by vdpbf16ps; float32 K/V as "avx512"),
// "avx512" (K/V widened to float32, AVX-512 FMA), "avx2" (8-wide AVX2 + FMA, decode_avx2.cpp; decode only),
// "portable" (the plain loop, any CPU; decode only). Each takes the next one down where it does not apply (a head
// size other than 32/64/128: the portable loop).
enum class AttentionPath { kPortable, kAvx2, kAvx512, kAvx512Bf16 };

}  // namespace

template <typename T>
bool decode_attention_avx2(const float* q, const T* k_cache, const T* v_cache, const int64_t* tables,
                           const int64_t* seq_lens, float* out, int64_t num_seqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                           float scale);
bool avx2_attention_built();

// Whether this CPU runs the bf16 dot-product path (and this build has it); asked of the CPU once.
bool bf16_dot_supported() {
#ifdef BATCHSERVE_BF16_DOT
  static const bool supported = __builtin_cpu_supports("avx512bf16");
  return supported;
#else
  return false;
#endif
}

std::vector<std::string> attention_paths() {
  std::vector<std::string> paths;
#ifdef BATCHSERVE_BF16_DOT
  paths.push_back("avx512_bf16");
#endif
#if defined(__AVX512F__)
  paths.push_back("avx512");
#endif
  if (avx2_attention_built()) paths.push_back("avx2");
  paths.push_back("portable");
  return paths;
}

// "auto": the best this build and CPU run. A path that is not built here, or that this CPU cannot run, raises.
static AttentionPath parse_path(const std::string& path) {
  const auto built = attention_paths();
  if (path == "auto") {
    if (bf16_dot_supported()) return AttentionPath::kAvx512Bf16;
    return built[0] == "avx512" ? AttentionPath::kAvx512 : built[0] == "avx2" ? AttentionPath::kAvx2
                                                                              : AttentionPath::kPortable;
  }
  TORCH_CHECK(std::find(built.begin(), built.end(), path) != built.end(), "attention path '", path,
              "' is not built here (built: ", c10::Join(", ", built), ")");
  if (path == "avx512_bf16") {
    TORCH_CHECK(bf16_dot_supported(), "attention path 'avx512_bf16' needs a CPU with avx512_bf16");
    return AttentionPath::kAvx512Bf16;
  }
  return path == "avx512" ? AttentionPath::kAvx512 : path == "avx2" ? AttentionPath::kAvx2 : AttentionPath::kPortable;
}

// Shapes the kernels index with, checked before any pointer is formed from them: a bad call raises, never reads or
// writes outside its tensors.
static void check_paged_inputs(const torch::Tensor& query, const torch::Tensor& key_cache,
                               const torch::Tensor& value_cache, const torch::Tensor& tables,
                               const torch::Tensor& lens) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [T, H, D] and caches [blocks, block_size, Hkv, D]");
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes() && value_cache.scalar_type() == key_cache.scalar_type(),
              "key and value caches must match");
  TORCH_CHECK(key_cache.size(3) == query.size(2), "query and cache head sizes differ");
  TORCH_CHECK(key_cache.size(2) > 0 && query.size(1) % key_cache.size(2) == 0,
              "query heads must be a multiple of kv heads");
  TORCH_CHECK(tables.dim() == 2 && lens.dim() == 1 && tables.size(0) == lens.size(0),
              "one block table row per sequence");
  const int64_t block_size = key_cache.size(1), num_blocks = key_cache.size(0);
  const int64_t* len = lens.data_ptr<int64_t>();
  const int64_t* table = tables.data_ptr<int64_t>();
  for (int64_t s = 0; s < lens.size(0); ++s) {
    TORCH_CHECK(len[s] >= 1 && len[s] <= tables.size(1) * block_size, "sequence ", s, ": length ", len[s],
                " outside its block table");
    for (int64_t b = 0; b < (len[s] + block_size - 1) / block_size; ++b) {
      const int64_t block = table[s * tables.size(1) + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "sequence ", s, ": block ", block, " outside the pool");
    }
  }
}

// query [B, H, D] float32 contiguous; caches [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks] int64;
// seq_lens [B] int64 -> [B, H, D] float32
// path: see AttentionPath ("auto", "avx512_bf16", "avx512", "portable").
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                     const std::string& path) {
  const AttentionPath chosen = parse_path(path);
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && query.is_contiguous(), "query: contiguous float32");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && seq_lens.scalar_type() == torch::kInt64, "int64 indices");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  check_paged_inputs(query, key_cache, value_cache, tables, lens);
  TORCH_CHECK(lens.size(0) == query.size(0), "one query per sequence");
  auto out = torch::empty_like(query);
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
#if defined(__AVX512F__)
  const auto vectorized = [&](auto* cache_type) {
    using T = std::remove_pointer_t<decltype(cache_type)>;
    return try_decode_attention_avx512<T>(query.data_ptr<float>(), key_cache.data_ptr<T>(), value_cache.data_ptr<T>(),
                                          tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<float>(),
                                          num_seqs, num_heads, num_kv_heads, head_dim, block_size, tables.size(1),
                                          static_cast<float>(scale), chosen == AttentionPath::kAvx512Bf16);
  };
  if (chosen == AttentionPath::kAvx512 || chosen == AttentionPath::kAvx512Bf16) {
    if (key_cache.scalar_type() == torch::kFloat32 && vectorized(static_cast<float*>(nullptr))) return out;
    if (key_cache.scalar_type() == torch::kBFloat16 && vectorized(static_cast<c10::BFloat16*>(nullptr))) return out;
  }
#endif
  const auto avx2 = [&](auto* cache_type) {
    using T = std::remove_pointer_t<decltype(cache_type)>;
    return decode_attention_avx2<T>(query.data_ptr<float>(), key_cache.data_ptr<T>(), value_cache.data_ptr<T>(),
                                    tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<float>(),
                                    num_seqs, num_heads, num_kv_heads, head_dim, block_size, tables.size(1),
                                    static_cast<float>(scale));
  };
  if (chosen == AttentionPath::kAvx2) {
    if (key_cache.scalar_type() == torch::kFloat32 && avx2(static_cast<float*>(nullptr))) return out;
    if (key_cache.scalar_type() == torch::kBFloat16 && avx2(static_cast<c10::BFloat16*>(nullptr))) return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key_cache.scalar_type(), "paged_decode_attention", [&] {
    decode_attention_impl<scalar_t>(query.data_ptr<float>(), key_cache.data_ptr<scalar_t>(),
                                    value_cache.data_ptr<scalar_t>(), tables.data_ptr<int64_t>(),
                                    lens.data_ptr<int64_t>(), out.data_ptr<float>(), num_seqs, num_heads,
                                    num_kv_heads, head_dim, block_size, tables.size(1), static_cast<float>(scale));
  });
  return out;
}

// query [T, H, D] float32 (heads contiguous within a token; any token stride), the rows of the prefill sequences in
// order; caches [num_blocks, block_size, Hkv, D] (float32 or bfloat16) holding every key up to each row's position
// (this step's included); block_tables [S, max_blocks]; seq_lens [S] context after this step; query_starts [S + 1]
// cumulative query rows -> [T, H, D] float32. Needs AVX-512 and head_dim in {32, 64, 128}: see
// prefill_attention_available().
torch::Tensor paged_prefill_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                      torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_starts,
                                      double scale, const std::string& path) {
  const AttentionPath chosen = parse_path(path);
  TORCH_CHECK(chosen == AttentionPath::kAvx512 || chosen == AttentionPath::kAvx512Bf16,
              "paged_prefill_attention runs on the AVX-512 paths only (on the others the torch code runs)");
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && query.dim() == 3 && query.stride(2) == 1 &&
                  query.stride(1) == query.size(2),
              "query: float32 [T, H, D] with contiguous heads");
  const auto cache_type = key_cache.scalar_type();
  TORCH_CHECK((cache_type == torch::kFloat32 || cache_type == torch::kBFloat16) &&
                  value_cache.scalar_type() == cache_type && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "caches: contiguous float32 or bfloat16");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && seq_lens.scalar_type() == torch::kInt64 &&
                  query_starts.scalar_type() == torch::kInt64,
              "int64 indices");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto starts = query_starts.contiguous();
  check_paged_inputs(query, key_cache, value_cache, tables, lens);
  const int64_t num_seqs = lens.size(0);
  TORCH_CHECK(starts.dim() == 1 && starts.size(0) == num_seqs + 1, "query_starts: [S + 1]");
  const int64_t* start = starts.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  TORCH_CHECK(start[0] == 0 && start[num_seqs] == query.size(0), "query_starts must run from 0 to the query rows");
  for (int64_t s = 0; s < num_seqs; ++s)
    TORCH_CHECK(start[s + 1] > start[s] && start[s + 1] - start[s] <= len[s], "sequence ", s,
                ": query rows must be 1..seq_len");
  auto out = torch::empty({query.size(0), query.size(1), query.size(2)}, query.options());
  const int64_t head_dim = query.size(2);
#if defined(__AVX512F__)
  const auto run = [&](auto nc, auto* cache_type, auto bf16_dot) {
    using T = std::remove_pointer_t<decltype(cache_type)>;
    prefill_attention_avx512<decltype(nc)::value, T, decltype(bf16_dot)::value>(
        query.data_ptr<float>(), query.stride(0), key_cache.data_ptr<T>(), value_cache.data_ptr<T>(),
        tables.data_ptr<int64_t>(), tables.size(1), lens.data_ptr<int64_t>(), starts.data_ptr<int64_t>(), num_seqs,
        query.size(1), key_cache.size(2), key_cache.size(1), static_cast<float>(scale), out.data_ptr<float>());
  };
  const auto run_typed = [&](auto nc) {
    if (cache_type == torch::kFloat32) run(nc, static_cast<float*>(nullptr), std::false_type{});
    else if (chosen == AttentionPath::kAvx512Bf16) run(nc, static_cast<c10::BFloat16*>(nullptr), std::true_type{});
    else run(nc, static_cast<c10::BFloat16*>(nullptr), std::false_type{});
  };
  if (head_dim == 32) return run_typed(std::integral_constant<int, 2>{}), out;
  if (head_dim == 64) return run_typed(std::integral_constant<int, 4>{}), out;
  if (head_dim == 128) return run_typed(std::integral_constant<int, 8>{}), out;
#endif
  TORCH_CHECK(false, "paged_prefill_attention: needs AVX-512 and head_dim 32, 64 or 128");
  return out;
}

bool prefill_attention_available(int64_t head_dim) {
#if defined(__AVX512F__)
  return head_dim == 32 || head_dim == 64 || head_dim == 128;
#else
  return false;
#endif
}
