// A step's decoder layers in one native call: the same operators, in the same order and on the same tensors, as the
// Python layers (models/llama.py DecoderLayer, layers/linear.py CpuLinear, layers/attention.py), so its
// output is bit for bit theirs. What it saves is the interpreter: ~20 Python-level torch calls a layer, which at 30
// layers were 6-10 ms of every step (a 32-sequence decode step: 40-43 -> 33-34 ms; Intel Xeon with AMX, bf16).
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <string>
#include <vector>

#include "kernels.h"

namespace {

// torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""): oneDNN's GEMM on a weight reordered once.
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(packed);
  stack.emplace_back(bias.has_value() ? c10::IValue(*bias) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<c10::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace

// One CpuLinear's layouts and its choice of GEMM by rows (layers/linear.py CpuLinear._forward, same thresholds).
struct Projection {
  torch::Tensor weight_t;  // [in, out] (empty when packed_only); its dtype is the GEMM's (float32 for bf16 weights
                           // without bf16 units)
  c10::optional<torch::Tensor> bias, packed, small_packed, amx_packed;
  int64_t out_features, small_max_m, small_min_m, packed_min_m, packed_max_m, amx_max_m;
  bool packed_only, amx_emulated;
  bool swiglu = false;  // a gate/up projection whose AMX panels are in swiglu order: AMX only through silu_and_mul

  // silu(gate) * up of this gate/up projection's output: fused into the AMX GEMM where it takes the rows
  torch::Tensor silu_and_mul_of(const torch::Tensor& x) const {
    if (swiglu && x.size(0) < amx_max_m && x.scalar_type() == weight_t.scalar_type())
      return amx_gemm(x, *amx_packed, c10::nullopt, amx_emulated, true);
    return silu_and_mul((*this)(x));
  }

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (x.scalar_type() != weight_t.scalar_type()) return gemm(x.to(weight_t.scalar_type())).to(x.scalar_type());
    return gemm(x);
  }

  torch::Tensor gemm(const torch::Tensor& x) const {
    const int64_t m = x.size(0);
    if (packed_only) {
      if (amx_packed.has_value() && m < amx_max_m && !swiglu)  // swiglu panels: only through silu_and_mul_of
        return amx_gemm(x, *amx_packed, bias, amx_emulated, false);
      if (m < packed_min_m)
        return packed_linear(torch::cat({x, x.new_zeros({packed_min_m - m, x.size(1)})}), *packed, bias).narrow(0, 0, m);
      return packed_linear(x, *packed, bias);
    }
    torch::Tensor out;
    if (m < small_min_m) {
      out = torch::matmul(x, weight_t);
    } else if (small_packed.has_value() && m <= small_max_m) {
      out = small_gemm(x, *small_packed, out_features);
    } else if (packed.has_value() && m < packed_max_m) {
      return packed_linear(x, *packed, bias);
    } else {
      out = torch::matmul(x, weight_t);
    }
    return bias.has_value() ? out + *bias : out;
  }
};

struct DecoderLayerWeights {
  torch::Tensor input_norm, post_attention_norm;
  Projection qkv, o, gate_up, down;
};

// One step's attention metadata (layers/attention.py AttentionMetadata): decodes are the batch's first rows, prefill
// chunks the rest; either group may be absent.
struct StepAttention {
  torch::Tensor slot_mapping;
  int64_t decode_rows = 0;  // rows 0..decode_rows-1 decode
  c10::optional<torch::Tensor> decode_block_tables, decode_seq_lens;
  c10::optional<torch::Tensor> prefill_block_tables, prefill_seq_lens, prefill_query_starts;
  std::vector<std::tuple<int64_t, int64_t, int64_t>> spans;  // per prefill chunk: first row, end row, context
  std::string prefill_mode;  // "sdpa" (one fused attention per chunk) or "native" (the native prefill kernel)
  AttentionPath path;        // the native kernels' attention path
};

// Per prefill chunk after earlier context: its causal mask shifted by the context (SeqGroup.chunk_mask); none for a
// fresh prompt. Built once a step, read by every layer.
using ChunkMasks = std::vector<c10::optional<torch::Tensor>>;

class DecoderLoop {
 public:
  DecoderLoop(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale) {}

