// x [M, K] @ W -> [M, N] float32 for decode-sized M (2 to ~64 rows); CpuLinear uses it there.
//
// At these M the library GEMMs reach a third to two thirds of this CPU's peak: they re-pack the weight per call and
// split work poorly over two threads. Here W is packed once, at load time, into panels of two vectors' worth of
// output columns laid out [K][panel]; x is packed per call into blocks of rows laid out [K][rows], so each block's
// broadcasts are one stream. Threads split the panels. A block of the output stays in registers over a slice of K.
//
// One code path per ISA level, picked by the packed weight's panel width (the Python side chooses the path once):
//   avx512: 32-column panels, 12-row blocks: 24 zmm accumulators + 2 weight vectors + 1 broadcast (of 32);
//   avx2:   16-column panels,  6-row blocks: 12 ymm accumulators + 2 weight vectors + 1 broadcast (of 16).
// Both are built wherever the compiler targets them (-march=native), so an AVX-512 CPU runs and tests both.
#include "aten_pch.h"  // first: the precompiled torch headers (build.py)

#include "isa.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <string>
#include <vector>

#include "vec_math.h"

#ifdef BATCHSERVE_ISA_AVX2
#include <immintrin.h>
#endif

namespace {

#ifdef BATCHSERVE_ISA_AVX512
struct Avx512 {
  using Vec = __m512;
  static constexpr int64_t kWidth = 16;  // floats per vector
  static constexpr int64_t kRows = 12;
  static constexpr int64_t kDepth = 192;  // K per slice: 192 x 32 weights (24 KiB) stay in L1 beside the inputs
  static constexpr int64_t kRowChunkBytes = 768 * 1024;  // rows per pass over the panels: their packed inputs in L2
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec broadcast(float x) { return _mm512_set1_ps(x); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
};
#endif

#ifdef BATCHSERVE_ISA_AVX2
struct Avx2 {
  using Vec = __m256;
  static constexpr int64_t kWidth = 8;
  static constexpr int64_t kRows = 6;
  static constexpr int64_t kDepth = 384;  // 384 x 16 weights: 24 KiB, as on the AVX-512 path
  static constexpr int64_t kRowChunkBytes = 384 * 1024;  // AVX2-only server CPUs (AMD Zen 2/3) have 512 KiB of L2
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec broadcast(float x) { return _mm256_set1_ps(x); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
};
#endif

#ifdef BATCHSERVE_ISA_AVX2
// One R x panel block of out (+)= xb [kc][kRows] (a packed row block) @ panel [kc][2 vectors], kept in registers
// over kc. `ahead`: the next weight slice (its first `ahead_rows` rows), pulled toward cache while this one
// computes; only the first row block passing a slice reads it from memory.
template <class Isa, int R, bool Prefetch>
inline void panel_block(const float* xb, int64_t kc, const float* panel, float* out, int64_t N, bool accumulate,
                        const float* ahead, int64_t ahead_rows) {
  constexpr int64_t W = Isa::kWidth, P = 2 * Isa::kWidth;
  typename Isa::Vec acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) {
    acc0[r] = accumulate ? Isa::load(out + r * N) : Isa::zero();
    acc1[r] = accumulate ? Isa::load(out + r * N + W) : Isa::zero();
  }
  for (int64_t k = 0; k < kc; ++k) {
    if (Prefetch && k < ahead_rows) {
      for (int64_t line = 0; line < P; line += 16)
        prefetch_line<_MM_HINT_T1>(ahead + k * P + line);
    }
    const auto w0 = Isa::load(panel + k * P);
    const auto w1 = Isa::load(panel + k * P + W);
    for (int r = 0; r < R; ++r) {
      const auto x = Isa::broadcast(xb[k * Isa::kRows + r]);
      acc0[r] = Isa::fmadd(x, w0, acc0[r]);
      acc1[r] = Isa::fmadd(x, w1, acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    Isa::store(out + r * N, acc0[r]);
    Isa::store(out + r * N + W, acc1[r]);
  }
}

template <class Isa, bool Prefetch>
void rows_block(int64_t rows, const float* xb, int64_t kc, const float* panel, float* out, int64_t N,
                bool accumulate, const float* ahead, int64_t ahead_rows) {
  static_assert(Isa::kRows <= 12, "rows_block instantiates blocks of up to 12 rows");
  switch (rows) {
#define BLOCK(R)                                                                                    \
  case R:                                                                                           \
    if constexpr (R <= Isa::kRows)                                                                  \
      return panel_block<Isa, R, Prefetch>(xb, kc, panel, out, N, accumulate, ahead, ahead_rows);   \
    break;
    BLOCK(1) BLOCK(2) BLOCK(3) BLOCK(4) BLOCK(5) BLOCK(6) BLOCK(7) BLOCK(8) BLOCK(9) BLOCK(10) BLOCK(11) BLOCK(12)
#undef BLOCK
  }
}

// x [M, K] -> [ceil(M / rows)][K][rows], zero-padded: the broadcasts of one row block become one stream.
void pack_rows(const float* x, int64_t M, int64_t K, int64_t block_rows, float* packed) {
  const int64_t blocks = (M + block_rows - 1) / block_rows;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      float* dst = packed + b * K * block_rows;
      const int64_t rows = std::min(block_rows, M - b * block_rows);
      if (rows < block_rows) std::fill(dst, dst + K * block_rows, 0.0f);
      for (int64_t r = 0; r < rows; ++r) {
        const float* src = x + (b * block_rows + r) * K;
        for (int64_t k = 0; k < K; ++k) dst[k * block_rows + r] = src[k];
      }
    }
  });
}

// out [M, panels * P] = x [M, K] @ packed panels [panels][K][P], P = 2 vectors.
template <class Isa>
void small_gemm_on(const float* xp, int64_t M, int64_t K, const float* wp, int64_t panels, float* op) {
  constexpr int64_t P = 2 * Isa::kWidth, kRows = Isa::kRows;
  const int64_t N = panels * P;
  auto xpacked = at::empty({(M + kRows - 1) / kRows * K * kRows}, at::kFloat);
  float* xb = xpacked.data_ptr<float>();
  pack_rows(xp, M, K, kRows, xb);
  // Cache blocking, weight-stationary: a kDepth x P slice of one panel stays in L1 while every row block of the
  // chunk streams past it (from L2), so each weight is read from memory once per row chunk and the accumulators
  // are reloaded only once per slice. (Keeping the inputs in L1 and streaming the panels from L2 instead is slower
  // on AVX-512: L2 cannot feed two weight vectors per 24 FMAs.)
  const int64_t kc = std::min<int64_t>(K, Isa::kDepth);
  const int64_t row_chunk = std::max<int64_t>(kRows, Isa::kRowChunkBytes / (K * sizeof(float)) / kRows * kRows);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += row_chunk) {
      const int64_t m1 = std::min(M, m0 + row_chunk);
      for (int64_t p = begin; p < end; ++p) {
        for (int64_t k0 = 0; k0 < K; k0 += kc) {
          const int64_t depth = std::min(kc, K - k0);
          const float* slice = wp + (p * K + k0) * P;
          // the next slice (of this panel, or the next one's first), pulled toward cache by the first row block
          const bool more_depth = k0 + kc < K;
          const float* ahead = more_depth ? slice + kc * P : (p + 1 < end ? wp + (p + 1) * K * P : nullptr);
          const int64_t ahead_rows = more_depth ? std::min(kc, K - k0 - kc) : kc;
          for (int64_t m = m0; m < m1; m += kRows) {
            const int64_t rows = std::min(kRows, M - m);
            const float* rows_in = xb + m * K + k0 * kRows;
            float* out_block = op + m * N + p * P;
            if (m == m0 && ahead != nullptr) {
              rows_block<Isa, true>(rows, rows_in, depth, slice, out_block, N, k0 > 0, ahead, ahead_rows);
            } else {
              rows_block<Isa, false>(rows, rows_in, depth, slice, out_block, N, k0 > 0, nullptr, 0);
            }
          }
        }
      }
    }
  });
}
#endif

