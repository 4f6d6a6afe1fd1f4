// Decode attention over a quantized KV pool (kv_cache_dtype "int8" or "fp8_e4m3", layers/kv_quant.py), reading the
// codes in place:
// each key row's scale multiplies its q.k dot, each value row's scale its softmax weight. On the AVX-512 attention
// paths the AVX-512 decode kernel reads the codes (decode_avx512.cpp), on avx2 the AVX2 one (decode_avx2.cpp), head
// sizes 32 / 64 / 128; on portable (and other head sizes) plain C++ loops that the build's -march=native vectorises. Registered as a torch op
// (torch.ops.batchserve_kv_quant.paged_decode)
// so that it needs no entry in bindings.cpp.
#include "aten_pch.h"  // first: the precompiled torch headers (build.py)

#include "isa.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <ATen/ATen.h>


#include "layer_ops.h"
#include "work_split.h"

namespace {

// One (sequence, context partition, KV head) of `split`: the `group` query heads sharing the kv head, online softmax
// over the partition's tokens (table: its blocks), float32 throughout.
template <typename Code>
void decode_one(DecodeSplit& split, const DecodeItem& item, const float* q, int64_t group, int64_t head_dim,
                const Code* key, const Code* value, const float* k_scale, const float* v_scale, const int64_t* table,
                int64_t seq_len, int64_t block_size, int64_t kv_heads, int64_t kv_head, float scale, float* out) {
  std::vector<float> acc(group * head_dim, 0.0f), max_logit(group, -std::numeric_limits<float>::infinity()),
      denom(group, 0.0f);
  const int64_t row_stride = kv_heads * head_dim;  // between slots of a block
  for (int64_t pos = 0; pos < seq_len; ++pos) {
    const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
    const Code* k = key + slot * row_stride + kv_head * head_dim;
    const Code* v = value + slot * row_stride + kv_head * head_dim;
    const float ks = k_scale[slot * kv_heads + kv_head], vs = v_scale[slot * kv_heads + kv_head];
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * head_dim;
      float dot = 0.0f;
      for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * static_cast<float>(k[d]);
      const float logit = dot * ks * scale;
      float* a = acc.data() + g * head_dim;
      if (logit > max_logit[g]) {
        const float shrink = std::exp(max_logit[g] - logit);
        for (int64_t d = 0; d < head_dim; ++d) a[d] *= shrink;
        denom[g] *= shrink;
        max_logit[g] = logit;
      }
      const float w = std::exp(logit - max_logit[g]);
      denom[g] += w;
      const float wv = w * vs;
      for (int64_t d = 0; d < head_dim; ++d) a[d] += wv * static_cast<float>(v[d]);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const int64_t head = kv_head * group + g;
    float* o = split.row(item, head, out);
    const float inv = denom[g] > 0.0f ? split.finish(item, head, max_logit[g], denom[g]) : 0.0f;
    for (int64_t d = 0; d < head_dim; ++d) o[d] = acc[g * head_dim + d] * inv;
  }
}

// The path's vectorized decode kernel on the codes (AVX-512 on avx512 / avx512_bf16, AVX2 on avx2) where it takes
// the head size; false where none does (portable, other head sizes): the plain loop runs.
template <typename Code>
bool vectorized_decode(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& tables,
                       const at::Tensor& lens, double scale, AttentionPath path, at::Tensor& out) {
  PagedArgs<Code> args{query.data_ptr<float>(), query.stride(0),    static_cast<const Code*>(key.data_ptr()),
                         static_cast<const Code*>(value.data_ptr()), tables.data_ptr<int64_t>(), tables.size(1),
                         lens.data_ptr<int64_t>(), nullptr,           out.data_ptr<float>(),
                         lens.size(0),             query.size(1),     key.size(2),
                         query.size(2),            key.size(1),       static_cast<float>(scale),
                         k_scale.data_ptr<float>(), v_scale.data_ptr<float>()};
#ifdef BATCHSERVE_ISA_AVX512
  if (path == AttentionPath::kAvx512 || path == AttentionPath::kAvx512Bf16) return decode_attention_avx512<Code>(args);
#endif
  return path == AttentionPath::kAvx2 && decode_attention_avx2<Code>(args);
}

// the plain loop over every (sequence, kv head)
template <typename Code>
void decode_loop(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_scale,
                 const at::Tensor& v_scale, const at::Tensor& tables, const at::Tensor& lens, double scale,
                 at::Tensor& out) {
  const int64_t num_seqs = query.size(0), heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key.size(1), kv_heads = key.size(2), group = heads / kv_heads;
  const int64_t max_blocks = tables.size(1);
  const float* q_p = query.data_ptr<float>();
  float* out_p = out.data_ptr<float>();
  const auto* key_p = static_cast<const Code*>(key.data_ptr());
  const auto* value_p = static_cast<const Code*>(value.data_ptr());
  DecodeSplit split = split_decode(lens.data_ptr<int64_t>(), num_seqs, heads, kv_heads, head_dim, block_size,
                                   /*per_head=*/true);
  run_decode_items(split, out_p, [&](WorkQueue& queue) {
    for (int64_t item; queue.next(item);) {
      const DecodeItem& it = split.items[item];
      const int64_t b = it.seq, h = it.first_kv;
      decode_one(split, it, q_p + (b * heads + h * group) * head_dim, group, head_dim, key_p, value_p,
                 k_scale.data_ptr<float>(), v_scale.data_ptr<float>(),
                 tables.data_ptr<int64_t>() + b * max_blocks + it.first_block, it.len, block_size, kv_heads, h,
                 static_cast<float>(scale), out_p);
    }
  });
}

template <typename Code>
void decode_codes(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_scale,
                  const at::Tensor& v_scale, const at::Tensor& tables, const at::Tensor& lens, double scale,
                  AttentionPath path, at::Tensor& out) {
  if (!vectorized_decode<Code>(query, key, value, k_scale, v_scale, tables, lens, scale, path, out))
    decode_loop<Code>(query, key, value, k_scale, v_scale, tables, lens, scale, out);
}

}  // namespace

