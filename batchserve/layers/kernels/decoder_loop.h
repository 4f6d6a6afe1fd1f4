// The native decoder loop (decoder_loop.cpp): a step's decoder layers in one call, from the model's op plan. Declared
// here so that the one file including pybind11 (bindings.cpp) binds it while decoder_loop.cpp includes only ATen.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "layer_ops.h"

// layers/op_plan.py OpKind, one for one; the arguments each takes are listed there.
enum class OpKind { kResidualNorm, kNorm, kQkv, kQkNorm, kRope, kAttention, kOProj, kSwigluMlp, kGegluMlp, kMoeMlp };

// One op as layers/op_plan.py exports it: (kind, tensors, projections, ints, floats, loras): loras, one a projection
// (or none at all), its adapter slots (LoraWeights() where it serves none)
using OpSpec = std::tuple<std::string, std::vector<at::Tensor>, std::vector<Projection>, std::vector<int64_t>,
                          std::vector<double>, std::vector<LoraWeights>>;

struct Op {
  OpKind kind;
  std::vector<at::Tensor> tensors;
  std::vector<Projection> projections;
  std::vector<int64_t> ints;
  std::vector<double> floats;
  std::vector<LoraWeights> loras;  // empty, or one a projection
};

class DecoderLoop {
 public:
  // the op kinds this loop runs, by name (layers/op_plan.py OpKind values)
  static std::vector<std::string> op_kind_names();

  // one layer's ops: (kind, tensors, projections, ints, floats) each; an unknown kind or argument count is refused
  void add_layer(std::vector<OpSpec> ops);

  int64_t num_layers() const;

  // x [T, H] (the step's embedded tokens) -> (x, residual) after the last layer, before the final norm. rope: cos, sin
  // of each table the plan's rope ops name; scales: a quantized pool's (empty: none); lora: the step's tokens grouped
  // by adapter (null or empty: the base model alone), their deltas added after each projection with slots.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x, const std::vector<at::Tensor>& rope,
                                             const std::vector<at::Tensor>& key_caches,
                                             const std::vector<at::Tensor>& value_caches, const StepAttention& step,
                                             const std::vector<at::Tensor>& key_scales,
                                             const std::vector<at::Tensor>& value_scales,
                                             const LoraBatch* lora = nullptr) const;

 private:
  std::vector<std::vector<Op>> layers_;
};