  void add_layer(torch::Tensor input_norm, torch::Tensor post_attention_norm, Projection qkv, Projection o,
                 Projection gate_up, Projection down) {
    layers_.push_back({std::move(input_norm), std::move(post_attention_norm), std::move(qkv), std::move(o),
                       std::move(gate_up), std::move(down)});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x [T, H] (the step's embedded tokens) -> (x, residual) after the last layer, before the final norm.
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                                                   const std::vector<torch::Tensor>& key_caches,
                                                   const std::vector<torch::Tensor>& value_caches,
                                                   const StepAttention& step) const {
    TORCH_CHECK(key_caches.size() == layers_.size() && value_caches.size() == layers_.size(),
                "one K and one V cache per layer");
    TORCH_CHECK(step.decode_rows == x.size(0) || step.prefill_block_tables.has_value(), "rows without a group");
    ChunkMasks masks;
    if (step.prefill_mode == "sdpa")
      for (const auto& [start, stop, context] : step.spans)
        masks.push_back(context == 0 ? c10::optional<torch::Tensor>()
                                     : torch::ones({stop - start, context + stop - start},
                                                   x.options().dtype(torch::kBool))
                                           .tril(context));
    const int64_t tokens = x.size(0), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    torch::Tensor residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const DecoderLayerWeights& layer = layers_[i];
      torch::Tensor h;
      if (i == 0) {
        residual = x;
        h = rms_norm(x, c10::nullopt, layer.input_norm, eps_);
      } else {
        h = rms_norm(x, residual, layer.input_norm, eps_);
      }
      const torch::Tensor qkv = layer.qkv(h);
      const auto parts = qkv.split_with_sizes({q_size + kv_size, kv_size}, -1);
      const torch::Tensor qk = parts[0].view({tokens, num_heads_ + num_kv_heads_, head_dim_});
      rope_(qk, cos, sin);
      const auto q_k = qk.split_with_sizes({num_heads_, num_kv_heads_}, 1);
      const torch::Tensor v = parts[1].view({tokens, num_kv_heads_, head_dim_});
      const torch::Tensor attn = attention(q_k[0], q_k[1], v, key_caches[i], value_caches[i], step, masks);
      h = layer.o(attn.reshape({tokens, q_size}));
      h = rms_norm(h, residual, layer.post_attention_norm, eps_);
      x = layer.down(layer.gate_up.silu_and_mul_of(h));
    }
    return {x, residual};
  }

 private:
  // layers/attention.py paged_attention: store the step's K/V, then each group on its own path.
  torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                          const StepAttention& step, const ChunkMasks& masks) const {
    write_kv_(k, v, key_cache, value_cache, step.slot_mapping);
    const int64_t tokens = q.size(0), d = step.decode_rows;
    if (d == tokens) return decode(q, key_cache, value_cache, step);
    if (d == 0) return prefill(q, k, v, key_cache, value_cache, step, masks);
    auto out = torch::empty_like(q);
    out.narrow(0, 0, d).copy_(decode(q.narrow(0, 0, d), key_cache, value_cache, step));
    out.narrow(0, d, tokens - d)
        .copy_(prefill(q.narrow(0, d, tokens - d), k.narrow(0, d, tokens - d), v.narrow(0, d, tokens - d), key_cache,
                       value_cache, step, masks));
    return out;
  }

  torch::Tensor decode(const torch::Tensor& q, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                       const StepAttention& step) const {
    return paged_decode_attention(q.to(torch::kFloat32).contiguous(), key_cache, value_cache,
                                  *step.decode_block_tables, *step.decode_seq_lens, scale_, step.path)
        .to(q.scalar_type());
  }

