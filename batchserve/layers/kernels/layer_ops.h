// The operators the layers are made of, as objects the Python layers hold and call (layers/linear.py CpuLinear,
// layers/attention.py paged_attention) and the native decoder loop sequences (decoder_loop.cpp): each is defined here
// once, so the two ways of running a step compute the same thing, bit for bit.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "kernels.h"
#include "lora_args.h"
#include "quant_gemm.h"

// The row counts at which a Projection changes GEMM, one object (layers/linear.py RowSchedule builds it): x @ W below
// small_min_m, the native small-M kernel up to small_max_m, oneDNN's brgemm micro-kernel on the same panels up to
// ukernel_max_m (0: never), oneDNN's packed GEMM below packed_max_m (bf16 rows padded up to packed_min_m), x @ W from
// there; bf16 on AMX: the AMX kernel below amx_max_m, oneDNN from there; bf16 on
// AVX512-BF16 without AMX: the bf16 pair kernel below pair_max_m, oneDNN from there (a projection with pairs and no
// oneDNN copy takes the pairs at every M).
// swiglu_tile_m: a gate/up projection fused with silu_and_mul runs its MLP in row tiles of this many (0: never).
struct RowSchedule {
  int64_t small_min_m = 0, small_max_m = 0, packed_min_m = 0, packed_max_m = 0, amx_max_m = 0, swiglu_tile_m = 0;
  int64_t pair_max_m = 0, ukernel_max_m = 0;
};

// A projection laid out for this CPU's GEMMs (layers/linear.py CpuLinear makes the layouts and the RowSchedule), which
// picks its GEMM by the number of rows M: the native AMX kernel, oneDNN's packed GEMM (bf16 rows padded up to its
// minimum), the native small-M kernel, or x @ W (projection.cpp).
struct Projection {
  at::Tensor weight_t;  // [in, out] (empty when packed_only); its dtype is the GEMM's (float32 for bf16 weights
                           // without bf16 units)
  c10::optional<at::Tensor> bias, packed, small_packed, amx_packed;
  int64_t out_features;
  RowSchedule rows;
  bool packed_only, amx_emulated;
  bool swiglu = false;  // a gate/up projection whose AMX panels are in swiglu order (columns put back by gemm)
  // bf16 pairs for bf16_gemm (bf16_gemm.cpp): when set, M below rows.pair_max_m takes it, and every M where there is
  // no oneDNN copy (deterministic mode, logits: one reduction order per row); float32 out
  c10::optional<at::Tensor> bf16_packed;
  bool float_output = false;  // the result stays in the GEMM's float32 (the output projection: logits), else x's dtype
  // a weight kept quantized (quant_gemm.h): when set, every M takes quant_gemm (weight_t is an empty float32)
  std::shared_ptr<const QuantWeight> quant;

  // x [M, in] -> [M, out] in x's dtype (the GEMM runs in weight_t's).
  at::Tensor operator()(const at::Tensor& x) const;
  // silu(gate) * up of this gate/up projection's output: fused into the AMX GEMM where it takes the rows.
  at::Tensor silu_and_mul_of(const at::Tensor& x) const;
  // This gate/up projection's product in the AMX kernel's swiglu order (16 gate columns, then 16 up columns, and so
  // on: silu_and_mul_panels reads it) where its AMX kernel takes x's rows; else an undefined tensor.
  at::Tensor swiglu_panels_of(const at::Tensor& x) const;

 private:
  at::Tensor gemm(const at::Tensor& x) const;
  at::Tensor quantized(const at::Tensor& x, at::ScalarType wanted) const;
};

// The SwiGLU MLP down(silu(gate) * up) of x; where gate/up is fused with silu_and_mul (AMX), in row tiles of its
// rows.swiglu_tile_m (projection.cpp). The Python MLP and the native decoder loop both call it.
at::Tensor swiglu_mlp(const at::Tensor& x, const Projection& gate_up, const Projection& down);

// The prefill chunks that take the native prefill kernel when longer ones of the same step take SDPA
// (layers/attention.py SeqGroup.native_subset): their rows within the prefill group, their sequences' block tables and
// lengths, and their query starts among those rows.
struct NativeSubset {
  at::Tensor rows, block_tables, seq_lens, query_starts;
};

