// A weight kept quantized, multiplied on AMX's bf16 tiles: x [M, K] bf16 @ W -> float32 or bf16, for the rows of a
// bf16 model from amx_min_m up (quant_gemm.h); fewer rows stay on W8A8 (quant_w8a8.cpp).
//
// Why bf16 tiles and not AMX-INT8: the int8 tiles contract 64 k per instruction into one int32 sum, while the
// activations' int8 scales change every 16 k (ACT_BLOCK, which the accuracy needs). Sums per 16 k would leave three
// quarters of each tile product idle and store a C tile every 16 k for its float epilogue, as much vector work as
// W8A8 does by itself. Here each pair of 16-column blocks (32 columns: one AMX panel) is dequantized once per call
// into the bf16 B tiles of amx_tiles.h, in a panel of K x 32 that stays in L2, and every row block of the call runs
// over it; the activations are not quantized at all (the bf16 model's own rows), and the weight's value at each
// code is rounded to bf16 once, as the bf16 tiles of the other paths round it.
//
// The weight is read in W8A8's packed layout (quant_w8a8.h), the one copy a weight keeps; a value is code x scale
// (+ the group's minimum, 8 x the scale added back where the minimum is packed at nibble 8), each in float32 with
// one rounding (an FMA), then rounded to bf16. The dequantization runs in AVX-512 where the CPU has AVX512-BF16
// (every AMX CPU), else in the scalar loop that the vector one is tested against.
#include "aten_pch.h"  // first: the precompiled torch headers (build.py)

#include "isa.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "amx_tiles.h"
#include "quant_gemm.h"
#include "quant_w8a8.h"

#ifdef BATCHSERVE_ISA_AVX512_BF16_FILE
#define BATCHSERVE_AMX_DEQUANT_AVX512 1
#endif

namespace {

using namespace amx;
using w8a8::column_values;
using w8a8::kCols;
using w8a8::kPairCols;
using w8a8::kVector;

// Where one pair's codes and per-group values are, and how to read them.
struct PairSource {
  const uint8_t* codes;  // the pair's packed codes
  const void *scales, *mins;
  bool half_values, add_eight_scales;
  int64_t pair, groups, group, bits;
};

PairSource source_of(const QuantWeight& w, int64_t pair) {
  return {w.w8a8_codes.data_ptr<uint8_t>() + pair * w8a8::pair_bytes(w.in_features, w.bits),
          w.w8a8_scales.data_ptr(),
          w.w8a8_mins.defined() ? w.w8a8_mins.data_ptr() : nullptr,
          w.w8a8_scales.scalar_type() == at::kHalf,
          w.w8a8_add_eight_scales,
          pair,
          w.w8a8_scales.size(1),
          w.in_features / w.w8a8_scales.size(1),
          w.bits};
}

// ---- the scalar dequantization (any CPU; the reference of the vector one) ----

float value_at(const void* values, bool half, int64_t at) {
  return half ? static_cast<float>(static_cast<const c10::Half*>(values)[at]) : static_cast<const float*>(values)[at];
}

// the signed code of k in column n of block c
int code_at(const PairSource& s, int64_t k, int c, int n) {
  const int64_t lane = c * kVector + n * 4;
  if (s.bits == 8) return static_cast<int>(s.codes[(k / 4) * 2 * kVector + lane + k % 4]) - 128;
  const int64_t j = k % 32;
  const uint8_t byte = s.codes[((k / 32) * 4 + (j % 16) / 4) * 2 * kVector + lane + j % 4];
  return (j < 16 ? (byte & 15) : (byte >> 4)) - 8;
}

void dequantize_pair_scalar(const PairSource& s, int64_t K, uint16_t* panel) {
  for (int64_t kb = 0; kb < K / kDepth; ++kb) {
    const int64_t g = kb * kDepth / s.group;
    for (int c = 0; c < 2; ++c)
      for (int n = 0; n < kCols; ++n) {
        const int64_t at = column_values(s.pair, s.groups, g, c) + n;
        const float scale = value_at(s.scales, s.half_values, at);
        float minimum = s.mins ? value_at(s.mins, s.half_values, at) : 0.0f;
        if (s.mins && s.add_eight_scales) minimum = std::fma(8.0f, scale, minimum);
        for (int kk = 0; kk < 16; ++kk)
          for (int j = 0; j < 2; ++j) {
            const float code = static_cast<float>(code_at(s, kb * kDepth + 2 * kk + j, c, n));
            const float v = s.mins ? std::fma(code, scale, minimum) : code * scale;
            panel[((kb * 2 + c) * 16 + kk) * kPanel + n * 2 + j] = float_to_bf16(v);
          }
      }
  }
}

// ---- the AVX-512 dequantization ----

#ifdef BATCHSERVE_AMX_DEQUANT_AVX512
// a column block's 16 values of group g
__m512 values_of(const void* values, bool half, int64_t at) {
  if (half) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                   static_cast<const uint16_t*>(values) + at)));
  return _mm512_loadu_ps(static_cast<const float*>(values) + at);
}

