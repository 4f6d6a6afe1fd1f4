// W8A8 with AVX512-VNNI: x [M, K] (float32 or bf16) @ a weight kept quantized (quant_gemm.h) -> float32 or bf16,
// the activations quantized to int8 per row and block of k, the products summed in int32 by vpdpbusd (u8 x s8, 64
// multiply-adds an instruction).
//
// Why: above a few rows the weight-only path either widens every code again per row block or dequantizes the whole
// weight into tiles every step; here the codes are multiplied as integers, the float work is one conversion and one
// or two FMAs per span of k. The weight is repacked once, at load (w8a8_pack), so that one 64-byte load holds 4
// consecutive k of 16 output columns, the operand vpdpbusd wants, and a tile's two blocks of 16 columns (a pair)
// lie side by side, so a pair's codes are one sequential stream (two streams a block apart ran at about two thirds
// of one's bandwidth):
//   8 bits: [N / 32][K / 4][2 blocks][16 columns][4 k] uint8 = code + 128;
//   4 bits: [N / 32][K / 32][4][2 blocks][16 columns][4 k] bytes: vector p of a 32-k subblock holds k = 4p..4p+3 in
//           its low nibbles and k = 16+4p..16+4p+3 in its high ones, the stored nibble (code + 8), so that a nibble
//           moved to a byte's top (the low half cleared) is the unsigned byte 16 x code + 128; the activations'
//           scales are divided by 16 to match.
// A grouped weight's scales (and minimums) are packed as float16 where every one of them is a float16 (GGUF's Q8_0,
// Q4_0, Q4_1 and int4's own scales), else float32: a 4-bit weight with float32 scale and minimum streams 0.75 byte a
// weight, with float16 ones 0.625. A 4-bit weight's minimum is the value at code 0 (GGUF Q4_1's m + 8d, as the other
// paths read it); where m alone is a float16 that is what is packed, and the kernel adds 8d back.
// The weights are the unsigned operand (offset 128 either way), the activations the signed one (-127..127), so the
// offset's share is a row's, not a column's: a span's int32 sums start at -128 x (the row's codes summed over the
// span) and end exact. Nothing is read per column but the codes and scales: a single row streams the weight's bytes
// only. A row's result depends only on that row (one order per row, whatever M). Rows go in chunks whose codes stay in
// L2 while every column block reads them.
#include "aten_pch.h"  // first: the precompiled torch headers (build.py)

#include "isa.h"
#include "quant_w8a8.h"
#include "vec_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#ifdef BATCHSERVE_ISA_AVX512_VNNI
#include <immintrin.h>
#define BATCHSERVE_W8A8 1
#endif

