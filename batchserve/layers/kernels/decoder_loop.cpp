// A step's decoder layers in one native call, run from the model's op plan (layers/op_plan.py): each layer a list of
// ops, built from the model's Python modules and handed over once. Each op calls the operator its Python module calls
// (rms_norm, the Projections, rope_, paged_attention, silu_and_mul: layer_ops.h; the torch code of windowed attention,
// MoE routing and GeGLU as the same ATen calls: composed_ops.cpp), in the same order on the same tensors, so its output
// is bit for bit theirs. What it saves is the interpreter: some twenty Python-level calls a layer, which add up over a
// model's layers at every step.
#include "aten_pch.h"  // first: the precompiled torch headers (build.py)

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "decoder_loop.h"

namespace {

// The op kinds this loop runs, by their OpKind values, with the (tensors, projections, ints, floats) each takes
// (-1: any number). The Python side reads the names (DecoderLoop.op_kinds) and runs a model here only if its plan
// has no other kind.
struct KindInfo {
  const char* name;
  OpKind kind;
  int tensors, projections, ints, floats;
};
const std::vector<KindInfo> kOpKinds = {
    {"residual_norm", OpKind::kResidualNorm, 1, 0, 0, 1},  // weight; eps
    {"norm", OpKind::kNorm, 1, 0, 0, 1},                   // weight; eps
    {"qkv", OpKind::kQkv, 0, 1, 3, 0},                     // qkv; heads, kv heads, head size
    {"qk_norm", OpKind::kQkNorm, 2, 0, 3, 1},              // q, k weights; heads, kv heads, head size; eps
    {"rope", OpKind::kRope, 0, 0, 3, 0},                   // table, rotary dims, head size
    {"attention", OpKind::kAttention, 0, 0, 5, 2},  // heads, kv heads, head size, window (0: none), query tile;
                                                    // scale, softcap (0: none)
    {"o_proj", OpKind::kOProj, 0, 1, 0, 0},
    {"swiglu_mlp", OpKind::kSwigluMlp, 0, 2, 0, 0},  // gate/up, down
    {"geglu_mlp", OpKind::kGegluMlp, 0, 2, 0, 0},    // gate/up, down
    {"moe_mlp", OpKind::kMoeMlp, 1, -1, 2, 0},       // router; each expert's gate/up, down; top k, normalize
};

Op make_op(OpSpec spec) {
  auto& [name, tensors, projections, ints, floats, loras] = spec;
  for (const auto& info : kOpKinds) {
    if (name != info.name) continue;
    const auto count_ok = [](int want, size_t have) { return want < 0 || static_cast<size_t>(want) == have; };
    TORCH_CHECK_VALUE(count_ok(info.tensors, tensors.size()) && count_ok(info.projections, projections.size()) &&
                          count_ok(info.ints, ints.size()) && count_ok(info.floats, floats.size()),
                      "op ", name, ": wrong number of arguments");
    TORCH_CHECK_VALUE(loras.empty() || loras.size() == projections.size(), "op ", name,
                      ": one LoRA slot set a projection, or none");
    return {info.kind, std::move(tensors), std::move(projections), std::move(ints), std::move(floats),
            std::move(loras)};
  }
  TORCH_CHECK_VALUE(false, "the native decoder loop has no op ", name);
}

// The step's values between ops, named as the Python layers name them: h (the sublayer's input or output), the
// residual stream (undefined before the first layer's norm), this layer's q and k heads [T, H + Hkv, D] and v.
struct Registers {
  at::Tensor h, residual, qk, v;
};

// One layer's pool and what the step shares between layers
struct LayerContext {
  const at::Tensor &key_cache, &value_cache;
  c10::optional<at::Tensor> key_scale, value_scale;
  const StepAttention& step;
  const std::vector<at::Tensor>& rope;  // cos, sin of each RoPE table
  DecodeWindows& windows;
  const LoraBatch* lora;  // the step's adapter groups (null: none)
};

// layers/lora.py takes_adapters: the step has adapter groups and projection i of the op has slots (a fused
// activation must then read the adapted output)
bool takes_adapters(const Op& op, size_t i, const LayerContext& c) {
  return c.lora != nullptr && !c.lora->empty() && i < op.loras.size() && op.loras[i].defined();
}

// layers/lora.py project: projection i of the op on x, plus the step's adapter deltas where it serves adapters
at::Tensor project(const Op& op, size_t i, const at::Tensor& x, const LayerContext& c) {
  auto y = op.projections[i](x);
  if (takes_adapters(op, i, c)) lora_add_(x, y, op.loras[i], *c.lora);
  return y;
}

// layers/mlp.py MLP.forward with adapters on gate/up: silu(gate) * up of the adapted product. Where the AMX kernel
// takes the rows, its product stays in its swiglu order and the deltas go into those columns (the same values the
// Python layers add after the columns are put back in order, bit for bit), which saves a copy of [T, 2I]
at::Tensor adapted_silu_and_mul(const Op& op, const at::Tensor& x, const LayerContext& c) {
  auto panels = op.projections[0].swiglu_panels_of(x);
  if (!panels.defined()) return silu_and_mul(project(op, 0, x, c));
  lora_add_swiglu_panels_(x, panels, op.loras[0], *c.lora);
  return silu_and_mul_panels(panels);
}

// layers/rotary.py apply_rope: the native kernel rotates x in place
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2), "RoPE on heads contiguous within a token");
  rope_(x, cos, sin);
  return x;
}

