// The body of the paged prefill attention of a bfloat16 pool on 32-row tiles, shared by its two kernels: AMX's tile
// products (prefill_amx.cpp: AMX, or amx_tiles.h's scalar emulation, the "amx_emulated" path tests run anywhere) and
// AVX512-BF16's dot products on the vector unit (prefill_avx512_bf16.cpp). Q.K^T and P.V multiply bf16 operands with
// float32 sums; the online softmax runs in float32 with AVX-512. A backend (`Tiles`) supplies the two products
// (TileProducts below: AMX's tile operations by default, or a specialization of its own).
//
// Why a row's output never depends on its chunking (a prefix-cache hit must round as the whole prompt did): key
// blocks are 128 keys aligned to absolute position 0, every row visits them in the same order, a product's row
// depends only on that row of Q or P, and a block wholly in a row's future leaves its softmax state untouched and adds
// exact zeros to its accumulator (P.V sums start from the accumulator). A row's weights take the unmasked code
// wherever the block is whole for it, the masked code only in its last block, whatever its tile mates.
// Within a row's last block the key tiles past the lane's last row are not multiplied: for the row they are all
// masked, their P.V product exact zeros, so leaving them out changes no sum. So the rows a row shares its tile with,
// where its chunk started and the number of threads change nothing.
//
// Layout: each (sequence, kv head)'s keys are first packed, once per call, into the tiles' B operand: per key tile of
// 32, Q.K^T's [head_dim / 32][2 halves of 16 keys][16 dim pairs][16 keys][2] and P.V's [head_dim / 16][16 key pairs]
// [16 dims][2] (zero keys past the context, up to a whole block). A work item is the query tiles (32 rows) of the
// heads sharing one kv head, and up to 4 consecutive tiles where that group is small: each K/V tile is loaded into L1
// once for all of them.
#pragma once

#include "isa.h"

#ifdef BATCHSERVE_ISA_AVX512
#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "prefill_work.h"
#include "vec_math.h"

namespace {

// Lane i of the result = the largest of the 16 lanes of v[i]: the row maxima of 16 rows at once.
inline __m512 max16(const __m512* v) {
  return combine16(v, [](__m512 x, __m512 y) { return _mm512_max_ps(x, y); });
}

// Whether a backend's code runs where AVX512-BF16 does (AMX's, the dot products'), so that it rounds P with it.
template <class Tiles>
constexpr bool kRoundsWithAvx512Bf16 = false;
#ifdef BATCHSERVE_AMX
template <>
constexpr bool kRoundsWithAvx512Bf16<amx::AmxTiles> = true;
#endif

// Whether a backend multiplies P.V by P's bf16 rounding and then by its remainder, also in bf16 (P to ~16 bits, where
// one bf16 keeps 8): the remainders follow the rounded weights in P's buffer, kWeights further.
template <class Tiles>
constexpr bool kSplitsWeights = false;
constexpr int64_t kWeights = kRows * kBlock;  // bf16 weights of one visit's P

// Where a backend splits the weights, a row's block keeps its remainders only if its largest weight is at least
// 2^kRestBelow of the row's running maximum (in base 2: its largest scaled score no more than -kRestBelow below).
// Rounding a weight e to bf16 moves it by at most 2^-8 e, so the blocks left at one rounding move a row's output by
// at most 2^-8 times their share of the row's softmax mass times the largest |v|, and each of their weights is under
// 2^kRestBelow of the row's largest. The near-ties that needed the remainder (the README question) sit in a short
// prompt's one block, which holds the row's maximum and keeps it; a long context's blocks far below the maximum, most
// of its keys, take P.V's products once. The choice reads only the row's own scores and running maximum, which are
// the same bits in any chunking, so a row's output still never depends on its chunk or its tile mates (a row left at
// one rounding has zero remainders, whose products add exact zeros where a mate's are multiplied).
constexpr float kRestBelow = -1.f;

// A backend's P buffer: the rounded weights, and their remainders where it splits them.
template <class Tiles>
constexpr int64_t kWeightBuffer = kSplitsWeights<Tiles> ? 2 * kWeights : kWeights;

// 32 softmax weights of one row as bf16 (round to nearest even): vcvtne2ps2bf16 where the backend runs it, the same
// rounding in integer steps for the emulation (P stays in [0, 1] and normal, where the two agree). Where the backend
// splits them, e - bf16(e) (exact: the two are within a factor 2) rounded to bf16 as well, kWeights further, or zeros
// where the row's block leaves its remainders out (`rest` false: kRestBelow).
template <class Tiles>
inline void weights_to_bf16(__m512 e0, __m512 e1, bool rest, uint16_t* p) {
  if constexpr (kRoundsWithAvx512Bf16<Tiles>) {
    const __m512i rounded = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e1, e0));
    _mm512_storeu_si512(p, rounded);
    if constexpr (kSplitsWeights<Tiles>) {
      if (!rest) return _mm512_storeu_si512(p + kWeights, _mm512_setzero_si512());
      const auto widen = [](__m256i half) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
      };
      const __m512 rest0 = _mm512_sub_ps(e0, widen(_mm512_castsi512_si256(rounded)));
      const __m512 rest1 = _mm512_sub_ps(e1, widen(_mm512_extracti64x4_epi64(rounded, 1)));
      _mm512_storeu_si512(p + kWeights, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(rest1, rest0)));
    }
  } else {
    store16(reinterpret_cast<c10::BFloat16*>(p), e0);
    store16(reinterpret_cast<c10::BFloat16*>(p + 16), e1);
  }
}

