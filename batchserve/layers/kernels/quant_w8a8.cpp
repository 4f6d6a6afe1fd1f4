// W8A8 with AVX512-VNNI: x [M, K] (float32 or bf16) @ a weight kept quantized (quant_gemm.h) -> float32 or bf16, the
// activations quantized to int8 per row and block of k, the products summed in int32 by vpdpbusd (u8 x s8, 64 multiply-adds an instruction).
//
// Why: above a few rows the weight-only path either widens every code again per row block or dequantizes the whole
// weight into tiles every step; here the codes are multiplied as integers, the float work is one conversion and one
// FMA per span of k. The weight is repacked once, at load (w8a8_pack), so that one 64-byte load holds 4 consecutive k
// of 16 output columns, the operand vpdpbusd wants:
//   8 bits: [N / 16][K / 4][16 columns][4 k] uint8 = code + 128;
//   4 bits: [N / 16][K / 32][4][16 columns][4 k] uint8: vector p of a 32-k subblock holds k = 4p..4p+3 in its low
//           nibbles and k = 16+4p..16+4p+3 in its high ones, the stored nibble (code + 8).
// The weights are the unsigned operand (offset 128 or 8), the activations the signed one (-127..127), so what the
// offset adds is the same for every column: it is taken out per row and weight group, in float, and the int32 sums
// start at zero (no register but a zeroed one enters the inner loop). A row's result depends only on that row (one
// order per row, whatever M). Rows go in chunks whose codes stay in L2 while every column block reads them.
#include "quant_gemm.h"
#include "vec_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define BATCHSERVE_W8A8 1
#endif

namespace {

constexpr int64_t kCols = 16;  // output columns per packed block: one zmm of int32
constexpr int kRows = 6;       // rows sharing one load of the packed weight

int64_t column_blocks(int64_t N) { return (N + kCols - 1) / kCols; }
// bytes of one packed block of 16 columns: K codes each, 8 or 4 bits
int64_t block_bytes(int64_t K, int64_t bits) { return K * kCols * bits / 8; }

// [N, G] float32 -> [N / 16][G][16] (zero-padded columns)
at::Tensor pack_columns(const at::Tensor& per_group) {
  const int64_t N = per_group.size(0), G = per_group.size(1), blocks = column_blocks(N);
  auto padded = at::zeros({blocks * kCols, G}, at::kFloat);
  padded.narrow(0, 0, N).copy_(per_group);
  return padded.view({blocks, kCols, G}).transpose(1, 2).contiguous();
}

// code k of a row of packed int4 (GGUF Q4_0's order: byte j of a subblock holds k = j low, k = j + 16 high)
uint8_t nibble_at(const uint8_t* row, int64_t k) {
  const int64_t sub = k / 32, j = k % 32;
  const uint8_t byte = row[sub * 16 + (j & 15)];
  return j < 16 ? (byte & 15) : (byte >> 4);
}

}  // namespace

bool w8a8_supported(const QuantWeight& w) { return w.group % 32 == 0 && w.in_features % 32 == 0; }

void w8a8_pack(QuantWeight& w) {
  const int64_t N = w.out_features, K = w.in_features, blocks = column_blocks(N);
  auto packed = at::zeros({blocks * block_bytes(K, w.bits)}, at::kByte);
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const auto* codes = static_cast<const uint8_t*>(w.codes.data_ptr());
  const int64_t row_bytes = w.bits == 8 ? K : K / 2;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      uint8_t* block = dst + b * block_bytes(K, w.bits);
      for (int64_t c = 0; c < kCols && b * kCols + c < N; ++c) {
        const uint8_t* row = codes + (b * kCols + c) * row_bytes;
        for (int64_t k = 0; k < K; ++k) {
          if (w.bits == 8) {
            block[(k / 4) * 64 + c * 4 + k % 4] = static_cast<uint8_t>(row[k] ^ 0x80);  // int8 code + 128
          } else {
            const int64_t sub = k / 32, j = k % 32, p = (j % 16) / 4, i = j % 4;
            uint8_t& byte = block[sub * 256 + p * 64 + c * 4 + i];
            byte |= static_cast<uint8_t>(nibble_at(row, k) << (j < 16 ? 0 : 4));
          }
        }
      }
    }
  });
  w.w8a8_codes = packed;
  w.w8a8_scales = pack_columns(w.scales);
  w.w8a8_mins = w.mins.defined() ? pack_columns(w.mins) : at::Tensor();
}

