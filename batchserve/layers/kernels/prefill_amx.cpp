// Paged prefill attention of a bfloat16 pool on AMX tiles: Q.K^T and P.V as bf16 tile products (float32
// accumulation), the online softmax in float32 with AVX-512. The tile operations sit behind a backend, as in
// amx_gemm.cpp: AMX's, or amx_tiles.h's scalar emulation (the "amx_emulated" path, which tests run anywhere).
//
// Why a row's output never depends on its chunking (a prefix-cache hit must round as the whole prompt did): key
// blocks are 128 keys aligned to absolute position 0, every row visits them in the same order, a tile product's row
// depends only on that row of A, and a block wholly in a row's future leaves its softmax state and accumulator
// untouched (skipped, not multiplied by 1). Within a row's last block the key tiles past the lane's last row are not
// multiplied: for the row they are all masked, their P.V product exact zeros, so leaving them out changes no sum. So
// the rows a row shares its tile with, where its chunk started and the number of threads change nothing.
//
// Layout: each (sequence, kv head)'s keys are first packed, once per call, into the tiles' B operand: per key tile of
// 32, Q.K^T's [head_dim / 32][2 halves of 16 keys][16 dim pairs][16 keys][2] and P.V's [head_dim / 16][16 key pairs]
// [16 dims][2] (zero keys past the context, up to a whole block). A work item is the query tiles (32 rows) of the
// heads sharing one kv head, and up to 4 consecutive tiles where that group is small: each K/V tile is loaded into L1
// once for all of them.
#include "isa.h"

#ifdef BATCHSERVE_ISA_AVX512
#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "paged_args.h"
#include "vec_math.h"
#include "work_split.h"

namespace {

constexpr int64_t kRows = 32;      // query rows per tile: two A tiles
constexpr int64_t kKeys = 32;      // keys per key tile: one A tile of P (32 bf16 a row)
constexpr int64_t kTile = 512;     // bf16 elements in one tile (16 rows of 64 bytes)
constexpr int64_t kSub = 4;        // key tiles per softmax block
constexpr int64_t kBlock = kSub * kKeys;  // keys per softmax block: the running maximum and the accumulator are
                                          // updated once per block, P.V summed over its tiles in the C tiles

// Where one (sequence, kv head)'s packed keys and values start, and how many key tiles they hold.
struct PackedKV {
  std::vector<int64_t> first_tile;  // per sequence: its first key tile in the packed buffers (kv head 0's)
  int64_t total_tiles = 0;          // per kv head summed over the sequences
};

PackedKV plan_packing(const int64_t* seq_lens, int64_t num_seqs) {
  PackedKV plan;
  for (int64_t s = 0; s < num_seqs; ++s) {
    plan.first_tile.push_back(plan.total_tiles);
    plan.total_tiles += (seq_lens[s] + kBlock - 1) / kBlock * kSub;
  }
  return plan;
}

// Key tile `t` of one sequence and kv head from the pool into both B layouts (k_out: 2 * D / 32 tiles, v_out: D / 16
// tiles), keys past `num_keys` zero.
void pack_key_tile(const PagedArgs<c10::BFloat16>& a, const int64_t* table, int64_t kv_head, int64_t t,
                   int64_t num_keys, uint16_t* k_out, uint16_t* v_out) {
  const int64_t D = a.head_dim, token_stride = a.num_kv_heads * D;
  const auto* k_cache = reinterpret_cast<const uint16_t*>(a.k_cache);
  const auto* v_cache = reinterpret_cast<const uint16_t*>(a.v_cache);
  std::memset(k_out, 0, sizeof(uint16_t) * kKeys * D);
  std::memset(v_out, 0, sizeof(uint16_t) * kKeys * D);
  for (int64_t i = 0; i < kKeys && t * kKeys + i < num_keys; ++i) {
    const int64_t key = t * kKeys + i;
    const int64_t slot = table[key / a.block_size] * a.block_size + key % a.block_size;
    const uint16_t* k = k_cache + slot * token_stride + kv_head * D;
    const uint16_t* v = v_cache + slot * token_stride + kv_head * D;
    const int64_t half = i / 16, n = i % 16;
    for (int64_t d = 0; d < D; ++d) {  // K: [d / 32][half][(d % 32) / 2][n][d % 2]
      k_out[(d / 32 * 2 + half) * kTile + ((d % 32) / 2) * 32 + n * 2 + d % 2] = k[d];
      // V: [d / 16][i / 2][d % 16][i % 2]
      v_out[(d / 16) * kTile + (i / 2) * 32 + (d % 16) * 2 + i % 2] = v[d];
    }
  }
}

void pack_kv(const PagedArgs<c10::BFloat16>& a, const PackedKV& plan, uint16_t* k_packed, uint16_t* v_packed) {
  const int64_t tile_elems = kKeys * a.head_dim;
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (sequence, key tile)
  for (int64_t s = 0; s < a.num_seqs; ++s)
    for (int64_t t = 0; t < (a.seq_lens[s] + kBlock - 1) / kBlock * kSub; ++t) tiles.emplace_back(s, t);
  const int64_t items = static_cast<int64_t>(tiles.size()) * a.num_kv_heads;
  at::parallel_for(0, items, 64, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const auto [s, t] = tiles[item / a.num_kv_heads];
      const int64_t h = item % a.num_kv_heads;
      const int64_t at = (h * plan.total_tiles + plan.first_tile[s] + t) * tile_elems;
      pack_key_tile(a, a.tables + s * a.max_blocks, h, t, a.seq_lens[s], k_packed + at, v_packed + at);
    }
  });
}

