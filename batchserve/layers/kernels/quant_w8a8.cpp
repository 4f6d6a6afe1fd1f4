// W8A8 with AVX512-VNNI: x [M, K] float32 @ a weight kept quantized (quant_gemm.h), the activations quantized to int8
// per row and block of k, the products summed in int32 by vpdpbusd (u8 x s8, 64 multiply-adds an instruction).
//
// Why: above a few rows the weight-only path either widens every code again per row block or dequantizes the whole
// weight into tiles every step; here the codes are multiplied as integers, the float work is one conversion and one
// FMA per span of k. The weight is repacked once, at load (w8a8_pack), so that one 64-byte load holds 4 consecutive k
// of 16 output columns, the operand vpdpbusd wants:
//   8 bits: [N / 16][K / 4][16 columns][4 k] uint8 = code + 128;
//   4 bits: [N / 16][K / 32][4][16 columns][4 k] uint8: vector p of a 32-k subblock holds k = 4p..4p+3 in its low
//           nibbles and k = 16+4p..16+4p+3 in its high ones, the stored nibble (code + 8).
// The weights are the unsigned operand (offset 128 or 8), the activations the signed one (-127..127), so the offset
// is removed per row, not per column: a span's int32 sum starts at -offset * (the row's codes summed over the span).
// A row's result depends only on that row (one order per row, whatever M).
#include "quant_gemm.h"

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

// One row's activations as int8 codes, per block of `block` k a scale (largest magnitude / 127), and per span of
// `span` k the codes' sum times the weights' offset (what the span's int32 sum starts from, negated).
struct QuantizedRows {
  at::Tensor codes, scales, offset_sums, group_sums;
};

QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K, int64_t block, int64_t span, int32_t offset,
                            int64_t group, bool with_group_sums) {
  QuantizedRows q;
  q.codes = at::empty({M, K}, at::kChar);
  q.scales = at::empty({M, K / block}, at::kFloat);
  q.offset_sums = at::empty({M, K / span}, at::kInt);
  q.group_sums = with_group_sums ? at::empty({M, K / group}, at::kFloat) : at::Tensor();
  auto* codes = q.codes.data_ptr<int8_t>();
  float* scales = q.scales.data_ptr<float>();
  int32_t* sums = q.offset_sums.data_ptr<int32_t>();
  float* gsums = with_group_sums ? q.group_sums.data_ptr<float>() : nullptr;
  at::parallel_for(0, M, 4, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* xr = x + m * K;
      for (int64_t b0 = 0; b0 < K; b0 += block) {
        __m512 mx = _mm512_setzero_ps();
        for (int64_t k = b0; k < b0 + block; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(xr + k)));
        const float amax = _mm512_reduce_max_ps(mx);
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        scales[m * (K / block) + b0 / block] = amax / 127.0f;
        const __m512 vinv = _mm512_set1_ps(inv);
        for (int64_t k = b0; k < b0 + block; k += 16) {
          const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xr + k), vinv));  // nearest, ties even
          _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + m * K + k), _mm512_cvtsepi32_epi8(qi));
        }
      }
      for (int64_t s0 = 0; s0 < K; s0 += span) {
        int32_t total = 0;
        for (int64_t k = s0; k < s0 + span; ++k) total += codes[m * K + k];
        sums[m * (K / span) + s0 / span] = -offset * total;
      }
      for (int64_t g = 0; gsums != nullptr && g < K / group; ++g) {
        float total = 0.0f;  // in k order, as the weight-only path's group sums
        for (int64_t k = g * group; k < (g + 1) * group; ++k) total += xr[k];
        gsums[m * (K / group) + g] = total;
      }
    }
  });
  return q;
}

struct Operands {
  const uint8_t* codes;  // packed
  const float *scales, *mins;  // packed [N / 16][G][16]
  const int8_t* xq;
  const float *xs, *xg;  // activation scales [M, K / block], float group sums [M, K / group]
  const int32_t* off;    // [M, K / span]
  int64_t M, K, N, group, block, span;
  int bits;
};

