// The Python module of the native CPU kernels (one extension built from every .cpp in this folder): the one file that
// includes pybind11, so every class and function is registered here and the files defining them include ATen at most.
// pybind11 comes with torch's casters for tensors (<torch/csrc/utils/pybind.h>), not through <torch/extension.h>:
// that header also brings torch's whole C++ front end (modules, optimizers, data loaders), which nothing here uses and
// which cost this file 15 of its 36 CPU-seconds of compiling.
#include "aten_pch.h"  // first: the precompiled torch headers (build.py)

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "decoder_loop.h"
#include "kernels.h"
#include "layer_ops.h"

// The kernels touch no Python object: each call lets go of the interpreter lock while it computes, as torch's own
// operators do, so the threads serving HTTP or Ray messages in the same process run meanwhile (and the engine loop
// does not wait for them to give the lock back).
static const auto kNoGil = pybind11::call_guard<pybind11::gil_scoped_release>();

namespace {

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
           py::arg("prefill_query_starts"), py::arg("spans"), py::arg("native_prefill_rows"), py::arg("path"),
           py::arg("mask_dtype"), py::arg("prefill_path") = Isa::kAvx512);
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
                       int64_t amx_max_m, int64_t swiglu_tile_m, int64_t pair_max_m, int64_t ukernel_max_m) {
             return RowSchedule{small_min_m, small_max_m, packed_min_m, packed_max_m, amx_max_m, swiglu_tile_m,
                                pair_max_m, ukernel_max_m};
           }),
           py::arg("small_min_m"), py::arg("small_max_m"), py::arg("packed_min_m"), py::arg("packed_max_m"),
           py::arg("amx_max_m"), py::arg("swiglu_tile_m") = 0, py::arg("pair_max_m") = 0,
           py::arg("ukernel_max_m") = 0)
      .def_readonly("small_min_m", &RowSchedule::small_min_m)
      .def_readonly("small_max_m", &RowSchedule::small_max_m)
      .def_readonly("packed_min_m", &RowSchedule::packed_min_m)
      .def_readonly("packed_max_m", &RowSchedule::packed_max_m)
      .def_readonly("amx_max_m", &RowSchedule::amx_max_m)
      .def_readonly("swiglu_tile_m", &RowSchedule::swiglu_tile_m)
      .def_readonly("pair_max_m", &RowSchedule::pair_max_m)
      .def_readonly("ukernel_max_m", &RowSchedule::ukernel_max_m);
  py::class_<Projection>(m, "Projection")
      .def(py::init([](at::Tensor weight_t, c10::optional<at::Tensor> bias, c10::optional<at::Tensor> packed,
                       c10::optional<at::Tensor> small_packed, int64_t out_features, RowSchedule rows,
                       bool packed_only, c10::optional<at::Tensor> amx_packed, bool amx_emulated, bool swiglu,
                       c10::optional<at::Tensor> bf16_packed, bool float_output) {
             TORCH_CHECK(!packed_only || packed.has_value() || amx_packed.has_value(),
                         "packed_only needs a packed weight or AMX panels");
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
  m.def("swiglu_mlp", &swiglu_mlp, "down(silu(gate) * up) of x, in row tiles where gate/up is AMX-fused", no_gil,
        py::arg("x"), py::arg("gate_up"), py::arg("down"));
  m.def("bf16_gemm_available", &bf16_gemm_available, "whether bf16_gemm is built here and this CPU has AVX512-BF16");
  m.def("bf16_gemm_pack", &bf16_gemm_pack, "[N, K] bf16 weight -> [N/32, K/2, 32, 2] pairs for bf16_gemm", no_gil);
  m.def("bf16_gemm", &bf16_gemm, "x [M, K] bf16 @ packed weight -> [M, n] float32, one reduction order per row",
        no_gil, py::arg("x"), py::arg("packed"), py::arg("n"));
}

void register_lora(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<LoraWeights>(m, "LoraWeights", "one projection's adapter slots (layers/lora.py LoRASlots)")
      .def(py::init<>(), "none: the projection serves no adapters")
      .def(py::init(&make_lora_weights), py::arg("a"), py::arg("b"), py::arg("present"), py::arg("slices"));
  py::class_<LoraBatch>(m, "LoraBatch", "one step's tokens grouped by adapter (layers/lora.py LoRAStep)")
      .def(py::init(&make_lora_batch), py::arg("slot"), py::arg("rank"), py::arg("scale"), py::arg("rows"),
           py::arg("offsets"), py::arg("path"));
  m.def("lora_add_", &lora_add_, "y += each adapter group's scale * (x_g @ A^T) @ B, in place", kNoGil,
        py::arg("x"), py::arg("y"), py::arg("weights"), py::arg("batch"));
}

void register_decoder_loop(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<DecoderLoop>(m, "DecoderLoop")
      .def(py::init<>())
      .def_static("op_kinds", &DecoderLoop::op_kind_names, "the op kinds the loop runs (layers/op_plan.py OpKind values)")
      .def("add_layer", &DecoderLoop::add_layer,
           "one layer's ops: (kind, tensors, projections, ints, floats, loras) each",
           py::arg("ops"))
      .def("num_layers", &DecoderLoop::num_layers)
      .def("forward", &DecoderLoop::forward, "a step's decoder layers -> (x, residual); scales: a quantized pool's",
           py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("rope"), py::arg("key_caches"),
           py::arg("value_caches"), py::arg("step"), py::arg("key_scales") = std::vector<at::Tensor>(),
           py::arg("value_scales") = std::vector<at::Tensor>(),
           py::arg("lora") = static_cast<const LoraBatch*>(nullptr));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // one enum of instruction sets for every operation's paths (isa.h; paths.py ISAS has the same names in order)
  pybind11::enum_<Isa>(m, "Isa", "the instruction sets the native kernels are written for")
      .value("portable", Isa::kPortable)
      .value("avx2", Isa::kAvx2)
      .value("avx512", Isa::kAvx512)
      .value("avx512_bf16", Isa::kAvx512Bf16)
      .value("avx512_vnni", Isa::kAvx512Vnni)
      .value("amx", Isa::kAmx);
  m.attr("AttentionPath") = m.attr("Isa");  // the attention paths are instruction sets
  m.def("cpu_runs", &cpu_runs, "whether this CPU runs an instruction set (AMX: and the kernel grants its tiles)");
  m.def("kernel_table", &kernel_table, "(operation, data format, instruction set) of every kernel built here");
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)", kNoGil,
        pybind11::arg("query"), pybind11::arg("key_cache"), pybind11::arg("value_cache"),
        pybind11::arg("block_tables"), pybind11::arg("seq_lens"), pybind11::arg("scale"), pybind11::arg("path"));
  m.def("paged_prefill_attention", &paged_prefill_attention, "causal paged attention of prefill rows (CPU)", kNoGil,
        pybind11::arg("query"), pybind11::arg("key_cache"), pybind11::arg("value_cache"),
        pybind11::arg("block_tables"), pybind11::arg("seq_lens"), pybind11::arg("query_starts"),
        pybind11::arg("scale"), pybind11::arg("path"), pybind11::arg("prefill_path") = Isa::kAvx512);
  m.def("attention_paths", &attention_paths, "the attention paths built here, best first");
  m.def("attention_path_runs", &attention_path_runs, "whether this path is built here and this CPU runs it");
  m.def("best_attention_path", &best_attention_path, "the best attention path this build and CPU run");
  m.def("bf16_dot_supported", &bf16_dot_supported, "whether this build and CPU run the avx512_bf16 path");
  m.def("prefill_attention_available", &prefill_attention_available, "whether paged_prefill_attention takes head_dim");
  m.def("rms_norm", &rms_norm, "RMSNorm of x, or of residual += x (in place)", kNoGil, pybind11::arg("x"),
        pybind11::arg("residual"), pybind11::arg("weight"), pybind11::arg("eps"));
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a fused [T, 2I] projection", kNoGil);
  m.def("rope_", &rope_, "rotary embedding in place on [T, heads, D] (rotate_half convention)", kNoGil);
  m.def("argmax_rows", &argmax_rows, "torch.argmax(logits, -1) of [R, V] float32, parallel over rows", kNoGil);
  m.def("write_kv_", &write_kv_, "store one step's K/V [T, Hkv, D] at their pool slots (in place)", kNoGil);
  m.def("small_gemm_paths", &small_gemm_paths, "the small_gemm paths built here (avx512, avx2), best first");
  m.def("small_gemm_pack", &small_gemm_pack, "[N, K] weight -> [N/P, K, P] panels of `path` for small_gemm", kNoGil,
        pybind11::arg("weight"), pybind11::arg("path"));
  m.def("small_gemm", &small_gemm, "x [M, K] @ packed weight -> [M, n], for small M", kNoGil);
  m.def("panel_brgemm", &panel_brgemm, "x [M, K] @ small_gemm_pack's panels -> [M, n] by oneDNN's brgemm", kNoGil);
  m.def("amx_gemm_available", &amx_gemm_available, "whether amx_gemm was built with AMX and may use the tiles");
  m.def("amx_gemm_takes", &amx_gemm_takes, "whether amx_gemm takes an [N, K] weight (both multiples of 32)");
  m.def("amx_gemm_pack", &amx_gemm_pack, "[N, K] bf16 weight -> [N/32, K/32, 2, 16, 32] AMX panels", kNoGil);
  m.def("amx_gemm", &amx_gemm,
        "x [M, K] @ packed weight (+ bias) -> [M, N] bf16 on AMX tiles; swiglu: a gate/up weight packed in "
        "swiglu_interleaved order -> silu(gate) * up [M, N / 2]",
        kNoGil, pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("bias"), pybind11::arg("emulated") = false,
        pybind11::arg("swiglu") = false);
  register_projection(m);
  register_step_attention(m);
  register_lora(m);
  register_decoder_loop(m);
  register_quant_gemm(m);
}
