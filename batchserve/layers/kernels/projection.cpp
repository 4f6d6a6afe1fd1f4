// Projection (layer_ops.h): one CpuLinear's GEMM, chosen by the number of rows. The Python layer (layers/linear.py
// CpuLinear) and the native decoder loop call this same object.
#include <ATen/core/dispatch/Dispatcher.h>

#include <string>

#include <torch/extension.h>  // pybind11: this file registers its classes

#include "layer_ops.h"

namespace {

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

}  // namespace

at::Tensor Projection::silu_and_mul_of(const at::Tensor& x) const {
  if (swiglu && x.size(0) < amx_max_m && x.scalar_type() == weight_t.scalar_type())
    return amx_gemm(x, *amx_packed, c10::nullopt, amx_emulated, true);
  return silu_and_mul((*this)(x));
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
  if (bf16_packed.has_value()) {
    const auto out = bf16_gemm(x, *bf16_packed, out_features);
    return bias.has_value() ? out + *bias : out;
  }
  if (packed_only) {
    if (amx_packed.has_value() && m < amx_max_m && !swiglu)  // swiglu panels: only through silu_and_mul_of
      return amx_gemm(x, *amx_packed, bias, amx_emulated, false);
    if (m < packed_min_m)
      return packed_linear(at::cat({x, x.new_zeros({packed_min_m - m, x.size(1)})}), *packed, bias).narrow(0, 0, m);
    return packed_linear(x, *packed, bias);
  }
  at::Tensor out;
  if (m < small_min_m) {
    out = at::matmul(x, weight_t);
  } else if (small_packed.has_value() && m <= small_max_m) {
    out = small_gemm(x, *small_packed, out_features);
  } else if (packed.has_value() && m < packed_max_m) {
    return packed_linear(x, *packed, bias);
  } else {
    out = at::matmul(x, weight_t);
  }
  return bias.has_value() ? out + *bias : out;
}

void register_projection(pybind11::module& m) {
  namespace py = pybind11;
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  py::class_<Projection>(m, "Projection")
      .def(py::init([](at::Tensor weight_t, c10::optional<at::Tensor> bias, c10::optional<at::Tensor> packed,
                       c10::optional<at::Tensor> small_packed, int64_t out_features, int64_t small_max_m,
                       int64_t small_min_m, int64_t packed_min_m, int64_t packed_max_m, bool packed_only,
                       c10::optional<at::Tensor> amx_packed, int64_t amx_max_m, bool amx_emulated, bool swiglu,
                       c10::optional<at::Tensor> bf16_packed, bool float_output) {
             TORCH_CHECK(!packed_only || packed.has_value(), "packed_only needs a packed weight");
             TORCH_CHECK(!swiglu || (packed_only && amx_packed.has_value() && !bias.has_value()),
                         "swiglu: a packed-only gate/up projection with AMX panels and no bias");
             return Projection{std::move(weight_t), std::move(bias),  std::move(packed), std::move(small_packed),
                               std::move(amx_packed), out_features, small_max_m,       small_min_m,
                               packed_min_m,          packed_max_m, amx_max_m,         packed_only,
                               amx_emulated,          swiglu,           std::move(bf16_packed), float_output};
           }),
           py::arg("weight_t"), py::arg("bias"), py::arg("packed"), py::arg("small_packed"), py::arg("out_features"),
           py::arg("small_max_m"), py::arg("small_min_m"), py::arg("packed_min_m"), py::arg("packed_max_m"),
           py::arg("packed_only"), py::arg("amx_packed") = c10::optional<at::Tensor>(), py::arg("amx_max_m") = 0,
           py::arg("amx_emulated") = false, py::arg("swiglu") = false,
           py::arg("bf16_packed") = c10::optional<at::Tensor>(), py::arg("float_output") = false)
      .def("__call__", &Projection::operator(), "x [M, in] -> [M, out], the GEMM chosen by M", no_gil)
      .def("silu_and_mul", &Projection::silu_and_mul_of, "silu(gate) * up of this gate/up projection of x", no_gil);
  m.def("bf16_gemm_available", &bf16_gemm_available, "whether bf16_gemm is built here and this CPU has AVX512-BF16");
  m.def("bf16_gemm_pack", &bf16_gemm_pack, "[N, K] bf16 weight -> [N/32, K/2, 32, 2] pairs for bf16_gemm", no_gil);
  m.def("bf16_gemm", &bf16_gemm, "x [M, K] bf16 @ packed weight -> [M, n] float32, one reduction order per row",
        no_gil, py::arg("x"), py::arg("packed"), py::arg("n"));
}
