// The paged attention entry points: the shapes checked (a bad call raises, never reads or writes outside its
// tensors), then the call handed to the kernel of its instruction-set path (kernels.h AttentionPath):
//   decode:  decode_avx512_bf16.cpp, decode_avx512.cpp, decode_avx2.cpp, decode_portable.cpp
//   prefill: prefill_avx512.cpp on both AVX-512 paths (the other paths have no prefill kernel: the torch code runs);
//            a bfloat16 pool by its prefill kernel path: prefill_amx.cpp, prefill_avx512_bf16.cpp or prefill_avx512.cpp
#include "aten_pch.h"  // first: the precompiled torch headers (build.py)

#include "isa.h"

#include <algorithm>
#include <type_traits>
#include <vector>

#include "attention_avx512_bf16.h"
#include "kernels.h"

// Whether this CPU runs the bf16 dot-product path (and this build has it).
bool bf16_dot_supported() {
#ifdef BATCHSERVE_BF16_DOT
  return cpu_runs(Isa::kAvx512Bf16);
#else
  return false;
#endif
}

std::vector<AttentionPath> attention_paths() {
  std::vector<AttentionPath> paths;
#ifdef BATCHSERVE_BF16_DOT
  paths.push_back(AttentionPath::kAvx512Bf16);
#endif
#ifdef BATCHSERVE_ISA_AVX512
  paths.push_back(AttentionPath::kAvx512);
#endif
#ifdef BATCHSERVE_ISA_AVX2
  paths.push_back(AttentionPath::kAvx2);
#endif
  paths.push_back(AttentionPath::kPortable);
  return paths;
}

// built here, and this CPU runs its instruction set
bool attention_path_runs(AttentionPath path) {
  const auto built = attention_paths();
  return std::find(built.begin(), built.end(), path) != built.end() && cpu_runs(path);
}

AttentionPath best_attention_path() {
  for (const AttentionPath path : attention_paths())
    if (attention_path_runs(path)) return path;
  return AttentionPath::kPortable;
}

// The bf16 dot-product prefill kernel is built here (prefill_avx512_bf16.cpp) and this CPU runs it.
bool prefill_bf16_dot_runs() {
#if defined(BATCHSERVE_ISA_AVX512) && defined(BATCHSERVE_ISA_AVX512_BF16_FILE)
  return cpu_runs(Isa::kAvx512Bf16);
#else
  return false;
#endif
}

bool prefill_attention_available(int64_t head_dim) {
#ifdef BATCHSERVE_ISA_AVX512
  return head_dim == 32 || head_dim == 64 || head_dim == 128;
#else
  return false;
#endif
}

namespace {

// Shapes the kernels index with, checked before any pointer is formed from them: a bad call raises, never reads or
// writes outside its tensors.
void check_paged_inputs(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                        const at::Tensor& tables, const at::Tensor& lens) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [T, H, D] and caches [blocks, block_size, Hkv, D]");
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes() && value_cache.scalar_type() == key_cache.scalar_type(),
              "key and value caches must match");
  TORCH_CHECK(key_cache.size(3) == query.size(2), "query and cache head sizes differ");
  TORCH_CHECK(key_cache.size(2) > 0 && query.size(1) % key_cache.size(2) == 0,
              "query heads must be a multiple of kv heads");
  TORCH_CHECK(tables.dim() == 2 && lens.dim() == 1 && tables.size(0) == lens.size(0),
              "one block table row per sequence");
  const int64_t block_size = key_cache.size(1), num_blocks = key_cache.size(0);
  const int64_t* len = lens.data_ptr<int64_t>();
  const int64_t* table = tables.data_ptr<int64_t>();
  for (int64_t s = 0; s < lens.size(0); ++s) {
    TORCH_CHECK(len[s] >= 1 && len[s] <= tables.size(1) * block_size, "sequence ", s, ": length ", len[s],
                " outside its block table");
    for (int64_t b = 0; b < (len[s] + block_size - 1) / block_size; ++b) {
      const int64_t block = table[s * tables.size(1) + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "sequence ", s, ": block ", block, " outside the pool");
    }
  }
}