// One B tile row: the values of two k (codes a and b, as int32 lanes = columns) interleaved per column.
inline void write_tile_row(__m512i a, __m512i b, __m512 scale, __m512 minimum, bool with_mins, uint16_t* row) {
  const __m512 fa = _mm512_cvtepi32_ps(a), fb = _mm512_cvtepi32_ps(b);
  const __m512 va = with_mins ? _mm512_fmadd_ps(fa, scale, minimum) : _mm512_mul_ps(fa, scale);
  const __m512 vb = with_mins ? _mm512_fmadd_ps(fb, scale, minimum) : _mm512_mul_ps(fb, scale);
  // cvtne2ps puts vb's 16 values above va's; the permutation takes them pairwise: [n][j]
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21,
                                       5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(vb, va));
  _mm512_storeu_si512(row, _mm512_permutexvar_epi16(idx, both));
}

// byte i of each int32 lane, sign-extended (8 bits: the code, once the offset's top bit is flipped)
template <int I>
inline __m512i signed_byte(__m512i v) {
  return _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * I), 24);
}

// the low or high nibble of byte `Byte` of each int32 lane, minus 8: a 4-bit code
template <int Byte, bool High>
inline __m512i nibble_code(__m512i v) {
  const __m512i nib = _mm512_and_si512(_mm512_srli_epi32(v, 8 * Byte + (High ? 4 : 0)), _mm512_set1_epi32(15));
  return _mm512_sub_epi32(nib, _mm512_set1_epi32(8));
}

void dequantize_pair_avx512(const PairSource& s, int64_t K, uint16_t* panel) {
  const bool with_mins = s.mins != nullptr;
  for (int64_t kb = 0; kb < K / kDepth; ++kb) {
    const int64_t g = kb * kDepth / s.group;
    for (int c = 0; c < 2; ++c) {
      const int64_t at = column_values(s.pair, s.groups, g, c);
      const __m512 scale = values_of(s.scales, s.half_values, at);
      __m512 minimum = with_mins ? values_of(s.mins, s.half_values, at) : _mm512_setzero_ps();
      if (with_mins && s.add_eight_scales) minimum = _mm512_fmadd_ps(_mm512_set1_ps(8.0f), scale, minimum);
      uint16_t* tile = panel + (kb * 2 + c) * 16 * kPanel;
      if (s.bits == 8) {  // vector q: k = 4q..4q+3, rows 2q (k % 4 = 0, 1) and 2q + 1 (2, 3)
        for (int q = 0; q < 8; ++q) {
          const __m512i v = _mm512_xor_si512(
              _mm512_loadu_si512(s.codes + ((kb * 8 + q) * 2 + c) * kVector), _mm512_set1_epi8(static_cast<char>(0x80)));
          write_tile_row(signed_byte<0>(v), signed_byte<1>(v), scale, minimum, with_mins, tile + 2 * q * kPanel);
          write_tile_row(signed_byte<2>(v), signed_byte<3>(v), scale, minimum, with_mins, tile + (2 * q + 1) * kPanel);
        }
      } else {  // vector p: low nibbles k = 4p..4p+3 (rows 2p, 2p + 1), high ones k = 16 + 4p.. (rows 8 + 2p, 9 + 2p)
        for (int p = 0; p < 4; ++p) {
          const __m512i v = _mm512_loadu_si512(s.codes + ((kb * 4 + p) * 2 + c) * kVector);
          write_tile_row(nibble_code<0, false>(v), nibble_code<1, false>(v), scale, minimum, with_mins,
                         tile + 2 * p * kPanel);
          write_tile_row(nibble_code<2, false>(v), nibble_code<3, false>(v), scale, minimum, with_mins,
                         tile + (2 * p + 1) * kPanel);
          write_tile_row(nibble_code<0, true>(v), nibble_code<1, true>(v), scale, minimum, with_mins,
                         tile + (8 + 2 * p) * kPanel);
          write_tile_row(nibble_code<2, true>(v), nibble_code<3, true>(v), scale, minimum, with_mins,
                         tile + (9 + 2 * p) * kPanel);
        }
      }
    }
  }
}
#endif

