// The work of the tile kernels' paged prefill attention (prefill_tiles.h): the tile and block sizes, each (sequence,
// kv head)'s keys and values packed once per call into the products' operand layouts, and the work items (the query
// tiles of the heads sharing one kv head). No arithmetic of attention here.
#pragma once

#include "isa.h"

#ifdef BATCHSERVE_ISA_AVX512
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "paged_args.h"
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
  const int64_t keys = std::clamp<int64_t>(num_keys - t * kKeys, 0, kKeys);
  if (keys < kKeys) {
    std::memset(k_out, 0, sizeof(uint16_t) * kKeys * D);
    std::memset(v_out, 0, sizeof(uint16_t) * kKeys * D);
  }
  const auto row = [&](const uint16_t* cache, int64_t i) {
    const int64_t key = t * kKeys + i, slot = table[key / a.block_size] * a.block_size + key % a.block_size;
    return cache + slot * token_stride + kv_head * D;
  };
  for (int64_t i = 0; i < keys; ++i) {  // K: [d / 32][i / 16][(d % 32) / 2][i % 16][d % 2], a dim pair at a time
    const auto* k = reinterpret_cast<const uint32_t*>(row(k_cache, i));
    auto* out = reinterpret_cast<uint32_t*>(k_out) + (i / 16) * (kTile / 2) + i % 16;
    for (int64_t pair = 0; pair < D / 2; ++pair) out[(pair / 16) * kTile + (pair % 16) * 16] = k[pair];
  }
  // V: [d / 16][i / 2][d % 16][i % 2], 16 dims of a key pair interleaved at a time
#ifndef __AVX512BW__
  for (int64_t i = 0; i < keys; ++i)
    for (int64_t d = 0; d < D; ++d) v_out[(d / 16) * kTile + (i / 2) * 32 + (d % 16) * 2 + i % 2] = row(v_cache, i)[d];
#else
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t i = 0; i < keys; i += 2) {
    const uint16_t *v0 = row(v_cache, i), *v1 = i + 1 < keys ? row(v_cache, i + 1) : nullptr;
    for (int64_t d = 0; d < D; d += 16) {
      const __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + d));
      const __m256i a1 = v1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + d)) : _mm256_setzero_si256();
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(a0), a1, 1);
      _mm512_storeu_si512(v_out + (d / 16) * kTile + (i / 2) * 32, _mm512_permutexvar_epi16(interleave, both));
    }
  }
#endif
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

}  // namespace

#endif  // BATCHSERVE_ISA_AVX512
