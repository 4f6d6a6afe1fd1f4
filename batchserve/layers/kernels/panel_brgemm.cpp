// x [M, K] @ W -> [M, N] float32 by oneDNN's brgemm micro-kernel (torch's at::native::cpublas::brgemm) on the small-M
// kernel's panels (small_gemm.cpp: [N / P, K, P], P output columns each). Projection takes it for the rows its
// RowSchedule gives it (ukernel_max_m; layers/linear.py CpuLinear.HALVES_UKERNEL_MAX_M).
//
// Why: on a CPU that runs AVX-512 in two halves, oneDNN's packed GEMM beat our vector kernel per CPU second from 8
// rows, but it splits a narrow projection unevenly over two threads (a 576-column weight is nine 64-column blocks,
// one thread gets five), and the calling thread also carries its per-call set-up. The micro-kernel is oneDNN's code
// for the inner block with none of that: torch caches one per shape and thread, so a call costs a hash look-up, and
// the panels split evenly (576 columns: 18 panels, 9 a thread). Each panel is one call over all of K, so a row's sum
// runs in one order whichever thread computes it. Without oneDNN's micro-kernel in the torch build, torch's brgemm
// falls back to its plain GEMM on the same operands (correct, slower).
#include "aten_pch.h"  // first: the precompiled torch headers (build.py)

#include <ATen/native/CPUBlas.h>

#include "kernels.h"

// x [M, K] float32 @ small_gemm_pack's panels [panels, K, P] -> [M, n] float32, panels split evenly over the threads
at::Tensor panel_brgemm(at::Tensor x, at::Tensor packed, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: [M, K] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kFloat,
              "packed: [panels, K, P] float32 from small_gemm_pack");
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), panels = packed.size(0), P = packed.size(2);
  TORCH_CHECK(packed.size(1) == K && K > 0, "x and the packed weight disagree on K");
  TORCH_CHECK(n > (panels - 1) * P && n <= panels * P, "n is not the packed weight's column count");
  auto out = at::empty({M, n}, xc.options());
  if (M == 0) return out;
  const float* a = xc.data_ptr<float>();
  const float* w = packed.data_ptr<float>();
  float* c = out.data_ptr<float>();
  // contiguous runs of panels, as even as the count allows (at::parallel_for cuts [0, panels) into equal chunks)
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t columns = std::min(P, n - p * P);  // the last panel's zero padding is never written out
      at::native::cpublas::brgemm(M, columns, K, /*ld_a=*/K, /*ld_b=*/P, /*ld_c=*/n, /*add_C=*/false, a,
                                  w + p * K * P, c + p * P, /*is_vnni=*/false);
    }
  });
  return out;
}
