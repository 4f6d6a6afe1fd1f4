// The Python module of the native CPU kernels (one extension built from every .cpp in this folder).
#include "bindings.h"
#include "kernels.h"
#include "layer_ops.h"

// The kernels touch no Python object: each call lets go of the interpreter lock while it computes, as torch's own
// operators do, so the threads serving HTTP or Ray messages in the same process run meanwhile (and the engine loop
// does not wait for them to give the lock back).
static const auto kNoGil = pybind11::call_guard<pybind11::gil_scoped_release>();

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
        pybind11::arg("scale"), pybind11::arg("path"));
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
  register_decoder_loop(m);
  register_quant_gemm(m);
}