// 2^x for x <= 0 (a softmax weight; the scores are kept in base 2, times log2(e)): p(f) * 2^floor(x) with
// f = x - floor(x) in [0, 1) (vreduceps) and p of degree 4 with p(0) = 1 (relative error ~3e-6, far below P's bf16
// rounding); vscalefps takes floor(x) from x itself, so no rounding step, and 2^floor(x) of a large negative x is 0.
// Cheaper than exp512, and the softmax's vector work is most of this kernel's, not the tile products.
inline __m512 exp2_weight(__m512 x) {
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF);  // imm 0x01: no fraction bits kept, round down
  __m512 p = _mm512_set1_ps(1.3426685e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.2242473e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4128020e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9304484e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, x);
}

// The rows' softmax state across key blocks: the running maximum (scaled, in base 2), per-lane partial sums.
struct Rows {
  alignas(64) float max[kRows];
  __m512 sum[kRows];
  alignas(64) float corr[kRows];  // this key block's rescale factor of what the row accumulated
  bool skip[kRows];               // the key block is wholly in the row's future: the row is left as it was
  bool rest[kRows];               // the block's weights' remainders are multiplied (kSplitsWeights, kRestBelow)
};

using Scores = float[kSub][4][16][16];  // a block's scores: per key tile, its four C tiles (amx_tiles.h store_c)

// Row r's 16 keys j * 16.. of a block's scores (j: 0-7)
inline const float* score_row(const Scores& s, int64_t r, int64_t j) { return s[j / 2][2 * (r / 16) + j % 2][r % 16]; }

constexpr int kVecs = kBlock / 16;  // 16-key vectors of a row of one block

inline __mmask16 first_lanes(int64_t n) {  // the lanes below n (of 16)
  return n >= 16 ? 0xFFFF : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
}

// The largest of row r's scores in a key block (unscaled), its first `visible` keys only where Masked (its later
// scores are another row's future, or were never computed).
template <bool Masked>
__attribute__((always_inline)) inline __m512 row_block_max(const Scores& s, int64_t r, int64_t visible) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m = neg_inf;
  for (int j = 0; j < kVecs; ++j) {
    const __m512 x = _mm512_loadu_ps(score_row(s, r, j));
    m = _mm512_max_ps(m, Masked ? _mm512_mask_mov_ps(neg_inf, first_lanes(visible - 16 * j), x) : x);
  }
  return m;
}

// Row r's softmax weights in a key block (0 past `visible` where Masked) into P as bf16; returns `sum` plus them.
// Two sums, even and odd vectors, so the adds wait on each other half as long. A row whose block is whole always
// takes the unmasked instance, in any chunk or tile: the same operations in the same order, so the same bits.
template <class Tiles, bool Masked>
__attribute__((always_inline)) inline __m512 row_weights(const Scores& s, int64_t r, int64_t visible, __m512 scale_v,
                                                         __m512 shift, __m512 sum, bool rest, uint16_t* p) {
  const auto weight = [&](int j) {
    if (Masked && 16 * j >= visible) return _mm512_setzero_ps();
    const __m512 e = exp2_weight(_mm512_fmsub_ps(_mm512_loadu_ps(score_row(s, r, j)), scale_v, shift));
    return Masked ? _mm512_maskz_mov_ps(first_lanes(visible - 16 * j), e) : e;
  };
  __m512 odd = _mm512_setzero_ps();
  for (int j = 0; j < kVecs; j += 2) {
    const __m512 e0 = weight(j), e1 = weight(j + 1);
    sum = _mm512_add_ps(sum, e0);
    odd = _mm512_add_ps(odd, e1);
    weights_to_bf16<Tiles>(e0, e1, rest, p + 16 * j);
  }
  return _mm512_add_ps(sum, odd);
}

