// Weights kept quantized (layers/quantization.py): int8 or packed int4 codes with group-wise float32 scales, and the
// GEMM that reads them as stored (quant_gemm.cpp). A Projection (layer_ops.h) holding one runs it at every M.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

// The instruction-set paths of the quantized GEMM, best first as Python lists them (kernels.QUANT_GEMM_PATHS).
// kAvx512Vnni: W8A8 (quant_w8a8.cpp) at every M where the weight allows it, else kAvx512's paths.
enum class QuantPath { kPortable, kAvx2, kAvx512, kAvx512Vnni };

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
  // W8A8 (quant_w8a8.cpp), path kAvx512Vnni: the codes repacked once for vpdpbusd, scales / mins per 16 columns;
  // undefined where not packed. When packed every M takes it; activations quantized per row and act_block k
  // (0: the whole row).
  at::Tensor w8a8_codes, w8a8_scales, w8a8_mins;  // scales / mins float16 where every value is one, else float32
  bool w8a8_add_eight_scales = false;  // 4 bits: w8a8_mins hold the minimum at nibble 0, the kernel adds 8 x scale
  int64_t act_block = 0;
  // From amx_min_m rows (0: never) a bf16 x takes quant_amx.cpp: the W8A8-packed weight dequantized into AMX's bf16
  // tiles (amx_emulated: the tile operations in scalar code, for tests). Packed for it on any path.
  int64_t amx_min_m = 0;
  bool amx_emulated = false;
};

// x [M, K] float32 -> [M, N] float32: x @ dequantized(W).T; W8A8 also takes bf16 x and returns out_dtype (float32 or
// bf16) directly, the other paths convert
at::Tensor quant_gemm(const at::Tensor& x, const QuantWeight& w, at::ScalarType out_dtype = at::kFloat);
// the weight dequantized to float32 [N, K] (tests, the torch fallback)
at::Tensor quant_dequantize(const QuantWeight& w);
std::vector<std::string> quant_gemm_paths();  // built here and runnable on this CPU, best first
// quant_w8a8.cpp
bool w8a8_built();                          // compiled with AVX512-VNNI
bool w8a8_supported(const QuantWeight& w);  // groups of whole 32-k subblocks (not GGUF Q6_K's 16)
void w8a8_pack(QuantWeight& w);             // sets w8a8_codes / _scales / _mins from codes, scales, mins
// x [M, K] float32 or bf16 -> out [M, N] float32 or bf16 (both contiguous)
void w8a8_gemm(const at::Tensor& x, const QuantWeight& w, const at::Tensor& out);
// quant_amx.cpp
bool quant_amx_available();                                        // built with AMX, and this process may use it
bool quant_amx_takes(const QuantWeight& w, const at::Tensor& x);  // whether x's GEMM runs on the tiles
void quant_amx_gemm(const at::Tensor& x, const QuantWeight& w, const at::Tensor& out);  // x bf16 -> out (contiguous)
at::Tensor quant_amx_panels(const QuantWeight& w, bool vectorized);  // every pair's B tiles (tests, benchmarks)
bool quant_amx_vectorized();  // the dequantization runs in AVX-512 here