#if defined(BATCHSERVE_W8A8)
namespace {

using namespace w8a8;

// A pass's activation codes (rows x K bytes) stay in L2 while every column block reads them; at least kChunkRows rows,
// since every pass reads the whole weight again (a batch of decodes: one pass).
constexpr int64_t kChunkBytes = 192 * 1024;
constexpr int64_t kChunkRows = 96;  // a multiple of every tile's rows (6 and 4)
// Tiles of up to kPrefetchRows rows (a decode batch of one or two) stream the weight from memory: they ask for the
// bytes some way along the pairs' stream, which runs on from pair to pair (the hardware prefetcher alone left a thread
// at about two thirds of what this draws). How far and into which cache is the CPU maker's: on the Intel AMX host 3
// KiB ahead into L2 streamed a batch-1 Q4_0 weight at the rate of a plain read, 8 KiB into L1 at three quarters of it;
// on AMD (families 25 and 26) 8 KiB into L1 is the best measured and 3 KiB into L2 draws a fifth less
// (docs/quantization.md). Larger tiles spend their time multiplying and read each weight line from cache for their
// other row tiles.
constexpr int kPrefetchRows = 2;

struct StreamPrefetch {
  int64_t ahead;  // bytes along the stream
  bool into_l1;   // prefetcht0, else prefetcht1 (L2)
};

StreamPrefetch stream_prefetch_of_this_cpu() {
  __builtin_cpu_init();  // this runs at load, maybe before the runtime's own initialisation of what cpu_is reads
  if (__builtin_cpu_is("amd")) return {8192, true};
  return {3072, false};
}

const StreamPrefetch kStreamPrefetch = stream_prefetch_of_this_cpu();

constexpr int kMostRows = 6;                  // a tile's int32 sums and float sums: 24 of the 32 registers

// The activations quantized: int8 codes [M, K], a scale per row and block of k [M, K / block], per row and span
// where its int32 sums start [M, K / span] (-kOffset x the span's codes summed), and with minimums each weight
// group's float sum [M, K / group]. All four in one allocation (each part 64-byte aligned): a decode step quantizes
// rows once per projection, and one tensor a call costs less than four.
struct QuantizedRows {
  at::Tensor storage;
  int8_t* codes;
  float *scales, *group_sums;
  int32_t* starts;
};

struct RowShape {
  int64_t K, block, span, group;
  float scale_factor;  // 4-bit weights: 1 / 16 (their operand is 16 x the code)
};

template <typename T>
void quantize_row(const T* xr, const RowShape& s, int8_t* codes, float* scales, int32_t* starts, float* gsums) {
  std::fill(starts, starts + s.K / s.span, 0);
  for (int64_t b0 = 0; b0 < s.K; b0 += s.block) {
    __m512 mx = _mm512_setzero_ps();
    for (int64_t k = b0; k < b0 + s.block; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(load16(xr + k)));
    const float amax = _mm512_reduce_max_ps(mx);
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    scales[b0 / s.block] = amax / 127.0f * s.scale_factor;
    for (int64_t k = b0; k < b0 + s.block; k += 16) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(xr + k), inv));  // nearest, ties even; |q| <= 127
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + k), _mm512_cvtsepi32_epi8(q));
      starts[k / s.span] -= kOffset * _mm512_reduce_add_epi32(q);
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
  const auto aligned = [](int64_t bytes) { return (bytes + 63) / 64 * 64; };
  const int64_t code_bytes = aligned(M * s.K), scale_bytes = aligned(M * (s.K / s.block) * 4);
  const int64_t start_bytes = aligned(M * (s.K / s.span) * 4);
  const int64_t sum_bytes = with_group_sums ? aligned(M * (s.K / s.group) * 4) : 0;
  QuantizedRows q;
  q.storage = at::empty({code_bytes + scale_bytes + start_bytes + sum_bytes}, at::kByte);
  auto* base = q.storage.data_ptr<uint8_t>();
  q.codes = reinterpret_cast<int8_t*>(base);
  q.scales = reinterpret_cast<float*>(base + code_bytes);
  q.starts = reinterpret_cast<int32_t*>(base + code_bytes + scale_bytes);
  q.group_sums = with_group_sums ? reinterpret_cast<float*>(base + code_bytes + scale_bytes + start_bytes) : nullptr;
  int8_t* codes = q.codes;
  float *scales = q.scales, *gsums = q.group_sums;
  int32_t* starts = q.starts;
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      quantize_row(x + m * s.K, s, codes + m * s.K, scales + m * (s.K / s.block), starts + m * (s.K / s.span),
                   gsums == nullptr ? nullptr : gsums + m * (s.K / s.group));
  });
  return q;
}