// One step's attention metadata (layers/attention.py AttentionMetadata): decodes are the batch's first rows, prefill
// chunks the rest; either group may be absent. Built once a step, read by every layer (step_attention.cpp).
struct StepAttention {
  at::Tensor slot_mapping;
  int64_t decode_rows = 0;  // rows 0..decode_rows-1 decode
  c10::optional<at::Tensor> decode_block_tables, decode_seq_lens;
  c10::optional<at::Tensor> prefill_block_tables, prefill_seq_lens, prefill_query_starts;
  std::vector<std::tuple<int64_t, int64_t, int64_t>> spans;  // per prefill chunk: first row, end row, context
  // prefill chunks of at most this many rows take the native prefill kernel (all of them in one call), longer ones
  // one SDPA per sequence; 0: every chunk SDPA (layers/attention.py native_prefill_rows)
  int64_t native_prefill_rows = 0;
  AttentionPath path = AttentionPath::kPortable;  // the native kernels' attention path
  Isa prefill_path = Isa::kAvx512;  // the native prefill kernel's (paged_prefill_attention's prefill_path)
  // per prefill chunk after earlier context (SDPA only): its causal mask shifted by the context, additive (0 / -inf)
  // in the queries' dtype; none for a fresh one
  std::vector<c10::optional<at::Tensor>> chunk_masks;
  // where some chunks take the native kernel and others SDPA: the native ones (none when all take one path)
  c10::optional<NativeSubset> native_subset;
};

// A StepAttention from the Python side's metadata, checked (quant_projection.cpp); the chunk masks of SDPA prefill
// made here, once a step, in `mask_dtype` (the queries').
StepAttention make_step(at::Tensor slot_mapping, int64_t decode_rows, c10::optional<at::Tensor> decode_block_tables,
                        c10::optional<at::Tensor> decode_seq_lens, c10::optional<at::Tensor> prefill_block_tables,
                        c10::optional<at::Tensor> prefill_seq_lens, c10::optional<at::Tensor> prefill_query_starts,
                        std::vector<std::tuple<int64_t, int64_t, int64_t>> spans, int64_t native_prefill_rows,
                        AttentionPath path, at::ScalarType mask_dtype, Isa prefill_path = Isa::kAvx512);

// A weight kept quantized (quant_gemm.h) from its codes, scales and minimums, checked, on `path` ("avx512_vnni",
// "avx512", "avx2", "portable"), repacked once for W8A8 or AMX where those take it (quant_projection.cpp).
std::shared_ptr<const QuantWeight> quant_weight(at::Tensor codes, at::Tensor scales, int64_t bits, int64_t group,
                                                const std::string& path, int64_t small_max_m,
                                                c10::optional<at::Tensor> mins = c10::nullopt,
                                                bool bf16_tiles = false, int64_t act_block = 0,
                                                int64_t amx_min_m = 0, bool amx_emulated = false);

// A quantized KV pool (kv_cache_dtype "int8" or "fp8_e4m3", layers/kv_quant.py QuantizedKV): int8 or float8 e4m3
// codes K and V [N, block_size, Hkv, D] and a float32 scale per (slot, KV head) for each [N, block_size, Hkv].
struct QuantizedPool {
  at::Tensor key, value, key_scale, value_scale;
};

// Attention of one layer over a step: this step's K/V stored at their pool slots, then the decode rows and the
// prefill rows each on their own path. q [T, H, D], k/v [T, Hkv, D] -> [T, H, D] in q's dtype. With scales the pool
// is quantized (QuantizedPool): K/V quantized as stored, decode reading the codes in place, prefill rows attending
// (SDPA) to the K/V as stored, dequantized.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& key_cache, const at::Tensor& value_cache,
                              const StepAttention& step, double scale,
                              const c10::optional<at::Tensor>& key_scale = c10::nullopt,
                              const c10::optional<at::Tensor>& value_scale = c10::nullopt);

