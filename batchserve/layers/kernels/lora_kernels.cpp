// LoRA's shrink and expand (lora_args.h) for the step's groups of tokens that share an adapter: vector maths per
// instruction set, the work split by work_split.h.
//
// A group's rows go in tiles of kTile: each row of A and of B is read once for the tile's rows, so a group of many
// tokens (an adapter's prefill, or its many decodes) reads its adapter's weights once per tile instead of once per
// token: what grouping tokens by adapter buys. Per row, the shrink (x . A_j, j over the slot's n_slices * rank rows)
// and the expand (u @ B into each slice's own columns: B's zeros outside them are skipped) accumulate in float32,
// and y gets scale * delta added and is rounded to its type once. Every row's result depends on its own values only,
// never on the batch around it.
#include "lora_args.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec_math.h"
#include "work_split.h"

#if defined(BATCHSERVE_ISA_AVX2) || defined(BATCHSERVE_ISA_AVX512)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kTile = 4;  // a group's rows shrunk and expanded together

// one lane: any CPU
struct Portable {
  using Vec = float;
  static constexpr int64_t kWidth = 1;
  static Vec zero() { return 0.f; }
  static Vec set1(float v) { return v; }
  static Vec fmadd(Vec a, Vec b, Vec c) { return a * b + c; }
  static Vec load(const float* p) { return *p; }
  static Vec load(const c10::BFloat16* p) { return static_cast<float>(*p); }
  static void store(float* p, Vec v) { *p = v; }
  static void store(c10::BFloat16* p, Vec v) { *p = c10::BFloat16(v); }
  static float sum(Vec v) { return v; }
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

// u[t][j] = x_t . a_j for the tile's n rows and the slot's first `used` rows of A
template <class V, class T>
void shrink(const T* const* x, int64_t n, const T* a, int64_t used, int64_t in, float* u, int64_t u_stride) {
  for (int64_t j = 0; j < used; ++j) {
    const T* aj = a + j * in;
    typename V::Vec acc[kTile];
    for (int64_t t = 0; t < n; ++t) acc[t] = V::zero();
    for (int64_t k = 0; k < in; k += V::kWidth) {
      const int64_t width = std::min(V::kWidth, in - k);
      const auto w = load_n<V>(aj + k, width);
      for (int64_t t = 0; t < n; ++t) acc[t] = V::fmadd(load_n<V>(x[t] + k, width), w, acc[t]);
    }
    for (int64_t t = 0; t < n; ++t) u[t * u_stride + j] = V::sum(acc[t]);
  }
}

// y_t[slice columns] += scale * u_t[slice rows] @ B[slice rows, slice columns], slice by slice
template <class V, class T>
void expand(const float* u, int64_t u_stride, int64_t n, const T* b, const LoraArgs& args, int64_t rank, float scale,
            T* const* y) {
  const auto s = V::set1(scale);
  for (int64_t i = 0; i < args.num_slices; ++i) {
    const int64_t first = i * rank, end = args.slices[i].offset + args.slices[i].size;
    for (int64_t c = args.slices[i].offset; c < end; c += V::kWidth) {
      const int64_t width = std::min(V::kWidth, end - c);
      typename V::Vec acc[kTile];
      for (int64_t t = 0; t < n; ++t) acc[t] = V::zero();
      for (int64_t j = first; j < first + rank; ++j) {
        const auto w = load_n<V>(b + j * args.out + c, width);
        for (int64_t t = 0; t < n; ++t) acc[t] = V::fmadd(V::set1(u[t * u_stride + j]), w, acc[t]);
      }
      for (int64_t t = 0; t < n; ++t) store_n<V>(y[t] + c, V::fmadd(s, acc[t], load_n<V>(y[t] + c, width)), width);
    }
  }
}

// One work item: up to kTile rows of group g, from its row list's index `first`
struct Item {
  int64_t group, first, count;
};

template <class V, class T>
void run_tile(const LoraArgs& args, const Item& item, float* u) {
  const int64_t g = item.group, slot = args.slot[g], rank = args.rank[g];
  const T* xs[kTile];
  T* ys[kTile];
  for (int64_t t = 0; t < item.count; ++t) {
    const int64_t row = args.rows[item.first + t];
    xs[t] = static_cast<const T*>(args.x) + row * args.x_stride;
    ys[t] = static_cast<T*>(args.y) + row * args.y_stride;
  }
  const T* a = static_cast<const T*>(args.a) + slot * args.rows_per_slot * args.in;
  const T* b = static_cast<const T*>(args.b) + slot * args.rows_per_slot * args.out;
  shrink<V>(xs, item.count, a, args.num_slices * rank, args.in, u, args.rows_per_slot);
  expand<V>(u, args.rows_per_slot, item.count, b, args, rank, args.scale[g], ys);
}

template <class V, class T>
void run(const LoraArgs& args) {
  std::vector<Item> items;
  for (int64_t g = 0; g < args.num_groups; ++g) {
    const int64_t count = args.offsets[g + 1] - args.offsets[g];
    if (!args.present[args.slot[g]]) continue;  // the adapter leaves this projection as it is
    if (args.gemm_min_rows > 0 && count >= args.gemm_min_rows) continue;  // two GEMMs (lora_op.cpp)
    for (int64_t i = args.offsets[g]; i < args.offsets[g + 1]; i += kTile)
      items.push_back({g, i, std::min(kTile, args.offsets[g + 1] - i)});
  }
  const auto cost = [&](int64_t i) { return items[i].count * args.rank[items[i].group]; };
  run_costliest_first(static_cast<int64_t>(items.size()), cost, [&](WorkQueue& queue) {
    std::vector<float> u(kTile * args.rows_per_slot);
    for (int64_t i; queue.next(i);) run_tile<V, T>(args, items[i], u.data());
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
#ifdef BATCHSERVE_ISA_AVX2
    case Isa::kAvx2:
      return run_on<Avx2>(args);
#endif
    default:  // lora_op.cpp lets only the table's paths through
      return run_on<Portable>(args);
  }
}
