// The AVX-512 attention kernels' shared pieces (decode_avx512.cpp, prefill_avx512.cpp): 16-token score tiles reduced by transpose-adds (one horizontal sum per 16 tokens instead
// of one per token), an online softmax a tile at a time, P.V with independent FMA chains. K/V are float32, or
// bfloat16 widened to float32 as they are loaded. Compiled only where the build has AVX-512.
#pragma once

#include "isa.h"

#ifdef BATCHSERVE_ISA_AVX512
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "paged_args.h"
#include "vec_math.h"
#include "work_split.h"

namespace {

// Lane i of the result = sum of the 16 lanes of v[i] (vec_math.h's combine16).
inline __m512 sum16(const __m512* v) {
  return combine16(v, [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); });
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

// f(std::integral_constant<int, NC>{}) with NC = head_dim / 16 vectors a head, for the head sizes the vectorized
// kernels are built for (32, 64, 128); false, and nothing run, for any other.
template <typename F>
bool with_vectors_per_head(int64_t head_dim, F&& f) {
  if (head_dim == 32) return f(std::integral_constant<int, 2>{}), true;
  if (head_dim == 64) return f(std::integral_constant<int, 4>{}), true;
  if (head_dim == 128) return f(std::integral_constant<int, 8>{}), true;
  return false;
}

// Every sequence's query rows in tiles of up to 16, one tile x head per work item: tile(seq, first row, head, rows,
// position of the first row). Scheduled by work_split.h, an item costing the context its last row attends to.
template <typename T, typename Tile>
void for_each_prefill_tile(const PagedArgs<T>& a, Tile&& tile) {
  struct PrefillTile {
    int64_t seq, row, rows, position;
  };
  std::vector<PrefillTile> tiles;
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    const int64_t end_row = a.query_starts[s + 1];
    for (int64_t row = a.query_starts[s]; row < end_row; row += 16)
      tiles.push_back({s, row, std::min<int64_t>(16, end_row - row), a.seq_lens[s] - (end_row - row)});
  }
  const int64_t num_items = static_cast<int64_t>(tiles.size()) * a.num_heads;
  const auto of = [&](int64_t item) -> const PrefillTile& { return tiles[item / a.num_heads]; };
  run_costliest_first(
      num_items, [&](int64_t item) { return of(item).position + of(item).rows; },
      [&](WorkQueue& queue) {
        for (int64_t item; queue.next(item);) {
          const PrefillTile& t = of(item);
          tile(t.seq, t.row, item % a.num_heads, t.rows, t.position);
        }
      });
}

}  // namespace

#endif  // BATCHSERVE_ISA_AVX512
