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
// apart in float32) on the other side: "L'Étoile, ..." where float32 weights answer "Paris". A row's key tile whose
// weights are all far below its running maximum keeps one rounding (kRestBelow): P.V takes the rows that keep their
// remainders in the same tiles together, 4 to a register block, and a register block's key tile multiplies the
// remainders only where one of its rows keeps them. Only the rows the lane holds are multiplied (AMX's tiles take
// all 32).
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

// P.V of 4 rows over one key tile (v_tile: its packed V, dims c0 * 16.., NV vectors) into the register block `acc`:
// per key pair, the rows' rounded weights (`weights`: each row's, `at` its tile's first key) against the packed V,
// then with_rest their remainders' (kWeights further) into the same sums. A branch, not a template argument: GCC 12
// then keeps the pair's V vectors in registers, where two instances of the loop made it reload them for every row.
template <int NV>
__attribute__((always_inline)) inline void tile_values(__m512 (&acc)[kValueRows][NV], const uint16_t* const* weights,
                                                       int64_t at, const uint16_t* v_tile, bool with_rest) {
  for (int64_t pair = 0; pair < kKeys / 2; ++pair) {
    __m512bh values[NV];
    for (int c = 0; c < NV; ++c) values[c] = load_pairs(v_tile + c * kTile + pair * 32);
    for (int64_t r = 0; r < kValueRows; ++r) {
      const __m512bh w = broadcast_pair(weights[r] + at + 2 * pair);
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w, values[c]);
      if (with_rest) {
        const __m512bh rest = broadcast_pair(weights[r] + kWeights + at + 2 * pair);
        for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], rest, values[c]);
      }
    }
  }
}

// P.V of 4 rows over a block's first `tiles` key tiles (v: its packed V), dims c0 * 16.. (NV vectors), added to the
// lane's accumulator (`sums`: each row's, at dim c0 * 16) after it is multiplied by the row's factor. Key tile j
// multiplies the remainders too where one of the 4 rows keeps them there (bit j of `rest`; the others' are zeros
// there, whose products add exact zeros).
template <int D, int NV>
__attribute__((always_inline)) inline void value_block(const uint16_t* const* weights, float* const* sums,
                                                       const float* factors, unsigned rest, const uint16_t* v,
                                                       int64_t tiles) {
  __m512 acc[kValueRows][NV];
  for (int64_t r = 0; r < kValueRows; ++r) {
    const __m512 factor = _mm512_set1_ps(factors[r]);
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_mul_ps(_mm512_load_ps(sums[r] + 16 * c), factor);
  }
  for (int64_t j = 0; j < tiles; ++j) tile_values<NV>(acc, weights, j * kKeys, v + j * kKeys * D, rest >> j & 1);
  for (int64_t r = 0; r < kValueRows; ++r)
    for (int c = 0; c < NV; ++c) _mm512_store_ps(sums[r] + 16 * c, acc[r][c]);
}

// value_block over 4 rows of the lane (`rows`), rescaling their accumulators by the block's factors first (1 for a
// row the block leaves alone).
template <int D, int NV>
__attribute__((always_inline)) inline void rows_block(LaneState<D>& st, const uint16_t* p, const uint16_t* v,
                                                      int64_t tiles, const int* rows, int64_t c0) {
  const uint16_t* weights[kValueRows];
  float* sums[kValueRows];
  float factors[kValueRows];
  unsigned rest = 0;
  for (int64_t r = 0; r < kValueRows; ++r) {
    weights[r] = p + rows[r] * kBlock;
    sums[r] = st.acc + rows[r] * D + 16 * c0;
    factors[r] = st.rows.skip[rows[r]] ? 1.f : st.rows.corr[rows[r]];
    rest |= st.rows.rest[rows[r]];
  }
  value_block<D, NV>(weights, sums, factors, rest, v + c0 * kTile, tiles);
}

// The lane's first `rows` rows (a multiple of 4) in the order P.V takes them, 4 at a time: grouped by which key tiles
// keep their remainders (Rows::rest), so that a register block's rows mostly share them and its key tiles multiply
// remainders only where one of its rows keeps them (zeros for the others, whose products add exact zeros: every row's
// sums are the same bits whatever rows share its register block).
inline void rows_by_rest(const Rows& st, int rows, int* order) {
  constexpr int kMasks = 1 << kSub;
  int first[kMasks + 1] = {};  // where each mask's rows start in `order`, the mask of every tile first
  for (int r = 0; r < rows; ++r) ++first[kMasks - st.rest[r]];
  for (int m = 0; m < kMasks; ++m) first[m + 1] += first[m];
  for (int r = 0; r < rows; ++r) order[first[kMasks - 1 - st.rest[r]]++] = r;
}

// prefill_tiles.h's products on this backend.
template <int D>
struct TileProducts<DotProducts, D> {
  using ScoreSteps = ScoreBlocks<D>;
  static ScoreSteps scores(const uint16_t* q, const char* k, int64_t tiles, int64_t rows, Scores* out) {
    return ScoreSteps(q, k, tiles, rows, out);
  }
  // 4 rows at a time, grouped by the key tiles that keep their remainders (rows_by_rest): a register block's key
  // tile multiplies the rounded weights, and the remainders where one of its rows keeps them.
  __attribute__((always_inline)) static void values(LaneState<D>& st, const uint16_t* p, const char* v,
                                                    int64_t tiles, int64_t rows) {
    constexpr int kVectors = D / 16 < 4 ? D / 16 : 4;
    const auto* packed = reinterpret_cast<const uint16_t*>(v);
    const int blocks = static_cast<int>((rows + kValueRows - 1) / kValueRows);
    int order[kRows];
    rows_by_rest(st.rows, blocks * kValueRows, order);
    for (int b = 0; b < blocks; ++b)
      for (int64_t c0 = 0; c0 < D / 16; c0 += kVectors)
        rows_block<D, kVectors>(st, p, packed, tiles, order + b * kValueRows, c0);
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
