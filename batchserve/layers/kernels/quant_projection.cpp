// Python classes and functions of the layer operators (layer_ops.h), the one file besides bindings.cpp and
// decoder_loop.cpp that includes pybind11: Projection and its RowSchedule (projection.cpp), StepAttention and
// paged_attention (step_attention.cpp), and the quantized GEMM (quant_gemm.cpp): a Projection holding a weight kept
// quantized, which CpuLinear's quantized counterpart (layers/quantization.py QuantizedLinear) and the native decoder
// loop call like any other; and the GEMM and dequantization alone, for tests.
#include <memory>
#include <string>

#include "bindings.h"
#include "layer_ops.h"

namespace {

QuantPath path_named(const std::string& name) {
  if (name == "avx512_vnni") return QuantPath::kAvx512Vnni;
  if (name == "avx512") return QuantPath::kAvx512;
  if (name == "avx2") return QuantPath::kAvx2;
  TORCH_CHECK(name == "portable", "quantized GEMM path: avx512_vnni, avx512, avx2 or portable, not ", name);
  return QuantPath::kPortable;
}

std::shared_ptr<const QuantWeight> quant_weight(at::Tensor codes, at::Tensor scales, int64_t bits, int64_t group,
                                                const std::string& path, int64_t small_max_m,
                                                c10::optional<at::Tensor> mins = c10::nullopt,
                                                bool bf16_tiles = false, int64_t act_block = 0,
                                                int64_t amx_min_m = 0, bool amx_emulated = false) {
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

StepAttention make_step(at::Tensor slot_mapping, int64_t decode_rows, c10::optional<at::Tensor> decode_block_tables,
                        c10::optional<at::Tensor> decode_seq_lens, c10::optional<at::Tensor> prefill_block_tables,
                        c10::optional<at::Tensor> prefill_seq_lens, c10::optional<at::Tensor> prefill_query_starts,
                        std::vector<std::tuple<int64_t, int64_t, int64_t>> spans, bool native_prefill,
                        AttentionPath path) {
  TORCH_CHECK(decode_rows == 0 || (decode_block_tables.has_value() && decode_seq_lens.has_value()),
              "decode rows need their block tables and lengths");
  TORCH_CHECK(!native_prefill || prefill_query_starts.has_value(), "the native prefill kernel needs query starts");
  StepAttention step{std::move(slot_mapping),         decode_rows,          std::move(decode_block_tables),
                     std::move(decode_seq_lens),      std::move(prefill_block_tables), std::move(prefill_seq_lens),
                     std::move(prefill_query_starts), std::move(spans),     native_prefill, path, {}};
  if (!native_prefill)
    for (const auto& [start, stop, context] : step.spans)
      step.chunk_masks.push_back(context == 0 ? c10::optional<at::Tensor>()
                                              : at::ones({stop - start, context + stop - start},
                                                            at::TensorOptions().dtype(at::kBool))
                                                    .tril(context));
  return step;
}

}  // namespace

void register_quant_gemm(pybind11::module& m) {
  namespace py = pybind11;
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("quant_gemm_paths", &quant_gemm_paths, "the quantized GEMM paths built here and runnable, best first");
  m.def(
      "quantized_projection",
      [](at::Tensor codes, at::Tensor scales, int64_t bits, int64_t group, c10::optional<at::Tensor> bias,
         const std::string& path, int64_t small_max_m, bool float_output, c10::optional<at::Tensor> mins,
         bool bf16_tiles, int64_t act_block, int64_t amx_min_m, bool amx_emulated) {
        Projection p{};
        p.quant = quant_weight(std::move(codes), std::move(scales), bits, group, path, small_max_m, std::move(mins),
                               bf16_tiles, act_block, amx_min_m, amx_emulated);
        p.weight_t = at::empty({0}, at::kFloat);  // unused: quant_gemm takes x as it comes
        p.bias = std::move(bias);
        p.out_features = p.quant->out_features;
        p.float_output = float_output;
        return p;
      },
      "a Projection over a weight kept quantized (quant_gemm.h), its GEMM quant_gemm at every M", py::arg("codes"),
      py::arg("scales"), py::arg("bits"), py::arg("group"), py::arg("bias"), py::arg("path"),
      py::arg("small_max_m"), py::arg("float_output") = false, py::arg("mins") = py::none(),
      py::arg("bf16_tiles") = false, py::arg("act_block") = 0, py::arg("amx_min_m") = 0,
      py::arg("amx_emulated") = false);
  m.def(
      "quant_codes_kept", [](const Projection& p) { return p.quant != nullptr && p.quant->codes.defined(); },
      "whether a quantized Projection still reads its codes, scales and minimums (false: W8A8 at every M, repacked)");
  m.def(
      "quant_gemm",
      [](at::Tensor x, at::Tensor codes, at::Tensor scales, int64_t bits, int64_t group, const std::string& path,
         int64_t small_max_m, c10::optional<at::Tensor> mins, bool bf16_tiles, int64_t act_block, int64_t amx_min_m,
         bool amx_emulated) {
        return quant_gemm(x, *quant_weight(std::move(codes), std::move(scales), bits, group, path, small_max_m,
                                           std::move(mins), bf16_tiles, act_block, amx_min_m, amx_emulated));
      },
      "x [M, K] float32 @ a quantized weight -> [M, N] float32", no_gil, py::arg("x"), py::arg("codes"),
      py::arg("scales"), py::arg("bits"), py::arg("group"), py::arg("path"), py::arg("small_max_m"),
      py::arg("mins") = py::none(), py::arg("bf16_tiles") = false, py::arg("act_block") = 0,
      py::arg("amx_min_m") = 0, py::arg("amx_emulated") = false);
  m.def("quant_amx_available", &quant_amx_available, "whether quant_amx runs on AMX tiles here (not emulated)");
  m.def("quant_amx_vectorized", &quant_amx_vectorized, "whether quant_amx dequantizes in AVX-512 here");
  m.def(
      "quant_amx_panels",
      [](const Projection& p, bool vectorized) {
        TORCH_CHECK(p.quant != nullptr, "quant_amx_panels: a quantized Projection");
        return quant_amx_panels(*p.quant, vectorized);
      },
      "a quantized Projection's weight as quant_amx dequantizes it: [pairs, K / 32, 2, 16, 32] bf16 B tiles (only "
      "where it was packed: W8A8 or amx_min_m)",
      no_gil, py::arg("projection"), py::arg("vectorized"));
  m.def(
      "quant_dequantize",
      [](at::Tensor codes, at::Tensor scales, int64_t bits, int64_t group, c10::optional<at::Tensor> mins) {
        return quant_dequantize(
            *quant_weight(std::move(codes), std::move(scales), bits, group, "portable", 0, std::move(mins)));
      },
      "a quantized weight as float32 [N, K]", no_gil, py::arg("codes"), py::arg("scales"), py::arg("bits"),
      py::arg("group"), py::arg("mins") = py::none());
}

void register_step_attention(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<StepAttention>(m, "StepAttention")
      .def(py::init(&make_step), py::arg("slot_mapping"), py::arg("decode_rows"), py::arg("decode_block_tables"),
           py::arg("decode_seq_lens"), py::arg("prefill_block_tables"), py::arg("prefill_seq_lens"),
           py::arg("prefill_query_starts"), py::arg("spans"), py::arg("native_prefill"), py::arg("path"));
  m.def("paged_attention", &paged_attention,
        "one layer's attention over a step: store its K/V, then the decode and the prefill rows on their paths",
        py::call_guard<py::gil_scoped_release>(), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("key_cache"),
        py::arg("value_cache"), py::arg("step"), py::arg("scale"), py::arg("key_scale") = py::none(),
        py::arg("value_scale") = py::none());
}

void register_projection(pybind11::module& m) {
  namespace py = pybind11;
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  py::class_<RowSchedule>(m, "RowSchedule", "the row counts at which a Projection changes GEMM (layer_ops.h)")
      .def(py::init([](int64_t small_min_m, int64_t small_max_m, int64_t packed_min_m, int64_t packed_max_m,
                       int64_t amx_max_m) {
             return RowSchedule{small_min_m, small_max_m, packed_min_m, packed_max_m, amx_max_m};
           }),
           py::arg("small_min_m"), py::arg("small_max_m"), py::arg("packed_min_m"), py::arg("packed_max_m"),
           py::arg("amx_max_m"))
      .def_readonly("small_min_m", &RowSchedule::small_min_m)
      .def_readonly("small_max_m", &RowSchedule::small_max_m)
      .def_readonly("packed_min_m", &RowSchedule::packed_min_m)
      .def_readonly("packed_max_m", &RowSchedule::packed_max_m)
      .def_readonly("amx_max_m", &RowSchedule::amx_max_m);
  py::class_<Projection>(m, "Projection")
      .def(py::init([](at::Tensor weight_t, c10::optional<at::Tensor> bias, c10::optional<at::Tensor> packed,
                       c10::optional<at::Tensor> small_packed, int64_t out_features, RowSchedule rows,
                       bool packed_only, c10::optional<at::Tensor> amx_packed, bool amx_emulated, bool swiglu,
                       c10::optional<at::Tensor> bf16_packed, bool float_output) {
             TORCH_CHECK(!packed_only || packed.has_value(), "packed_only needs a packed weight");
             TORCH_CHECK(!swiglu || (packed_only && amx_packed.has_value() && !bias.has_value()),
                         "swiglu: a packed-only gate/up projection with AMX panels and no bias");
             return Projection{std::move(weight_t), std::move(bias),      std::move(packed),
                               std::move(small_packed), std::move(amx_packed), out_features,
                               rows,                packed_only,          amx_emulated,
                               swiglu,              std::move(bf16_packed), float_output};
           }),
           py::arg("weight_t"), py::arg("bias"), py::arg("packed"), py::arg("small_packed"), py::arg("out_features"),
           py::arg("rows"), py::arg("packed_only"), py::arg("amx_packed") = c10::optional<at::Tensor>(),
           py::arg("amx_emulated") = false, py::arg("swiglu") = false,
           py::arg("bf16_packed") = c10::optional<at::Tensor>(), py::arg("float_output") = false)
      .def("__call__", &Projection::operator(), "x [M, in] -> [M, out], the GEMM chosen by M", no_gil)
      .def("silu_and_mul", &Projection::silu_and_mul_of, "silu(gate) * up of this gate/up projection of x", no_gil);
  m.def("bf16_gemm_available", &bf16_gemm_available, "whether bf16_gemm is built here and this CPU has AVX512-BF16");
  m.def("bf16_gemm_pack", &bf16_gemm_pack, "[N, K] bf16 weight -> [N/32, K/2, 32, 2] pairs for bf16_gemm", no_gil);
  m.def("bf16_gemm", &bf16_gemm, "x [M, K] bf16 @ packed weight -> [M, n] float32, one reduction order per row",
        no_gil, py::arg("x"), py::arg("packed"), py::arg("n"));
}
