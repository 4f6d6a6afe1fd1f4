// Paged prefill attention of a bfloat16 pool by AVX512-BF16 dot products (the "avx512_bf16" prefill kernel path, for
// AVX-512 CPUs with bf16 dot products and no AMX): prefill_tiles.h's body (the packed K/V, the 32-row lanes of a GQA
// group, the key blocks aligned to position 0, the float32 online softmax), with its two products by vdpbf16ps on the
// vector unit in place of AMX's tile products.
//
// Q.K^T: 8 query rows x 32 keys (two vectors of 16 keys) a register block; per dim pair, one broadcast of the row's
// (q[2p], q[2p + 1]) against the packed K's 16 keys of that pair. A score is the sum over the dim pairs in order,
// whatever rows share its block, so a row's scores never depend on its tile mates. No horizontal sums: a score vector
// holds 16 keys, as the softmax reads them.
// P.V: 4 rows x 64 dims a register block, the accumulator loaded from the lane's (times the block's rescale factor)
// and stored back; per key pair, one broadcast of the row's (p[2i], p[2i + 1]) against the packed V's 16 dims of that
// pair. P is taken to ~16 bits, as two bf16 products: its rounding to bf16, then the remainder's (kSplitsWeights). A
// single rounding, as AMX's tiles multiply, put the default model's logit at the README question's near-tie (0.08
// apart in float32) on the other side: "L'Étoile, ..." where float32 weights answer "Paris". A row's block whose
// weights are all far below its running maximum keeps one rounding (kRestBelow): P.V takes the rows that keep their
// remainders together, 4 to a register block, and the others' blocks multiply P once. Only the rows the lane holds
// are multiplied (AMX's tiles take all 32).
#include "isa.h"

#if defined(BATCHSERVE_ISA_AVX512) && defined(BATCHSERVE_ISA_AVX512_BF16_FILE)
#include "prefill_tiles.h"

namespace {

// The backend: the vector unit, which keeps no tile state between items.
struct DotProducts {
  static void configure() {}
  static void release() {}
};

template <>
constexpr bool kRoundsWithAvx512Bf16<DotProducts> = true;
// P.V by P's bf16 rounding and its remainder: the weights to ~16 bits, as near float32's as the vector kernel's (a
// single bf16 rounding turned the default model's answer to the README question at its near-tie)
template <>
constexpr bool kSplitsWeights<DotProducts> = true;

constexpr int64_t kScoreRows = 8;  // a Q.K^T register block: 8 rows x 2 vectors of keys (16 accumulators)
constexpr int64_t kValueRows = 4;  // a P.V register block: 4 rows x up to 4 vectors of dims (16 accumulators)

// Two bf16 values (a dim pair of a query row, or a key pair of a weight row) in every 32-bit lane.
inline __m512bh broadcast_pair(const uint16_t* pair) {
  int32_t bits;
  std::memcpy(&bits, pair, sizeof bits);
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(bits));
}

// 16 pairs of bf16 values (memcpy: GCC 12 otherwise takes a detour through the stack for a __m512bh).
inline __m512bh load_pairs(const uint16_t* p) {
  __m512bh v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Scores of query rows r0..r0 + 7 (q: the lane's 32 rows of D bf16) against one packed key tile (32 keys), into its
// four C tiles' layout (c: tile 2 * (row / 16) + half, row % 16).
template <int D>
inline void score_block(const uint16_t* q, const uint16_t* k_tile, int64_t r0, float (*c)[16][16]) {
  __m512 acc[kScoreRows][2];
  for (auto& row : acc) row[0] = row[1] = _mm512_setzero_ps();
  for (int64_t pair = 0; pair < D / 2; ++pair) {
    const uint16_t* k = k_tile + (pair / 16) * 2 * kTile + (pair % 16) * 32;
    const __m512bh keys0 = load_pairs(k), keys1 = load_pairs(k + kTile);
    for (int64_t r = 0; r < kScoreRows; ++r) {
      const __m512bh qr = broadcast_pair(q + (r0 + r) * D + 2 * pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qr, keys0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qr, keys1);
    }
  }
  for (int64_t r = 0; r < kScoreRows; ++r) {
    const int64_t row = r0 + r;
    _mm512_store_ps(c[2 * (row / 16)][row % 16], acc[r][0]);
    _mm512_store_ps(c[2 * (row / 16) + 1][row % 16], acc[r][1]);
  }
}

// One lane's scores against one key block as steps of one register block each (key tile x 8 rows), so that the body
// can spread them between the rows of the previous block's softmax as it does the tile operations.
template <int D>
class ScoreBlocks {
 public:
  ScoreBlocks(const uint16_t* q, const char* k, int64_t tiles, int64_t rows, Scores* out)
      : q_(q),
        k_(reinterpret_cast<const uint16_t*>(k)),
        out_(out),
        row_blocks_(static_cast<int>((rows + kScoreRows - 1) / kScoreRows)),
        total_(static_cast<int>(tiles) * row_blocks_) {}
  int total() const { return total_; }
  // Runs the steps up to the n-th.
  __attribute__((always_inline)) void until(int n) {
    for (n = std::min(n, total_); done_ < n; ++done_) {
      const int j = done_ / row_blocks_, block = done_ % row_blocks_;
      score_block<D>(q_, k_ + j * kKeys * D, block * kScoreRows, (*out_)[j]);
    }
  }

 private:
  const uint16_t* q_;
  const uint16_t* k_;
  Scores* out_;
  int row_blocks_, total_, done_ = 0;
};

// P.V of 4 rows over a block's first `tiles` key tiles (v: its packed V), dims c0 * 16.. (NV vectors), added to the
// lane's accumulator (`sums`: each row's, at dim c0 * 16) after it is multiplied by the row's factor: per key pair,
// the rows' rounded weights (`weights`: each row's) against the packed V, then WithRest their remainders' (kWeights
// further) into the same sums.
template <int D, int NV, bool WithRest>
__attribute__((always_inline)) inline void value_block(const uint16_t* const* weights, float* const* sums,
                                                       const float* factors, const uint16_t* v, int64_t tiles) {
  __m512 acc[kValueRows][NV];
  for (int64_t r = 0; r < kValueRows; ++r) {
    const __m512 factor = _mm512_set1_ps(factors[r]);
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_mul_ps(_mm512_load_ps(sums[r] + 16 * c), factor);
  }
  for (int64_t j = 0; j < tiles; ++j) {
    const uint16_t* v_tile = v + j * kKeys * D;
    for (int64_t pair = 0; pair < kKeys / 2; ++pair) {
      __m512bh values[NV];
      for (int c = 0; c < NV; ++c) values[c] = load_pairs(v_tile + c * kTile + pair * 32);
      for (int64_t r = 0; r < kValueRows; ++r) {
        const uint16_t* w = weights[r] + j * kKeys + 2 * pair;
        const __m512bh rounded = broadcast_pair(w);
        for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], rounded, values[c]);
        if constexpr (WithRest) {
          const __m512bh rest = broadcast_pair(w + kWeights);
          for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], rest, values[c]);
        }
      }
    }
  }
  for (int64_t r = 0; r < kValueRows; ++r)
    for (int c = 0; c < NV; ++c) _mm512_store_ps(sums[r] + 16 * c, acc[r][c]);
}

