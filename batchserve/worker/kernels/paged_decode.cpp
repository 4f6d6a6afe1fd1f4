// Paged decode attention for CPU: one query token per sequence attends over its context, read in place through
// its block table (no gather into a padded copy). Online softmax one tile of tokens at a time; parallel over
// (sequence, kv head) pairs; the query heads that share a kv head are done back to back so K/V come from L1/L2.
// With AVX-512 and float32 K/V, head_dim in {32, 64, 128}, a vectorized path scores 16 tokens at once (a transpose-add
// reduction instead of one horizontal sum per token); other cases take the portable loop.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
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

// NC = head_dim / 16 vectors per head.
template <int NC>
void decode_attention_avx512(const float* q, const float* k_cache, const float* v_cache, const int64_t* tables,
                             const int64_t* seq_lens, float* out, int64_t num_seqs, int64_t num_heads,
                             int64_t num_kv_heads, int64_t block_size, int64_t max_blocks, float scale) {
  constexpr int64_t D = NC * 16;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * D;
  const int64_t block_stride = block_size * token_stride;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc_store(group * D), m(group), l(group);
    alignas(64) float p[16];
    __m512 dots[16];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
      const float* q_seq = q + (seq * num_heads + kv_head * group) * D;
      std::fill(acc_store.begin(), acc_store.end(), 0.f);
      std::fill(m.begin(), m.end(), -1e30f);  // finite: exp(m - max) must be 0, not NaN
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t len = seq_lens[seq];
      for (int64_t start = 0, n = 0; start < len; start += n) {
        // A tile: up to 16 tokens of one block.
        const int64_t in_block = start % block_size;
        n = std::min<int64_t>({16, block_size - in_block, len - start});
        const int64_t offset = tables[seq * max_blocks + start / block_size] * block_stride +
                               in_block * token_stride + kv_head * D;
        const float* k_tile = k_cache + offset;
        const float* v_tile = v_cache + offset;
        const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = q_seq + g * D;
          __m512 qv[NC];
          for (int c = 0; c < NC; ++c) qv[c] = _mm512_mul_ps(_mm512_loadu_ps(qg + 16 * c), _mm512_set1_ps(scale));
          for (int t = 0; t < 16; ++t) {
            if (t < n) {
              const float* k = k_tile + t * token_stride;
              __m512 d = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
              for (int c = 1; c < NC; ++c) d = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + 16 * c), d);
              dots[t] = d;
            } else {
              dots[t] = _mm512_setzero_ps();
            }
          }
          const __m512 s = sum16(dots);
          const float tile_max = _mm512_mask_reduce_max_ps(valid, s);
          const float new_max = std::max(m[g], tile_max);
          const float correction = std::exp(m[g] - new_max);
          const __m512 e = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(s, _mm512_set1_ps(new_max))));
          _mm512_store_ps(p, e);
          l[g] = l[g] * correction + _mm512_reduce_add_ps(e);
          m[g] = new_max;
          float* ag = acc_store.data() + g * D;
          __m512 acc[NC];
          const __m512 corr = _mm512_set1_ps(correction);
          for (int c = 0; c < NC; ++c) acc[c] = _mm512_mul_ps(_mm512_loadu_ps(ag + 16 * c), corr);
          for (int64_t t = 0; t < n; ++t) {
            const __m512 pt = _mm512_set1_ps(p[t]);
            const float* v = v_tile + t * token_stride;
            for (int c = 0; c < NC; ++c) acc[c] = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v + 16 * c), acc[c]);
          }
          for (int c = 0; c < NC; ++c) _mm512_storeu_ps(ag + 16 * c, acc[c]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* o = out + (seq * num_heads + kv_head * group + g) * D;
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < D; ++d) o[d] = acc_store[g * D + d] * inv;
      }
    }
  });
}

// True when the vectorized path took the call.
bool try_decode_attention_avx512(const float* q, const float* k_cache, const float* v_cache, const int64_t* tables,
                                 const int64_t* seq_lens, float* out, int64_t num_seqs, int64_t num_heads,
                                 int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                                 float scale) {
  switch (head_dim) {
    case 32:
      decode_attention_avx512<2>(q, k_cache, v_cache, tables, seq_lens, out, num_seqs, num_heads, num_kv_heads,
                                 block_size, max_blocks, scale);
      return true;
    case 64:
      decode_attention_avx512<4>(q, k_cache, v_cache, tables, seq_lens, out, num_seqs, num_heads, num_kv_heads,
                                 block_size, max_blocks, scale);
      return true;
    case 128:
      decode_attention_avx512<8>(q, k_cache, v_cache, tables, seq_lens, out, num_seqs, num_heads, num_kv_heads,
                                 block_size, max_blocks, scale);
      return true;
    default:
      return false;
  }
}

#endif  // __AVX512F__

}  // namespace

// query [B, H, D] float32 contiguous; caches [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks] int64;
// seq_lens [B] int64 -> [B, H, D] float32
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && query.is_contiguous(), "query: contiguous float32");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && seq_lens.scalar_type() == torch::kInt64, "int64 indices");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty_like(query);
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
#if defined(__AVX512F__)
  if (key_cache.scalar_type() == torch::kFloat32 &&
      try_decode_attention_avx512(query.data_ptr<float>(), key_cache.data_ptr<float>(), value_cache.data_ptr<float>(),
                                  tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<float>(),
                                  num_seqs, num_heads, num_kv_heads, head_dim, block_size, tables.size(1),
                                  static_cast<float>(scale)))
    return out;
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key_cache.scalar_type(), "paged_decode_attention", [&] {
    decode_attention_impl<scalar_t>(query.data_ptr<float>(), key_cache.data_ptr<scalar_t>(),
                                    value_cache.data_ptr<scalar_t>(), tables.data_ptr<int64_t>(),
                                    lens.data_ptr<int64_t>(), out.data_ptr<float>(), num_seqs, num_heads,
                                    num_kv_heads, head_dim, block_size, tables.size(1), static_cast<float>(scale));
  });
  return out;
}