bool dequantizes_in_avx512() {
#ifdef BATCHSERVE_AMX_DEQUANT_AVX512
  return cpu_runs(Isa::kAvx512Bf16);
#else
  return false;
#endif
}

void dequantize_pair(const PairSource& s, int64_t K, uint16_t* panel, bool vectorized) {
#ifdef BATCHSERVE_AMX_DEQUANT_AVX512
  if (vectorized) return dequantize_pair_avx512(s, K, panel);
#endif
  dequantize_pair_scalar(s, K, panel);
}

// ---- the GEMM ----

struct AmxArgs {
  const QuantWeight* w;
  const uint16_t* x;     // [M, K] bf16
  const uint16_t* tail;  // the last M % 32 rows copied into a zeroed [32, K] block, or null
  int64_t K, N, full_blocks, tail_rows;
};

// row r (0-31) of a finished 32 x 32 output block: the pair's columns that exist
template <class Tiles, typename OutT>
inline void write_output_row(const float (*c)[16][16], int64_t r, int64_t width, OutT* out) {
  const int t = static_cast<int>(r / 16) * 2;
  if constexpr (std::is_same_v<OutT, float>) {
    std::memcpy(out, c[t][r % 16], std::min<int64_t>(width, 16) * sizeof(float));
    if (width > 16) std::memcpy(out + 16, c[t + 1][r % 16], (width - 16) * sizeof(float));
  } else if (width == kPanel) {
    Tiles::write_row(c[t][r % 16], c[t + 1][r % 16], nullptr, reinterpret_cast<uint16_t*>(out));
  } else {
    alignas(64) uint16_t row[kPanel];
    Tiles::write_row(c[t][r % 16], c[t + 1][r % 16], nullptr, row);
    std::memcpy(out, row, width * sizeof(uint16_t));
  }
}

// Pairs [p0, p1): each dequantized into `panel`, then every row block over it (StreamA: the rows pass through L1
// without evicting the panel's K blocks, where there is more than one row block).
template <class Tiles, bool StreamA, typename OutT>
__attribute__((always_inline)) inline void pairs_on_tiles(const AmxArgs& a, int64_t p0, int64_t p1, uint16_t* panel,
                                                          bool vectorized, OutT* out) {
  Tiles::configure();
  alignas(64) float c[4][16][16];
  const int64_t kblocks = a.K / kDepth, blocks = a.full_blocks + (a.tail_rows > 0);
  for (int64_t p = p0; p < p1; ++p) {
    dequantize_pair(source_of(*a.w, p), a.K, panel, vectorized);
    const int64_t width = std::min<int64_t>(kPanel, a.N - p * kPanel);
    const char* b_tiles = reinterpret_cast<const char*>(panel);
    for (int64_t b = 0; b < blocks; ++b) {
      const uint16_t* rows = b < a.full_blocks ? a.x + b * kBlockRows * a.K : a.tail;
      Tiles::zero_c();
      for (int64_t kb = 0; kb < kblocks; ++kb) {
        Tiles::template load_a<StreamA>(rows + kb * kDepth, a.K * 2);
        Tiles::load_b(b_tiles + kb * kKBlockBytes);
        Tiles::dot_all();
      }
      Tiles::store_c(c);
      const int64_t n_rows = b < a.full_blocks ? kBlockRows : a.tail_rows;
      for (int64_t r = 0; r < n_rows; ++r)
        write_output_row<Tiles>(c, r, width, out + (b * kBlockRows + r) * a.N + p * kPanel);
    }
  }
  Tiles::release();
}