// Key block b's scores -> P [32][128] bf16 and each row's rescale factor. Only a block reaching past a row's position
// masks that row's keys.
template <class Tiles, class Between>
__attribute__((always_inline)) inline void softmax_block(const Scores& s, int64_t b, int64_t first_pos, int64_t rows,
                                                         float scale, Rows& st, uint16_t* p, Between&& between) {
  const __m512 scale_v = _mm512_set1_ps(scale * 1.44269504f);  // to base 2
  alignas(64) float new_max[kRows];
  int64_t visible[kRows];
  for (int half = 0; half < 2; ++half) {
    __m512 row_max[16];
    for (int i = 0; i < 16; ++i) {
      const int64_t r = half * 16 + i;
      visible[r] = r < rows ? std::min<int64_t>(kBlock, first_pos + r - b * kBlock + 1) : 0;
      st.skip[r] = visible[r] <= 0;
      row_max[i] = visible[r] >= kBlock ? row_block_max<false>(s, r, kBlock) : row_block_max<true>(s, r, visible[r]);
    }
    const __m512 old_max = _mm512_load_ps(st.max + 16 * half), block_max = _mm512_mul_ps(max16(row_max), scale_v);
    const __m512 grown = _mm512_max_ps(old_max, block_max);
    const __mmask16 rest =
        _mm512_cmp_ps_mask(_mm512_sub_ps(block_max, grown), _mm512_set1_ps(kRestBelow), _CMP_GE_OQ);
    for (int i = 0; i < 16; ++i)
      st.rest[half * 16 + i] = kSplitsWeights<Tiles> && !st.skip[half * 16 + i] && (rest >> i & 1);
    _mm512_store_ps(new_max + 16 * half, grown);
    _mm512_store_ps(st.corr + 16 * half, exp2_weight(_mm512_sub_ps(old_max, grown)));
  }
  for (int r = 0; r < kRows; ++r) {
    between(r);
    if (st.skip[r]) {
      std::memset(p + r * kBlock, 0, kBlock * sizeof(uint16_t));
      if constexpr (kSplitsWeights<Tiles>) std::memset(p + kWeights + r * kBlock, 0, kBlock * sizeof(uint16_t));
      continue;
    }
    const __m512 shift = _mm512_set1_ps(new_max[r]);
    const __m512 sum = _mm512_mul_ps(st.sum[r], _mm512_set1_ps(st.corr[r]));
    const bool rest = st.rest[r];
    st.sum[r] = visible[r] >= kBlock
                    ? row_weights<Tiles, false>(s, r, kBlock, scale_v, shift, sum, rest, p + r * kBlock)
                    : row_weights<Tiles, true>(s, r, visible[r], scale_v, shift, sum, rest, p + r * kBlock);
    st.max[r] = new_max[r];
  }
}

// acc *= corr, the rows whose running maximum grew this key block (a factor of 1 changes no bits: skipped).
template <int D>
__attribute__((always_inline)) inline void rescale_rows(float* acc, const Rows& st) {
  for (int64_t r = 0; r < kRows; ++r) {
    if (st.skip[r] || st.corr[r] == 1.f) continue;
    const __m512 corr = _mm512_set1_ps(st.corr[r]);
    for (float* a = acc + r * D; a < acc + (r + 1) * D; a += 16)
      _mm512_storeu_ps(a, _mm512_mul_ps(_mm512_loadu_ps(a), corr));
  }
}

// A lane's query rows as bf16, its softmax state and accumulator, in the thread's scratch.
template <int D>
struct LaneState {
  alignas(64) uint16_t q[kRows * D];
  alignas(64) float acc[kRows * D];
  Rows rows;
};

// The lane's query rows as bf16: copied, or rounded from float32 (exact: they hold bf16 values).
template <int D>
__attribute__((always_inline)) inline void start_lane(const Lane& lane, const PagedArgs<c10::BFloat16>& a,
                                                      LaneState<D>& st) {
  for (int64_t r = 0; r < kRows; ++r) {
    const int64_t at = (lane.row + r) * a.q_stride + lane.head * D;
    if (r >= lane.rows)
      std::memset(st.q + r * D, 0, D * sizeof(uint16_t));
    else if (a.q_bf16 != nullptr)
      std::memcpy(st.q + r * D, a.q_bf16 + at, D * sizeof(uint16_t));
    else
      for (int64_t d = 0; d < D; d += 16)
        store16(reinterpret_cast<c10::BFloat16*>(st.q + r * D + d), _mm512_loadu_ps(a.q + at + d));
    st.rows.max[r] = -1e30f;
    st.rows.sum[r] = _mm512_setzero_ps();
  }
  std::fill(st.acc, st.acc + kRows * D, 0.f);
}