// Lane i of the result = the largest of the 16 lanes of v[i] (attention_avx512.h's sum16 with max for add): the
// row maxima of 16 rows in 15 shuffles and maxima instead of 16 horizontal reductions.
inline __m512 max16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int j = 0; j < 8; ++j)
    t[j] = _mm512_max_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {
    const __m512d a = _mm512_castps_pd(t[2 * j]), b = _mm512_castps_pd(t[2 * j + 1]);
    u[j] = _mm512_max_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int j = 0; j < 2; ++j)
    w[j] = _mm512_max_ps(_mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], 0xDD));
  return _mm512_max_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

// 32 softmax weights of one row as bf16 (round to nearest even): vcvtne2ps2bf16 beside the tiles, the same rounding
// in integer steps for the emulation (P stays in [0, 1] and normal, where the two agree).
template <class Tiles>
inline void weights_to_bf16(__m512 e0, __m512 e1, uint16_t* p) {
#ifdef BATCHSERVE_AMX
  if constexpr (std::is_same_v<Tiles, amx::AmxTiles>) {
    _mm512_storeu_si512(p, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e1, e0)));
    return;
  }
#endif
  store16(reinterpret_cast<c10::BFloat16*>(p), e0);
  store16(reinterpret_cast<c10::BFloat16*>(p + 16), e1);
}

// 2^x for x <= 0 (a softmax weight; the scores are kept in base 2, times log2(e)): 2^k * p(f), f = x - k in
// [-1/2, 1/2], p of degree 5 (relative error ~2e-6, well below P's bf16 rounding); no clamp, 2^k of a large negative
// k is 0. Cheaper than exp512, and the softmax's vector work is most of this kernel's, not the tile products.
inline __m512 exp2_weight(__m512 x) {
  const __m512 k = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT);
  const __m512 f = _mm512_sub_ps(x, k);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, k);
}

// The rows' softmax state across key blocks: the running maximum (scaled, in base 2), per-lane partial sums.
struct Rows {
  alignas(64) float max[kRows];
  __m512 sum[kRows];
  alignas(64) float corr[kRows];  // this key block's rescale factor of what the row accumulated
  bool skip[kRows];               // the key block is wholly in the row's future: the row is left as it was
};

using Scores = float[kSub][4][16][16];  // a block's scores: per key tile, its four C tiles (amx_tiles.h store_c)

