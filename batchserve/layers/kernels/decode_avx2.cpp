// Paged decode attention on the "avx2" path: 8-wide AVX2 + FMA vectors, for CPUs without AVX-512 (AMD Zen 1-3,
// Intel before Skylake-SP, many desktop and cloud parts). Float32 or bfloat16 K/V (widened to float32), or a quantized
// pool's int8 / float8 e4m3 codes read in place (each token's scores times its K row's scale, its softmax weight times
// its V row's), head_dim 32, 64 or 128; anything else is left to the portable loop.
// A decode query sees its whole context at once, so each (sequence, kv head) runs in three passes instead of an
// online softmax: (1) the scores of every token for each query head sharing the kv head, 8 tokens per transpose-add
// reduction (sum8) rather than one horizontal sum per token; (2) their max, exp(s - max) and the sum; (3) P.V with the
// accumulators in registers from the first token to the last, at most 8 vectors of head_dim at a time (AVX2 has 16
// registers).
#include "isa.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "paged_args.h"
#include "vec_math.h"
#include "work_split.h"

#ifdef BATCHSERVE_ISA_AVX2

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // a bfloat16 is a float's upper half
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const c10::Float8_e4m3fn* p) {  // as vec_math.h's load16: through a float16, times 2^8
  const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i magnitude = _mm_slli_epi16(_mm_and_si128(bytes, _mm_set1_epi16(0x7F)), 7);
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(bytes, _mm_set1_epi16(0x80)), 8);
  return _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(magnitude, sign)), _mm256_set1_ps(256.0f));
}

template <typename T>
constexpr bool kScaledCodes = std::is_same_v<T, int8_t> || std::is_same_v<T, c10::Float8_e4m3fn>;

// A quantized pool's row scales of one kv head ([slots, Hkv], from this head's column): the scale of slot s at
// head[s * stride]
struct RowScales {
  const float* head;
  int64_t stride;
  float at(int64_t slot) const { return head[slot * stride]; }
};

// Lane i of the result = the sum of the 8 lanes of v[i]: two rounds of hadd leave each vector's half sums, in order,
// in the two 128-bit halves; one cross-half add finishes them.
inline __m256 sum8(const __m256* v) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float reduce_max8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// How many blocks ahead of the one being computed the first kv head of an item pulls every kv head's rows toward
// L2: one block of one head's scores is ~100 cycles of compute, a DRAM read several times that.
constexpr int64_t kBlocksAhead = 4;

// The rows of one head in the block after the one at `start` (if any) into L1 while this one is computed: a
// sequence's blocks are scattered over the pool, where the hardware prefetchers do not follow. With `whole_tokens`
// (the first kv head of an item that holds them all) every kv head's rows of the block kBlocksAhead on go toward L2
// as well, one contiguous run, so the item's other kv heads find them there.
template <typename T>
inline void prefetch_next_block(const T* head, const int64_t* table, int64_t start, int64_t len, int64_t block_size,
                                int64_t block_stride, int64_t token_stride, int64_t row_bytes,
                                const T* whole_tokens) {
  const int64_t token_bytes = token_stride * sizeof(T);
  const int64_t ahead = start + kBlocksAhead * block_size;
  if (whole_tokens != nullptr && ahead < len)
    prefetch_rows<_MM_HINT_T1>(whole_tokens + table[ahead / block_size] * block_stride,
                               std::min(block_size, len - ahead), token_bytes, token_bytes);
  const int64_t next = start + block_size;
  if (next >= len) return;
  prefetch_rows(head + table[next / block_size] * block_stride, std::min(block_size, len - next), token_bytes,
                row_bytes);
}

// The first kBlocksAhead blocks' whole tokens, before a pass with `whole_tokens` starts.
template <typename T>
inline void prefetch_first_blocks(const T* whole_tokens, const int64_t* table, int64_t len, int64_t block_size,
                                  int64_t block_stride, int64_t token_stride) {
  if (whole_tokens == nullptr) return;
  const int64_t token_bytes = token_stride * sizeof(T);
  for (int64_t start = 0; start < std::min(len, kBlocksAhead * block_size); start += block_size)
    prefetch_rows<_MM_HINT_T1>(whole_tokens + table[start / block_size] * block_stride,
                               std::min(block_size, len - start), token_bytes, token_bytes);
}

