// Paged decode attention on the "avx512" path (and a float32 or quantized pool's on "avx512_bf16"): K/V widened to
// float32, head_dim 32, 64 or 128, 16 tokens scored at once and every kv head of a tile read in one pass. A quantized
// pool's codes (int8, float8 e4m3) are read in place: a tile's scores times its K rows' scales, its softmax weights
// times its V rows'.
#include "isa.h"
#include "attention_avx512.h"

#ifdef BATCHSERVE_ISA_AVX512

namespace {

// The 16 row scales of a tile's first n slots (from slot0) for one kv head of a quantized pool ([slots, Hkv]); 0
// beyond n
inline __m512 tile_scales(const float* scales, int64_t slot0, int64_t num_kv_heads, int64_t kv_head, int64_t n) {
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(static_cast<int>(num_kv_heads)));
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, rows, scales + slot0 * num_kv_heads + kv_head, 4);
}

// NC = head_dim / 16 vectors per head. The work items (a sequence with all its kv heads, so each 16-token tile is read
// as one contiguous run of memory, or one kv head of it) and their threads are work_split.h's.
template <int NC, typename T>
void decode_heads_avx512(const float* q, const T* k_cache, const T* v_cache, const int64_t* tables,
                             const int64_t* seq_lens, float* out, int64_t num_seqs, int64_t num_heads,
                             int64_t num_kv_heads, int64_t block_size, int64_t max_blocks, float scale,
                             const float* k_scale, const float* v_scale) {
  constexpr int64_t D = NC * 16;
  constexpr bool kScaled = std::is_same_v<T, int8_t> || std::is_same_v<T, c10::Float8_e4m3fn>;  // codes and scales
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * D;
  const int64_t block_stride = block_size * token_stride;
  DecodeSplit split = split_decode(seq_lens, num_seqs, num_heads, num_kv_heads, D, block_size);
  const int64_t heads_per_item = split.heads_per_item;
  const bool grouped = group <= kMaxGroup;
  run_decode_items(split, out, [&](WorkQueue& queue) {
    std::vector<float> acc_store(num_heads * D), m(num_heads), p(num_heads * 16), corr(num_heads), qs(num_heads * D);
    std::vector<__m512> l(num_heads);  // per-lane partial sums of the softmax denominator
    __m512 scores[kMaxGroup];
    for (int64_t item; queue.next(item);) {
      const DecodeItem& it = split.items[item];
      const int64_t seq = it.seq, first_kv = it.first_kv;
      const int64_t* table = tables + seq * max_blocks + it.first_block;  // of its partition
      const int64_t first_head = first_kv * group, last_head = first_head + heads_per_item * group;
      const float* q_seq = q + seq * num_heads * D;
      for (int64_t h = first_head; h < last_head; ++h)  // scaled once per sequence, not per tile
        for (int c = 0; c < NC; ++c)
          _mm512_storeu_ps(qs.data() + h * D + 16 * c,
                           _mm512_mul_ps(_mm512_loadu_ps(q_seq + h * D + 16 * c), _mm512_set1_ps(scale)));
      std::fill(acc_store.begin(), acc_store.end(), 0.f);
      std::fill(m.begin(), m.end(), -1e30f);  // finite: exp(m - max) must be 0, not NaN
      std::fill(l.begin(), l.end(), _mm512_setzero_ps());
      const int64_t len = it.len;
      for (int64_t start = 0, n = 0; start < len; start += n) {
        // A tile: up to 16 tokens of one block.
        const int64_t in_block = start % block_size;
        n = std::min<int64_t>({16, block_size - in_block, len - start});
        const int64_t block = table[start / block_size];
        const int64_t offset = block * block_stride + in_block * token_stride, slot0 = block * block_size + in_block;
        // the next tile's K and V asked for during this one's kv heads (the pool's blocks are scattered, which the
        // hardware prefetchers do not foresee), a few lines a kv head (see RowPrefetcher), into L2: on the EPYC a
        // request into L1 holds one of its few miss buffers until the line comes, and the tile's own loads waited
        // behind them (as in decode_avx512_bf16.cpp); a line moves on to L1 at its load. During an item's last tile,
        // the first tile of the item the queue hands out next, which otherwise began on loads from memory (another
        // thread may claim it; the lines then wait in L3)
        const int64_t next = start + n, next_in_block = next % block_size;
        int64_t next_rows = std::max<int64_t>(0, std::min<int64_t>({16, block_size - next_in_block, len - next}));
        int64_t next_offset = next_rows ? table[next / block_size] * block_stride +
                                              next_in_block * token_stride + first_kv * D
                                        : 0;
        if (int64_t upcoming; next_rows == 0 && queue.peek(upcoming)) {
          const DecodeItem& up = split.items[upcoming];
          next_rows = std::min<int64_t>({16, block_size, up.len});
          next_offset = tables[up.seq * max_blocks + up.first_block] * block_stride + up.first_kv * D;
        }
        const int64_t row_bytes = heads_per_item * D * sizeof(T), steps = 2 * heads_per_item;
        RowPrefetcher<_MM_HINT_T1> next_k(k_cache + next_offset, next_rows, token_stride * sizeof(T), row_bytes, steps);
        RowPrefetcher<_MM_HINT_T1> next_v(v_cache + next_offset, next_rows, token_stride * sizeof(T), row_bytes, steps);
        for (int64_t kv_head = first_kv; kv_head < first_kv + heads_per_item && grouped; ++kv_head) {
          next_k.step();
          next_v.step();
          const int64_t h0 = kv_head * group;
          score_group<NC>(qs.data() + h0 * D, group, k_cache + offset + kv_head * D, token_stride, n, scores);
          if constexpr (kScaled) {
            const __m512 ks = tile_scales(k_scale, slot0, num_kv_heads, kv_head, n);
            for (int64_t g = 0; g < group; ++g) scores[g] = _mm512_mul_ps(scores[g], ks);
          }
          for (int64_t g = 0; g < group; ++g)
            softmax_update(scores[g], n, m[h0 + g], l[h0 + g], corr[h0 + g], p.data() + (h0 + g) * 16);
        }
        for (int64_t h = first_head; h < last_head && !grouped; ++h) {
          __m512 qv[NC];
          for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_ps(qs.data() + h * D + 16 * c);
          __m512 s = score_tile<NC>(qv, k_cache + offset + h / group * D, token_stride, n);
          if constexpr (kScaled) s = _mm512_mul_ps(s, tile_scales(k_scale, slot0, num_kv_heads, h / group, n));
          softmax_update(s, n, m[h], l[h], corr[h], p.data() + h * 16);
        }
        for (int64_t kv_head = first_kv; kv_head < first_kv + heads_per_item; ++kv_head) {
          next_k.step();
          next_v.step();
          const int64_t h = kv_head * group;
          if constexpr (kScaled) {  // the weights (already summed into the denominator) times the V rows' scales
            const __m512 vs = tile_scales(v_scale, slot0, num_kv_heads, kv_head, n);
            for (int64_t g = 0; g < group; ++g)
              _mm512_storeu_ps(p.data() + (h + g) * 16, _mm512_mul_ps(_mm512_loadu_ps(p.data() + (h + g) * 16), vs));
          }
          accumulate_group<NC>(v_cache + offset + kv_head * D, token_stride, n, p.data() + h * 16, corr.data() + h,
                               acc_store.data() + h * D, group);
        }
      }
      for (int64_t h = first_head; h < last_head; ++h) {
        float* o = split.row(it, h, out);
        const float inv = split.finish(it, h, m[h], _mm512_reduce_add_ps(l[h]));
        for (int64_t d = 0; d < D; ++d) o[d] = acc_store[h * D + d] * inv;
      }
    }
  });
}

}  // namespace

template <typename T>
bool decode_attention_avx512(const PagedArgs<T>& a) {
  return with_vectors_per_head(a.head_dim, [&](auto nc) {
    decode_heads_avx512<decltype(nc)::value, T>(a.q, a.k_cache, a.v_cache, a.tables, a.seq_lens, a.out, a.num_seqs,
                                                a.num_heads, a.num_kv_heads, a.block_size, a.max_blocks, a.scale,
                                                a.k_scale, a.v_scale);
  });
}

template bool decode_attention_avx512<float>(const PagedArgs<float>&);
template bool decode_attention_avx512<c10::BFloat16>(const PagedArgs<c10::BFloat16>&);
template bool decode_attention_avx512<int8_t>(const PagedArgs<int8_t>&);
template bool decode_attention_avx512<c10::Float8_e4m3fn>(const PagedArgs<c10::Float8_e4m3fn>&);

#endif  // BATCHSERVE_ISA_AVX512