#if defined(BATCHSERVE_W8A8)
namespace {

constexpr int64_t kChunkBytes = 192 * 1024;  // a pass's activation codes (rows x K bytes): they stay in L2

// The activations quantized: int8 codes [M, K], a scale per row and block of k [M, K / block], per row and weight
// group the offset's share [M, K / group] (-offset x the group's codes times their scales, summed: what the offset
// adds to every column's int32 sums, taken out once in float), and with minimums each group's float sum.
struct QuantizedRows {
  at::Tensor codes, scales, offset_shares, group_sums;
};

struct RowShape {
  int64_t K, block, group;
  int32_t offset;
};

template <typename T>
void quantize_row(const T* xr, const RowShape& s, int8_t* codes, float* scales, float* shares, float* gsums) {
  std::fill(shares, shares + s.K / s.group, 0.0f);
  for (int64_t b0 = 0; b0 < s.K; b0 += s.block) {
    __m512 mx = _mm512_setzero_ps();
    for (int64_t k = b0; k < b0 + s.block; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(load16(xr + k)));
    const float amax = _mm512_reduce_max_ps(mx), scale = amax / 127.0f;
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    scales[b0 / s.block] = scale;
    for (int64_t k = b0; k < b0 + s.block; k += 16) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(xr + k), inv));  // nearest, ties even; |q| <= 127
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + k), _mm512_cvtsepi32_epi8(q));
      shares[k / s.group] -= static_cast<float>(s.offset) * scale * static_cast<float>(_mm512_reduce_add_epi32(q));
    }
  }
  for (int64_t g = 0; gsums != nullptr && g < s.K / s.group; ++g) {
    __m512 total = _mm512_setzero_ps();
    for (int64_t k = g * s.group; k < (g + 1) * s.group; k += 16) total = _mm512_add_ps(total, load16(xr + k));
    gsums[g] = _mm512_reduce_add_ps(total);
  }
}

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t M, const RowShape& s, bool with_group_sums) {
  QuantizedRows q;
  q.codes = at::empty({M, s.K}, at::kChar);
  q.scales = at::empty({M, s.K / s.block}, at::kFloat);
  q.offset_shares = at::empty({M, s.K / s.group}, at::kFloat);
  q.group_sums = with_group_sums ? at::empty({M, s.K / s.group}, at::kFloat) : at::Tensor();
  auto* codes = q.codes.data_ptr<int8_t>();
  float *scales = q.scales.data_ptr<float>(), *shares = q.offset_shares.data_ptr<float>();
  float* gsums = with_group_sums ? q.group_sums.data_ptr<float>() : nullptr;
  const int64_t blocks = s.K / s.block, groups = s.K / s.group;
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      quantize_row(x + m * s.K, s, codes + m * s.K, scales + m * blocks, shares + m * groups,
                   gsums == nullptr ? nullptr : gsums + m * groups);
  });
  return q;
}

struct Operands {
  const uint8_t* codes;        // packed
  const float *scales, *mins;  // packed [N / 16][G][16]
  const int8_t* xq;
  const float *xs, *shares, *xg;  // [M, K / block], [M, K / group], [M, K / group]
  int64_t M, K, N, group, block, span;
};

// acc += u8 x s8 products, 4 a lane. In inline assembly: for the intrinsic, GCC 12 keeps each accumulator in two
// registers across a loop and copies it there and back every iteration, as many moves as multiply-adds.
inline void dpbusd(__m512i& acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
}

inline __m512i broadcast_quad(const int8_t* p) {
  int32_t quad;
  std::memcpy(&quad, p, 4);
  return _mm512_set1_epi32(quad);
}