// Row r's 16 keys j * 16.. of a block's scores (j: 0-7)
inline const float* score_row(const Scores& s, int64_t r, int64_t j) { return s[j / 2][2 * (r / 16) + j % 2][r % 16]; }

// Key block b's scores -> P [32][128] bf16 and each row's rescale factor. Only a block reaching past a row's position
// masks that row's keys.
template <class Tiles>
__attribute__((always_inline)) inline void softmax_block(const Scores& s, int64_t b, int64_t first_pos, int64_t rows,
                                                         float scale, Rows& st, uint16_t* p) {
  constexpr int kVecs = kBlock / 16;
  const __m512 scale_v = _mm512_set1_ps(scale * 1.44269504f);  // to base 2
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  alignas(64) float new_max[kRows];
  int64_t visible[kRows];
  const auto mask = [&](int64_t r, int j) -> __mmask16 {
    const int64_t n = visible[r] - 16 * j;
    return n >= 16 ? 0xFFFF : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
  };
  for (int half = 0; half < 2; ++half) {
    __m512 row_max[16];
    for (int i = 0; i < 16; ++i) {
      const int64_t r = half * 16 + i;
      visible[r] = r < rows ? std::min<int64_t>(kBlock, first_pos + r - b * kBlock + 1) : 0;
      st.skip[r] = visible[r] <= 0;
      row_max[i] = neg_inf;
      for (int j = 0; j < kVecs; ++j)
        row_max[i] = _mm512_max_ps(row_max[i], _mm512_mask_mov_ps(neg_inf, mask(r, j), _mm512_loadu_ps(score_row(s, r, j))));
    }
    const __m512 old_max = _mm512_load_ps(st.max + 16 * half);
    const __m512 grown = _mm512_max_ps(old_max, _mm512_mul_ps(max16(row_max), scale_v));
    _mm512_store_ps(new_max + 16 * half, grown);
    _mm512_store_ps(st.corr + 16 * half, exp2_weight(_mm512_sub_ps(old_max, grown)));
  }
  for (int64_t r = 0; r < kRows; ++r) {
    if (st.skip[r]) {
      std::memset(p + r * kBlock, 0, kBlock * sizeof(uint16_t));
      continue;
    }
    const __m512 shift = _mm512_set1_ps(new_max[r]);
    __m512 sum = _mm512_mul_ps(st.sum[r], _mm512_set1_ps(st.corr[r]));
    const auto weights = [&](int j) {
      if (16 * j >= visible[r]) return _mm512_setzero_ps();  // past the row (its scores maybe never computed)
      const __m512 e = exp2_weight(_mm512_fmsub_ps(_mm512_loadu_ps(score_row(s, r, j)), scale_v, shift));
      return visible[r] >= kBlock ? e : _mm512_maskz_mov_ps(mask(r, j), e);
    };
    for (int j = 0; j < kVecs; j += 2) {
      const __m512 e0 = weights(j), e1 = weights(j + 1);
      sum = _mm512_add_ps(_mm512_add_ps(sum, e0), e1);
      weights_to_bf16<Tiles>(e0, e1, p + r * kBlock + 16 * j);
    }
    st.sum[r] = sum;
    st.max[r] = new_max[r];
  }
}

// acc[:, 32g .. 32g + 32) = acc * corr + P.V's 32 dims (c: rows 0-15 then 16-31, dims 0-15 then 16-31), for the
// rows the key block reached.
template <int D>
__attribute__((always_inline)) inline void rescale_add(float* acc, const float (*c)[16][16], int g, const Rows& st) {
  for (int64_t r = 0; r < kRows; ++r) {
    if (st.skip[r]) continue;
    const __m512 corr = _mm512_set1_ps(st.corr[r]);
    float* a = acc + r * D + 32 * g;
    const int half = static_cast<int>(r / 16), i = static_cast<int>(r % 16);
    _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_loadu_ps(a), corr, _mm512_loadu_ps(c[2 * half][i])));
    _mm512_storeu_ps(a + 16, _mm512_fmadd_ps(_mm512_loadu_ps(a + 16), corr, _mm512_loadu_ps(c[2 * half + 1][i])));
  }
}

