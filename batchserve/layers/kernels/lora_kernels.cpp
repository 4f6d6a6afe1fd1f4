// LoRA's shrink and expand (lora_args.h) on the path the kernel table chose: each instruction set's kernel is
// instantiated in a file of its own (lora_kernels_<isa>.cpp, from lora_tiles.h), so that they compile side by side.
#include "lora_args.h"

void lora_add(const LoraArgs& args, Isa path) {
  switch (path) {
#ifdef BATCHSERVE_ISA_AVX512
    case Isa::kAvx512:
      return lora_add_avx512(args);
#endif
#ifdef BATCHSERVE_ISA_AVX512_BF16
    case Isa::kAvx512Bf16:
      return lora_add_avx512_bf16(args);
#endif
#ifdef BATCHSERVE_ISA_AVX2
    case Isa::kAvx2:
      return lora_add_avx2(args);
#endif
    default:  // lora_op.cpp lets only the table's paths through
      return lora_add_portable(args);
  }
}
