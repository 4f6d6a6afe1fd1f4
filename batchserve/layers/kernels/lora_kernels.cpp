// LoRA's shrink and expand (lora_args.h) for the step's groups of tokens that share an adapter: vector maths per
// instruction set, the work split by work_split.h.
//
// A group's rows go in tiles of up to kTile: each row of A and of B is read once for the tile's rows, so a group of
// many tokens (an adapter's prefill, or its many decodes) reads its adapter's weights once per tile instead of once
// per token: what grouping tokens by adapter buys. Per row, the shrink (x . A_j, j over the slice's rank rows) and
// the expand (u @ B into the slice's own columns, B packed in panels: lora_args.h) accumulate in float32, and y
// gets scale * delta added and is rounded to its type once. The sums of a pass are kept in registers, several rows
// of A (or vectors of B's columns) by the tile's rows, so that no sum waits on its own previous FMA and every weight
// loaded serves the whole tile; the weights ahead are prefetched, as they come from memory once a step. On the vector
// paths every row's result depends on its own values only, never on the batch or the tile around it; the plain C++
// path's sums are the compiler's to reorder (-ffast-math), tile height by tile height, within float32 rounding.
#include "lora_args.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "vec_math.h"
#include "work_split.h"

#if defined(BATCHSERVE_ISA_AVX2) || defined(BATCHSERVE_ISA_AVX512)
#include <immintrin.h>
#endif

namespace {

constexpr int kTile = 8;  // a group's rows shrunk and expanded together

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

// u[t][j] = x_t . a_j for J rows of A and the tile's N rows at once: J * N independent sums (a single sum waits on
// its previous FMA at every step), each in the order of one row alone. `next`: rows to prefetch alongside.
template <class V, class T, int N, int J>
void shrink_block(const float* xf, int64_t xf_stride, const T* a, const T* next, int64_t in, float* u,
                  int64_t u_stride) {
  typename V::Vec acc[J][N];
  for (int jj = 0; jj < J; ++jj)
    for (int t = 0; t < N; ++t) acc[jj][t] = V::zero();
  const int64_t whole = in / V::kWidth * V::kWidth;
  for (int64_t k = 0; k < whole; k += V::kWidth) {
    for (int jj = 0; jj < J; ++jj) __builtin_prefetch(next + jj * in + k, 0, 3);
    typename V::Vec xv[N];
    for (int t = 0; t < N; ++t) xv[t] = V::load(xf + t * xf_stride + k);
    for (int jj = 0; jj < J; ++jj) {
      const auto w = V::load(a + jj * in + k);
      for (int t = 0; t < N; ++t) acc[jj][t] = V::fmadd(xv[t], w, acc[jj][t]);
    }
  }
  if (whole < in) {  // the rows' last, shorter vector (x is padded with zeros)
    for (int jj = 0; jj < J; ++jj) {
      const auto w = load_n<V>(a + jj * in + whole, in - whole);
      for (int t = 0; t < N; ++t) acc[jj][t] = V::fmadd(V::load(xf + t * xf_stride + whole), w, acc[jj][t]);
    }
  }
  for (int jj = 0; jj < J; ++jj)
    for (int t = 0; t < N; ++t) u[t * u_stride + jj] = V::sum(acc[jj][t]);
}

#ifdef BATCHSERVE_ISA_AVX512_BF16
// One run of 32 values of shrink_block_pairs: the tile's x and J rows of A under `mask` (zeros past a row's end)
template <int N, int J>
BATCHSERVE_BF16_TARGET inline void pairs_pass(__m512 (&acc)[J][N], const c10::BFloat16* const* x,
                                              const c10::BFloat16* a, int64_t in, int64_t k, __mmask32 mask) {
  __m512bh xv[N];
  for (int t = 0; t < N; ++t) xv[t] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x[t] + k);
  for (int jj = 0; jj < J; ++jj) {
    const auto w = (__m512bh)_mm512_maskz_loadu_epi16(mask, a + jj * in + k);
    for (int t = 0; t < N; ++t) acc[jj][t] = _mm512_dpbf16_ps(acc[jj][t], xv[t], w);
  }
}