// One query tile (up to 32 rows of one head) of a work item.
struct Lane {
  int64_t row, head;  // its first row in the call, and its query head
  int64_t first_pos, rows;
};

// A work item: the lanes that read one (sequence, kv head)'s packed K and V (the query heads sharing it, and up to
// kLaneTiles consecutive query tiles when they are few), each K/V tile loaded once for all of them.
constexpr int kMaxLanes = 16;
constexpr int64_t kLaneTiles = 4;  // query tiles x heads per item, where the kv head's group is smaller

struct WorkItem {
  const uint16_t* k;  // key tile 0 of the (sequence, kv head) (each key tile kKeys * D further)
  const uint16_t* v;
  int64_t last_pos;   // the last row's position: its keys are the item's cost
  int lanes = 0;
  Lane lane[kMaxLanes];
};

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

// One lane against key block b (k, v: its first packed tile): scores, softmax, P.V into the accumulator.
template <class Tiles, int D>
__attribute__((always_inline)) inline void lane_key_block(const Lane& lane, LaneState<D>& st, const char* k,
                                                          const char* v, int64_t b, float scale) {
  constexpr int64_t kTileBytes = kKeys * D * 2;  // one packed key tile
  alignas(64) uint16_t p[kRows * kBlock];
  alignas(64) Scores s;
  // the key tiles up to the lane's last row: any later one is masked for every row, its P.V product all zeros
  const int64_t tiles = std::min<int64_t>(kSub, (lane.first_pos + lane.rows - 1 - b * kBlock) / kKeys + 1);
  for (int j = 0; j < tiles; ++j) {
    Tiles::zero_c();
    for (int g = 0; g < D / 32; ++g) {
      Tiles::template load_a<false>(st.q + 32 * g, D * 2);
      Tiles::load_b(k + j * kTileBytes + g * 2 * kTile * 2);
      Tiles::dot_all();
    }
    Tiles::store_c(s[j]);
  }
  softmax_block<Tiles>(s, b, lane.first_pos, lane.rows, scale, st.rows, p);
  for (int g = 0; g < D / 32; ++g) {
    Tiles::zero_c();
    for (int j = 0; j < tiles; ++j) {
      Tiles::template load_a<false>(p + j * kKeys, kBlock * 2);
      Tiles::load_b(v + j * kTileBytes + g * 2 * kTile * 2);
      Tiles::dot_all();
    }
    Tiles::store_c(s[0]);
    rescale_add<D>(st.acc, s[0], g, st.rows);
  }
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

// One item: every key tile up to its last row's, each lane taking the tiles up to its own last row's.
template <class Tiles, int D>
__attribute__((always_inline)) inline void attend_item(const WorkItem& item, const PagedArgs<c10::BFloat16>& a,
                                                       LaneState<D>* states) {
  for (int l = 0; l < item.lanes; ++l) start_lane<D>(item.lane[l], a, states[l]);
  for (int64_t b = 0; b <= item.last_pos / kBlock; ++b) {
    const auto* k = reinterpret_cast<const char*>(item.k + b * kBlock * D);
    const auto* v = reinterpret_cast<const char*>(item.v + b * kBlock * D);
    for (int l = 0; l < item.lanes; ++l) {
      const Lane& lane = item.lane[l];
      if (b * kBlock <= lane.first_pos + lane.rows - 1) lane_key_block<Tiles, D>(lane, states[l], k, v, b, a.scale);
    }
  }
  for (int l = 0; l < item.lanes; ++l) finish_lane<D>(item.lane[l], states[l], a);
}

template <class Tiles, int D>
__attribute__((always_inline)) inline void attend_items(const std::vector<WorkItem>& items,
                                                        const PagedArgs<c10::BFloat16>& a, WorkQueue& queue) {
  const std::unique_ptr<LaneState<D>[]> states(new LaneState<D>[kMaxLanes]);  // set up by each item
  Tiles::configure();
  for (int64_t item; queue.next(item);) attend_item<Tiles, D>(items[item], a, states.get());
  Tiles::release();
}

#ifdef BATCHSERVE_AMX
template <int D>
AMX_TARGET __attribute__((flatten, noinline)) void amx_items(const std::vector<WorkItem>& items,
                                                             const PagedArgs<c10::BFloat16>& a, WorkQueue& queue) {
  attend_items<amx::AmxTiles, D>(items, a, queue);
}
#endif

template <int D>
void emulated_items(const std::vector<WorkItem>& items, const PagedArgs<c10::BFloat16>& a, WorkQueue& queue) {
  attend_items<amx::EmulatedTiles, D>(items, a, queue);
}

// The call's work items: per sequence, blocks of query tiles x each kv head, the block's lanes its tiles x the heads
// of the kv head's group (at most kMaxLanes).
std::vector<WorkItem> work_items(const PagedArgs<c10::BFloat16>& a, const PackedKV& plan, const uint16_t* k_packed,
                                 const uint16_t* v_packed) {
  std::vector<WorkItem> items;
  const int64_t D = a.head_dim, group = a.num_heads / a.num_kv_heads, tile_elems = kKeys * D;
  const int64_t tiles_per_block = std::max<int64_t>(1, kLaneTiles / group);
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    const int64_t first = a.query_starts[s], end = a.query_starts[s + 1];
    const int64_t context = a.seq_lens[s] - (end - first);
    for (int64_t block = first; block < end; block += tiles_per_block * kRows)
      for (int64_t kv = 0; kv < a.num_kv_heads; ++kv) {
        const int64_t at = (kv * plan.total_tiles + plan.first_tile[s]) * tile_elems;
        WorkItem item{k_packed + at, v_packed + at, 0};
        for (int64_t h = kv * group; h < (kv + 1) * group; ++h)
          for (int64_t row = block; row < std::min(end, block + tiles_per_block * kRows); row += kRows) {
            if (item.lanes == kMaxLanes) items.push_back(item), item.lanes = 0;
            const int64_t rows = std::min(kRows, end - row), pos = context + row - first;
            item.lane[item.lanes++] = {row, h, pos, rows};
            item.last_pos = std::max(item.last_pos, pos + rows - 1);
          }
        items.push_back(item);
      }
  }
  return items;
}