struct Operands {
  const uint8_t* codes;        // packed
  const void *scales, *mins;   // packed [N / 32][G][2][16], float32 or float16 (the tiles' V)
  bool add_eight_scales;       // the minimums are a 4-bit weight's at nibble 0: 8 x the scale added back
  const int8_t* xq;
  const float *xs, *xg;  // [M, K / block], [M, K / group]
  const int32_t* starts;  // [M, K / span]
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

// a pair's vectors at w (one per block), asking for the bytes kStreamPrefetch.ahead along its stream where R rows
// stream it
template <int R>
inline void load_pair(const uint8_t* w, __m512i (&v)[kBlocks]) {
  for (int c = 0; c < kBlocks; ++c) {
    v[c] = _mm512_loadu_si512(w + c * kVector);
    if constexpr (R <= kPrefetchRows) {
      const uint8_t* ahead = w + c * kVector + kStreamPrefetch.ahead;
      if (kStreamPrefetch.into_l1) {
        prefetch_line<_MM_HINT_T0>(ahead);
      } else {
        prefetch_line<_MM_HINT_T1>(ahead);
      }
    }
  }
}

// One packed 4-bit vector of each block of a pair (16 columns x 4 k of a subblock) as two operands: its low nibbles
// and its high ones, each moved to the top of its byte (16 x code + 128).
template <int R>
inline void nibble_vectors(const uint8_t* w, __m512i (&lo)[kBlocks], __m512i (&hi)[kBlocks]) {
  const __m512i top = _mm512_set1_epi8(static_cast<char>(0xF0));
  __m512i v[kBlocks];
  load_pair<R>(w, v);
  for (int c = 0; c < kBlocks; ++c) {
    lo[c] = _mm512_and_si512(_mm512_slli_epi16(v[c], 4), top);
    hi[c] = _mm512_and_si512(v[c], top);
  }
}

// acc[r][c] += the int32 products over k in [s0, s0 + span) of row r (x + r * K) and the 16 columns of block c of
// the pair at w; one weight vector serves R rows, one activation broadcast both blocks. 4 bits (whole subblocks): a
// nibble moved to the top of its byte, the low half cleared, is 16 x its code + 128.
template <int Bits, int R>
inline void span_products(const uint8_t* w, const int8_t* x, int64_t K, int64_t s0, int64_t span,
                          __m512i (&acc)[R][kBlocks]) {
  constexpr int64_t kStep = kBlocks * kVector;  // a pair's bytes per 4 k (8 bits) or per vector of a subblock
  if constexpr (Bits == 8) {
    w += s0 / 4 * kStep;
    for (int64_t k = s0; k < s0 + span; k += 4, w += kStep) {
      __m512i wv[kBlocks];
      load_pair<R>(w, wv);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = broadcast_quad(x + r * K + k);
        for (int c = 0; c < kBlocks; ++c) dpbusd(acc[r][c], wv[c], xv);
      }
    }
  } else {
    w += s0 / 32 * 4 * kStep;
    for (int64_t k = s0; k < s0 + span; k += 32) {
      for (int p = 0; p < 4; ++p, w += kStep) {
        __m512i lo[kBlocks], hi[kBlocks];
        nibble_vectors<R>(w, lo, hi);
        for (int r = 0; r < R; ++r) {
          const __m512i xlo = broadcast_quad(x + r * K + k + 4 * p), xhi = broadcast_quad(x + r * K + k + 16 + 4 * p);
          for (int c = 0; c < kBlocks; ++c) {
            dpbusd(acc[r][c], lo[c], xlo);
            dpbusd(acc[r][c], hi[c], xhi);
          }
        }
      }
    }
  }
}

// 16 packed per-group values, float32 or float16 (V = uint16_t)
template <typename V>
inline __m512 load_values(const void* values, int64_t at) {
  if constexpr (std::is_same_v<V, float>) {
    return _mm512_loadu_ps(static_cast<const float*>(values) + at);
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const V*>(values) + at)));
  }
}

// at the end of weight group g (where the weight has minimums): each column's minimum times the row's group sum
template <int R, typename V>
inline void add_minimums(const Operands& o, int64_t pair, int64_t m0, int64_t g, __m512 (&total)[R][kBlocks]) {
  if (o.mins == nullptr) return;
  const int64_t groups = o.K / o.group;
  for (int c = 0; c < kBlocks; ++c) {
    const int64_t at = column_values(pair, groups, g, c);
    __m512 mn = load_values<V>(o.mins, at);
    if (o.add_eight_scales) mn = _mm512_fmadd_ps(_mm512_set1_ps(8.0f), load_values<V>(o.scales, at), mn);
    for (int r = 0; r < R; ++r)
      total[r][c] = _mm512_fmadd_ps(mn, _mm512_set1_ps(o.xg[(m0 + r) * groups + g]), total[r][c]);
  }
}

// the tile's float sums into out (rows m0.., the pair's columns that exist); per channel (not Grouped) scaled by the
// column scales here
template <bool Grouped, int R, typename OutT>
inline void store_tile(const Operands& o, int64_t pair, int64_t m0, const __m512 (&total)[R][kBlocks], OutT* out) {
  for (int c = 0; c < kBlocks; ++c) {
    const int64_t n0 = pair * kPairCols + c * kCols, width = std::min<int64_t>(kCols, o.N - n0);
    if (width <= 0) return;
    const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1);
    const __m512 sw = Grouped ? _mm512_set1_ps(1.0f) : load_values<float>(o.scales, column_values(pair, 1, 0, c));
    for (int r = 0; r < R; ++r)
      store16(out + (m0 + r) * o.N + n0, Grouped ? total[r][c] : _mm512_mul_ps(total[r][c], sw), mask);
  }
}