// shrink_block on bfloat16 rows by pair dot products: x's rows read where they are (no widened copy), the last,
// shorter run of 32 loaded under a mask
template <int N, int J>
BATCHSERVE_BF16_TARGET void shrink_block_pairs(const c10::BFloat16* const* x, const c10::BFloat16* a,
                                               const c10::BFloat16* next, int64_t in, float* u, int64_t u_stride) {
  __m512 acc[J][N];
  for (int jj = 0; jj < J; ++jj)
    for (int t = 0; t < N; ++t) acc[jj][t] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= in; k += 32) {
    for (int jj = 0; jj < J; ++jj) __builtin_prefetch(next + jj * in + k, 0, 3);  // 32 values: one line
    pairs_pass<N, J>(acc, x, a, in, k, ~__mmask32(0));
  }
  if (k < in) pairs_pass<N, J>(acc, x, a, in, k, (__mmask32(1) << (in - k)) - 1);
  for (int jj = 0; jj < J; ++jj)
    for (int t = 0; t < N; ++t) u[t * u_stride + jj] = _mm512_reduce_add_ps(acc[jj][t]);
}
#endif

// Register blocking by tile height: J rows of A in a shrink pass, C vectors of B's columns in an expand pass, so
// that the J * N (or N * C) sums stay in registers
template <int N>
constexpr int kRowBlock = N <= 4 ? 4 : 2;
template <int N>
constexpr int kColBlock = N <= 4 ? 4 : 2;

// u[t][j] = x_t . a_j for the slot's first `used` rows of A
template <class V, class T, int N>
void shrink(const float* xf, int64_t xf_stride, const T* a, int64_t used, int64_t in, float* u, int64_t u_stride) {
  constexpr int J = kRowBlock<N>;
  int64_t j = 0;
  for (; j + J <= used; j += J) {
    const T* next = a + (j + 2 * J <= used ? j + J : j) * in;  // the next block's rows, or these again at the end
    shrink_block<V, T, N, J>(xf, xf_stride, a + j * in, next, in, u + j, u_stride);
  }
  for (; j < used; ++j) shrink_block<V, T, N, 1>(xf, xf_stride, a + j * in, a + j * in, in, u + j, u_stride);
}

#ifdef BATCHSERVE_ISA_AVX512_BF16
// shrink on bfloat16 rows by pair dot products (Avx512Bf16), blocked as shrink is
template <int N>
void shrink_pairs(const c10::BFloat16* const* x, const c10::BFloat16* a, int64_t used, int64_t in, float* u,
                  int64_t u_stride) {
  constexpr int J = kRowBlock<N>;
  int64_t j = 0;
  for (; j + J <= used; j += J) {
    const auto* next = a + (j + 2 * J <= used ? j + J : j) * in;
    shrink_block_pairs<N, J>(x, a + j * in, next, in, u + j, u_stride);
  }
  for (; j < used; ++j) shrink_block_pairs<N, 1>(x, a + j * in, a + j * in, in, u + j, u_stride);
}
#endif