template <int D>
void attend(const PagedArgs<c10::BFloat16>& a, bool emulated) {
  const PackedKV plan = plan_packing(a.seq_lens, a.num_seqs);
  const int64_t packed = plan.total_tiles * a.num_kv_heads * kKeys * D;  // every element written by pack_kv
  const std::unique_ptr<uint16_t[]> k_packed(new uint16_t[packed]), v_packed(new uint16_t[packed]);
  pack_kv(a, plan, k_packed.get(), v_packed.get());
  const std::vector<WorkItem> items = work_items(a, plan, k_packed.get(), v_packed.get());
  run_costliest_first(
      static_cast<int64_t>(items.size()), [&](int64_t i) { return items[i].last_pos; },
      [&](WorkQueue& queue) {
#ifdef BATCHSERVE_AMX
        if (!emulated) return amx_items<D>(items, a, queue);
#endif
        emulated_items<D>(items, a, queue);
      });
}

}  // namespace

bool prefill_attention_amx(const PagedArgs<c10::BFloat16>& a, bool emulated) {
#ifndef BATCHSERVE_AMX
  if (!emulated) return false;
#endif
  if (a.head_dim == 64) return attend<64>(a, emulated), true;
  if (a.head_dim == 128) return attend<128>(a, emulated), true;
  if (a.head_dim == 32) return attend<32>(a, emulated), true;
  return false;
}

#endif  // BATCHSERVE_ISA_AVX512
