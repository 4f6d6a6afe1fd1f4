// Projection (layer_ops.h): one CpuLinear's GEMM, chosen by the number of rows. The Python layer (layers/linear.py
// CpuLinear) and the native decoder loop call this same object.
#include "aten_pch.h"  // first: the precompiled torch headers (build.py)

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <string>

#include "layer_ops.h"

namespace {

// oneDNN builds and caches a primitive per row count it is called with (about 0.6 MB each for a 576 x 3,072 float32
// weight; ~1 ms to build): one per step length, the cache filled for hours as rare lengths came, +277 MB over the
// float32 path's 463 lengths (docs/BENCHMARKS.md, the soak). From this many rows on, rows are padded with zeros to
// the next of 16 counts per doubling (less than 1/16 more work), so it sees a few dozen counts, not hundreds.
constexpr int64_t kExactRows = 64;
constexpr int64_t kCountsPerDoubling = 16;

// torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""): oneDNN's GEMM on a weight reordered once.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed,
                            const c10::optional<at::Tensor>& bias) {
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

// The rows oneDNN is called with for m rows: at least min_m (its bf16 GEMM runs fewer than 4 rows slower than 4), m
// below kExactRows, else m rounded up to a multiple of m's power of two / kCountsPerDoubling.
int64_t packed_rows(int64_t m, int64_t min_m) {
  if (m < kExactRows) return std::max(m, min_m);
  int64_t step = 1;
  while (step * 2 * kCountsPerDoubling <= m) step *= 2;
  return (m + step - 1) / step * step;
}

// packed_linear on packed_rows(m) rows, the zero rows' results cut off
at::Tensor bucketed_packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                                  int64_t min_m) {
  const int64_t m = x.size(0), padded = packed_rows(m, min_m);
  if (padded == m) return packed_linear(x, packed, bias);
  return packed_linear(at::cat({x, x.new_zeros({padded - m, x.size(1)})}), packed, bias).narrow(0, 0, m);
}

}  // namespace

at::Tensor Projection::silu_and_mul_of(const at::Tensor& x) const {
  if (swiglu && x.size(0) < rows.amx_max_m && x.scalar_type() == weight_t.scalar_type())
    return amx_gemm(x, *amx_packed, c10::nullopt, amx_emulated, true);
  return silu_and_mul((*this)(x));
}

at::Tensor Projection::swiglu_panels_of(const at::Tensor& x) const {
  const bool amx = packed_only && amx_packed.has_value() && (x.size(0) < rows.amx_max_m || !packed.has_value());
  if (!swiglu || !amx || quant || bf16_packed.has_value() || x.scalar_type() != weight_t.scalar_type()) return {};
  return amx_gemm(x, *amx_packed, c10::nullopt, amx_emulated, false);
}

// Row tiles small enough that the fused AMX kernel takes each and a tile's [tile, I] activation stays in cache between
// the two GEMMs: over a long prefill chunk this ran the MLP faster than one oneDNN GEMM, silu_and_mul over the whole
// [M, 2I] output (memory-bound at that size) and the down GEMM (docs/embeddings.md).
at::Tensor swiglu_mlp(const at::Tensor& x, const Projection& gate_up, const Projection& down) {
  const int64_t m = x.size(0), tile = gate_up.rows.swiglu_tile_m;
  if (!gate_up.swiglu || tile <= 0 || m <= tile) return down(gate_up.silu_and_mul_of(x));
  at::Tensor out;
  for (int64_t start = 0; start < m; start += tile) {
    const auto y = down(gate_up.silu_and_mul_of(x.narrow(0, start, std::min(tile, m - start))));
    if (!out.defined()) out = at::empty({m, y.size(1)}, y.options());
    out.narrow(0, start, y.size(0)).copy_(y);
  }
  return out;
}

at::Tensor Projection::operator()(const at::Tensor& x) const {
  const auto wanted = float_output ? at::kFloat : x.scalar_type();
  if (quant) return quantized(x, wanted);
  const auto out = gemm(x.scalar_type() == weight_t.scalar_type() ? x : x.to(weight_t.scalar_type()));
  return out.scalar_type() == wanted ? out : out.to(wanted);
}

// W8A8 reads a bf16 x and writes the wanted dtype itself (no conversion passes); the other paths convert inside
at::Tensor Projection::quantized(const at::Tensor& x, at::ScalarType wanted) const {
  if (!bias.has_value() && (wanted == at::kFloat || wanted == at::kBFloat16)) return quant_gemm(x, *quant, wanted);
  const auto out = bias.has_value() ? quant_gemm(x, *quant) + *bias : quant_gemm(x, *quant);
  return out.scalar_type() == wanted ? out : out.to(wanted);
}

at::Tensor Projection::gemm(const at::Tensor& x) const {
  const int64_t m = x.size(0);
  if (bf16_packed.has_value() && (m < rows.pair_max_m || !packed.has_value())) {
    const auto out = bf16_gemm(x, *bf16_packed, out_features);
    return bias.has_value() ? out + *bias : out;
  }
  if (packed_only) {
    // no oneDNN copy where no call was to carry its rows (LinearPolicy.max_rows): the AMX kernel takes any M
    const bool amx = amx_packed.has_value() && (m < rows.amx_max_m || !packed.has_value());
    if (amx && !swiglu) return amx_gemm(x, *amx_packed, bias, amx_emulated, false);
    if (amx) {
      // swiglu panels (16 gate then 16 up columns each, no bias): the plain product, its columns put back in
      // [gate | up] order, for a step whose adapters add their deltas to gate and up before silu_and_mul reads them
      const auto y = amx_gemm(x, *amx_packed, c10::nullopt, amx_emulated, false);
      return y.view({m, -1, 2, kSwigluHalfPanel}).transpose(1, 2).reshape({m, out_features});
    }
    return bucketed_packed_linear(x, *packed, bias, rows.packed_min_m);
  }
  at::Tensor out;
  if (m < rows.small_min_m) {
    out = at::matmul(x, weight_t);
  } else if (small_packed.has_value() && m <= rows.small_max_m) {
    out = small_gemm(x, *small_packed, out_features);
  } else if (small_packed.has_value() && m <= rows.ukernel_max_m) {
    out = panel_brgemm(x, *small_packed, out_features);
  } else if (packed.has_value() && m < rows.packed_max_m) {
    return bucketed_packed_linear(x, *packed, bias, 0);
  } else {
    out = at::matmul(x, weight_t);
  }
  return bias.has_value() ? out + *bias : out;
}