// Pass 1 for one query head (qv: its scaled query, NC vectors): scores[t] for the sequence's `len` tokens, read
// through its block table; scores has room for len + 8.
template <int NC, typename T>
void score_sequence(const __m256* qv, const T* k_head, const int64_t* table, int64_t len, int64_t block_size,
                    int64_t block_stride, int64_t token_stride, const T* whole_tokens, float* scores,
                    const RowScales& k_scales) {
  prefetch_first_blocks(whole_tokens, table, len, block_size, block_stride, token_stride);
  for (int64_t start = 0; start < len; start += block_size) {
    const T* k_block = k_head + table[start / block_size] * block_stride;
    const int64_t n = std::min(block_size, len - start);
    prefetch_next_block(k_head, table, start, len, block_size, block_stride, token_stride, NC * 8 * sizeof(T),
                        whole_tokens);
    for (int64_t t0 = 0; t0 < n; t0 += 8) {
      __m256 dots[8];
      for (int t = 0; t < 8; ++t) {
        if (t0 + t < n) {
          const T* k = k_block + (t0 + t) * token_stride;
          __m256 d = _mm256_mul_ps(qv[0], load8(k));
          for (int c = 1; c < NC; ++c) d = _mm256_fmadd_ps(qv[c], load8(k + 8 * c), d);
          dots[t] = d;
        } else {
          dots[t] = _mm256_setzero_ps();
        }
      }
      // a block of fewer than 8 tokens writes past its end; the next block's scores overwrite that
      _mm256_storeu_ps(scores + start + t0, sum8(dots));
    }
    if constexpr (kScaledCodes<T>) {
      const int64_t slot0 = table[start / block_size] * block_size;
      for (int64_t t = 0; t < n; ++t) scores[start + t] *= k_scales.at(slot0 + t);
    }
  }
}

// Pass 2: scores -> exp(s - max) in place (padding lanes to 0); returns their sum, and their max in `max_out`.
inline float softmax_in_place(float* scores, int64_t len, float& max_out) {
  const int64_t padded = (len + 7) / 8 * 8;
  std::fill(scores + len, scores + padded, -1e30f);  // exp(-1e30 - max) is 0
  __m256 vmax = _mm256_set1_ps(-1e30f);
  for (int64_t t = 0; t < padded; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(scores + t));
  max_out = reduce_max8(vmax);
  const __m256 max = _mm256_set1_ps(max_out);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t t = 0; t < padded; t += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + t), max));
    _mm256_storeu_ps(scores + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  return reduce_add8(sum);
}

// Pass 3 for one query head and CH vectors of head_dim from `d0` on: out = sum_t p[t] * v[t] * inv.
template <int CH, typename T>
void values_chunk(const T* v_head, const int64_t* table, int64_t len, int64_t block_size, int64_t block_stride,
                  int64_t token_stride, const T* whole_tokens, const float* p, float inv, float* out) {
  prefetch_first_blocks(whole_tokens, table, len, block_size, block_stride, token_stride);
  __m256 acc[CH];
  for (int c = 0; c < CH; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t start = 0; start < len; start += block_size) {
    const T* v_block = v_head + table[start / block_size] * block_stride;
    const int64_t n = std::min(block_size, len - start);
    prefetch_next_block(v_head, table, start, len, block_size, block_stride, token_stride, CH * 8 * sizeof(T),
                        whole_tokens);
    for (int64_t t = 0; t < n; ++t) {
      const __m256 pt = _mm256_set1_ps(p[start + t]);
      const T* v = v_block + t * token_stride;
      for (int c = 0; c < CH; ++c) acc[c] = _mm256_fmadd_ps(pt, load8(v + 8 * c), acc[c]);
    }
  }
  const __m256 scale = _mm256_set1_ps(inv);
  for (int c = 0; c < CH; ++c) _mm256_storeu_ps(out + 8 * c, _mm256_mul_ps(acc[c], scale));
}

// A NaN query gives its head a NaN output, as SDPA does. Checked on the bits: under -ffast-math the compiler may
// assume that no NaN reaches a float comparison, and the max and exp of the softmax then dropped it on one CPU (tiny
// garbage instead of NaN on an AMD EPYC of family 23).
inline bool has_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof(bits));
    if ((bits & 0x7fffffffu) > 0x7f800000u) return true;
  }
  return false;
}