// composed_ops.cpp: operators the Python layers write as torch code, here as the same ATen calls in the same order
// (so that the native decoder loop's rows are theirs bit for bit).
// layers/windowed_attention.py windowed_attention: a layer with a sliding window (> 0) and/or soft-capped scores
// (softcap > 0), this step's K/V already in the pool; q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]. `decode_windows`
// keeps each window's decode block ids and visible slots for the step's later layers (the Python code's per-step cache).
using DecodeWindows = std::vector<std::tuple<int64_t, at::Tensor, at::Tensor>>;
at::Tensor windowed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& key_cache,
                              const at::Tensor& value_cache, const StepAttention& step, double scale, int64_t window,
                              double softcap, int64_t query_tile, DecodeWindows& decode_windows);
// layers/moe.py SparseMoE.forward: x [T, H] -> [T, H]; experts: each expert's gate/up then down projection.
at::Tensor moe_mlp(const at::Tensor& x, const at::Tensor& router, const std::vector<Projection>& experts, int64_t top_k,
                   bool normalize);
// layers/activation.py gelu_tanh_and_mul: gelu_tanh(gate) * up of a gate/up projection's output [T, 2I]
at::Tensor gelu_tanh_and_mul(const at::Tensor& gate_up);

// lora_op.cpp: LoRA deltas on a projection's output (layers/lora.py), the kernel of lora_tiles.h.
// One projection's adapter slots (layers/lora.py LoRASlots): a [S, R, in], b [S, packed values] (lora_args.h),
// present [S] uint8, the slices of its fused output. Default-constructed (a undefined): the projection serves no adapters.
struct LoraWeights {
  at::Tensor a, b, present;
  std::vector<LoraSlice> slices;
  bool defined() const { return a.defined(); }
};
// One step's tokens grouped by adapter (layers/lora.py LoRAStep): group g's slot, rank, scale and rows
// rows[offsets[g]..offsets[g + 1]) and the kernel's path. Empty: the step runs the base model alone.
struct LoraBatch {
  std::vector<int64_t> slot, rank, offsets;
  std::vector<float> scale;
  at::Tensor rows;
  int64_t max_row = -1;
  Isa path = Isa::kPortable;
  bool empty() const { return slot.empty(); }
};
LoraWeights make_lora_weights(at::Tensor a, at::Tensor b, at::Tensor present,
                              const std::vector<std::tuple<int64_t, int64_t>>& slices);
LoraBatch make_lora_batch(std::vector<int64_t> slot, std::vector<int64_t> rank, const std::vector<double>& scale,
                          at::Tensor rows, std::vector<int64_t> offsets, Isa path);
// y [T, out] (the projection's fresh output of x [T, in]) += each group's scale * (x_g @ A^T) @ B, in place
void lora_add_(const at::Tensor& x, const at::Tensor& y, const LoraWeights& weights, const LoraBatch& batch);
// the same on a gate/up projection's output in the AMX kernel's swiglu order (Projection::swiglu_panels_of: 16 gate
// columns, then 16 up columns, and so on), so that silu_and_mul_panels reads it without a copy back to [gate | up]
void lora_add_swiglu_panels_(const at::Tensor& x, const at::Tensor& y, const LoraWeights& weights,
                             const LoraBatch& batch);

// kv_quantized.cpp: whether a pool element type is a quantized one (int8, float8 e4m3); k/v [T, Hkv, D] quantized into
// the pool's slots -> (k, v) as stored, dequantized, in k's dtype; a pool's blocks dequantized to dtype
// [len(blocks), block_size, Hkv, D]
bool is_quantized_pool_type(at::ScalarType type);
std::tuple<at::Tensor, at::Tensor> write_kv_quantized_(const at::Tensor& k, const at::Tensor& v, const QuantizedPool& pool,
                                                  const at::Tensor& slot_mapping);
at::Tensor dequantized_blocks(const at::Tensor& cache, const at::Tensor& scales, const at::Tensor& blocks,
                              at::ScalarType dtype);
// decode_quantized_kv.cpp: decode attention reading a quantized pool's codes in place on `path`; query [B, H, D]
// float32 -> [B, H, D] float32
at::Tensor paged_decode_quantized(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, double scale, AttentionPath path);

// bf16_gemm.cpp: x [M, K] bf16 @ W -> [M, n] float32 by AVX512-BF16, in one reduction order per row whatever M.
bool bf16_gemm_available();
at::Tensor bf16_gemm_pack(at::Tensor weight);
at::Tensor bf16_gemm(at::Tensor x, at::Tensor packed, int64_t n);
