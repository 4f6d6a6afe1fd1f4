// Vector math shared by the kernels (AVX-512, and AVX2 + FMA).
#pragma once

#include "isa.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>

// One cache line toward L1 (_MM_HINT_T0), L2 (T1) or L3 (T2). In inline assembly, not _mm_prefetch: GCC 12 dropped
// every _mm_prefetch of the AMX GEMM and the AVX2 decode attention at -O1 and above (none in their object code), while
// an asm statement is always emitted.
template <int kHint = _MM_HINT_T0>
inline void prefetch_line(const void* p) {
  static_assert(kHint == _MM_HINT_T0 || kHint == _MM_HINT_T1 || kHint == _MM_HINT_T2, "a T0, T1 or T2 hint");
  if constexpr (kHint == _MM_HINT_T0) {
    asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
  } else if constexpr (kHint == _MM_HINT_T1) {
    asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
  } else {
    asm volatile("prefetcht2 %0" : : "m"(*static_cast<const char*>(p)));
  }
}
#endif

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>

// Asks for `rows` rows of `row_bytes` bytes, `stride` bytes apart, to be brought into L1: a tile's K/V sit in blocks
// scattered over the pool, which the hardware prefetchers do not foresee.
template <int kHint = _MM_HINT_T0>
inline void prefetch_rows(const void* first, int64_t rows, int64_t stride, int64_t row_bytes) {
  const char* p = static_cast<const char*>(first);
  if (stride == row_bytes) row_bytes *= rows, rows = 1;  // one contiguous run
  for (int64_t r = 0; r < rows; ++r, p += stride)
    for (int64_t b = 0; b < row_bytes; b += 64) prefetch_line<kHint>(p + b);
}

// prefetch_rows' lines asked for a few at a time over `steps` steps of work (step() asks for the next few) rather
// than all at its start, where a burst waits on the line-fill buffers that the loads need too. Not prefetch_rows
// itself (a RowPrefetcher of one step): its per-line bookkeeping made the AVX2 decode attention, which asks for whole
// blocks, slower.
template <int kHint = _MM_HINT_T0>
class RowPrefetcher {
 public:
  RowPrefetcher(const void* first, int64_t rows, int64_t stride, int64_t row_bytes, int64_t steps)
      : row_(static_cast<const char*>(first)), rows_(rows), stride_(stride), row_bytes_(row_bytes) {
    if (stride == row_bytes) row_bytes_ *= rows_, rows_ = rows_ > 0;  // one contiguous run
    per_step_ = (rows_ * ((row_bytes_ + 63) / 64) + steps - 1) / std::max<int64_t>(steps, 1);
  }
  void step() {
    for (int64_t k = 0; k < per_step_ && rows_ > 0; ++k) {
      prefetch_line<kHint>(row_ + offset_);
      if ((offset_ += 64) >= row_bytes_) offset_ = 0, row_ += stride_, --rows_;
    }
  }
  bool done() const { return rows_ <= 0; }

 private:
  const char* row_;
  int64_t rows_, stride_, row_bytes_, offset_ = 0, per_step_;
};

#endif

#ifdef BATCHSERVE_ISA_AVX512
#include <immintrin.h>

// 16 values as floats from float32 or bfloat16 (a bfloat16 is a float's upper half), and back; the bfloat16 store
// rounds to nearest even, as c10::BFloat16 does, and a NaN (tested on the bits: -ffast-math assumes there is none)
// stays a quiet NaN instead of rounding into -0.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const int8_t* p) {  // an int8 KV pool's codes, widened (their row's scale applied apart)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// float8 e4m3 codes (a KV pool's), widened: each byte's exponent and mantissa moved into a float16's (bias 15 for
// e4m3's 7) and converted, then times 2^8 for the bias. Its subnormals land on float16 subnormals, which the
// conversion takes exactly, and come out as float32 normals. (NaN codes, never written by the pool, read as 1.875.)
inline __m512 load16(const c10::Float8_e4m3fn* p) {
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i magnitude = _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x7F)), 7);
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x80)), 8);
  return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(magnitude, sign)), _mm512_set1_ps(256.0f));
}
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m256i bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits(v));
}
// the lanes of `mask` only
inline void store16(float* p, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(p, mask, v); }
#if defined(__AVX512BW__) && defined(__AVX512VL__)
inline void store16(c10::BFloat16* p, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(reinterpret_cast<__m256i*>(p), mask, bf16_bits(v));
}
#endif

// Lane i of the result = the 16 lanes of v[i] combined by `op` (an add: their sum; a max: their largest). Pairs are
// interleaved and combined four times (within 128-bit lanes twice, then across them twice), so each level halves the
// vector count and the order comes out natural: 15 shuffles and ops instead of 16 horizontal reductions.
template <class Op>
inline __m512 combine16(const __m512* v, Op op) {
  __m512 t[8], u[4], w[2];
  for (int j = 0; j < 8; ++j)
    t[j] = op(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {
    const __m512d a = _mm512_castps_pd(t[2 * j]), b = _mm512_castps_pd(t[2 * j + 1]);
    u[j] = op(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int j = 0; j < 2; ++j)
    w[j] = op(_mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], 0x88), _mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], 0xDD));
  return op(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

// exp(x), x clamped to [-87, 88]: 2^k * p(r) with r = x - k ln2 in [-ln2/2, ln2/2] and p of degree 6 (relative error
// ~1e-7, about one float ulp). NaN stays NaN: vmaxps/vminps return their second operand when one is NaN.
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(_mm512_set1_ps(-87.0f), x));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, k);
}
#endif

#ifdef BATCHSERVE_ISA_AVX2
#include <immintrin.h>

// exp512 in 8 lanes: the same clamp and polynomial; 2^k built in the exponent bits (AVX2 has no vscalefps), which
// the clamp keeps in the normal range (k in [-126, 127]).
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.0f), x));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i two_k = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_k));
}
#endif
