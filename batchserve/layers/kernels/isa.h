// The instruction sets the kernels are written for: one enum for every path of every operation, bound to Python as
// the module's Isa (layers/kernels/paths.py ISAS lists the same names in the same order, and a test holds them
// equal). What this build compiled (kernel_table) and what this CPU runs (cpu_runs) are asked here and nowhere else.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

// What this build compiles, from the compiler's target (-march=native): the one place these conditions are spelled.
// avx512_bf16 code is compiled per function for its target (any AVX-512 build has it, whatever the build's CPU), so
// that it is asked of the CPU at run time (cpu_runs) before a call; AMX code only where the CPU has AMX (amx_tiles.h),
// and the kernel must still grant this process the tiles.
#if defined(__AVX2__) && defined(__FMA__)
#define BATCHSERVE_ISA_AVX2 1
#endif
#if defined(__AVX512F__)
#define BATCHSERVE_ISA_AVX512 1
#endif
#if defined(__AVX512F__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 10))
#define BATCHSERVE_ISA_AVX512_BF16 1
#define BATCHSERVE_BF16_TARGET __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl")))
#endif
// W8A8 (quant_w8a8.cpp) and the AVX-512 dequantization into bf16 tiles (quant_amx.cpp) need these for the whole file
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define BATCHSERVE_ISA_AVX512_VNNI 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define BATCHSERVE_ISA_AVX512_BF16_FILE 1
#endif

enum class Isa : int64_t { kPortable, kAvx2, kAvx512, kAvx512Bf16, kAvx512Vnni, kAmx };

// The attention kernels' paths are instruction sets (portable, avx2, avx512, avx512_bf16).
using AttentionPath = Isa;

// Whether this CPU runs `isa` (its flags, asked once; AMX also needs the kernel to hand this process its tile state).
bool cpu_runs(Isa isa);

// The kernel table: one row (operation, data format, instruction set) per kernel this build compiled, filled once
// when the module loads. Python (paths.py select_paths) picks each operation's path from these rows and the CPU's
// flags; the C++ entry points take the chosen path as an argument.
std::vector<std::tuple<std::string, std::string, Isa>> kernel_table();