// value_block over 4 rows of the lane (`rows`), rescaling their accumulators by the block's factors first (1 for a
// row the block leaves alone).
template <int D, int NV, bool WithRest>
__attribute__((always_inline)) inline void rows_block(LaneState<D>& st, const uint16_t* p, const uint16_t* v,
                                                      int64_t tiles, const int* rows, int64_t c0) {
  const uint16_t* weights[kValueRows];
  float* sums[kValueRows];
  float factors[kValueRows];
  for (int64_t r = 0; r < kValueRows; ++r) {
    weights[r] = p + rows[r] * kBlock;
    sums[r] = st.acc + rows[r] * D + 16 * c0;
    factors[r] = st.rows.skip[rows[r]] ? 1.f : st.rows.corr[rows[r]];
  }
  value_block<D, NV, WithRest>(weights, sums, factors, v + c0 * kTile, tiles);
}

// The lane's first `rows` rows (a multiple of 4) in the order P.V takes them, 4 at a time: those that multiply their
// remainders in this block first, then the others. Returns how many register blocks hold a row of the first kind: they
// multiply the remainders, which are zeros for their other rows, whose products add exact zeros (so every row's sums
// are the same bits whatever rows share its register block).
inline int rows_by_rest(const Rows& st, int rows, int* order) {
  int n = 0;
  for (int r = 0; r < rows; ++r)
    if (st.rest[r]) order[n++] = r;
  const int with_rest = (n + kValueRows - 1) / kValueRows;
  for (int r = 0; r < rows; ++r)
    if (!st.rest[r]) order[n++] = r;
  return with_rest;
}

// prefill_tiles.h's products on this backend.
template <int D>
struct TileProducts<DotProducts, D> {
  using ScoreSteps = ScoreBlocks<D>;
  static ScoreSteps scores(const uint16_t* q, const char* k, int64_t tiles, int64_t rows, Scores* out) {
    return ScoreSteps(q, k, tiles, rows, out);
  }
  // 4 rows at a time, those that keep their remainders in this block first (rows_by_rest): their register blocks
  // multiply the rounded weights and the remainders, the others' the rounded weights only.
  __attribute__((always_inline)) static void values(LaneState<D>& st, const uint16_t* p, const char* v,
                                                    int64_t tiles, int64_t rows) {
    constexpr int kVectors = D / 16 < 4 ? D / 16 : 4;
    const auto* packed = reinterpret_cast<const uint16_t*>(v);
    const int blocks = static_cast<int>((rows + kValueRows - 1) / kValueRows);
    int order[kRows];
    const int with_rest = rows_by_rest(st.rows, blocks * kValueRows, order);
    for (int b = 0; b < blocks; ++b)
      for (int64_t c0 = 0; c0 < D / 16; c0 += kVectors)
        b < with_rest ? rows_block<D, kVectors, true>(st, p, packed, tiles, order + b * kValueRows, c0)
                      : rows_block<D, kVectors, false>(st, p, packed, tiles, order + b * kValueRows, c0);
  }
};

template <int D>
__attribute__((flatten, noinline)) void dot_items(const std::vector<WorkItem>& items,
                                                  const PagedArgs<c10::BFloat16>& a, WorkQueue& queue) {
  attend_items<DotProducts, D>(items, a, queue);
}

template <int D>
void attend_by_dot_products(const PagedArgs<c10::BFloat16>& a) {
  attend<D>(a, [&](const std::vector<WorkItem>& items, WorkQueue& queue) { dot_items<D>(items, a, queue); });
}

}  // namespace

bool prefill_attention_avx512_bf16(const PagedArgs<c10::BFloat16>& a) {
  if (a.head_dim == 64) return attend_by_dot_products<64>(a), true;
  if (a.head_dim == 128) return attend_by_dot_products<128>(a), true;
  if (a.head_dim == 32) return attend_by_dot_products<32>(a), true;
  return false;
}

#endif  // AVX-512 with AVX512-BF16 in this build