// C vectors of a slice's columns, from column c of it (the last vector `last` wide), of the tile's N rows:
// y_t += scale * sum_j u_t[j] * B[j], j over the slice's rank rows, each column summed in j's order. `b`: the slice's
// packed B (lora_args.h), so each vector's rows are kLoraPanel apart; `next`: the next block's values to prefetch
// (the block after this one is contiguous with it), or null.
template <class V, class T, int N, int C>
void expand_block(const float* u, int64_t u_stride, const T* b, int64_t rank, int64_t c, int64_t last, const T* next,
                  typename V::Vec scale, T* const* y, int64_t pitch) {
  const T* base[C];
  for (int cc = 0; cc < C; ++cc) {
    const int64_t col = c + cc * V::kWidth;  // a vector never straddles two panels (kLoraPanel % kWidth == 0)
    base[cc] = b + col / kLoraPanel * rank * kLoraPanel + col % kLoraPanel;
  }
  typename V::Vec acc[N][C];
  for (int t = 0; t < N; ++t)
    for (int cc = 0; cc < C; ++cc) acc[t][cc] = V::zero();
  for (int64_t j = 0; j < rank; ++j) {
    if (next != nullptr) prefetch_lines(next + j * C * V::kWidth, C * V::kWidth);
    typename V::Vec w[C];
    for (int cc = 0; cc + 1 < C; ++cc) w[cc] = V::load(base[cc] + j * kLoraPanel);
    w[C - 1] = last == V::kWidth ? V::load(base[C - 1] + j * kLoraPanel)
                                 : load_n<V>(base[C - 1] + j * kLoraPanel, last);
    for (int t = 0; t < N; ++t) {
      const auto ut = V::set1(u[t * u_stride + j]);
      for (int cc = 0; cc < C; ++cc) acc[t][cc] = V::fmadd(ut, w[cc], acc[t][cc]);
    }
  }
  for (int t = 0; t < N; ++t)
    for (int cc = 0; cc < C; ++cc) {
      const int64_t col = c + cc * V::kWidth;  // y's column of it: panels `pitch` apart (kLoraPanel: contiguous)
      T* p = y[t] + col / kLoraPanel * pitch + col % kLoraPanel;
      const int64_t width = cc + 1 < C ? V::kWidth : last;
      store_n<V>(p, V::fmadd(scale, acc[t][cc], load_n<V>(p, width)), width);
    }
}

// y_t[slice i's columns] += scale * u_t[slice i's rows] @ B_i
template <class V, class T, int N>
void expand(const float* u, int64_t u_stride, const T* b_slot, const LoraArgs& args, int64_t i, int64_t rank,
            float scale, T* const* y) {
  const auto s = V::set1(scale);
  constexpr int C = kColBlock<N>;
  constexpr int64_t kBlockWidth = C * V::kWidth;
  const LoraSlice& slice = args.slices[i];
  const T* b = b_slot + rank * slice.packed;
  // the rows from the slice's first column, and the distance between two of its panels there
  const int64_t first = args.swiglu_panels ? i * kLoraPanel : slice.offset;
  const int64_t pitch = args.swiglu_panels ? args.num_slices * kLoraPanel : kLoraPanel;
  T* ys[N];
  for (int t = 0; t < N; ++t) ys[t] = y[t] + first;
  int64_t c = 0;
  for (; c + kBlockWidth <= slice.size; c += kBlockWidth) {
    // blocks of whole panels: the next block's values follow this one's
    const bool whole = kBlockWidth % kLoraPanel == 0 && c + 2 * kBlockWidth <= slice.size;
    const T* next = whole ? b + (c + kBlockWidth) * rank : nullptr;
    expand_block<V, T, N, C>(u, u_stride, b, rank, c, V::kWidth, next, s, ys, pitch);
  }
  for (; c < slice.size; c += V::kWidth)
    expand_block<V, T, N, 1>(u, u_stride, b, rank, c, std::min(V::kWidth, slice.size - c), nullptr, s, ys, pitch);
}

// One work item: up to kTile rows of group g, from its row list's index `first`, in one slice of the projection's
// output (a slice's shrink rows and expand columns are its own: q, k and v, or gate and up, are independent items,
// which spreads even one token's deltas over the threads)
struct Item {
  int64_t group, first, count, slice;
};

// A thread's scratch, kept between calls (a step makes some hundred of them): the tile's widened x and its u
struct Scratch {
  std::vector<float> x, u;
};

