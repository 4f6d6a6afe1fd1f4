// A step's decoder layers in one native call. It only sequences the operators the Python layers call
// (models/llama.py DecoderLayer: rms_norm, the Projections, rope_, paged_attention, silu_and_mul; layer_ops.h), in the
// same order on the same tensors, so its output is bit for bit theirs. What it saves is the interpreter: some twenty
// Python-level calls a layer, which add up over a model's layers at every step.
#include <string>
#include <vector>

#include <torch/extension.h>  // pybind11: this file registers its classes

#include "layer_ops.h"

namespace {

// What the loop computes, in the names of layers/capabilities.py Capability: a model is run here only if it declares
// nothing else (models/llama.py checks, and says in the log what is missing). Tied embeddings are outside the layers.
const std::vector<std::string> kCapabilities = {"rope", "rms_norm", "gqa", "swiglu", "qkv_bias", "o_bias",
                                                "tied_embeddings"};

struct DecoderLayerWeights {
  at::Tensor input_norm, post_attention_norm;
  Projection qkv, o, gate_up, down;
};

class DecoderLoop {
 public:
  DecoderLoop(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale) {}

  void add_layer(at::Tensor input_norm, at::Tensor post_attention_norm, Projection qkv, Projection o,
                 Projection gate_up, Projection down) {
    layers_.push_back({std::move(input_norm), std::move(post_attention_norm), std::move(qkv), std::move(o),
                       std::move(gate_up), std::move(down)});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x [T, H] (the step's embedded tokens) -> (x, residual) after the last layer, before the final norm.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x, at::Tensor cos, at::Tensor sin,
                                                   const std::vector<at::Tensor>& key_caches,
                                                   const std::vector<at::Tensor>& value_caches,
                                                   const StepAttention& step,
                                                   const std::vector<at::Tensor>& key_scales,
                                                   const std::vector<at::Tensor>& value_scales) const {
    TORCH_CHECK(key_caches.size() == layers_.size() && value_caches.size() == layers_.size(),
                "one K and one V cache per layer");
    const bool quantized = !key_scales.empty();
    TORCH_CHECK(!quantized || (key_scales.size() == layers_.size() && value_scales.size() == layers_.size()),
                "a quantized pool: one K and one V scale tensor per layer");
    at::Tensor residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const DecoderLayerWeights& layer = layers_[i];
      at::Tensor h;
      if (i == 0) {
        residual = x;
        h = rms_norm(x, c10::nullopt, layer.input_norm, eps_);
      } else {
        h = rms_norm(x, residual, layer.input_norm, eps_);
      }
      h = attention(layer, h, cos, sin, key_caches[i], value_caches[i], step,
                    quantized ? c10::optional<at::Tensor>(key_scales[i]) : c10::nullopt,
                    quantized ? c10::optional<at::Tensor>(value_scales[i]) : c10::nullopt);
      h = rms_norm(h, residual, layer.post_attention_norm, eps_);
      x = layer.down(layer.gate_up.silu_and_mul_of(h));
    }
    return {x, residual};
  }

 private:
  // models/llama.py Attention.forward
  at::Tensor attention(const DecoderLayerWeights& layer, const at::Tensor& h, const at::Tensor& cos,
                          const at::Tensor& sin, const at::Tensor& key_cache, const at::Tensor& value_cache,
                          const StepAttention& step, const c10::optional<at::Tensor>& key_scale,
                          const c10::optional<at::Tensor>& value_scale) const {
    const int64_t tokens = h.size(0), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    const auto parts = layer.qkv(h).split_with_sizes({q_size + kv_size, kv_size}, -1);
    const at::Tensor qk = parts[0].view({tokens, num_heads_ + num_kv_heads_, head_dim_});
    rope_(qk, cos, sin);
    const auto q_k = qk.split_with_sizes({num_heads_, num_kv_heads_}, 1);
    const at::Tensor v = parts[1].view({tokens, num_kv_heads_, head_dim_});
    const at::Tensor out =
        paged_attention(q_k[0], q_k[1], v, key_cache, value_cache, step, scale_, key_scale, value_scale);
    return layer.o(out.reshape({tokens, q_size}));
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  std::vector<DecoderLayerWeights> layers_;
};

}  // namespace

void register_decoder_loop(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<DecoderLoop>(m, "DecoderLoop")
      .def(py::init<int64_t, int64_t, int64_t, double, double>(), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("eps"), py::arg("scale"))
      .def_static("capabilities", [] { return kCapabilities; }, "what the loop computes (Capability values)")
      .def("add_layer", &DecoderLoop::add_layer)
      .def("num_layers", &DecoderLoop::num_layers)
      .def("forward", &DecoderLoop::forward, "a step's decoder layers -> (x, residual); scales: a quantized pool's",
           py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("cos"), py::arg("sin"),
           py::arg("key_caches"), py::arg("value_caches"), py::arg("step"),
           py::arg("key_scales") = std::vector<at::Tensor>(), py::arg("value_scales") = std::vector<at::Tensor>());
}
