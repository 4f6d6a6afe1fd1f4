// The LoRA kernel in plain C++ (lora_tiles.h on lora_vectors.h's Portable vectors): any CPU.
#include "lora_args.h"
#include "lora_tiles.h"

void lora_add_portable(const LoraArgs& args) { lora_tiles::run_on<lora_vectors::Portable>(args); }