// out[m0 + r][the 32 columns of pair `pair`] for R rows. A span's int32 sums (exact) times the span's activation
// scale are added up: Grouped (scales per weight group, or minimums), each times its group's column scales, the
// minimums times the row's group sums; else (int8 per channel) scaled once at the end.
template <int Bits, bool Grouped, int R, typename V, typename OutT>
void row_tile(const Operands& o, int64_t pair, int64_t m0, OutT* out) {
  const int64_t groups = o.K / o.group, blocks = o.K / o.block, spans = o.K / o.span;
  const int64_t per_block = o.block / o.span, per_group = o.group / o.span;
  const uint8_t* w = o.codes + pair * pair_bytes(o.K, Bits);
  const int8_t* x = o.xq + m0 * o.K;
  __m512 total[R][kBlocks];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kBlocks; ++c) total[r][c] = _mm512_setzero_ps();
  // span s: activation block a, weight group g (counted, not divided: this loop is per span)
  for (int64_t s = 0, a = 0, g = 0, in_block = 0, in_group = 0; s < spans; ++s) {
    __m512i acc[R][kBlocks];
    for (int r = 0; r < R; ++r) {
      const __m512i start = _mm512_set1_epi32(o.starts[(m0 + r) * spans + s]);
      for (int c = 0; c < kBlocks; ++c) acc[r][c] = start;
    }
    span_products<Bits, R>(w, x, o.K, s * o.span, o.span, acc);
    for (int r = 0; r < R; ++r) {
      const __m512 xs = _mm512_set1_ps(o.xs[(m0 + r) * blocks + a]);
      for (int c = 0; c < kBlocks; ++c) {
        if constexpr (Grouped) {
          const __m512 sw = load_values<V>(o.scales, column_values(pair, groups, g, c));
          total[r][c] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][c]), xs), sw, total[r][c]);
        } else {
          total[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), xs, total[r][c]);
        }
      }
    }
    const bool group_ends = ++in_group == per_group;
    if (Grouped && group_ends) add_minimums<R, V>(o, pair, m0, g, total);
    if (++in_block == per_block) in_block = 0, ++a;
    if (group_ends) in_group = 0, ++g;
  }
  store_tile<Grouped, R>(o, pair, m0, total, out);
}

// row_tile for 4 bits in 16-k spans (GGUF's 4-bit types at activation block 16): both halves of a 32-k subblock
// from one load of its codes, their int32 sums apart (each has its activation scale), then scaled together.
template <bool Grouped, int R, typename V, typename OutT>
void halves_tile(const Operands& o, int64_t pair, int64_t m0, OutT* out) {
  const int64_t groups = o.K / o.group, blocks = o.K / o.block, spans = o.K / 16, per_group = o.group / 32;
  const uint8_t* w = o.codes + pair * pair_bytes(o.K, 4);
  const int8_t* x = o.xq + m0 * o.K;
  __m512 total[R][kBlocks];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kBlocks; ++c) total[r][c] = _mm512_setzero_ps();
  for (int64_t sub = 0, g = 0, in_group = 0; sub < o.K / 32; ++sub) {
    __m512i lo[R][kBlocks], hi[R][kBlocks];
    for (int r = 0; r < R; ++r) {
      const __m512i start_lo = _mm512_set1_epi32(o.starts[(m0 + r) * spans + 2 * sub]);
      const __m512i start_hi = _mm512_set1_epi32(o.starts[(m0 + r) * spans + 2 * sub + 1]);
      for (int c = 0; c < kBlocks; ++c) lo[r][c] = start_lo, hi[r][c] = start_hi;
    }
    for (int p = 0; p < 4; ++p, w += kBlocks * kVector) {
      __m512i wlo[kBlocks], whi[kBlocks];
      nibble_vectors<R>(w, wlo, whi);
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = x + r * o.K + 32 * sub + 4 * p;
        const __m512i xlo = broadcast_quad(xr), xhi = broadcast_quad(xr + 16);
        for (int c = 0; c < kBlocks; ++c) {
          dpbusd(lo[r][c], wlo[c], xlo);
          dpbusd(hi[r][c], whi[c], xhi);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xs_lo = _mm512_set1_ps(o.xs[(m0 + r) * blocks + 2 * sub]);
      const __m512 xs_hi = _mm512_set1_ps(o.xs[(m0 + r) * blocks + 2 * sub + 1]);
      for (int c = 0; c < kBlocks; ++c) {
        const __m512 both = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi[r][c]), xs_hi,
                                            _mm512_mul_ps(_mm512_cvtepi32_ps(lo[r][c]), xs_lo));
        const __m512 sw = load_values<V>(o.scales, column_values(pair, groups, g, c));
        total[r][c] = Grouped ? _mm512_fmadd_ps(both, sw, total[r][c]) : _mm512_add_ps(both, total[r][c]);
      }
    }
    if (++in_group == per_group) {
      if (Grouped) add_minimums<R, V>(o, pair, m0, g, total);
      in_group = 0, ++g;
    }
  }
  store_tile<Grouped, R>(o, pair, m0, total, out);
}