// The panel width (output columns) of each path's packed weight.
int64_t panel_width(const std::string& path) {
  if (path == "avx512") return 32;
  if (path == "avx2") return 16;
  TORCH_CHECK(false, "small_gemm path: avx512 or avx2, not ", path);
  return 0;
}

}  // namespace

// The small-M paths built here, best first (each needs the compiler to target its ISA).
std::vector<std::string> small_gemm_paths() {
  std::vector<std::string> paths;
#ifdef BATCHSERVE_ISA_AVX512
  paths.push_back("avx512");
#endif
#ifdef BATCHSERVE_ISA_AVX2
  paths.push_back("avx2");
#endif
  return paths;
}

// weight [N, K] (nn.Linear layout) -> panels [ceil(N / P), K, P] for `path` (P = its panel width), zero-padded.
// A transpose per panel, in tiles of kTileK columns: the panel's P rows of a tile (P x kTileK floats) stay in L1
// while they are written out K-major (a plain strided copy walks each of the P rows with a cache miss per element:
// seconds for a 135M-parameter model at load).
at::Tensor small_gemm_pack(at::Tensor weight, const std::string& path) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "weight: [N, K] float32");
  const int64_t P = panel_width(path);
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t panels = (N + P - 1) / P;
  constexpr int64_t kTileK = 64;
  auto source = weight.contiguous();
  auto packed = at::empty({panels, K, P}, weight.options());
  const float* w = source.data_ptr<float>();
  float* out = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) {
      const int64_t rows = std::min(P, N - panel * P);
      const float* src = w + panel * P * K;
      float* dst = out + panel * K * P;
      for (int64_t k0 = 0; k0 < K; k0 += kTileK) {
        const int64_t k1 = std::min(K, k0 + kTileK);
        for (int64_t k = k0; k < k1; ++k) {
          float* row = dst + k * P;
          for (int64_t j = 0; j < rows; ++j) row[j] = src[j * K + k];
          for (int64_t j = rows; j < P; ++j) row[j] = 0.0f;
        }
      }
    }
  });
  return packed;
}

// x [M, K] float32 (contiguous rows) @ packed panels -> [M, n] float32, on the path the panels were packed for
at::Tensor small_gemm(at::Tensor x, at::Tensor packed, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: [M, K] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous(), "packed: [P, K, panel] from small_gemm_pack");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), panels = packed.size(0), P = packed.size(2);
  TORCH_CHECK(packed.size(1) == K, "x and the packed weight disagree on K");
  TORCH_CHECK(K > 0, "small_gemm needs K > 0");
  TORCH_CHECK(n <= panels * P, "n exceeds the packed columns");
  auto out = at::empty({M, panels * P}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (P == 32) {
#ifdef BATCHSERVE_ISA_AVX512
    small_gemm_on<Avx512>(xp, M, K, wp, panels, op);
#else
    TORCH_CHECK(false, "small_gemm: 32-column panels are the avx512 path, not built here");
#endif
  } else if (P == 16) {
#ifdef BATCHSERVE_ISA_AVX2
    small_gemm_on<Avx2>(xp, M, K, wp, panels, op);
#else
    TORCH_CHECK(false, "small_gemm: 16-column panels are the avx2 path, not built here");
#endif
  } else {
    TORCH_CHECK(false, "small_gemm: panels of ", P, " columns are no path's");
  }
  return n == panels * P ? out : out.narrow(1, 0, n);
}