#ifdef BATCHSERVE_AMX
template <typename OutT>
AMX_TARGET __attribute__((flatten, noinline)) void amx_pairs_streaming(const AmxArgs& a, int64_t p0, int64_t p1,
                                                                      uint16_t* panel, bool vectorized, OutT* out) {
  pairs_on_tiles<AmxTiles, true>(a, p0, p1, panel, vectorized, out);
}
template <typename OutT>
AMX_TARGET __attribute__((flatten, noinline)) void amx_pairs_cached(const AmxArgs& a, int64_t p0, int64_t p1,
                                                                   uint16_t* panel, bool vectorized, OutT* out) {
  pairs_on_tiles<AmxTiles, false>(a, p0, p1, panel, vectorized, out);
}
#endif

template <typename OutT>
void pairs_of(const AmxArgs& a, int64_t p0, int64_t p1, uint16_t* panel, OutT* out) {
  const bool vectorized = dequantizes_in_avx512();
#ifdef BATCHSERVE_AMX
  if (!a.w->amx_emulated) {
    if (a.full_blocks + (a.tail_rows > 0) > 1) return amx_pairs_streaming(a, p0, p1, panel, vectorized, out);
    return amx_pairs_cached(a, p0, p1, panel, vectorized, out);
  }
#endif
  pairs_on_tiles<EmulatedTiles, false>(a, p0, p1, panel, vectorized, out);
}

}  // namespace

bool quant_amx_available() {
#ifdef BATCHSERVE_AMX
  return amx_permitted();
#else
  return false;
#endif
}

bool quant_amx_takes(const QuantWeight& w, const at::Tensor& x) {
  return w.amx_min_m > 0 && x.size(0) >= w.amx_min_m && x.scalar_type() == at::kBFloat16 &&
         w.w8a8_codes.defined() && (w.amx_emulated || quant_amx_available());
}

void quant_amx_gemm(const at::Tensor& x, const QuantWeight& w, const at::Tensor& out) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && x.scalar_type() == at::kBFloat16 &&
                  x.size(1) == w.in_features && out.size(0) == x.size(0) && out.size(1) == w.out_features,
              "quant_amx: x [M, in_features] bf16 and out [M, out_features], contiguous");
  TORCH_CHECK(w.w8a8_codes.defined(), "quant_amx: the weight is not packed (W8A8's layout)");
  const int64_t M = x.size(0), K = w.in_features, N = w.out_features;
  if (M == 0) return;
  const int64_t full_blocks = M / kBlockRows, tail_rows = M % kBlockRows;
  at::Tensor tail;
  if (tail_rows) {
    tail = at::zeros({kBlockRows, K}, x.options());
    tail.narrow(0, 0, tail_rows).copy_(x.narrow(0, full_blocks * kBlockRows, tail_rows));
  }
  const AmxArgs a{&w, reinterpret_cast<const uint16_t*>(x.data_ptr()),
                  tail_rows ? reinterpret_cast<const uint16_t*>(tail.data_ptr()) : nullptr, K, N, full_blocks,
                  tail_rows};
  at::parallel_for(0, w8a8::column_pairs(N), 1, [&](int64_t p0, int64_t p1) {
    auto panel = at::empty({K * kPanel}, at::kBFloat16);  // this thread's dequantized pair: K x 32 bf16
    auto* buffer = reinterpret_cast<uint16_t*>(panel.data_ptr());
    if (out.scalar_type() == at::kBFloat16) {
      pairs_of(a, p0, p1, buffer, out.data_ptr<c10::BFloat16>());
    } else {
      pairs_of(a, p0, p1, buffer, out.data_ptr<float>());
    }
  });
}

at::Tensor quant_amx_panels(const QuantWeight& w, bool vectorized) {
  TORCH_CHECK(w.w8a8_codes.defined(), "quant_amx: the weight is not packed (W8A8's layout)");
  TORCH_CHECK(!vectorized || dequantizes_in_avx512(), "quant_amx: no AVX-512 dequantization on this CPU or build");
  const int64_t K = w.in_features, pairs = w8a8::column_pairs(w.out_features);
  auto panels = at::empty({pairs, K / kDepth, 2, 16, kPanel}, at::kBFloat16);
  auto* out = reinterpret_cast<uint16_t*>(panels.data_ptr());
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) dequantize_pair(source_of(w, p), K, out + p * K * kPanel, vectorized);
  });
  return panels;
}

bool quant_amx_vectorized() { return dequantizes_in_avx512(); }