// The key tiles of block b that a lane multiplies: up to its last row's (any later one is masked for every row, its
// P.V product all zeros).
inline int64_t lane_tiles(const Lane& lane, int64_t b) {
  return std::min<int64_t>(kSub, (lane.first_pos + lane.rows - 1 - b * kBlock) / kKeys + 1);
}

// One lane's scores against one key block (k: its first packed tile) as tile operations issued a few at a time, so
// that the tile unit computes them while the vector unit works on the previous block's softmax. A key tile's steps:
// zero the C tiles, one product per 32 dims, store.
template <class Tiles, int D>
class ScoreTiles {
 public:
  static constexpr int kSteps = D / 32 + 2;  // per key tile

  ScoreTiles(const uint16_t* q, const char* k, int64_t tiles, Scores* out)
      : q_(q), k_(k), out_(out), total_(static_cast<int>(tiles) * kSteps) {}
  int total() const { return total_; }
  // Issues the steps up to the n-th.
  __attribute__((always_inline)) void until(int n) {
    for (n = std::min(n, total_); done_ < n; ++done_) {
      const int j = done_ / kSteps, at = done_ % kSteps;
      if (at == 0) {
        Tiles::zero_c();
      } else if (at <= D / 32) {
        Tiles::template load_a<false>(q_ + 32 * (at - 1), D * 2);
        Tiles::load_b(k_ + (j * kKeys * D + (at - 1) * 2 * kTile) * 2);
        Tiles::dot_all();
      } else {
        Tiles::store_c((*out_)[j]);
      }
    }
  }

 private:
  const uint16_t* q_;
  const char* k_;
  Scores* out_;
  int total_, done_ = 0;
};

// P.V of one lane's key block (v: its first packed tile) added to the accumulator, rescaled first: the C tiles start
// from it, 32 dims at a time, and go back into it. A row the block does not reach has P all zeros there, and adding
// their exact zero products leaves its sums as they were.
template <class Tiles, int D>
__attribute__((always_inline)) inline void lane_values(LaneState<D>& st, const uint16_t* p, const char* v,
                                                       int64_t tiles) {
  rescale_rows<D>(st.acc, st.rows);
  for (int g = 0; g < D / 32; ++g) {
    Tiles::load_c(st.acc + 32 * g, D * 4);
    for (int j = 0; j < tiles; ++j) {
      Tiles::template load_a<false>(p + j * kKeys, kBlock * 2);
      Tiles::load_b(v + (j * kKeys * D + g * 2 * kTile) * 2);
      Tiles::dot_all();
    }
    Tiles::store_c(st.acc + 32 * g, D * 4);
  }
}

// A backend's two products of a lane's key block: Q.K^T as steps issued a few at a time (ScoreSteps: total(),
// until(n)) and P.V into the accumulator. AMX's tile operations here; a backend of its own specializes it.
template <class Tiles, int D>
struct TileProducts {
  using ScoreSteps = ScoreTiles<Tiles, D>;
  // rows: the lane's query rows (the tiles take all 32 whatever it holds)
  static ScoreSteps scores(const uint16_t* q, const char* k, int64_t tiles, int64_t /*rows*/, Scores* out) {
    return ScoreSteps(q, k, tiles, out);
  }
  __attribute__((always_inline)) static void values(LaneState<D>& st, const uint16_t* p, const char* v,
                                                    int64_t tiles, int64_t /*rows*/) {
    lane_values<Tiles, D>(st, p, v, tiles);
  }
};

// A (lane, key block) pair of an item, in the order the item visits them: block by block, each block's lanes.
struct Visit {
  int l = 0;
  int64_t b = 0;
};

// The visit after `at` (false after the last): the next lane that reaches its block, or the next block's first.
inline bool next_visit(const WorkItem& item, Visit& at) {
  do {
    if (++at.l == item.lanes) at.l = 0, ++at.b;
    if (at.b > item.last_pos / kBlock) return false;
  } while (at.b * kBlock > item.lane[at.l].first_pos + item.lane[at.l].rows - 1);
  return true;
}

