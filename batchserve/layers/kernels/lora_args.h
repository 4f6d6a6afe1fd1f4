// The LoRA kernel's arguments as raw pointers (lora_tiles.h includes no ATen; lora_op.cpp fills these from
// tensors, checked). One projection's adapter slots and one step's grouping of tokens by adapter.
#pragma once

#include <cstdint>

#include "isa.h"

// B's packed layout (layers/lora.py LoRASlots holds the same number): a slice's B of rank r is its columns cut into
// panels of kLoraPanel (the last padded with zeros), each panel's r rows of kLoraPanel values one after the other,
// the panels one after the other. An expand of a few columns then reads one contiguous run of r * width values
// instead of r short pieces a whole output row apart.
constexpr int64_t kLoraPanel = 16;

inline int64_t lora_padded(int64_t size) { return (size + kLoraPanel - 1) / kLoraPanel * kLoraPanel; }

// One part of a fused projection's output (q, k, v; gate, up; or the whole): its first column and width, and where
// its packed B starts in a slot, in values per unit of rank (the padded widths of the slices before it).
struct LoraSlice {
  int64_t offset, size, packed;
};

struct LoraArgs {
  // the projection's input rows x [T, in] and its fresh output y [T, out], updated in place; all four tensors are
  // float32, or all bfloat16 (bf16)
  const void* x;
  void* y;
  int64_t x_stride, y_stride;
  bool bf16;
  // the slots (layers/lora.py LoRASlots): a [S, rows_per_slot, in] (slice i's A in rows i*r..(i+1)*r of a slot of
  // rank r), b [S, b_per_slot] (each slice's B packed, from r * its `packed`); present[s]: the slot's adapter
  // targets this projection
  const void* a;
  const void* b;
  int64_t rows_per_slot, in, b_per_slot;
  const LoraSlice* slices;
  int64_t num_slices;
  const uint8_t* present;
  // the step's groups: group g's slot, rank and scale, and its rows rows[offsets[g]..offsets[g + 1])
  const int64_t* slot;
  const int64_t* rank;
  const float* scale;
  const int64_t* offsets;
  const int64_t* rows;
  int64_t num_groups;
  // y in the AMX gate/up kernel's swiglu order (projection.cpp): kLoraPanel columns of each slice in turn, so
  // that slice i's column c is y's column (c / kLoraPanel * num_slices + i) * kLoraPanel + c % kLoraPanel
  bool swiglu_panels = false;
};

// y[rows of g] += scale_g * (x[rows of g] @ A_slot^T) @ B_slot for every group whose slot is present, on `path`
// (portable, avx2, avx512): float32 accumulation, one rounding to y's type at the end.
void lora_add(const LoraArgs& args, Isa path);

// Each instruction set's kernel (lora_kernels_<isa>.cpp), those of the build's instruction sets (isa.h): what lora_add
// calls for `path`.
void lora_add_portable(const LoraArgs& args);
void lora_add_avx2(const LoraArgs& args);
void lora_add_avx512(const LoraArgs& args);
void lora_add_avx512_bf16(const LoraArgs& args);