  torch::Tensor prefill(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                        const StepAttention& step, const ChunkMasks& masks) const {
    if (step.prefill_mode == "native")
      return paged_prefill_attention(q.to(torch::kFloat32), key_cache, value_cache, *step.prefill_block_tables,
                                     *step.prefill_seq_lens, *step.prefill_query_starts, scale_, step.path)
          .to(q.scalar_type());
    // layers/attention.py _per_sequence_prefill_attention
    auto out = torch::empty_like(q);
    const bool gqa = q.size(1) != k.size(1);
    const int64_t block_size = key_cache.size(1);
    for (size_t i = 0; i < step.spans.size(); ++i) {
      const auto [start, stop, context] = step.spans[i];
      const auto qs = q.slice(0, start, stop).transpose(0, 1).unsqueeze(0);
      torch::Tensor o;
      if (context == 0) {
        o = at::scaled_dot_product_attention(qs, k.slice(0, start, stop).transpose(0, 1).unsqueeze(0),
                                             v.slice(0, start, stop).transpose(0, 1).unsqueeze(0), {}, 0.0, true,
                                             scale_, gqa);
      } else {
        const int64_t num_keys = context + stop - start;
        const auto blocks = step.prefill_block_tables->select(0, i).slice(0, 0, (num_keys + block_size - 1) / block_size);
        const auto sequence = [&](const torch::Tensor& cache) {
          return cache.index_select(0, blocks)
              .view({-1, num_kv_heads_, head_dim_})
              .slice(0, 0, num_keys)
              .transpose(0, 1)
              .unsqueeze(0)
              .to(q.scalar_type());
        };
        o = at::scaled_dot_product_attention(qs, sequence(key_cache), sequence(value_cache), masks[i], 0.0,
                                             false, scale_, gqa);
      }
      out.slice(0, start, stop).copy_(o.select(0, 0).transpose(0, 1));
    }
    return out;
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  std::vector<DecoderLayerWeights> layers_;
};

void register_decoder_loop(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<Projection>(m, "Projection")
      .def(py::init([](torch::Tensor weight_t, c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> packed,
                       c10::optional<torch::Tensor> small_packed, int64_t out_features, int64_t small_max_m,
                       int64_t small_min_m, int64_t packed_min_m, int64_t packed_max_m, bool packed_only,
                       c10::optional<torch::Tensor> amx_packed, int64_t amx_max_m, bool amx_emulated, bool swiglu) {
             TORCH_CHECK(!packed_only || packed.has_value(), "packed_only needs a packed weight");
             TORCH_CHECK(!swiglu || (packed_only && amx_packed.has_value() && !bias.has_value()),
                         "swiglu: a packed-only gate/up projection with AMX panels and no bias");
             return Projection{std::move(weight_t), std::move(bias),  std::move(packed), std::move(small_packed),
                               std::move(amx_packed), out_features, small_max_m,       small_min_m,
                               packed_min_m,          packed_max_m, amx_max_m,         packed_only,
                               amx_emulated,          swiglu};
           }),
           py::arg("weight_t"), py::arg("bias"), py::arg("packed"), py::arg("small_packed"), py::arg("out_features"),
           py::arg("small_max_m"), py::arg("small_min_m"), py::arg("packed_min_m"), py::arg("packed_max_m"),
           py::arg("packed_only"), py::arg("amx_packed") = c10::optional<torch::Tensor>(), py::arg("amx_max_m") = 0,
           py::arg("amx_emulated") = false, py::arg("swiglu") = false);
  py::class_<StepAttention>(m, "StepAttention")
      .def(py::init([](torch::Tensor slot_mapping, int64_t decode_rows, c10::optional<torch::Tensor> decode_block_tables,
                       c10::optional<torch::Tensor> decode_seq_lens, c10::optional<torch::Tensor> prefill_block_tables,
                       c10::optional<torch::Tensor> prefill_seq_lens, c10::optional<torch::Tensor> prefill_query_starts,
                       std::vector<std::tuple<int64_t, int64_t, int64_t>> spans, std::string prefill_mode,
                       AttentionPath path) {
             TORCH_CHECK(decode_rows == 0 || (decode_block_tables.has_value() && decode_seq_lens.has_value()),
                         "decode rows need their block tables and lengths");
             TORCH_CHECK(!prefill_block_tables.has_value() || prefill_mode == "sdpa" ||
                             (prefill_mode == "native" && prefill_query_starts.has_value()),
                         "prefill chunks attend by sdpa or the native kernel (with their query starts)");
             return StepAttention{std::move(slot_mapping), decode_rows, std::move(decode_block_tables),
                                  std::move(decode_seq_lens), std::move(prefill_block_tables),
                                  std::move(prefill_seq_lens), std::move(prefill_query_starts), std::move(spans),
                                  std::move(prefill_mode), path};
           }),
           py::arg("slot_mapping"), py::arg("decode_rows"), py::arg("decode_block_tables"), py::arg("decode_seq_lens"),
           py::arg("prefill_block_tables"), py::arg("prefill_seq_lens"), py::arg("prefill_query_starts"),
           py::arg("spans"), py::arg("prefill_mode"), py::arg("path"));
  py::class_<DecoderLoop>(m, "DecoderLoop")
      .def(py::init<int64_t, int64_t, int64_t, double, double>(), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("eps"), py::arg("scale"))
      .def("add_layer", &DecoderLoop::add_layer)
      .def("num_layers", &DecoderLoop::num_layers)
      .def("forward", &DecoderLoop::forward, "a step's decoder layers -> (x, residual)",
           py::call_guard<py::gil_scoped_release>());
}