// layers/rotary.py apply_partial_rope: a head's first 2 * cos.size(-1) dims rotated, the rest passed through
at::Tensor apply_partial_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t rot = 2 * cos.size(-1);
  if (rot == x.size(-1)) return apply_rope(x, cos, sin);
  return at::cat({apply_rope(x.slice(-1, 0, rot).contiguous(), cos, sin), x.slice(-1, rot)}, -1);
}

// The ops, one by one (the loop's state between them: Registers)
void run(const Op& op, Registers& r, LayerContext& context);

}  // namespace

void DecoderLoop::add_layer(std::vector<OpSpec> ops) {
  std::vector<Op> layer;
  for (auto& spec : ops) layer.push_back(make_op(std::move(spec)));
  layers_.push_back(std::move(layer));
}

int64_t DecoderLoop::num_layers() const { return static_cast<int64_t>(layers_.size()); }

std::tuple<at::Tensor, at::Tensor> DecoderLoop::forward(at::Tensor x, const std::vector<at::Tensor>& rope,
                                                        const std::vector<at::Tensor>& key_caches,
                                                        const std::vector<at::Tensor>& value_caches,
                                                        const StepAttention& step,
                                                        const std::vector<at::Tensor>& key_scales,
                                                        const std::vector<at::Tensor>& value_scales,
                                                        const LoraBatch* lora) const {
  TORCH_CHECK(key_caches.size() == layers_.size() && value_caches.size() == layers_.size(),
              "one K and one V cache per layer");
  const bool quantized = !key_scales.empty();
  TORCH_CHECK(!quantized || (key_scales.size() == layers_.size() && value_scales.size() == layers_.size()),
              "a quantized pool: one K and one V scale tensor per layer");
  Registers r{std::move(x), {}, {}, {}};
  DecodeWindows windows;
  for (size_t i = 0; i < layers_.size(); ++i) {
    LayerContext context{key_caches[i],
                         value_caches[i],
                         quantized ? c10::optional<at::Tensor>(key_scales[i]) : c10::nullopt,
                         quantized ? c10::optional<at::Tensor>(value_scales[i]) : c10::nullopt,
                         step,
                         rope,
                         windows,
                         lora};
    for (const Op& op : layers_[i]) run(op, r, context);
  }
  return {r.h, r.residual};
}