// the int32 products of one span of k for R rows and the 16 columns of each of C blocks from b (acc[r * C + c]): a
// weight vector serves R rows, an activation broadcast C blocks
template <int Bits, int R, int C>
inline void span_products(const Operands& o, int64_t b, int64_t m0, int64_t s0, __m512i* acc) {
  const int8_t* x = o.xq + m0 * o.K;
  const int64_t stride = block_bytes(o.K, Bits);
  if constexpr (Bits == 8) {
    const uint8_t* wp = o.codes + b * stride + s0 * kCols;
    for (int64_t k = s0; k < s0 + o.span; k += 4, wp += 64) {
      __m512i wv[C];
      for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_si512(wp + c * stride);
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, x + r * o.K + k, 4);
        const __m512i xv = _mm512_set1_epi32(quad);
        for (int c = 0; c < C; ++c) acc[r * C + c] = _mm512_dpbusd_epi32(acc[r * C + c], wv[c], xv);
      }
    }
  } else if (o.span == 16) {  // half a subblock: its low nibbles (k 0..15) or its high ones (k 16..31)
    const __m512i low = _mm512_set1_epi8(0x0F);
    const uint8_t* wp = o.codes + b * stride + (s0 / 32) * 32 * kCols / 2;
    const bool high = s0 % 32 != 0;
    for (int p = 0; p < 4; ++p, wp += 64) {
      __m512i nib[C];
      for (int c = 0; c < C; ++c) {
        const __m512i v = _mm512_loadu_si512(wp + c * stride);
        nib[c] = _mm512_and_si512(high ? _mm512_srli_epi16(v, 4) : v, low);
      }
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, x + r * o.K + s0 + 4 * p, 4);
        const __m512i xv = _mm512_set1_epi32(quad);
        for (int c = 0; c < C; ++c) acc[r * C + c] = _mm512_dpbusd_epi32(acc[r * C + c], nib[c], xv);
      }
    }
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const uint8_t* wp = o.codes + b * stride + s0 * kCols / 2;
    for (int64_t k = s0; k < s0 + o.span; k += 32) {
      for (int p = 0; p < 4; ++p, wp += 64) {
        __m512i lo[C], hi[C];
        for (int c = 0; c < C; ++c) {
          const __m512i v = _mm512_loadu_si512(wp + c * stride);
          lo[c] = _mm512_and_si512(v, low);
          hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        for (int r = 0; r < R; ++r) {
          int32_t qlo, qhi;
          std::memcpy(&qlo, x + r * o.K + k + 4 * p, 4);
          std::memcpy(&qhi, x + r * o.K + k + 16 + 4 * p, 4);
          const __m512i xlo = _mm512_set1_epi32(qlo), xhi = _mm512_set1_epi32(qhi);
          for (int c = 0; c < C; ++c) {
            acc[r * C + c] = _mm512_dpbusd_epi32(acc[r * C + c], lo[c], xlo);
            acc[r * C + c] = _mm512_dpbusd_epi32(acc[r * C + c], hi[c], xhi);
          }
        }
      }
    }
  }
}

// out[m0 + r][the 16 columns of each of C blocks from b] for R rows
template <int Bits, int R, int C>
void row_tile(const Operands& o, int64_t b, int64_t m0, float* out) {
  const int64_t groups = o.K / o.group, blocks = o.K / o.block, spans = o.K / o.span;
  const bool per_channel = groups == 1 && o.mins == nullptr;  // one scale a column: applied after the last span
  __m512 accf[R * C];
  for (int i = 0; i < R * C; ++i) accf[i] = _mm512_setzero_ps();
  for (int64_t s = 0; s < spans; ++s) {
    const int64_t s0 = s * o.span, g = s0 / o.group, a = s0 / o.block;
    __m512i acc[R * C];
    for (int r = 0; r < R; ++r) {
      const __m512i start = _mm512_set1_epi32(o.off[(m0 + r) * spans + s]);
      for (int c = 0; c < C; ++c) acc[r * C + c] = start;
    }
    span_products<Bits, R, C>(o, b, m0, s0, acc);
    if (per_channel) {
      for (int r = 0; r < R; ++r) {
        const __m512 xs = _mm512_set1_ps(o.xs[(m0 + r) * blocks + a]);
        for (int c = 0; c < C; ++c)
          accf[r * C + c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r * C + c]), xs, accf[r * C + c]);
      }
    } else {
      __m512 sw[C];
      for (int c = 0; c < C; ++c) sw[c] = _mm512_loadu_ps(o.scales + ((b + c) * groups + g) * kCols);
      for (int r = 0; r < R; ++r) {
        const __m512 xs = _mm512_set1_ps(o.xs[(m0 + r) * blocks + a]);
        for (int c = 0; c < C; ++c)
          accf[r * C + c] =
              _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r * C + c]), _mm512_mul_ps(sw[c], xs), accf[r * C + c]);
      }
    }
    if (o.mins != nullptr && (s0 + o.span) % o.group == 0) {
      for (int c = 0; c < C; ++c) {
        const __m512 mn = _mm512_loadu_ps(o.mins + ((b + c) * groups + g) * kCols);
        for (int r = 0; r < R; ++r)
          accf[r * C + c] = _mm512_fmadd_ps(mn, _mm512_set1_ps(o.xg[(m0 + r) * groups + g]), accf[r * C + c]);
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    const int64_t n0 = (b + c) * kCols, width = std::min<int64_t>(kCols, o.N - n0);
    const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1);
    const __m512 sw = per_channel ? _mm512_loadu_ps(o.scales + (b + c) * kCols) : _mm512_set1_ps(1.0f);
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(out + (m0 + r) * o.N + n0, mask, per_channel ? _mm512_mul_ps(accf[r * C + c], sw)
                                                                          : accf[r * C + c]);
  }
}

