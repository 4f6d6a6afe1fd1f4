// x [M, K] @ W -> [M, N] for the few rows of a decode step (M up to ~64), float32, AVX-512.
//
// At these M the library GEMMs reach a third to a half of this CPU's peak: they re-pack operands per call and split
// work poorly over two threads. Here W is packed once, at load time, into panels of 32 output columns laid out
// [K][32] (one contiguous stream per panel); threads split the panels; each panel is read from memory once and
// reused from cache by every block of 12 rows, whose 12 x 32 outputs stay in 24 registers over the whole K loop.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 32;  // output columns per panel (two 16-float vectors)
constexpr int64_t kRows = 12;   // rows per register block: 24 accumulators + 2 weight vectors + 1 broadcast

#if defined(__AVX512F__)
// `ahead`: the next panel, pulled into cache while this one computes (nullptr: none).
template <int R>
inline void panel_block(const float* x, int64_t K, const float* panel, float* out, int64_t N, const float* ahead) {
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if (ahead != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead + k * kPanel), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(ahead + k * kPanel + 16), _MM_HINT_T1);
    }
    const __m512 w0 = _mm512_loadu_ps(panel + k * kPanel);
    const __m512 w1 = _mm512_loadu_ps(panel + k * kPanel + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * K + k]);
      acc0[r] = _mm512_fmadd_ps(xb, w0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(xb, w1, acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out + r * N, acc0[r]);
    _mm512_storeu_ps(out + r * N + 16, acc1[r]);
  }
}

void rows_block(int64_t rows, const float* x, int64_t K, const float* panel, float* out, int64_t N,
                const float* ahead) {
  switch (rows) {
#define BLOCK(R) \
  case R:        \
    return panel_block<R>(x, K, panel, out, N, ahead);
    BLOCK(1) BLOCK(2) BLOCK(3) BLOCK(4) BLOCK(5) BLOCK(6) BLOCK(7) BLOCK(8) BLOCK(9) BLOCK(10) BLOCK(11) BLOCK(12)
#undef BLOCK
  }
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
  TORCH_CHECK(n <= panels * kPanel, "n exceeds the packed columns");
  const int64_t N = panels * kPanel;
  auto out = torch::empty({M, N}, xc.options());
#if defined(__AVX512F__)
  const float* xp = xc.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = wp + p * K * kPanel;
      const float* ahead = p + 1 < end ? panel + K * kPanel : nullptr;
      for (int64_t m = 0; m < M; m += kRows) {
        // the first row block streams this panel from memory; the others find it in cache and prefetch the next
        rows_block(std::min(kRows, M - m), xp + m * K, K, panel, op + m * N + p * kPanel, N,
                   m > 0 || M <= kRows ? ahead : nullptr);
      }
    }
  });
#endif
  return n == N ? out : out.narrow(1, 0, n);
}