// out = acc / sum, in float32 or rounded to bf16 (to nearest even, as a float32 output's conversion rounds).
template <int D>
void finish_lane(const Lane& lane, const LaneState<D>& st, const PagedArgs<c10::BFloat16>& a) {
  for (int64_t r = 0; r < lane.rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(st.rows.sum[r]));
    const int64_t at = ((lane.row + r) * a.num_heads + lane.head) * D;
    for (int j = 0; j < D; j += 16) {
      const __m512 o = _mm512_mul_ps(_mm512_loadu_ps(st.acc + r * D + j), inv);
      if (a.out_bf16 != nullptr)
        store16(a.out_bf16 + at + j, o);
      else
        _mm512_storeu_ps(a.out + at + j, o);
    }
  }
}

// One item: every key tile up to its last row's, each lane taking the tiles up to its own last row's. The next
// visit's scores are issued on the tiles between the rows of this visit's softmax (two score buffers).
template <class Tiles, int D>
__attribute__((always_inline)) inline void attend_item(const WorkItem& item, const PagedArgs<c10::BFloat16>& a,
                                                       LaneState<D>* states, Scores* scores) {
  alignas(64) uint16_t p[kWeightBuffer<Tiles>];
  const auto key_tile = [&](const uint16_t* packed, int64_t b) {
    return reinterpret_cast<const char*>(packed + b * kBlock * D);
  };
  using Products = TileProducts<Tiles, D>;
  const auto scores_of = [&](const Visit& at, Scores* out) {
    const Lane& lane = item.lane[at.l];
    return Products::scores(states[at.l].q, key_tile(item.k, at.b), lane_tiles(lane, at.b), lane.rows, out);
  };
  for (int l = 0; l < item.lanes; ++l) start_lane<D>(item.lane[l], a, states[l]);
  Visit at;  // lane 0 reaches block 0
  typename Products::ScoreSteps first = scores_of(at, scores);
  first.until(first.total());
  for (int buf = 0;; buf ^= 1) {
    Visit next = at;
    const bool more = next_visit(item, next);
    typename Products::ScoreSteps ahead =
        more ? scores_of(next, scores + (buf ^ 1)) : Products::scores(nullptr, nullptr, 0, 0, nullptr);
    const Lane& lane = item.lane[at.l];
    softmax_block<Tiles>(scores[buf], at.b, lane.first_pos, lane.rows, a.scale, states[at.l].rows, p, [&](int r) {
      ahead.until((r + 1) * ahead.total() / kRows);
    });
    ahead.until(ahead.total());
    Products::values(states[at.l], p, key_tile(item.v, at.b), lane_tiles(lane, at.b), lane.rows);
    if (!more) break;
    at = next;
  }
  for (int l = 0; l < item.lanes; ++l) finish_lane<D>(item.lane[l], states[l], a);
}

template <class Tiles, int D>
__attribute__((always_inline)) inline void attend_items(const std::vector<WorkItem>& items,
                                                        const PagedArgs<c10::BFloat16>& a, WorkQueue& queue) {
  const std::unique_ptr<LaneState<D>[]> states(new LaneState<D>[kMaxLanes]);  // set up by each item
  struct alignas(64) TwoScores {  // whole cache lines: a tile row stored across two lines costs two
    Scores s[2];
  };
  const std::unique_ptr<TwoScores> scores(new TwoScores);
  Tiles::configure();
  for (int64_t item; queue.next(item);) attend_item<Tiles, D>(items[item], a, states.get(), scores->s);
  Tiles::release();
}

// The call on one backend: K/V packed, the work items made, then run_items(items, queue) on each thread, which runs
// attend_items<Tiles, D> under its backend's target.
template <int D, class RunItems>
void attend(const PagedArgs<c10::BFloat16>& a, RunItems&& run_items) {
  const PackedKV plan = plan_packing(a.seq_lens, a.num_seqs);
  const int64_t packed = plan.total_tiles * a.num_kv_heads * kKeys * D;  // every element written by pack_kv
  const std::unique_ptr<uint16_t[]> k_packed(new uint16_t[packed]), v_packed(new uint16_t[packed]);
  pack_kv(a, plan, k_packed.get(), v_packed.get());
  const std::vector<WorkItem> items = work_items(a, plan, k_packed.get(), v_packed.get());
  run_costliest_first(
      static_cast<int64_t>(items.size()), [&](int64_t i) { return items[i].last_pos; },
      [&](WorkQueue& queue) { run_items(items, queue); });
}

}  // namespace

#endif  // BATCHSERVE_ISA_AVX512
