// x [M, K] @ W -> [M, N] float32, AVX-512; CpuLinear uses it for decode-sized M (2 to ~64 rows).
//
// At these M the library GEMMs reach a third to a half of this CPU's peak: they re-pack the weight per call and
// split work poorly over two threads. Here W is packed once, at load time, into panels of 32 output columns laid out
// [K][32]; x is packed per call into blocks of 12 rows laid out [K][12], so each block's broadcasts are one stream.
// Threads split the panels. A 12 x 32 block of the output stays in 24 registers over a slice of K.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 32;  // output columns per panel (two 16-float vectors)
constexpr int64_t kRows = 12;   // rows per register block: 24 accumulators + 2 weight vectors + 1 broadcast
constexpr int64_t kDepth = 192;  // K per slice: 192 x 32 weights (24 KiB) stay in L1 beside one row block's inputs
constexpr int64_t kRowChunkBytes = 768 * 1024;  // rows per pass over the panels: their packed inputs fit in L2

#if defined(__AVX512F__)
// One R x 32 block of out (+)= xb [kc][kRows] (a packed row block) @ panel [kc][32], kept in 24 registers over kc.
// `ahead`: the next weight slice (its first `ahead_rows` rows), pulled toward cache while this one computes; only
// the first row block passing a slice reads it from memory.
template <int R, bool Prefetch>
inline void panel_block(const float* xb, int64_t kc, const float* panel, float* out, int64_t N, bool accumulate,
                        const float* ahead, int64_t ahead_rows) {
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) {
    acc0[r] = accumulate ? _mm512_loadu_ps(out + r * N) : _mm512_setzero_ps();
    acc1[r] = accumulate ? _mm512_loadu_ps(out + r * N + 16) : _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < kc; ++k) {
    if (Prefetch && k < ahead_rows) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead + k * kPanel), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(ahead + k * kPanel + 16), _MM_HINT_T1);
    }
    const __m512 w0 = _mm512_loadu_ps(panel + k * kPanel);
    const __m512 w1 = _mm512_loadu_ps(panel + k * kPanel + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(xb[k * kRows + r]);
      acc0[r] = _mm512_fmadd_ps(x, w0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(x, w1, acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out + r * N, acc0[r]);
    _mm512_storeu_ps(out + r * N + 16, acc1[r]);
  }
}

template <bool Prefetch>
void rows_block(int64_t rows, const float* xb, int64_t kc, const float* panel, float* out, int64_t N,
                bool accumulate, const float* ahead, int64_t ahead_rows) {
  switch (rows) {
#define BLOCK(R) \
  case R:        \
    return panel_block<R, Prefetch>(xb, kc, panel, out, N, accumulate, ahead, ahead_rows);
    BLOCK(1) BLOCK(2) BLOCK(3) BLOCK(4) BLOCK(5) BLOCK(6) BLOCK(7) BLOCK(8) BLOCK(9) BLOCK(10) BLOCK(11) BLOCK(12)
#undef BLOCK
  }
}

// x [M, K] -> [ceil(M / kRows)][K][kRows], zero-padded: the broadcasts of one row block become one stream.
void pack_rows(const float* x, int64_t M, int64_t K, float* packed) {
  const int64_t blocks = (M + kRows - 1) / kRows;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      float* dst = packed + b * K * kRows;
      const int64_t rows = std::min(kRows, M - b * kRows);
      if (rows < kRows) std::fill(dst, dst + K * kRows, 0.0f);
      for (int64_t r = 0; r < rows; ++r) {
        const float* src = x + (b * kRows + r) * K;
        for (int64_t k = 0; k < K; ++k) dst[k * kRows + r] = src[k];
      }
    }
  });
}
#endif

}  // namespace

bool small_gemm_available() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// weight [N, K] (nn.Linear layout) -> panels [ceil(N / 32), K, 32], zero-padded past N.
torch::Tensor small_gemm_pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32, "weight: [N, K] float32");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t panels = (N + kPanel - 1) / kPanel;
  auto padded = torch::zeros({panels * kPanel, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({panels, kPanel, K}).transpose(1, 2).contiguous();
}

// x [M, K] float32 (contiguous rows) @ packed panels -> [M, n] float32
torch::Tensor small_gemm(torch::Tensor x, torch::Tensor packed, int64_t n) {
  TORCH_CHECK(small_gemm_available(), "small_gemm needs AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x: [M, K] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(), "packed: [P, K, 32]");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "x and the packed weight disagree on K");
  TORCH_CHECK(K > 0, "small_gemm needs K > 0");
  TORCH_CHECK(n <= panels * kPanel, "n exceeds the packed columns");
  const int64_t N = panels * kPanel;
  auto out = torch::empty({M, N}, xc.options());
#if defined(__AVX512F__)
  const float* xp = xc.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  auto xpacked = torch::empty({(M + kRows - 1) / kRows * K * kRows}, xc.options());
  float* xb = xpacked.data_ptr<float>();
  pack_rows(xp, M, K, xb);
  // Cache blocking, weight-stationary: a kDepth x 32 slice of one panel stays in L1 while every row block of the
  // chunk streams past it (from L2), so each weight is read from memory once per row chunk and the 24 accumulators
  // are reloaded only once per slice. (Keeping the inputs in L1 and streaming the panels from L2 instead is ~1.5x
  // slower here: L2 cannot feed two weight vectors per 24 FMAs.)
  const int64_t kc = std::min<int64_t>(K, kDepth);
  const int64_t row_chunk = std::max<int64_t>(kRows, kRowChunkBytes / (K * sizeof(float)) / kRows * kRows);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += row_chunk) {
      const int64_t m1 = std::min(M, m0 + row_chunk);
      for (int64_t p = begin; p < end; ++p) {
        for (int64_t k0 = 0; k0 < K; k0 += kc) {
          const int64_t depth = std::min(kc, K - k0);
          const float* slice = wp + (p * K + k0) * kPanel;
          // the next slice (of this panel, or the next one's first), pulled toward cache by the first row block
          const bool more_depth = k0 + kc < K;
          const float* ahead = more_depth ? slice + kc * kPanel : (p + 1 < end ? wp + (p + 1) * K * kPanel : nullptr);
          const int64_t ahead_rows = more_depth ? std::min(kc, K - k0 - kc) : kc;
          for (int64_t m = m0; m < m1; m += kRows) {
            const int64_t rows = std::min(kRows, M - m);
            const float* rows_in = xb + m * K + k0 * kRows;
            float* out_block = op + m * N + p * kPanel;
            if (m == m0 && ahead != nullptr) {
              rows_block<true>(rows, rows_in, depth, slice, out_block, N, k0 > 0, ahead, ahead_rows);
            } else {
              rows_block<false>(rows, rows_in, depth, slice, out_block, N, k0 > 0, nullptr, 0);
            }
          }
        }
      }
    }
  });
#endif
  return n == N ? out : out.narrow(1, 0, n);
}