// acc[r][c] += the int32 products over k in [s0, s0 + span) of row r (x + r * K) and the 16 columns of column block
// c (w + c * stride); one weight vector serves R rows, one activation broadcast C blocks
template <int Bits, int R, int C>
inline void span_products(const uint8_t* w, int64_t stride, const int8_t* x, int64_t K, int64_t s0, int64_t span,
                          __m512i (&acc)[R][C]) {
  if constexpr (Bits == 8) {
    w += s0 * kCols;
    for (int64_t k = s0; k < s0 + span; k += 4, w += 64) {
      __m512i wv[C];
      for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_si512(w + c * stride);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = broadcast_quad(x + r * K + k);
        for (int c = 0; c < C; ++c) dpbusd(acc[r][c], wv[c], xv);
      }
    }
  } else if (span == 16) {  // half a subblock: its low nibbles (k 0..15) or its high ones (k 16..31)
    const __m512i low = _mm512_set1_epi8(0x0F);
    const int shift = s0 % 32 == 0 ? 0 : 4;
    w += (s0 / 32) * 32 * kCols / 2;
    for (int p = 0; p < 4; ++p, w += 64) {
      __m512i nib[C];
      for (int c = 0; c < C; ++c)
        nib[c] = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(w + c * stride), shift), low);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = broadcast_quad(x + r * K + s0 + 4 * p);
        for (int c = 0; c < C; ++c) dpbusd(acc[r][c], nib[c], xv);
      }
    }
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F);
    w += s0 * kCols / 2;
    for (int64_t k = s0; k < s0 + span; k += 32) {
      for (int p = 0; p < 4; ++p, w += 64) {
        __m512i lo[C], hi[C];
        for (int c = 0; c < C; ++c) {
          const __m512i v = _mm512_loadu_si512(w + c * stride);
          lo[c] = _mm512_and_si512(v, low);
          hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        for (int r = 0; r < R; ++r) {
          const __m512i xlo = broadcast_quad(x + r * K + k + 4 * p), xhi = broadcast_quad(x + r * K + k + 16 + 4 * p);
          for (int c = 0; c < C; ++c) {
            dpbusd(acc[r][c], lo[c], xlo);
            dpbusd(acc[r][c], hi[c], xhi);
          }
        }
      }
    }
  }
}

// out[m0 + r][the 16 columns of each of C blocks from b] for R rows. Per weight group, a float sum starts at the
// row's offset share and takes each span's int32 sums times the span's activation scale; Grouped: each group's sum
// times the group's column scales (and its minimums times the row's group sum) is added up, else (one group, no
// minimums: int8 per channel) the one sum is scaled at the end.
template <int Bits, bool Grouped, int R, int C, typename OutT>
void row_tile(const Operands& o, int64_t b, int64_t m0, OutT* out) {
  const int64_t groups = o.K / o.group, blocks = o.K / o.block, stride = block_bytes(o.K, Bits);
  const uint8_t* w = o.codes + b * stride;
  const int8_t* x = o.xq + m0 * o.K;
  __m512 total[R][C], part[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) total[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int r = 0; r < R; ++r) {
      const __m512 share = _mm512_set1_ps(o.shares[(m0 + r) * groups + g]);
      for (int c = 0; c < C; ++c) part[r][c] = share;
    }
    for (int64_t s0 = g * o.group; s0 < (g + 1) * o.group; s0 += o.span) {
      __m512i acc[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_si512();
      span_products<Bits, R, C>(w, stride, x, o.K, s0, o.span, acc);
      for (int r = 0; r < R; ++r) {
        const __m512 xs = _mm512_set1_ps(o.xs[(m0 + r) * blocks + s0 / o.block]);
        for (int c = 0; c < C; ++c) part[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), xs, part[r][c]);
      }
    }
    if constexpr (Grouped) {
      for (int c = 0; c < C; ++c) {
        const __m512 sw = _mm512_loadu_ps(o.scales + ((b + c) * groups + g) * kCols);
        for (int r = 0; r < R; ++r) total[r][c] = _mm512_fmadd_ps(part[r][c], sw, total[r][c]);
      }
      if (o.mins != nullptr) {
        for (int c = 0; c < C; ++c) {
          const __m512 mn = _mm512_loadu_ps(o.mins + ((b + c) * groups + g) * kCols);
          for (int r = 0; r < R; ++r)
            total[r][c] = _mm512_fmadd_ps(mn, _mm512_set1_ps(o.xg[(m0 + r) * groups + g]), total[r][c]);
        }
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    const int64_t n0 = (b + c) * kCols, width = std::min<int64_t>(kCols, o.N - n0);
    const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1);
    const __m512 sw = _mm512_loadu_ps(o.scales + (b + c) * kCols);  // Grouped: unused
    for (int r = 0; r < R; ++r)
      store16(out + (m0 + r) * o.N + n0, Grouped ? total[r][c] : _mm512_mul_ps(part[r][c], sw), mask);
  }
}

// rows [m0, m1) of C column blocks from b, in tiles of up to kRows(Grouped) rows
template <int Bits, bool Grouped, int C, typename OutT>
void rows_of(const Operands& o, int64_t b, int64_t m0, int64_t m1, OutT* out) {
  constexpr int kMost = Grouped ? 4 : 6;  // int32 sums, float sums (and totals) of a tile fit the 32 registers
  for (int64_t m = m0; m < m1; m += kMost) {
    switch (std::min<int64_t>(kMost, m1 - m)) {
      case 1: row_tile<Bits, Grouped, 1, C>(o, b, m, out); break;
      case 2: row_tile<Bits, Grouped, 2, C>(o, b, m, out); break;
      case 3: row_tile<Bits, Grouped, 3, C>(o, b, m, out); break;
      case 4: row_tile<Bits, Grouped, 4, C>(o, b, m, out); break;
      case 5: row_tile<Bits, Grouped, Grouped ? 4 : 5, C>(o, b, m, out); break;  // Grouped: never 5 or 6
      default: row_tile<Bits, Grouped, Grouped ? 4 : 6, C>(o, b, m, out); break;
    }
  }
}