// The call's raw pointers, for a pool of element type T.
template <typename T>
PagedArgs<T> paged_args(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                        const at::Tensor& tables, const at::Tensor& lens, const int64_t* query_starts,
                        double scale, at::Tensor& out) {
  const auto floats = [](const at::Tensor& t) { return t.scalar_type() == at::kFloat ? t.data_ptr<float>() : nullptr; };
  return {floats(query),              query.stride(0),         key_cache.data_ptr<T>(), value_cache.data_ptr<T>(),
          tables.data_ptr<int64_t>(), tables.size(1),         lens.data_ptr<int64_t>(), query_starts,
          floats(out),                lens.size(0),           query.size(1),           key_cache.size(2),
          query.size(2),              key_cache.size(1),      static_cast<float>(scale)};
}

// The decode kernel of `path` for a pool of T, else the next path down that takes the call (the vectorized kernels
// take float32 and bfloat16 pools).
template <typename T>
void decode_on_path(const PagedArgs<T>& a, AttentionPath path) {
  constexpr bool kVectorized = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;
  if constexpr (kVectorized) {
#ifdef BATCHSERVE_ISA_AVX512
    if (path == AttentionPath::kAvx512 || path == AttentionPath::kAvx512Bf16) {
#ifdef BATCHSERVE_BF16_DOT
      if constexpr (std::is_same_v<T, c10::BFloat16>)
        if (path == AttentionPath::kAvx512Bf16 && decode_attention_avx512_bf16(a)) return;
#endif
      if (decode_attention_avx512<T>(a)) return;
    }
#endif
    if (path == AttentionPath::kAvx2 && decode_attention_avx2<T>(a)) return;
  }
  decode_attention_portable<T>(a);
}

}  // namespace

// query [B, H, D] float32 contiguous; caches [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks] int64;
// seq_lens [B] int64 -> [B, H, D] float32. `path` must run here (attention_path_runs).
at::Tensor paged_decode_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                     at::Tensor block_tables, at::Tensor seq_lens, double scale,
                                     AttentionPath path) {
  TORCH_CHECK(attention_path_runs(path), "this attention path is not built here or does not run on this CPU");
  TORCH_CHECK(query.scalar_type() == at::kFloat && query.is_contiguous(), "query: contiguous float32");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 indices");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  check_paged_inputs(query, key_cache, value_cache, tables, lens);
  TORCH_CHECK(lens.size(0) == query.size(0), "one query per sequence");
  auto out = at::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key_cache.scalar_type(), "paged_decode_attention", [&] {
    decode_on_path<scalar_t>(paged_args<scalar_t>(query, key_cache, value_cache, tables, lens, nullptr, scale, out),
                             path);
  });
  return out;
}

