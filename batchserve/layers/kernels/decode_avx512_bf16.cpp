// Paged decode attention on the "avx512_bf16" path, for a bfloat16 pool: three passes a sequence (scores, weights,
// P.V) with the scattered blocks asked for ahead of use. See attention_avx512_bf16.h for the arithmetic.
#include "attention_avx512_bf16.h"

#ifdef BATCHSERVE_BF16_DOT
#include <optional>

#include "work_split.h"

namespace {

// P.V of HC query heads over a whole sequence's V rows of one kv head (v_head: that head's slice of the pool),
// pb: the heads' bf16 weights by position, rows `p_stride` apart -> acc (HC * NC vectors, in the permuted order of
// unpermute_store). Two tokens per vdpbf16ps; a block's odd last token is paired with zeros (the next row may be
// garbage, NaN, or outside the pool). The accumulators stay in registers for the whole sequence. The next block's
// rows of this head are asked for at each block's start: the score pass's request for them (into L2) does not keep
// them there for long contexts, and without it these loads waited on memory for a third of the kernel's time.
template <int NC, int HC, typename Ahead>
BF16_TARGET void values_bf16(const bf16_t* v_head, const int64_t* table, int64_t len, int64_t block_size,
                             int64_t block_stride, int64_t token_stride, const uint16_t* pb, int64_t p_stride,
                             float* acc_out, Ahead& ahead) {
  constexpr int NP = NC / 2;
  __m512 acc[HC][NC];
  for (int h = 0; h < HC; ++h)
    for (int j = 0; j < NC; ++j) acc[h][j] = _mm512_setzero_ps();
  for (int64_t start = 0; start < len; start += block_size) {
    const int64_t n = std::min(block_size, len - start);
    const bf16_t* v = v_head + table[start / block_size] * block_stride;
    const uint16_t* p = pb + start;
    if (start + block_size < len)
      prefetch_rows(v_head + table[start / block_size + 1] * block_stride, std::min(block_size, len - start - block_size),
                    token_stride * 2, NC * 32);
    for (int64_t t = 0; t < n; t += 2, v += 2 * token_stride, p += 2) {
      const bool pair = t + 1 < n;
      ahead.step();
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
template <int NC, typename Ahead>
BF16_TARGET void values_group_bf16(const bf16_t* v_head, const int64_t* table, int64_t len, int64_t block_size,
                                   int64_t block_stride, int64_t token_stride, const uint16_t* pb, int64_t p_stride,
                                   float* acc_out, int64_t heads, Ahead& ahead) {
  constexpr int kChunk = NC <= 4 ? 4 : 2;
  const auto run = [&](auto hc, int64_t h) {
    values_bf16<NC, decltype(hc)::value>(v_head, table, len, block_size, block_stride, token_stride,
                                         pb + h * p_stride, p_stride, acc_out + h * NC * 16, ahead);
  };
  int64_t h = 0;
  for (; h + kChunk <= heads; h += kChunk) run(std::integral_constant<int, kChunk>{}, h);
  if (heads - h == 3) run(std::integral_constant<int, 3>{}, h);
  if (heads - h == 2) run(std::integral_constant<int, 2>{}, h);
  if (heads - h == 1) run(std::integral_constant<int, 1>{}, h);
}

// One tile's scores for `heads` query heads that share one kv head's K (qb: their bf16 queries in a row), a chunk of
// heads at a time (score_tiles_bf16: each K row loaded once a chunk, not once a head), into their rows of `scores`
// (`stride` apart) and their running maxes; the next block's prefetchers step once per head.
template <int NP, int G, typename Ahead>
BF16_TARGET void score_chunk_bf16(const uint16_t* qb, const bf16_t* k_tile, int64_t token_stride, int64_t n,
                                  float scale, float* scores, int64_t stride, float* maxes, __mmask16 valid,
                                  Ahead& next_k, Ahead& next_v) {
  for (int g = 0; g < G; ++g) next_k.step(), next_v.step();
  __m512 s[G];
  score_tiles_bf16<NP, G>(qb, k_tile, token_stride, n, scale, s);
  for (int g = 0; g < G; ++g) {
    _mm512_storeu_ps(scores + g * stride, s[g]);
    float* mx = maxes + g * 16;
    _mm512_storeu_ps(mx, _mm512_mask_max_ps(_mm512_loadu_ps(mx), valid, _mm512_loadu_ps(mx), s[g]));
  }
}

// score_chunk_bf16 over a group of heads
template <int NP, typename Ahead>
BF16_TARGET void score_group_bf16(const uint16_t* qb, const bf16_t* k_tile, int64_t token_stride, int64_t n,
                                  float scale, int64_t heads, float* scores, int64_t stride, float* maxes,
                                  __mmask16 valid, Ahead& next_k, Ahead& next_v) {
  constexpr int kChunk = NP >= 4 ? 2 : 4;  // 2 x 4 queries + 2 x 4 sums + 4 K vectors at head size 128
  const auto run = [&](auto gc, int64_t h) {
    score_chunk_bf16<NP, decltype(gc)::value>(qb + h * NP * 32, k_tile, token_stride, n, scale, scores + h * stride,
                                              stride, maxes + h * 16, valid, next_k, next_v);
  };
  int64_t h = 0;
  for (; h + kChunk <= heads; h += kChunk) run(std::integral_constant<int, kChunk>{}, h);
  if (heads - h == 3) run(std::integral_constant<int, 3>{}, h);
  if (heads - h == 2) run(std::integral_constant<int, 2>{}, h);
  if (heads - h == 1) run(std::integral_constant<int, 1>{}, h);
}

// The rows of a work item (a head run of each of its tokens, in its scattered blocks) asked for into L2 a few lines at
// a time over `steps` steps of other work: a RowPrefetcher per block, each at the item's rate.
class ItemRowsPrefetcher {
 public:
  ItemRowsPrefetcher() = default;
  ItemRowsPrefetcher(const bf16_t* head_pool, const int64_t* table, int64_t len, int64_t block_size,
                     int64_t block_stride, int64_t token_stride, int64_t row_bytes, int64_t steps)
      : pool_(head_pool), table_(table), len_(len), block_size_(block_size), block_stride_(block_stride),
        token_bytes_(token_stride * 2), row_bytes_(row_bytes),
        per_step_((len * lines(row_bytes) + steps - 1) / std::max<int64_t>(steps, 1)) {
    start_block(0);
  }
  void step() {
    if (!block_) return;
    block_->step();
    if (block_->done()) start_block(first_token_ + block_size_);
  }

 private:
  static int64_t lines(int64_t bytes) { return (bytes + 63) / 64; }
  void start_block(int64_t token) {
    first_token_ = token;
    const int64_t rows = std::clamp<int64_t>(len_ - token, 0, block_size_);
    if (rows == 0 || per_step_ == 0) return block_.reset();
    const int64_t steps = (rows * lines(row_bytes_) + per_step_ - 1) / per_step_;
    block_.emplace(pool_ + table_[token / block_size_] * block_stride_, rows, token_bytes_, row_bytes_, steps);
  }
  const bf16_t* pool_ = nullptr;
  const int64_t* table_ = nullptr;
  int64_t len_ = 0, block_size_ = 1, block_stride_ = 0, token_bytes_ = 0, row_bytes_ = 0, per_step_ = 0;
  int64_t first_token_ = 0;
  std::optional<RowPrefetcher<_MM_HINT_T1>> block_;
};

// The work items of decode_attention_bf16 this thread claims from `queue` (work_split.h), until none is left
// (a function of its own: a lambda would not carry the target). A decode query sees its whole item (its context, or
// one partition of it) at once, so its softmax needs no online rescaling: (1) every score of the item, and their
// max; (2) the weights exp(s - max) in bf16, and their sum; (3) P.V with the accumulators in registers from the
// first token to the last; a partition's sums go to work_split.h's partials unnormalised. While (2) and (3) work
// from L2, the K of the item the queue hands out next is asked for (ItemRowsPrefetcher), so that memory is read
// through the whole item instead of only during (1).
template <int NC>
BF16_TARGET void decode_items_bf16(WorkQueue& queue, DecodeSplit& split, const float* q,
                                   const bf16_t* k_cache, const bf16_t* v_cache, const int64_t* tables,
                                   float* out, int64_t num_heads, int64_t num_kv_heads,
                                   int64_t block_size, int64_t max_blocks, float scale) {
  constexpr int64_t D = NC * 16;
  constexpr int NP = NC / 2;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * D;
  const int64_t block_stride = block_size * token_stride;
  const int64_t heads_per_item = split.heads_per_item;
  const int64_t item_heads = heads_per_item * group;
  std::vector<float> scores, acc(item_heads * D), maxes(item_heads * 16);
  std::vector<uint16_t> qb(item_heads * D), pb;
  std::vector<float> sums(item_heads), head_max(item_heads);
  for (int64_t item; queue.next(item);) {
    const DecodeItem& it = split.items[item];
    const int64_t seq = it.seq, first_kv = it.first_kv;
    const int64_t first_head = first_kv * group;
    const int64_t len = it.len;  // of its partition
    const int64_t stride = (len + 31) / 16 * 16;  // per head, room for a whole last vector
    if (static_cast<int64_t>(scores.size()) < item_heads * stride) {
      scores.resize(item_heads * stride);
      pb.resize(item_heads * stride);
    }
    const int64_t* table = tables + seq * max_blocks + it.first_block;
    for (int64_t h = 0; h < item_heads; ++h) {
      query_to_bf16<NP>(q + (seq * num_heads + first_head + h) * D, &qb[h * D]);
      _mm512_storeu_ps(&maxes[h * 16], _mm512_set1_ps(-3.0e38f));
    }
    // (1) scores, a block at a time (its kv heads are one run of memory). The pool's blocks are scattered, which the
    // hardware prefetchers do not foresee: the next block's K and V are asked for, a slice per tile and head, spread
    // over the block's work. Asked for all at a block's start, the same lines took longer (the burst waits on the
    // line-fill buffers the loads need too). Both go to L2, not L1: on the EPYC an L1 request holds one of the few
    // L1 miss buffers until its line arrives, and K asked for into L1 left the pass waiting on them (K into L2 took
    // the kernel from 0.72 to 0.50 ms over 8,000 tokens from memory); the line moves on to L1 at its load.
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
      RowPrefetcher<_MM_HINT_T1> next_k(next_rows ? first_row(k_cache, start + block_size) : k_cache, next_rows,
                                        token_stride * 2, row_bytes, steps);
      RowPrefetcher<_MM_HINT_T1> next_v(next_rows ? first_row(v_cache, start + block_size) : v_cache, next_rows,
                                        token_stride * 2, row_bytes, steps);
      for (int64_t i = 0; i < n; i += 16) {
        const int64_t m = std::min<int64_t>(16, n - i);
        const __mmask16 valid = static_cast<__mmask16>((1u << m) - 1);
        for (int64_t kv = 0; kv < heads_per_item; ++kv)
          score_group_bf16<NP>(&qb[kv * group * D], k_cache + base + i * token_stride + kv * D, token_stride, m,
                               scale, group, &scores[kv * group * stride + start + i], stride,
                               &maxes[kv * group * 16], valid, next_k, next_v);
      }
    }
    // From here on the item's K and V are in L2, and memory would sit idle: the K of the next item in the queue is
    // asked for into L2, spread over (2) and (3). Another thread may claim that item; the lines then were asked for in
    // vain (they stay in L3 for the other core).
    ItemRowsPrefetcher ahead;
    int64_t upcoming;
    if (queue.peek(upcoming)) {
      const DecodeItem& nx = split.items[upcoming];
      ahead = ItemRowsPrefetcher(k_cache + nx.first_kv * D, tables + nx.seq * max_blocks + nx.first_block, nx.len,
                                 block_size, block_stride, token_stride, row_bytes,
                                 item_heads * ((len + 15) / 16) + heads_per_item * ((len + 1) / 2));
    }
    // (2) weights, rounded to bf16 as (3) uses them; the sum is of the rounded weights
    for (int64_t h = 0; h < item_heads; ++h) {
      head_max[h] = _mm512_reduce_max_ps(_mm512_loadu_ps(&maxes[h * 16]));
      const __m512 mx = _mm512_set1_ps(head_max[h]);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t i = 0; i < len; i += 16) {
        ahead.step();
        const __mmask16 valid = static_cast<__mmask16>(len - i >= 16 ? 0xFFFFu : (1u << (len - i)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(_mm512_loadu_ps(&scores[h * stride + i]), mx)));
        const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&pb[h * stride + i]), rounded);
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16)));
      }
      sums[h] = _mm512_reduce_add_ps(sum);
    }
    // (3) P.V, one kv head at a time, its V in L2 (asked for by (1))
    for (int64_t kv = 0; kv < heads_per_item; ++kv)
      values_group_bf16<NC>(v_cache + (first_kv + kv) * D, table, len, block_size, block_stride, token_stride,
                            &pb[kv * group * stride], stride, &acc[kv * group * D], group, ahead);
    for (int64_t h = 0; h < item_heads; ++h)
      unpermute_store<NC>(&acc[h * D], split.finish(it, first_head + h, head_max[h], sums[h]),
                          split.row(it, first_head + h, out));
  }
}

// work_split.h's items and threads, on the bf16 dot-product path.
template <int NC>
void decode_attention_bf16(const float* q, const bf16_t* k_cache, const bf16_t* v_cache, const int64_t* tables,
                           const int64_t* seq_lens, float* out, int64_t num_seqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t block_size, int64_t max_blocks, float scale) {
  DecodeSplit split = split_decode(seq_lens, num_seqs, num_heads, num_kv_heads, NC * 16, block_size);
  run_decode_items(split, out, [&](WorkQueue& queue) {
    decode_items_bf16<NC>(queue, split, q, k_cache, v_cache, tables, out, num_heads, num_kv_heads,
                          block_size, max_blocks, scale);
  });
}

}  // namespace

bool decode_attention_avx512_bf16(const PagedArgs<c10::BFloat16>& a) {
  return with_vectors_per_head(a.head_dim, [&](auto nc) {
    decode_attention_bf16<decltype(nc)::value>(a.q, a.k_cache, a.v_cache, a.tables, a.seq_lens, a.out, a.num_seqs,
                                               a.num_heads, a.num_kv_heads, a.block_size, a.max_blocks, a.scale);
  });
}

#endif  // BATCHSERVE_BF16_DOT
