// The native CPU kernels' one shared header: the entry points each .cpp of this folder defines (the Python module,
// bindings.cpp, and the layer operators of layer_ops.h call them by these prototypes), the attention paths, and the
// per-instruction-set attention kernels that paged_attention.cpp dispatches to.
#pragma once

// ATen, not <torch/extension.h>: pybind11 and torch's C++ API on top of it cost each translation unit 4x the compile
// time, so only bindings.cpp, which registers every Python function and class, includes that.
#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

// ---- Attention paths ----
// The native attention kernels' paths are instruction sets (isa.h): "avx512_bf16" (a bfloat16 pool's K/V multiplied
// as stored by vdpbf16ps; a float32 pool as "avx512"), "avx512" (K/V widened to float32, AVX-512 FMA), "avx2" (8-wide
// AVX2 + FMA; decode only), "portable" (the plain loop, any CPU; decode only). A path takes the next one down where
// it does not apply (a head size other than 32/64/128: the portable loop). Chosen once from the kernel table
// (Python paths.select_paths), and handed to every call.
#include "isa.h"

std::vector<AttentionPath> attention_paths();     // built here, best first
bool attention_path_runs(AttentionPath path);     // built here and runnable on this CPU
AttentionPath best_attention_path();              // the first of attention_paths() that runs
bool bf16_dot_supported();                        // this build and CPU run the avx512_bf16 path
bool prefill_attention_available(int64_t head_dim);

// ---- Entry points (each one coarse call a layer makes; see bindings.cpp for what each does) ----
at::Tensor paged_decode_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                     at::Tensor block_tables, at::Tensor seq_lens, double scale,
                                     AttentionPath path);
at::Tensor paged_prefill_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                      at::Tensor block_tables, at::Tensor seq_lens, at::Tensor query_starts,
                                      double scale, AttentionPath path, Isa prefill_path = Isa::kAvx512);
at::Tensor rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps);
at::Tensor silu_and_mul(at::Tensor gate_up);
// the same of a gate/up product in the AMX kernel's swiglu order (kSwigluHalfPanel gate columns, then their up
// columns, and so on): per element what silu_and_mul gives of the columns put back in order
constexpr int64_t kSwigluHalfPanel = 16;  // layers/linear.py swiglu_interleaved: half of an AMX panel (amx_gemm.cpp)
at::Tensor silu_and_mul_panels(at::Tensor gate_up);
void rope_(at::Tensor x, at::Tensor cos, at::Tensor sin);
at::Tensor argmax_rows(at::Tensor logits);
void write_kv_(at::Tensor key, at::Tensor value, at::Tensor key_cache, at::Tensor value_cache,
               at::Tensor slot_mapping);
std::vector<std::string> small_gemm_paths();
at::Tensor small_gemm_pack(at::Tensor weight, const std::string& path);
at::Tensor small_gemm(at::Tensor x, at::Tensor packed, int64_t n);
// the same panels multiplied by oneDNN's brgemm micro-kernel (panel_brgemm.cpp)
at::Tensor panel_brgemm(at::Tensor x, at::Tensor packed, int64_t n);
bool amx_gemm_available();
bool amx_gemm_takes(int64_t n, int64_t k);
at::Tensor amx_gemm_pack(at::Tensor weight);
at::Tensor amx_gemm(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias, bool emulated,
                       bool swiglu);

#include "paged_args.h"  // the per-instruction-set attention kernels paged_attention.cpp dispatches to
