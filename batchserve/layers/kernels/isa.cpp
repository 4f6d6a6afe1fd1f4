// The instruction sets this CPU runs and the kernel table of this build (isa.h). No ATen here: a light translation
// unit, compiled in a second.
#include "isa.h"

#include "amx_tiles.h"

bool w8a8_built();  // quant_w8a8.cpp: built with AVX512-VNNI

bool cpu_runs(Isa isa) {
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  static const bool avx512_bf16 = avx512 && __builtin_cpu_supports("avx512bf16");
  static const bool avx512_vnni = avx512 && __builtin_cpu_supports("avx512vnni");
  switch (isa) {
    case Isa::kPortable: return true;
    case Isa::kAvx2: return avx2;
    case Isa::kAvx512: return avx512;
    case Isa::kAvx512Bf16: return avx512_bf16;
    case Isa::kAvx512Vnni: return avx512_vnni;
    case Isa::kAmx:
#ifdef BATCHSERVE_AMX
      return avx512_bf16 && amx::amx_permitted();  // the kernel's epilogue rounds with AVX512-BF16
#else
      return false;
#endif
  }
  return false;
}

std::vector<std::tuple<std::string, std::string, Isa>> kernel_table() {
  static const auto rows = [] {
    std::vector<std::tuple<std::string, std::string, Isa>> t;
    const auto add = [&](const char* op, std::initializer_list<const char*> formats, Isa isa) {
      for (const char* format : formats) t.emplace_back(op, format, isa);
    };
    // decode attention by the pool's format (paged_attention.cpp, decode_quantized_kv.cpp); prefill on AVX-512 only
    add("attention", {"float32", "bfloat16", "float16", "int8", "fp8_e4m3"}, Isa::kPortable);
#ifdef BATCHSERVE_ISA_AVX2
    add("attention", {"float32", "bfloat16", "int8", "fp8_e4m3"}, Isa::kAvx2);
#endif
#ifdef BATCHSERVE_ISA_AVX512
    add("attention", {"float32", "bfloat16", "int8", "fp8_e4m3"}, Isa::kAvx512);
    add("prefill_attention", {"float32", "bfloat16"}, Isa::kAvx512);
    // a bfloat16 pool's prefill on AMX tiles (prefill_amx.cpp), the tiles emulated in scalar code on any AVX-512 CPU
    add("prefill_attention", {"bfloat16"}, Isa::kPortable);
#ifdef BATCHSERVE_AMX
    add("prefill_attention", {"bfloat16"}, Isa::kAmx);
#endif
#ifdef BATCHSERVE_ISA_AVX512_BF16_FILE
    add("prefill_attention", {"bfloat16"}, Isa::kAvx512Bf16);  // by bf16 dot products (prefill_avx512_bf16.cpp)
#endif
#endif
#ifdef BATCHSERVE_ISA_AVX512_BF16
    add("attention", {"bfloat16"}, Isa::kAvx512Bf16);
    add("bf16_gemm", {"bfloat16"}, Isa::kAvx512Bf16);  // bf16_gemm.cpp: one order per row at every M
#endif
    // float32 GEMM of decode-sized M (small_gemm.cpp)
#ifdef BATCHSERVE_ISA_AVX2
    add("small_gemm", {"float32"}, Isa::kAvx2);
#endif
#ifdef BATCHSERVE_ISA_AVX512
    add("small_gemm", {"float32"}, Isa::kAvx512);
#endif
    // bf16 GEMM on AMX tiles (amx_gemm.cpp); emulated in scalar code on any CPU (tests)
    add("bf16_gemm", {"bfloat16"}, Isa::kPortable);
#ifdef BATCHSERVE_AMX
    add("bf16_gemm", {"bfloat16"}, Isa::kAmx);
#endif
    // weights kept quantized (quant_gemm.cpp, quant_w8a8.cpp)
    add("quant_gemm", {"int8", "int4", "gguf"}, Isa::kPortable);
#ifdef BATCHSERVE_ISA_AVX2
    add("quant_gemm", {"int8", "int4", "gguf"}, Isa::kAvx2);
#endif
#ifdef BATCHSERVE_ISA_AVX512
    add("quant_gemm", {"int8", "int4", "gguf"}, Isa::kAvx512);
#endif
    if (w8a8_built()) add("quant_gemm", {"int8", "int4", "gguf"}, Isa::kAvx512Vnni);
    // a quantized KV pool's codec (kv_quantized.cpp)
    add("kv_codec", {"int8", "fp8_e4m3"}, Isa::kPortable);
#ifdef BATCHSERVE_ISA_AVX512
    add("kv_codec", {"int8", "fp8_e4m3"}, Isa::kAvx512);
#endif
    // LoRA's shrink and expand of a step's adapter groups (lora_tiles.h)
    add("lora", {"float32", "bfloat16"}, Isa::kPortable);
#ifdef BATCHSERVE_ISA_AVX2
    add("lora", {"float32", "bfloat16"}, Isa::kAvx2);
#endif
#ifdef BATCHSERVE_ISA_AVX512
    add("lora", {"float32", "bfloat16"}, Isa::kAvx512);
#endif
#ifdef BATCHSERVE_ISA_AVX512_BF16
    add("lora", {"bfloat16"}, Isa::kAvx512Bf16);  // the shrink by pair dot products (float32 slots: AVX-512's)
#endif
    return t;
  }();
  return rows;
}