// the tile of a weight's kind (V: its packed scales' type)
template <int Bits, bool Grouped, bool Halves, typename V, int R, typename OutT>
inline void tile(const Operands& o, int64_t pair, int64_t m0, OutT* out) {
  if constexpr (Halves) {
    halves_tile<Grouped, R, V>(o, pair, m0, out);
  } else {
    row_tile<Bits, Grouped, R, V>(o, pair, m0, out);
  }
}

// rows [m0, m1) of a pair, in tiles of up to kMostRows rows (Halves: 4, its sums take 3 registers)
template <int Bits, bool Grouped, bool Halves, typename V, typename OutT>
void rows_of(const Operands& o, int64_t pair, int64_t m0, int64_t m1, OutT* out) {
  constexpr int kMost = Halves ? 4 : kMostRows;
  for (int64_t m = m0; m < m1; m += kMost) {
    switch (std::min<int64_t>(kMost, m1 - m)) {
      case 1: tile<Bits, Grouped, Halves, V, 1>(o, pair, m, out); break;
      case 2: tile<Bits, Grouped, Halves, V, 2>(o, pair, m, out); break;
      case 3: tile<Bits, Grouped, Halves, V, 3>(o, pair, m, out); break;
      case 4: tile<Bits, Grouped, Halves, V, 4>(o, pair, m, out); break;
      case 5: tile<Bits, Grouped, Halves, V, std::min(5, kMost)>(o, pair, m, out); break;
      default: tile<Bits, Grouped, Halves, V, kMost>(o, pair, m, out); break;
    }
  }
}

// Threads split (row chunk, pair) items, chunk by chunk: a chunk's codes are read from L2 by every pair.
template <int Bits, bool Grouped, bool Halves, typename V, typename OutT>
void all_tiles(const Operands& o, OutT* out) {
  const int64_t pairs = column_pairs(o.N);
  const int64_t chunk = std::max(kChunkRows, kChunkBytes / o.K / kChunkRows * kChunkRows);
  const int64_t chunks = (o.M + chunk - 1) / chunk;
  at::parallel_for(0, chunks * pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m0 = (i / pairs) * chunk, m1 = std::min(o.M, m0 + chunk);
      rows_of<Bits, Grouped, Halves, V>(o, i % pairs, m0, m1, out);
    }
  });
}

// a weight with scales per group (or minimums), its scales packed as V
template <typename V, typename OutT>
void grouped_tiles(const QuantWeight& w, const Operands& o, OutT* out) {
  if (w.bits == 8) return all_tiles<8, true, false, V>(o, out);
  return o.span == 16 ? all_tiles<4, true, true, V>(o, out) : all_tiles<4, true, false, V>(o, out);
}

template <typename InT, typename OutT>
void w8a8_typed(const InT* x, int64_t M, const QuantWeight& w, OutT* out) {
  const int64_t K = w.in_features;
  const Spans spans = spans_of(w);
  const bool has_mins = w.w8a8_mins.defined();
  const RowShape shape{K, spans.block, spans.span, w.group, w.bits == 8 ? 1.0f : 1.0f / 16};
  const QuantizedRows q = quantize_rows(x, M, shape, has_mins);
  Operands o{};
  o.codes = w.w8a8_codes.data_ptr<uint8_t>();
  o.scales = w.w8a8_scales.data_ptr();
  o.mins = has_mins ? w.w8a8_mins.data_ptr() : nullptr;
  o.add_eight_scales = w.w8a8_add_eight_scales;
  o.xq = q.codes;
  o.starts = q.starts;
  o.xs = q.scales;
  o.xg = q.group_sums;
  o.M = M, o.K = K, o.N = w.out_features, o.group = w.group, o.block = spans.block, o.span = spans.span;
  if (K / w.group == 1 && !has_mins) {  // one scale a column, applied at the end (float32)
    if (w.bits == 8) return all_tiles<8, false, false, float>(o, out);
    return o.span == 16 ? all_tiles<4, false, true, float>(o, out) : all_tiles<4, false, false, float>(o, out);
  }
  if (w.w8a8_scales.scalar_type() == at::kHalf) return grouped_tiles<uint16_t>(w, o, out);
  grouped_tiles<float>(w, o, out);
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
