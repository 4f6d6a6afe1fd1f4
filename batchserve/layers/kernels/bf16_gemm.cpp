// x [M, K] bfloat16 @ W -> [M, N] float32 by AVX512-BF16 (vdpbf16ps), with one reduction order per output element
// whatever M and wherever the row sits in the batch: the GEMM of deterministic mode on CPUs with bf16 dot products,
// and the output projection's everywhere on them (its float32 accumulator is the logits, never rounded to bf16).
//
// small_gemm.cpp's layout and blocking, in bf16 pairs: W is packed once into panels of 32 output columns laid out
// [K / 2][32 columns][2 k], so one zmm holds 16 columns' (w[2kk], w[2kk + 1]) pairs; x is packed per call into blocks
// of 12 rows laid out [K / 2][rows] of pairs, each broadcast once per pair. An output element is the sum over k-pairs
// in increasing k, one vdpbf16ps per pair, whatever the row block, the row chunk, the K slice (accumulators stored
// and reloaded exactly) or the thread: threads split the panels, never K.
#include "aten_pch.h"  // first: the precompiled torch headers (build.py)

#include "isa.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#ifdef BATCHSERVE_ISA_AVX512_BF16
#define BATCHSERVE_BF16_GEMM 1
#include <immintrin.h>
#define BF16_GEMM_TARGET BATCHSERVE_BF16_TARGET
#endif

namespace {

constexpr int64_t kPanel = 32;               // output columns per panel: two zmm of float32 accumulators
constexpr int64_t kRows = 12;                // rows per block: 24 accumulators + 2 weight vectors + 1 broadcast
constexpr int64_t kDepthPairs = 192;         // k-pairs per slice: 192 x 128 bytes (24 KiB) of a panel stay in L1
constexpr int64_t kRowChunkBytes = 768 * 1024;  // rows per pass over the panels: their packed inputs in L2

#ifdef BATCHSERVE_BF16_GEMM
BF16_GEMM_TARGET inline __m512bh as_bh(__m512i v) {
  __m512bh b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

// One R x 32 block of out (+)= pairs xb [kc][kRows] @ panel [kc][32][2], kept in registers over kc pairs.
// Whether it adds to out is a template argument, and the loops over the rows outside the k loop are unrolled by
// pragma: otherwise GCC turned the zeroing of 9 rows or more into two memset calls on a stack copy of the
// accumulators, copied in and out around the k loop, on every call.
template <int R, bool Accumulate>
BF16_GEMM_TARGET void panel_block(const uint32_t* xb, int64_t kc, const uint16_t* panel, float* out, int64_t N) {
  __m512 acc0[R], acc1[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    acc0[r] = Accumulate ? _mm512_loadu_ps(out + r * N) : _mm512_setzero_ps();
    acc1[r] = Accumulate ? _mm512_loadu_ps(out + r * N + 16) : _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m512bh w0 = as_bh(_mm512_loadu_si512(panel + k * 2 * kPanel));
    const __m512bh w1 = as_bh(_mm512_loadu_si512(panel + k * 2 * kPanel + kPanel));
    for (int r = 0; r < R; ++r) {
      const __m512bh x = as_bh(_mm512_set1_epi32(static_cast<int>(xb[k * kRows + r])));
      acc0[r] = _mm512_dpbf16_ps(acc0[r], x, w0);
      acc1[r] = _mm512_dpbf16_ps(acc1[r], x, w1);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out + r * N, acc0[r]);
    _mm512_storeu_ps(out + r * N + 16, acc1[r]);
  }
}

BF16_GEMM_TARGET void rows_block(int64_t rows, const uint32_t* xb, int64_t kc, const uint16_t* panel, float* out,
                                 int64_t N, bool accumulate) {
  switch (rows) {
#define BLOCK(R)                                                     \
  case R:                                                            \
    if (accumulate) return panel_block<R, true>(xb, kc, panel, out, N); \
    return panel_block<R, false>(xb, kc, panel, out, N);
    BLOCK(1) BLOCK(2) BLOCK(3) BLOCK(4) BLOCK(5) BLOCK(6) BLOCK(7) BLOCK(8) BLOCK(9) BLOCK(10) BLOCK(11) BLOCK(12)
#undef BLOCK
  }
}

// x [M, K] bf16 -> [ceil(M / kRows)][K2][kRows] k-pairs, zero-padded (rows and an odd K's last pair).
void pack_row_pairs(const uint16_t* x, int64_t M, int64_t K, int64_t K2, uint32_t* packed) {
  const int64_t blocks = (M + kRows - 1) / kRows;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      uint32_t* dst = packed + b * K2 * kRows;
      const int64_t rows = std::min(kRows, M - b * kRows);
      if (rows < kRows || K2 * 2 != K) std::fill(dst, dst + K2 * kRows, 0u);
      for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* src = x + (b * kRows + r) * K;
        for (int64_t k = 0; k + 1 < K; k += 2)
          dst[k / 2 * kRows + r] = static_cast<uint32_t>(src[k]) | (static_cast<uint32_t>(src[k + 1]) << 16);
        if (K % 2) dst[(K2 - 1) * kRows + r] = src[K - 1];
      }
    }
  });
}

