// Paged prefill attention on both AVX-512 paths ("avx512", "avx512_bf16"; a bfloat16 pool's K/V widened to float32 as
// they are loaded, the scores and softmax weights float32): causal by absolute position,
// tiles of up to 16 query rows of one sequence and one head, every key read in place from the pool.
#include "isa.h"
#include "attention_avx512.h"

#ifdef BATCHSERVE_ISA_AVX512

namespace {

// The first n rows of a bfloat16 pool's tile (rows token_stride apart) widened to float32 into `wide` (rows D apart).
// Exact (a bf16 is a float's upper half), so the tile's rows compute the same products, bit for bit, as when each
// widened the rows again for itself (each K row 16 times, each V row once per pair of rows); profiled on an 8k prompt
// (AVX-512 EPYC), those repeated conversions were about a sixth of the kernel's samples.
template <int NC, typename T>
inline const float* widened_rows(const T* tile, int64_t token_stride, int64_t n, float* wide) {
  constexpr int64_t D = NC * 16;
  for (int64_t t = 0; t < n; ++t)
    for (int c = 0; c < NC; ++c) _mm512_store_ps(wide + t * D + 16 * c, load16(tile + t * token_stride + 16 * c));
  return wide;
}

// Prefill tiles: up to 16 consecutive query rows of one sequence and one head, at positions first_pos.. (their keys
// are 0..position, this step's included, all read from the pool through the block table).
template <int NC, typename T>
void prefill_tile(const float* q, int64_t q_stride, const T* k_cache, const T* v_cache, const int64_t* table,
                  int64_t first_pos, int64_t rows, int64_t kv_head, int64_t token_stride, int64_t block_size,
                  float scale, float* out, int64_t out_stride) {
  constexpr int64_t D = NC * 16;
  alignas(64) float acc[16 * D], p[16 * 16], m[16], corr[16], q_scaled[16 * D];
  alignas(64) float k_wide[std::is_same_v<T, float> ? 1 : 16 * D], v_wide[std::is_same_v<T, float> ? 1 : 16 * D];
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
    const auto attend = [&](const auto* k_tile, const auto* v_tile, int64_t tile_stride) {
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t visible = std::min<int64_t>(n, first_pos + r - start + 1);  // causal: keys up to the row's own
        if (visible <= 0) {  // the whole tile is in this row's future: it contributes nothing
          corr[r] = 1.f;
          _mm512_storeu_ps(p + r * 16, _mm512_setzero_ps());
          continue;
        }
        __m512 qv[NC];
        for (int c = 0; c < NC; ++c) qv[c] = _mm512_load_ps(q_scaled + r * D + 16 * c);
        softmax_update(score_tile<NC>(qv, k_tile, tile_stride, visible), visible, m[r], l[r], corr[r], p + r * 16);
      }
      accumulate_group<NC>(v_tile, tile_stride, n, p, corr, acc, rows);
    };
    // a float32 pool's tile read in place; a bf16 pool's widened once for all the rows
    if constexpr (std::is_same_v<T, float>)
      attend(k_cache + offset, v_cache + offset, token_stride);
    else
      attend(widened_rows<NC>(k_cache + offset, token_stride, n, k_wide),
             widened_rows<NC>(v_cache + offset, token_stride, n, v_wide), D);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / _mm512_reduce_add_ps(l[r]);
    for (int64_t d = 0; d < D; ++d) out[r * out_stride + d] = acc[r * D + d] * inv;
  }
}

}  // namespace

template <typename T>
bool prefill_attention_avx512(const PagedArgs<T>& a) {
  return with_vectors_per_head(a.head_dim, [&](auto nc) {
    constexpr int64_t D = decltype(nc)::value * 16;
    const int64_t group = a.num_heads / a.num_kv_heads;
    for_each_prefill_tile(a, [&](int64_t seq, int64_t row, int64_t head, int64_t rows, int64_t first_pos) {
      prefill_tile<decltype(nc)::value, T>(a.q + row * a.q_stride + head * D, a.q_stride, a.k_cache, a.v_cache,
                                           a.tables + seq * a.max_blocks, first_pos, rows, head / group,
                                           a.num_kv_heads * D, a.block_size, a.scale,
                                           a.out + (row * a.num_heads + head) * D, a.num_heads * D);
    });
  });
}

template bool prefill_attention_avx512<float>(const PagedArgs<float>&);
template bool prefill_attention_avx512<c10::BFloat16>(const PagedArgs<c10::BFloat16>&);

#endif  // BATCHSERVE_ISA_AVX512
