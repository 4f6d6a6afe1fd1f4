// The layer operators' objects as the Python side hands them over (bindings.cpp binds these): a weight kept quantized
// (quant_gemm.h), checked and laid out once at load, which a Projection (CpuLinear's quantized counterpart,
// layers/quantization.py QuantizedLinear, and the native decoder loop) calls like any other; and one step's
// attention metadata (StepAttention).
#include "aten_pch.h"  // first: the precompiled torch headers (build.py)

#include <limits>
#include <memory>
#include <string>

#include "layer_ops.h"

namespace {

QuantPath path_named(const std::string& name) {
  if (name == "avx512_vnni") return QuantPath::kAvx512Vnni;
  if (name == "avx512") return QuantPath::kAvx512;
  if (name == "avx2") return QuantPath::kAvx2;
  TORCH_CHECK(name == "portable", "quantized GEMM path: avx512_vnni, avx512, avx2 or portable, not ", name);
  return QuantPath::kPortable;
}

}  // namespace

std::shared_ptr<const QuantWeight> quant_weight(at::Tensor codes, at::Tensor scales, int64_t bits, int64_t group,
                                                const std::string& path, int64_t small_max_m,
                                                c10::optional<at::Tensor> mins, bool bf16_tiles, int64_t act_block,
                                                int64_t amx_min_m, bool amx_emulated) {
  TORCH_CHECK(bits == 8 || bits == 4, "quantized weight: 8 or 4 bits, not ", bits);
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous(), "codes: [N, K] (int8) or [N, K / 2] (packed int4)");
  TORCH_CHECK(codes.scalar_type() == (bits == 8 ? at::kChar : at::kByte), "codes: int8 for 8 bits, uint8 for 4");
  const int64_t N = codes.size(0), K = bits == 8 ? codes.size(1) : codes.size(1) * 2;
  TORCH_CHECK(K % 32 == 0 && group > 0 && (group == 16 || group % 32 == 0) && K % group == 0,
              "group: 16 or a multiple of 32 dividing K = ", K, " (a multiple of 32)");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == N && scales.size(1) == K / group,
              "scales: [N, K / group] float32");
  TORCH_CHECK(!mins.has_value() || (mins->scalar_type() == at::kFloat && mins->is_contiguous() &&
                                    mins->sizes() == scales.sizes()),
              "mins: float32 shaped as the scales");
  auto w = std::make_shared<QuantWeight>();
  if (mins.has_value()) w->mins = std::move(*mins);
  w->codes = std::move(codes);
  w->scales = std::move(scales);
  w->bits = bits;
  w->group = group;
  w->in_features = K;
  w->out_features = N;
  w->small_max_m = small_max_m;
  w->bf16_tiles = bf16_tiles;
  w->path = path_named(path);
  TORCH_CHECK(act_block == 0 || act_block == 16 || act_block % 32 == 0,
              "act_block: 0 (the whole row), 16 or a multiple of 32");
  w->act_block = act_block;
  const bool w8a8 = w->path == QuantPath::kAvx512Vnni && w8a8_supported(*w);
  w->amx_min_m = w8a8_supported(*w) ? amx_min_m : 0;  // AMX reads W8A8's layout
  w->amx_emulated = amx_emulated;
  if (w8a8 || w->amx_min_m > 0) w8a8_pack(*w);  // once, at load
  if (w8a8) {
    // every M takes W8A8 or AMX: the repacked copies are the only ones read; the caller may free its codes, scales
    // and minimums (quant_codes_kept)
    w->codes = w->scales = w->mins = at::Tensor();
  }
  return w;
}

namespace {

// A chunk's causal mask shifted by its context, [rows, context + rows], as SDPA adds it to the scores: 0 where query
// row r sees key j (j <= context + r), -inf elsewhere, in the queries' dtype. SDPA turns a bool mask into exactly this
// on every call, which was a [rows, context + rows] pass per layer; made here once a step, the output is bit-equal.
at::Tensor additive_chunk_mask(int64_t rows, int64_t context, at::ScalarType dtype) {
  const auto hidden = at::ones({rows, context + rows}, at::TensorOptions().dtype(at::kBool)).triu(context + 1);
  return at::zeros({rows, context + rows}, at::TensorOptions().dtype(dtype))
      .masked_fill_(hidden, -std::numeric_limits<double>::infinity());
}

}  // namespace

StepAttention make_step(at::Tensor slot_mapping, int64_t decode_rows, c10::optional<at::Tensor> decode_block_tables,
                        c10::optional<at::Tensor> decode_seq_lens, c10::optional<at::Tensor> prefill_block_tables,
                        c10::optional<at::Tensor> prefill_seq_lens, c10::optional<at::Tensor> prefill_query_starts,
                        std::vector<std::tuple<int64_t, int64_t, int64_t>> spans, int64_t native_prefill_rows,
                        AttentionPath path, at::ScalarType mask_dtype, Isa prefill_path) {
  TORCH_CHECK(decode_rows == 0 || (decode_block_tables.has_value() && decode_seq_lens.has_value()),
              "decode rows need their block tables and lengths");
  TORCH_CHECK(native_prefill_rows >= 0, "native_prefill_rows: a row count, 0 for none");
  TORCH_CHECK(native_prefill_rows == 0 || (prefill_query_starts.has_value() && prefill_block_tables.has_value() &&
                                           prefill_seq_lens.has_value()),
              "the native prefill kernel needs block tables, lengths and query starts");
  StepAttention step{std::move(slot_mapping),         decode_rows,          std::move(decode_block_tables),
                     std::move(decode_seq_lens),      std::move(prefill_block_tables), std::move(prefill_seq_lens),
                     std::move(prefill_query_starts), std::move(spans),     native_prefill_rows, path, prefill_path,
                     {},                              {}};
  std::vector<int64_t> native_seqs, native_rows, native_starts{0};
  for (size_t i = 0; i < step.spans.size(); ++i) {
    const auto [start, stop, context] = step.spans[i];
    const bool native = stop - start <= native_prefill_rows;
    step.chunk_masks.push_back(native || context == 0 ? c10::optional<at::Tensor>()
                                                      : additive_chunk_mask(stop - start, context, mask_dtype));
    if (!native) continue;
    native_seqs.push_back(static_cast<int64_t>(i));
    for (int64_t r = start; r < stop; ++r) native_rows.push_back(r);
    native_starts.push_back(native_starts.back() + stop - start);
  }
  if (!native_seqs.empty() && native_seqs.size() < step.spans.size()) {
    const auto index = [](const std::vector<int64_t>& v) { return at::tensor(v, at::TensorOptions().dtype(at::kLong)); };
    const auto seqs = index(native_seqs);
    step.native_subset = NativeSubset{index(native_rows), step.prefill_block_tables->index_select(0, seqs),
                                      step.prefill_seq_lens->index_select(0, seqs), index(native_starts)};
  }
  return step;
}