// C column blocks from b, every row in tiles of up to kRows
template <int Bits, int C>
void column_blocks_from(const Operands& o, int64_t b, float* out) {
  for (int64_t m0 = 0; m0 < o.M; m0 += kRows) {
    switch (std::min<int64_t>(kRows, o.M - m0)) {
      case 1: row_tile<Bits, 1, C>(o, b, m0, out); break;
      case 2: row_tile<Bits, 2, C>(o, b, m0, out); break;
      case 3: row_tile<Bits, 3, C>(o, b, m0, out); break;
      case 4: row_tile<Bits, 4, C>(o, b, m0, out); break;
      case 5: row_tile<Bits, 5, C>(o, b, m0, out); break;
      default: row_tile<Bits, 6, C>(o, b, m0, out); break;
    }
  }
}

// pair p: column blocks 2p and 2p + 1 (the last alone where their count is odd)
template <int Bits>
void column_pair(const Operands& o, int64_t p, float* out) {
  if (2 * p + 1 < column_blocks(o.N)) {
    column_blocks_from<Bits, 2>(o, 2 * p, out);
  } else {
    column_blocks_from<Bits, 1>(o, 2 * p, out);
  }
}

}  // namespace

bool w8a8_built() { return true; }

void w8a8_gemm(const float* x, int64_t M, const QuantWeight& w, float* out) {
  const int64_t K = w.in_features, N = w.out_features;
  // the activations' block: w.act_block (0: the whole row), never across a weight group's edge; a span (k summed in
  // int32) is 16 k or whole 32-k subblocks
  const int64_t block = w.act_block > 0 && w.act_block < K ? w.act_block : K;
  TORCH_CHECK(K % block == 0 && (w.group % block == 0 || block % w.group == 0), "w8a8: activation block ", block,
              " does not tile K = ", K, " and group ", w.group);
  const int64_t span = std::min(block, w.group);
  TORCH_CHECK(span == 16 || span % 32 == 0, "w8a8: a span of ", span, " k");
  const bool has_mins = w.w8a8_mins.defined();
  const auto q = quantize_rows(x, M, K, block, span, w.bits == 8 ? 128 : 8, w.group, has_mins);
  Operands o{};
  o.codes = w.w8a8_codes.data_ptr<uint8_t>();
  o.scales = w.w8a8_scales.data_ptr<float>();
  o.mins = has_mins ? w.w8a8_mins.data_ptr<float>() : nullptr;
  o.xq = q.codes.data_ptr<int8_t>();
  o.xs = q.scales.data_ptr<float>();
  o.xg = has_mins ? q.group_sums.data_ptr<float>() : nullptr;
  o.off = q.offset_sums.data_ptr<int32_t>();
  o.M = M, o.K = K, o.N = N, o.group = w.group, o.block = block, o.span = span, o.bits = static_cast<int>(w.bits);
  at::parallel_for(0, (column_blocks(N) + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      if (w.bits == 8) {
        column_pair<8>(o, p, out);
      } else {
        column_pair<4>(o, p, out);
      }
    }
  });
}

#else

bool w8a8_built() { return false; }

void w8a8_gemm(const float*, int64_t, const QuantWeight&, float*) {
  TORCH_CHECK(false, "w8a8: not built here (needs AVX512-VNNI)");
}

#endif
