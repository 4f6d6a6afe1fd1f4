// The LoRA kernel in AVX-512 and AVX512-BF16 (lora_tiles.h on lora_vectors.h's vectors): one file, as the
// AVX512-BF16 path's float32 slots take AVX-512's kernel.
#include "lora_args.h"
#include "lora_tiles.h"

#ifdef BATCHSERVE_ISA_AVX512
void lora_add_avx512(const LoraArgs& args) { lora_tiles::run_on<lora_vectors::Avx512>(args); }
#endif

#ifdef BATCHSERVE_ISA_AVX512_BF16
void lora_add_avx512_bf16(const LoraArgs& args) {
  // its table row is bfloat16's; float32 slots take AVX-512's kernel
  if (args.bf16) return lora_tiles::run<lora_vectors::Avx512Bf16, c10::BFloat16>(args);
  lora_tiles::run<lora_vectors::Avx512, float>(args);
}
#endif