// query [B, H, D] float32; key/value [N, block_size, Hkv, D] int8 or float8 e4m3; scales [N, block_size, Hkv] float32;
// block_tables [B, max_blocks] int64; seq_lens [B] int64 -> [B, H, D] float32.
at::Tensor paged_decode_quantized(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, double scale, AttentionPath path) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kFloat && query.is_contiguous(), "query: [B, H, D] f32");
  TORCH_CHECK(key.dim() == 4 && is_quantized_pool_type(key.scalar_type()) && key.is_contiguous() &&
                  value.sizes() == key.sizes() && value.scalar_type() == key.scalar_type() && value.is_contiguous(),
              "key/value: contiguous int8 or float8_e4m3fn [N, block_size, Hkv, D] of one shape and type");
  TORCH_CHECK(k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat && k_scale.is_contiguous() &&
                  v_scale.is_contiguous() && k_scale.sizes() == key.sizes().slice(0, 3) &&
                  v_scale.sizes() == key.sizes().slice(0, 3),
              "scales: contiguous float32 [N, block_size, Hkv]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  block_tables.dim() == 2 && seq_lens.dim() == 1 && block_tables.size(0) == query.size(0) &&
                  seq_lens.size(0) == query.size(0),
              "block_tables [B, max_blocks] and seq_lens [B], int64");
  const int64_t num_seqs = query.size(0), heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = key.size(0), block_size = key.size(1), kv_heads = key.size(2);
  TORCH_CHECK(key.size(3) == head_dim && kv_heads > 0 && heads % kv_heads == 0, "head sizes do not match");
  const auto tables = block_tables.contiguous();
  const auto lens = seq_lens.contiguous();
  const int64_t max_blocks = tables.size(1);
  const int64_t* lens_p = lens.data_ptr<int64_t>();
  const int64_t* tables_p = tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < num_seqs; ++b) {
    TORCH_CHECK(lens_p[b] >= 0 && lens_p[b] <= max_blocks * block_size, "seq_len beyond its block table");
    for (int64_t i = 0; i < (lens_p[b] + block_size - 1) / block_size; ++i) {
      const int64_t id = tables_p[b * max_blocks + i];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block id outside the pool");
    }
  }
  auto out = at::empty_like(query);
  if (key.scalar_type() == at::kChar) {
    decode_codes<int8_t>(query, key, value, k_scale, v_scale, tables, lens, scale, path, out);
  } else {
    decode_codes<c10::Float8_e4m3fn>(query, key, value, k_scale, v_scale, tables, lens, scale, path, out);
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(batchserve_kv_quant, m) {
  m.def("paged_decode(Tensor query, Tensor key, Tensor value, Tensor k_scale, Tensor v_scale, Tensor block_tables, "
        "Tensor seq_lens, float scale, int path) -> Tensor");
}

namespace {
// the op's form: the attention path as its integer (kernels.attention_path(), an AttentionPath)
at::Tensor paged_decode_op(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, double scale, int64_t path) {
  return paged_decode_quantized(query, key, value, k_scale, v_scale, block_tables, seq_lens, scale,
                           static_cast<AttentionPath>(path));
}
}  // namespace

TORCH_LIBRARY_IMPL(batchserve_kv_quant, CPU, m) { m.impl("paged_decode", &paged_decode_op); }