// query [T, H, D] float32 (heads contiguous within a token; any token stride), the rows of the prefill sequences in
// order; caches [num_blocks, block_size, Hkv, D] (float32 or bfloat16) holding every key up to each row's position
// (this step's included); block_tables [S, max_blocks]; seq_lens [S] context after this step; query_starts [S + 1]
// cumulative query rows -> [T, H, D] float32. Needs an AVX-512 path and head_dim in {32, 64, 128}: see
// prefill_attention_available(). prefill_path (the kernel table's prefill_attention row): a bfloat16 pool's rows on
// AMX tiles (kAmx), on their scalar emulation (kPortable, tests), by AVX512-BF16 dot products (kAvx512Bf16), or
// (kAvx512) the vector kernel of `path`, K/V widened to float32.
at::Tensor paged_prefill_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                      at::Tensor block_tables, at::Tensor seq_lens, at::Tensor query_starts,
                                      double scale, AttentionPath path, Isa prefill_path) {
  TORCH_CHECK(attention_path_runs(path), "this attention path is not built here or does not run on this CPU");
  TORCH_CHECK(path == AttentionPath::kAvx512 || path == AttentionPath::kAvx512Bf16,
              "paged_prefill_attention runs on the AVX-512 paths only (on the others the torch code runs)");
  TORCH_CHECK(prefill_path == Isa::kAvx512 || prefill_path == Isa::kPortable || prefill_path == Isa::kAmx ||
                  prefill_path == Isa::kAvx512Bf16,
              "prefill_path: amx, portable (emulated tiles), avx512_bf16 or avx512");
  TORCH_CHECK(prefill_path != Isa::kAmx || cpu_runs(Isa::kAmx), "prefill_path amx: this CPU grants no AMX tiles");
  TORCH_CHECK(prefill_path != Isa::kAvx512Bf16 || prefill_bf16_dot_runs(),
              "prefill_path avx512_bf16: not built here or this CPU lacks avx512_bf16");
  const auto cache_type = key_cache.scalar_type();
  // bfloat16 queries (and output) go to the AMX kernel of a bfloat16 pool as they are, with no float32 copy
  const bool bf16_rows = query.scalar_type() == at::kBFloat16 && cache_type == at::kBFloat16 && prefill_path != Isa::kAvx512;
  TORCH_CHECK((query.scalar_type() == at::kFloat || bf16_rows) && query.dim() == 3 && query.stride(2) == 1 &&
                  query.stride(1) == query.size(2),
              "query: float32 [T, H, D] with contiguous heads (or bfloat16, on the AMX kernel of a bfloat16 pool)");
  TORCH_CHECK((cache_type == at::kFloat || cache_type == at::kBFloat16) &&
                  value_cache.scalar_type() == cache_type && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "caches: contiguous float32 or bfloat16");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  query_starts.scalar_type() == at::kLong,
              "int64 indices");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto starts = query_starts.contiguous();
  check_paged_inputs(query, key_cache, value_cache, tables, lens);
  const int64_t num_seqs = lens.size(0);
  TORCH_CHECK(starts.dim() == 1 && starts.size(0) == num_seqs + 1, "query_starts: [S + 1]");
  const int64_t* start = starts.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  TORCH_CHECK(start[0] == 0 && start[num_seqs] == query.size(0), "query_starts must run from 0 to the query rows");
  for (int64_t s = 0; s < num_seqs; ++s)
    TORCH_CHECK(start[s + 1] > start[s] && start[s + 1] - start[s] <= len[s], "sequence ", s,
                ": query rows must be 1..seq_len");
  TORCH_CHECK(prefill_attention_available(query.size(2)), "paged_prefill_attention: head_dim 32, 64 or 128 only");
  auto out = at::empty({query.size(0), query.size(1), query.size(2)}, query.options());
#ifdef BATCHSERVE_ISA_AVX512
  if (cache_type == at::kFloat) {
    prefill_attention_avx512<float>(paged_args<float>(query, key_cache, value_cache, tables, lens, start, scale, out));
    return out;
  }
  // A bfloat16 pool: on prefill_path kAvx512 the vector kernel widens K/V to float32 and keeps the scores and softmax
  // weights in float32 (docs/cpu-kernels.md, prefill attention by chunk length); the tile kernels (AMX, AVX512-BF16 dot
  // products) multiply bf16 Q, K, P and V with float32 sums (prefill_tiles.h).
  auto args = paged_args<c10::BFloat16>(query, key_cache, value_cache, tables, lens, start, scale, out);
  if (bf16_rows) {
    args.q = nullptr, args.out = nullptr;
    args.q_bf16 = query.data_ptr<c10::BFloat16>(), args.out_bf16 = out.data_ptr<c10::BFloat16>();
  }
#ifdef BATCHSERVE_ISA_AVX512_BF16_FILE
  if (prefill_path == Isa::kAvx512Bf16 && prefill_attention_avx512_bf16(args)) return out;
#endif
  if ((prefill_path == Isa::kAmx || prefill_path == Isa::kPortable) &&
      prefill_attention_amx(args, prefill_path == Isa::kPortable))
    return out;
  TORCH_CHECK(!bf16_rows, "paged_prefill_attention: bfloat16 queries need the AMX or the avx512_bf16 kernel");
  prefill_attention_avx512<c10::BFloat16>(args);
#endif
  return out;
}
