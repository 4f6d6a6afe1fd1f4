// The per-instruction-set attention kernels' one argument and their prototypes. Light on purpose (c10's scalar types
// and isa.h, no ATen operators): the files holding those kernels include only this, work_split.h and their vector
// maths, and compile in a fraction of the time a file including <ATen/ATen.h> takes.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "isa.h"

// ---- Per-instruction-set attention kernels (paged_attention.cpp checks the shapes before any of them runs) ----
// One paged-attention call as raw pointers. Decode: one query row per sequence (q_stride = heads * head_dim,
// query_starts unused). Prefill: the query rows of each sequence in order, query_starts [S + 1] cumulative.
template <typename T>
struct PagedArgs {
  const float* q;
  int64_t q_stride;  // floats from one query token to the next
  const T* k_cache;
  const T* v_cache;
  const int64_t* tables;  // [num_seqs, max_blocks]
  int64_t max_blocks;
  const int64_t* seq_lens;
  const int64_t* query_starts;
  float* out;  // [rows, num_heads, head_dim], contiguous
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size;
  float scale;
  // an int8 pool (T = int8_t): each K and V row's scale, [slots, Hkv] (kv_cache_dtype="int8")
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  // bfloat16 queries and output instead of q and out (the AMX prefill kernel only), strided as they are
  const c10::BFloat16* q_bf16 = nullptr;
  c10::BFloat16* out_bf16 = nullptr;
};

// Each returns false (and writes nothing) where it does not take the call: another head size, or a build without its
// instruction set. decode_portable.cpp takes every call.
template <typename T>
void decode_attention_portable(const PagedArgs<T>& a);                     // decode_portable.cpp
template <typename T>
bool decode_attention_avx2(const PagedArgs<T>& a);                         // decode_avx2.cpp
template <typename T>
bool decode_attention_avx512(const PagedArgs<T>& a);                       // decode_avx512.cpp
bool decode_attention_avx512_bf16(const PagedArgs<c10::BFloat16>& a);      // decode_avx512_bf16.cpp
template <typename T>
bool prefill_attention_avx512(const PagedArgs<T>& a);                      // prefill_avx512.cpp
// a bfloat16 pool on AMX tiles, or their scalar emulation (tests); head_dim 32, 64 or 128
bool prefill_attention_amx(const PagedArgs<c10::BFloat16>& a, bool emulated);  // prefill_amx.cpp
// a bfloat16 pool by AVX512-BF16 dot products (built where the compiler targets AVX512-BF16); the same head sizes
bool prefill_attention_avx512_bf16(const PagedArgs<c10::BFloat16>& a);  // prefill_avx512_bf16.cpp
