// Paged decode attention on the "portable" path, and the fallback of every other path: one query token per sequence
// attends over its context, read in place through its block table (no gather into a padded copy). Online softmax a
// block at a time; the query heads that share a kv head are done back to back so K/V come from L1. Parallel over
// (sequence, context partition, kv head) items (work_split.h); any head size, float32 / bfloat16 / float16 (and float64) K/V.
#include <algorithm>
#include <cmath>
#include <vector>

#include "paged_args.h"
#include "work_split.h"

namespace {

template <typename scalar_t>
void decode_attention_impl(const float* q, const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* tables,
                           const int64_t* seq_lens, float* out, int64_t num_seqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                           float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t block_stride = block_size * token_stride;
  DecodeSplit split = split_decode(seq_lens, num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                                   /*per_head=*/true);
  run_decode_items(split, out, [&](WorkQueue& queue) {
    std::vector<float> acc(group * head_dim), m(group), l(group), scores(group * block_size), kv(head_dim);
    for (int64_t item; queue.next(item);) {
      const DecodeItem& it = split.items[item];
      const int64_t seq = it.seq, kv_head = it.first_kv;
      const int64_t* table = tables + seq * max_blocks + it.first_block;  // of its partition
      const float* q_seq = q + (seq * num_heads + kv_head * group) * head_dim;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -1e30f);  // finite: exp(m - max) must be 0, not NaN
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t len = it.len;
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t n = std::min(block_size, len - start);
        const scalar_t* k_block = k_cache + table[start / block_size] * block_stride +
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
        float* o = split.row(it, kv_head * group + g, out);
        const float inv = split.finish(it, kv_head * group + g, m[g], l[g]);
        for (int64_t d = 0; d < head_dim; ++d) o[d] = acc[g * head_dim + d] * inv;
      }
    }
  });
}

}  // namespace

template <typename T>
void decode_attention_portable(const PagedArgs<T>& a) {
  decode_attention_impl<T>(a.q, a.k_cache, a.v_cache, a.tables, a.seq_lens, a.out, a.num_seqs, a.num_heads,
                           a.num_kv_heads, a.head_dim, a.block_size, a.max_blocks, a.scale);
}

template void decode_attention_portable<float>(const PagedArgs<float>&);
template void decode_attention_portable<c10::BFloat16>(const PagedArgs<c10::BFloat16>&);
template void decode_attention_portable<c10::Half>(const PagedArgs<c10::Half>&);
template void decode_attention_portable<double>(const PagedArgs<double>&);