namespace {

// models/llama.py Attention.forward from the split of q and k on; layers/attention.py paged_attention
at::Tensor attention(const Op& op, const Registers& r, LayerContext& c) {
  const int64_t tokens = r.qk.size(0), heads = op.ints[0], kv_heads = op.ints[1], head_dim = op.ints[2];
  const int64_t window = op.ints[3], query_tile = op.ints[4];
  const double scale = op.floats[0], softcap = op.floats[1];
  const auto q_k = r.qk.split_with_sizes({heads, kv_heads}, 1);
  at::Tensor out;
  if (window > 0 || softcap > 0) {
    TORCH_CHECK(!c.key_scale.has_value(), "an 8-bit KV cache with sliding-window or soft-capped attention");
    write_kv_(q_k[1], r.v, c.key_cache, c.value_cache, c.step.slot_mapping);
    out = windowed_attention(q_k[0], q_k[1], r.v, c.key_cache, c.value_cache, c.step, scale, window, softcap,
                             query_tile, c.windows);
  } else {
    out = paged_attention(q_k[0], q_k[1], r.v, c.key_cache, c.value_cache, c.step, scale, c.key_scale,
                          c.value_scale);
  }
  return out.reshape({tokens, heads * head_dim});
}

void run(const Op& op, Registers& r, LayerContext& context) {
  const auto& t = op.tensors;
  const auto& p = op.projections;
  const auto& n = op.ints;
  switch (op.kind) {
    case OpKind::kResidualNorm:  // models/llama.py DecoderLayer: the residual add fused into the norm
      if (!r.residual.defined()) {
        r.residual = r.h;
        r.h = rms_norm(r.h, c10::nullopt, t[0], op.floats[0]);
      } else {
        r.h = rms_norm(r.h, r.residual, t[0], op.floats[0]);
      }
      return;
    case OpKind::kNorm:
      r.h = rms_norm(r.h, c10::nullopt, t[0], op.floats[0]);
      return;
    case OpKind::kQkv: {  // models/llama.py Attention.forward
      const int64_t tokens = r.h.size(0), heads = n[0], kv_heads = n[1], head_dim = n[2];
      const auto qkv = project(op, 0, r.h, context);
      const auto parts = qkv.split_with_sizes({(heads + kv_heads) * head_dim, kv_heads * head_dim}, -1);
      r.qk = parts[0].view({tokens, heads + kv_heads, head_dim});
      r.v = parts[1].view({tokens, kv_heads, head_dim});
      return;
    }
    case OpKind::kQkNorm: {
      const int64_t tokens = r.qk.size(0), heads = n[0], kv_heads = n[1], head_dim = n[2];
      const auto q_k = r.qk.split_with_sizes({heads, kv_heads}, 1);
      const auto q = rms_norm(q_k[0].reshape({-1, head_dim}), c10::nullopt, t[0], op.floats[0])
                         .view({tokens, heads, head_dim});
      const auto k = rms_norm(q_k[1].reshape({-1, head_dim}), c10::nullopt, t[1], op.floats[0])
                         .view({tokens, kv_heads, head_dim});
      r.qk = at::cat({q, k}, 1);
      return;
    }
    case OpKind::kRope: {
      const auto& cos = context.rope.at(2 * n[0]);
      TORCH_CHECK(2 * cos.size(-1) == n[1], "the RoPE table rotates ", 2 * cos.size(-1), " dims, the plan ", n[1]);
      r.qk = apply_partial_rope(r.qk, cos, context.rope.at(2 * n[0] + 1));
      return;
    }
    case OpKind::kAttention:
      r.h = attention(op, r, context);
      return;
    case OpKind::kOProj:
      r.h = project(op, 0, r.h, context);
      return;
    case OpKind::kSwigluMlp:  // layers/mlp.py MLP.forward: the deltas join gate and up before SwiGLU reads them
      if (!takes_adapters(op, 0, context) && !takes_adapters(op, 1, context)) {
        r.h = swiglu_mlp(r.h, p[0], p[1]);
        return;
      }
      r.h = project(op, 1, takes_adapters(op, 0, context) ? adapted_silu_and_mul(op, r.h, context)
                                                          : p[0].silu_and_mul_of(r.h),
                    context);
      return;
    case OpKind::kGegluMlp:  // layers/activation.py GeGLUMLP.forward
      r.h = project(op, 1, gelu_tanh_and_mul(project(op, 0, r.h, context)), context);
      return;
    case OpKind::kMoeMlp:
      r.h = moe_mlp(r.h, t[0], p, n[0], n[1] != 0);
      return;
  }
}

}  // namespace

std::vector<std::string> DecoderLoop::op_kind_names() {
  std::vector<std::string> names;
  for (const auto& info : kOpKinds) names.emplace_back(info.name);
  return names;
}

