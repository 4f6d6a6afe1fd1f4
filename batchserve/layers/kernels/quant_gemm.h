// Weights kept quantized (layers/quantization.py): int8 or packed int4 codes with group-wise float32 scales, and the
// GEMM that reads them as stored (quant_gemm.cpp). A Projection (layer_ops.h) holding one runs it at every M.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

// The instruction-set paths of the quantized GEMM, best first as Python lists them (kernels.QUANT_GEMM_PATHS).
enum class QuantPath { kPortable, kAvx2, kAvx512 };

// Codes in 32-k subblocks: bits 8: int8 [N, K], value = code * scale; bits 4: uint8 [N, K / 2], per 32 k 16 bytes,
// byte j's low nibble is k = j and its high nibble k = j + 16 (GGUF Q4_0's order), value = (nibble - 8) * scale.
// scales [N, K / group] float32; group 16 (GGUF Q6_K's) or a multiple of 32 dividing K (int8 per output channel:
// group = K). mins: undefined, or [N, K / group] float32 added per group (value = code * scale + min: GGUF's Q4_1 and
// K-quants' minimum; the GEMM adds min times the activations' group sums, formed once per row of x).
struct QuantWeight {
  at::Tensor codes, scales, mins;
  int64_t bits = 8, group = 32, in_features = 0, out_features = 0;
  int64_t small_max_m = 16;  // up to here every row block reads the codes in registers; above, dequantized tiles + mm
  bool bf16_tiles = false;  // above small_max_m: tiles and activations rounded to bf16 for the bf16 GEMM (bf16 models)
  QuantPath path = QuantPath::kPortable;
};

// x [M, K] float32 -> [M, N] float32: x @ dequantized(W).T
at::Tensor quant_gemm(const at::Tensor& x, const QuantWeight& w);
// the weight dequantized to float32 [N, K] (tests, the torch fallback)
at::Tensor quant_dequantize(const QuantWeight& w);
std::vector<std::string> quant_gemm_paths();  // built here and runnable on this CPU, best first