// NC = head_dim / 8. The work items (a sequence with all its kv heads, so that its blocks are read from memory as
// contiguous runs of whole tokens and its later kv heads find them in cache, or one kv head of it) and their threads
// are work_split.h's.
template <int NC, typename T>
void decode_attention_avx2_impl(const float* q, const T* k_cache, const T* v_cache, const int64_t* tables,
                                const int64_t* seq_lens, float* out, int64_t num_seqs, int64_t num_heads,
                                int64_t num_kv_heads, int64_t block_size, int64_t max_blocks, float scale,
                                const float* k_scale, const float* v_scale) {
  constexpr int64_t D = NC * 8;
  constexpr int CH = NC < 8 ? NC : 8;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * D;
  const int64_t block_stride = block_size * token_stride;
  DecodeSplit split = split_decode(seq_lens, num_seqs, num_heads, num_kv_heads, D, block_size);
  const int64_t heads_per_item = split.heads_per_item;
  run_decode_items(split, out, [&](WorkQueue& queue) {
    std::vector<float> scores, weights, v_row_scales;
    for (int64_t item; queue.next(item);) {
      const DecodeItem& it = split.items[item];
      const int64_t seq = it.seq, first_kv = it.first_kv;
      const int64_t len = it.len;  // of its partition
      const int64_t* table = tables + seq * max_blocks + it.first_block;
      scores.resize(len + 8);  // the last tile of 8 may start at any token (a block size not a multiple of 8)
      weights.resize(kScaledCodes<T> ? len : 0);
      v_row_scales.resize(kScaledCodes<T> ? len : 0);
      for (int64_t kv_head = first_kv; kv_head < first_kv + heads_per_item; ++kv_head) {
        const T* k_head = k_cache + kv_head * D;
        const T* v_head = v_cache + kv_head * D;
        const bool first_of_many = heads_per_item > 1 && kv_head == first_kv;
        const T* k_tokens = first_of_many ? k_cache : nullptr;
        const T* v_tokens = first_of_many ? v_cache : nullptr;
        if constexpr (kScaledCodes<T>) {  // this kv head's V row scales in token order, once for its query heads
          const RowScales v_scales{v_scale + kv_head, num_kv_heads};
          for (int64_t start = 0; start < len; start += block_size) {
            const int64_t slot0 = table[start / block_size] * block_size;
            for (int64_t t = start; t < std::min(len, start + block_size); ++t)
              v_row_scales[t] = v_scales.at(slot0 + t - start);
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          const int64_t h = kv_head * group + g;
          const float* qh = q + (seq * num_heads + h) * D;
          float* o = split.row(it, h, out);
          if (has_nan(qh, D)) {
            std::fill(o, o + D, std::numeric_limits<float>::quiet_NaN());
            split.finish(it, h, 0.f, 1.f);  // a partition's NaN row carries into the merged one
            continue;
          }
          __m256 qv[NC];
          for (int c = 0; c < NC; ++c) qv[c] = _mm256_mul_ps(_mm256_loadu_ps(qh + 8 * c), _mm256_set1_ps(scale));
          // the whole tokens are pulled once, by the first query head of the first kv head
          score_sequence<NC>(qv, k_head, table, len, block_size, block_stride, token_stride,
                             g == 0 ? k_tokens : nullptr, scores.data(), RowScales{k_scale + kv_head, num_kv_heads});
          float max = 0.f;
          const float sum = softmax_in_place(scores.data(), len, max);
          const float inv = split.finish(it, h, max, sum);
          const float* p = scores.data();
          if constexpr (kScaledCodes<T>) {  // the weights (summed into inv as they are) times the V rows' scales
            for (int64_t t = 0; t < len; ++t) weights[t] = scores[t] * v_row_scales[t];
            p = weights.data();
          }
          for (int c0 = 0; c0 < NC; c0 += CH)
            values_chunk<CH>(v_head + 8 * c0, table, len, block_size, block_stride, token_stride,
                             g == 0 && c0 == 0 ? v_tokens : nullptr, p, inv, o + 8 * c0);
        }
      }
    }
  });
}

}  // namespace

template <typename T>
bool decode_attention_avx2(const PagedArgs<T>& a) {
  const auto run = [&](auto nc) {
    decode_attention_avx2_impl<decltype(nc)::value, T>(a.q, a.k_cache, a.v_cache, a.tables, a.seq_lens, a.out,
                                                       a.num_seqs, a.num_heads, a.num_kv_heads, a.block_size,
                                                       a.max_blocks, a.scale, a.k_scale, a.v_scale);
    return true;
  };
  if (a.head_dim == 32) return run(std::integral_constant<int, 4>{});
  if (a.head_dim == 64) return run(std::integral_constant<int, 8>{});
  if (a.head_dim == 128) return run(std::integral_constant<int, 16>{});
  return false;
}

#else  // no AVX2 + FMA in this build: the caller runs the portable loop

template <typename T>
bool decode_attention_avx2(const PagedArgs<T>&) {
  return false;
}

#endif

template bool decode_attention_avx2<float>(const PagedArgs<float>&);
template bool decode_attention_avx2<c10::BFloat16>(const PagedArgs<c10::BFloat16>&);
template bool decode_attention_avx2<int8_t>(const PagedArgs<int8_t>&);
template bool decode_attention_avx2<c10::Float8_e4m3fn>(const PagedArgs<c10::Float8_e4m3fn>&);