template <class V, class T, int N>
void run_rows(const LoraArgs& args, const Item& item, const T* const* xs, T* const* ys, Scratch& scratch) {
  const int64_t g = item.group, slot = args.slot[g], rank = args.rank[g], first = item.slice * rank;
  const T* a = static_cast<const T*>(args.a) + (slot * args.rows_per_slot + first) * args.in;
  const T* b = static_cast<const T*>(args.b) + slot * args.b_per_slot;
  // u: the tile's shrink of this item's slice only (an item is one slice), max_rank a row
  float* u = scratch.u.data();
  const int64_t u_stride = args.rows_per_slot / args.num_slices;
#ifdef BATCHSERVE_ISA_AVX512_BF16
  if constexpr (std::is_same_v<V, Avx512Bf16>) {
    shrink_pairs<N>(xs, a, rank, args.in, u, u_stride);
  } else
#endif
  {
    const int64_t xf_stride = (args.in + V::kWidth - 1) / V::kWidth * V::kWidth;
    widen_rows(xs, N, args.in, scratch.x.data(), xf_stride);
    shrink<V, T, N>(scratch.x.data(), xf_stride, a, rank, args.in, u, u_stride);
  }
  expand<V, T, N>(u, u_stride, b, args, item.slice, rank, args.scale[g], ys);
}

template <class V, class T, int N = 1>
void run_height(const LoraArgs& args, const Item& item, const T* const* xs, T* const* ys, Scratch& scratch) {
  if constexpr (N < kTile) {
    if (item.count > N) return run_height<V, T, N + 1>(args, item, xs, ys, scratch);
  }
  run_rows<V, T, N>(args, item, xs, ys, scratch);
}

template <class V, class T>
void run_tile(const LoraArgs& args, const Item& item, Scratch& scratch) {
  const T* xs[kTile];
  T* ys[kTile];
  for (int64_t t = 0; t < item.count; ++t) {
    const int64_t row = args.rows[item.first + t];
    xs[t] = static_cast<const T*>(args.x) + row * args.x_stride;
    ys[t] = static_cast<T*>(args.y) + row * args.y_stride;
  }
  scratch.x.resize(kTile * ((args.in + V::kWidth - 1) / V::kWidth * V::kWidth));
  scratch.u.resize(kTile * (args.rows_per_slot / args.num_slices));
  run_height<V, T>(args, item, xs, ys, scratch);
}

template <class V, class T>
void run(const LoraArgs& args) {
  thread_local std::vector<Item> items;  // the caller's: kept between calls
  items.clear();
  for (int64_t g = 0; g < args.num_groups; ++g) {
    const int64_t count = args.offsets[g + 1] - args.offsets[g];
    if (!args.present[args.slot[g]]) continue;  // the adapter leaves this projection as it is
    if (args.gemm_min_rows > 0 && count >= args.gemm_min_rows) continue;  // two GEMMs (lora_op.cpp)
    for (int64_t i = args.offsets[g]; i < args.offsets[g + 1]; i += kTile)
      for (int64_t slice = 0; slice < args.num_slices; ++slice)
        items.push_back({g, i, std::min<int64_t>(kTile, args.offsets[g + 1] - i), slice});
  }
  const auto& work = items;
  const auto cost = [&](int64_t i) {  // a slice's weights: rank rows of A (in wide) and of B (its size wide)
    return work[i].count * args.rank[work[i].group] * (args.in + args.slices[work[i].slice].size);
  };
  run_costliest_first(static_cast<int64_t>(work.size()), cost, [&](WorkQueue& queue) {
    thread_local Scratch scratch;
    for (int64_t i; queue.next(i);) run_tile<V, T>(args, work[i], scratch);
  });
}

template <class V>
void run_on(const LoraArgs& args) {
  if (args.bf16) return run<V, c10::BFloat16>(args);
  run<V, float>(args);
}

}  // namespace

void lora_add(const LoraArgs& args, Isa path) {
  switch (path) {
#ifdef BATCHSERVE_ISA_AVX512
    case Isa::kAvx512:
      return run_on<Avx512>(args);
#endif
#ifdef BATCHSERVE_ISA_AVX512_BF16
    case Isa::kAvx512Bf16:  // its table row is bfloat16's; float32 slots take AVX-512's kernel
      if (args.bf16) return run<Avx512Bf16, c10::BFloat16>(args);
      return run<Avx512, float>(args);
#endif
#ifdef BATCHSERVE_ISA_AVX2
    case Isa::kAvx2:
      return run_on<Avx2>(args);
#endif
    default:  // lora_op.cpp lets only the table's paths through
      return run_on<Portable>(args);
  }
}