// Threads split (row chunk, column pair) items, chunk by chunk: a chunk's codes are read from L2 by every pair.
// Pair p: column blocks 2p and 2p + 1 (the last alone where their count is odd).
template <int Bits, bool Grouped, typename OutT>
void all_tiles(const Operands& o, OutT* out) {
  const int64_t blocks = column_blocks(o.N), pairs = (blocks + 1) / 2;
  const int64_t chunk = std::max<int64_t>(12, kChunkBytes / o.K / 12 * 12), chunks = (o.M + chunk - 1) / chunk;
  at::parallel_for(0, chunks * pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m0 = (i / pairs) * chunk, m1 = std::min(o.M, m0 + chunk), b = 2 * (i % pairs);
      if (b + 1 < blocks) {
        rows_of<Bits, Grouped, 2>(o, b, m0, m1, out);
      } else {
        rows_of<Bits, Grouped, 1>(o, b, m0, m1, out);
      }
    }
  });
}

template <typename InT, typename OutT>
void w8a8_typed(const InT* x, int64_t M, const QuantWeight& w, OutT* out) {
  const int64_t K = w.in_features;
  // the activations' block: w.act_block (0: the whole row), never across a weight group's edge; a span (k summed in
  // int32) is 16 k or whole 32-k subblocks
  const int64_t block = w.act_block > 0 && w.act_block < K ? w.act_block : K;
  TORCH_CHECK(K % block == 0 && (w.group % block == 0 || block % w.group == 0), "w8a8: activation block ", block,
              " does not tile K = ", K, " and group ", w.group);
  const int64_t span = std::min(block, w.group);
  TORCH_CHECK(span == 16 || span % 32 == 0, "w8a8: a span of ", span, " k");
  const bool has_mins = w.w8a8_mins.defined();
  const RowShape shape{K, block, w.group, w.bits == 8 ? 128 : 8};
  const QuantizedRows q = quantize_rows(x, M, shape, has_mins);
  Operands o{};
  o.codes = w.w8a8_codes.data_ptr<uint8_t>();
  o.scales = w.w8a8_scales.data_ptr<float>();
  o.mins = has_mins ? w.w8a8_mins.data_ptr<float>() : nullptr;
  o.xq = q.codes.data_ptr<int8_t>();
  o.xs = q.scales.data_ptr<float>();
  o.shares = q.offset_shares.data_ptr<float>();
  o.xg = has_mins ? q.group_sums.data_ptr<float>() : nullptr;
  o.M = M, o.K = K, o.N = w.out_features, o.group = w.group, o.block = block, o.span = span;
  const bool grouped = K / w.group > 1 || has_mins;
  if (w.bits == 8) {
    grouped ? all_tiles<8, true>(o, out) : all_tiles<8, false>(o, out);
  } else {
    grouped ? all_tiles<4, true>(o, out) : all_tiles<4, false>(o, out);
  }
}

template <typename InT>
void w8a8_to(const InT* x, int64_t M, const QuantWeight& w, const at::Tensor& out) {
  if (out.scalar_type() == at::kBFloat16) {
    w8a8_typed(x, M, w, out.data_ptr<c10::BFloat16>());
  } else {
    w8a8_typed(x, M, w, out.data_ptr<float>());
  }
}

}  // namespace

bool w8a8_built() { return true; }

void w8a8_gemm(const at::Tensor& x, const QuantWeight& w, const at::Tensor& out) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && out.size(0) == x.size(0) &&
                  out.size(1) == w.out_features && x.size(1) == w.in_features,
              "w8a8: x [M, in_features] and out [M, out_features], contiguous");
  if (x.scalar_type() == at::kBFloat16) {
    w8a8_to(x.data_ptr<c10::BFloat16>(), x.size(0), w, out);
  } else {
    w8a8_to(x.data_ptr<float>(), x.size(0), w, out);
  }
}

#else

bool w8a8_built() { return false; }

void w8a8_gemm(const at::Tensor&, const QuantWeight&, const at::Tensor&) {
  TORCH_CHECK(false, "w8a8: not built here (needs AVX512-VNNI)");
}

#endif
