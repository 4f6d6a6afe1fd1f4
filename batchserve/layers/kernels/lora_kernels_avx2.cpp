// The LoRA kernel in AVX2 (lora_tiles.h on lora_vectors.h's Avx2 vectors).
#include "lora_args.h"
#include "lora_tiles.h"

#ifdef BATCHSERVE_ISA_AVX2
void lora_add_avx2(const LoraArgs& args) { lora_tiles::run_on<lora_vectors::Avx2>(args); }
#endif