void bf16_gemm_on(const uint16_t* xp, int64_t M, int64_t K, const uint16_t* wp, int64_t panels, float* op) {
  const int64_t K2 = (K + 1) / 2, N = panels * kPanel;
  auto xpacked = at::empty({(M + kRows - 1) / kRows * K2 * kRows}, at::kInt);
  auto* xb = reinterpret_cast<uint32_t*>(xpacked.data_ptr<int32_t>());
  pack_row_pairs(xp, M, K, K2, xb);
  const int64_t row_chunk = std::max<int64_t>(kRows, kRowChunkBytes / (K2 * 4) / kRows * kRows);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += row_chunk) {
      const int64_t m1 = std::min(M, m0 + row_chunk);
      for (int64_t p = begin; p < end; ++p) {
        for (int64_t k0 = 0; k0 < K2; k0 += kDepthPairs) {
          const int64_t depth = std::min(kDepthPairs, K2 - k0);
          const uint16_t* slice = wp + (p * K2 + k0) * 2 * kPanel;
          for (int64_t m = m0; m < m1; m += kRows)
            rows_block(std::min(kRows, M - m), xb + m * K2 + k0 * kRows, depth, slice, op + m * N + p * kPanel, N,
                       k0 > 0);
        }
      }
    }
  });
}
#endif

}  // namespace

bool bf16_gemm_available() {
#ifdef BATCHSERVE_BF16_GEMM
  return cpu_runs(Isa::kAvx512Bf16);
#else
  return false;
#endif
}

// weight [N, K] bf16 (nn.Linear layout) -> panels [ceil(N / 32), ceil(K / 2), 32, 2], zero-padded.
at::Tensor bf16_gemm_pack(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "weight: [N, K] bfloat16");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t panels = (N + kPanel - 1) / kPanel, K2 = (K + 1) / 2;
  auto padded = at::zeros({panels * kPanel, K2 * 2}, weight.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  // [panels, 32 columns, K2, 2] -> [panels, K2, 32 columns, 2]
  return padded.view({panels, kPanel, K2, 2}).transpose(1, 2).contiguous();
}

// x [M, K] bf16 @ packed panels -> [M, n] float32 (the accumulators as they are).
at::Tensor bf16_gemm(at::Tensor x, at::Tensor packed, int64_t n) {
  TORCH_CHECK(bf16_gemm_available(), "bf16_gemm: needs AVX512-BF16 (bf16_gemm_available())");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: [M, K] bfloat16");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(2) == kPanel,
              "packed: [P, K/2, 32, 2] from bf16_gemm_pack");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == (K + 1) / 2, "x and the packed weight disagree on K");
  TORCH_CHECK(K > 0 && n <= panels * kPanel, "bf16_gemm: K > 0 and n within the packed columns");
  auto out = at::empty({M, panels * kPanel}, xc.options().dtype(at::kFloat));
#ifdef BATCHSERVE_BF16_GEMM
  if (M > 0)
    bf16_gemm_on(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), M, K,
                 reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), panels, out.data_ptr<float>());
#endif
  return n == panels * kPanel ? out : out.narrow(1, 0, n);
}
