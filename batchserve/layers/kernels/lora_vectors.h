// The LoRA kernel's vectors (lora_tiles.h): one struct per instruction set with the few operations the shrink
// and expand use, and the helpers they share (short loads and stores, prefetches, a block's sums, register blocking).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "lora_args.h"
#include "vec_math.h"

#if defined(BATCHSERVE_ISA_AVX2) || defined(BATCHSERVE_ISA_AVX512)
#include <immintrin.h>
#endif

namespace lora_vectors {

// eight lanes in plain C++: any CPU (the compiler maps them onto what vectors it has)
struct Portable {
  static constexpr int64_t kWidth = 8;
  struct Vec {
    float lane[kWidth];
  };
  static Vec zero() { return set1(0.f); }
  static Vec set1(float v) {
    Vec out;
    for (int64_t i = 0; i < kWidth; ++i) out.lane[i] = v;
    return out;
  }
  static Vec fmadd(Vec a, Vec b, Vec c) {
    for (int64_t i = 0; i < kWidth; ++i) c.lane[i] = a.lane[i] * b.lane[i] + c.lane[i];
    return c;
  }
  template <class T>
  static Vec load(const T* p) {
    Vec out;
    for (int64_t i = 0; i < kWidth; ++i) out.lane[i] = static_cast<float>(p[i]);
    return out;
  }
  template <class T>
  static void store(T* p, Vec v) {
    for (int64_t i = 0; i < kWidth; ++i) p[i] = T(v.lane[i]);
  }
  static float sum(Vec v) {
    float total = 0.f;
    for (int64_t i = 0; i < kWidth; ++i) total += v.lane[i];
    return total;
  }
};

#ifdef BATCHSERVE_ISA_AVX2
struct Avx2 {
  using Vec = __m256;
  static constexpr int64_t kWidth = 8;
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec set1(float v) { return _mm256_set1_ps(v); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static Vec load(const c10::BFloat16* p) {  // a bfloat16 is a float's upper half
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  static void store(c10::BFloat16* p, Vec v) {  // rounded to nearest even as c10::BFloat16 rounds
    alignas(32) float lanes[kWidth];
    _mm256_store_ps(lanes, v);
    for (int64_t i = 0; i < kWidth; ++i) p[i] = c10::BFloat16(lanes[i]);
  }
  static float sum(Vec v) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
  }
};
#endif

#ifdef BATCHSERVE_ISA_AVX512
struct Avx512 {
  using Vec = __m512;
  static constexpr int64_t kWidth = 16;
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec set1(float v) { return _mm512_set1_ps(v); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static Vec load(const float* p) { return load16(p); }
  static Vec load(const c10::BFloat16* p) { return load16(p); }
  static void store(float* p, Vec v) { store16(p, v); }
  static void store(c10::BFloat16* p, Vec v) { store16(p, v); }
  static float sum(Vec v) { return _mm512_reduce_add_ps(v); }
};
#endif

#ifdef BATCHSERVE_ISA_AVX512_BF16
// AVX-512 whose bfloat16 shrink multiplies pairs (AVX512-BF16's dot product: 32 products an instruction, x and A as
// stored, nothing widened): per row, lane i sums the products of elements 32k + 2i and 32k + 2i + 1 in that order,
// the same order whatever the tile. The expand and float32 are Avx512's.
struct Avx512Bf16 : Avx512 {};
#endif

// n <= V::kWidth values (a row's last, shorter chunk through a zero-padded copy)
template <class V, class T>
typename V::Vec load_n(const T* p, int64_t n) {
  if (n == V::kWidth) return V::load(p);
  T padded[V::kWidth];
  for (int64_t i = 0; i < V::kWidth; ++i) padded[i] = i < n ? p[i] : T(0.f);
  return V::load(padded);
}

template <class V, class T>
void store_n(T* p, typename V::Vec v, int64_t n) {
  if (n == V::kWidth) return V::store(p, v);
  T lanes[V::kWidth];
  V::store(lanes, v);
  std::copy(lanes, lanes + n, p);
}

// The tile's n rows of x in float32 (exact for bfloat16), zero-padded to whole vectors: every row of A reads them, so
// they are widened once a tile instead of once a row of A
template <class T>
void widen_rows(const T* const* x, int64_t n, int64_t in, float* xf, int64_t xf_stride) {
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t k = 0; k < in; ++k) xf[t * xf_stride + k] = static_cast<float>(x[t][k]);
    std::fill(xf + t * xf_stride + in, xf + (t + 1) * xf_stride, 0.f);
  }
}

// The weights stream from memory (an adapter's rows are read once a step, and eight adapters are 78 MB for the
// default model): the next rows are asked for while these are summed, so the loads rarely wait on memory.
template <class T>
inline void prefetch_lines(const T* p, int64_t count) {
  for (int64_t i = 0; i < count * static_cast<int64_t>(sizeof(T)); i += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(p) + i, 0, 3);
}

// u[t][jj] = the lanes of acc[jj][t] summed. On AVX-512 the block's (up to 16) sums come out of one transposed
// reduction (combine16: 15 shuffles and adds for all of them, where a horizontal sum costs 8 a vector), padded with
// zeros; each lane is summed by the same tree whatever its place, so a row's sums do not depend on its tile.
template <class V, int N, int J>
void store_sums(const typename V::Vec (&acc)[J][N], float* u, int64_t u_stride) {
#ifdef BATCHSERVE_ISA_AVX512
  if constexpr (std::is_base_of_v<Avx512, V> && J * N <= 16) {
    __m512 v[16];
    for (int i = 0; i < 16; ++i) v[i] = i < J * N ? acc[i / N][i % N] : _mm512_setzero_ps();
    alignas(64) float sums[16];
    _mm512_store_ps(sums, combine16(v, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); }));
    for (int i = 0; i < J * N; ++i) u[(i % N) * u_stride + i / N] = sums[i];
    return;
  }
#endif
  for (int jj = 0; jj < J; ++jj)
    for (int t = 0; t < N; ++t) u[t * u_stride + jj] = V::sum(acc[jj][t]);
}

// Register blocking by tile height: J rows of A in a shrink pass, C vectors of B's columns in an expand pass, so
// that the J * N (or N * C) sums stay in registers
template <int N>
constexpr int kRowBlock = N <= 4 ? 4 : 2;
template <int N>
constexpr int kColBlock = N <= 4 ? 4 : 2;

}  // namespace lora_vectors
