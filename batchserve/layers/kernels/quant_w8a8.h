// The W8A8 kernel's packed weight layout (quant_w8a8_pack.cpp writes it, quant_w8a8.cpp reads it): blocks of 16
// output columns, two blocks a pair laid side by side, and the activations' block and span over k.
// 8 bits: [N / 32][K / 4][2 blocks][16 columns][4 k] uint8 = code + 128; 4 bits: [N / 32][K / 32][4][2 blocks]
// [16 columns][4 k] bytes, vector p of a 32-k subblock holding k = 4p..4p+3 in its low nibbles and 16+4p..16+4p+3 in
// its high ones (quant_w8a8.cpp says why).
#pragma once

#include <algorithm>
#include <cstdint>

#include "quant_gemm.h"

namespace w8a8 {

constexpr int64_t kCols = 16;  // output columns per block: one zmm of int32
constexpr int kBlocks = 2;     // blocks per pair, a tile's columns (N is packed padded to whole pairs)
constexpr int64_t kPairCols = kBlocks * kCols;
constexpr int64_t kVector = 64;  // bytes of one block's operand vector; a pair's vectors are kBlocks x this
constexpr int32_t kOffset = 128;  // added to the weight codes (4 bits: to 16 x the code): vpdpbusd's unsigned operand

inline int64_t column_pairs(int64_t N) { return (N + kPairCols - 1) / kPairCols; }
// bytes of one packed pair of 32 columns: K codes each, 8 or 4 bits
inline int64_t pair_bytes(int64_t K, int64_t bits) { return K * kPairCols * bits / 8; }
// where block c of pair `pair` has its 16 per-group values (scales, minimums) for group g: [N / 32][G][2][16]
inline int64_t column_values(int64_t pair, int64_t groups, int64_t g, int c) {
  return (pair * groups + g) * kPairCols + c * kCols;
}

// The activations' block: act_block (0: the whole row), never across a weight group's edge; a span (k summed in
// int32) is 16 k or whole 32-k subblocks.
struct Spans {
  int64_t block, span;
};

inline Spans spans_of(const QuantWeight& w) {
  const int64_t K = w.in_features;
  const int64_t block = w.act_block > 0 && w.act_block < K ? w.act_block : K;
  TORCH_CHECK(K % block == 0 && (w.group % block == 0 || block % w.group == 0), "w8a8: activation block ", block,
              " does not tile K = ", K, " and group ", w.group);
  const int64_t span = std::min(block, w.group);
  TORCH_CHECK(span == 16 || span % 32 == 0, "w8a8: a span of ", span, " k");
  return {block, span};
}

}  // namespace w8a8
