// paged_attention (layer_ops.h): one layer's attention over a step's packed rows. The Python layers
// (layers/attention.py paged_attention, on the CPU) and the native decoder loop call this same function.
#include "aten_pch.h"  // first: the precompiled torch headers (build.py)

#include <string>

#include "layer_ops.h"

namespace {

// A layer's pool: float (its dtype's K/V), or quantized codes with scales
struct Pool {
  const at::Tensor &key, &value;
  const QuantizedPool* quantized;  // null for a float pool
};

at::Tensor decode(const at::Tensor& q, const Pool& pool, const StepAttention& step, double scale) {
  const auto q32 = q.to(at::kFloat).contiguous();
  const auto tables = *step.decode_block_tables, lens = *step.decode_seq_lens;
  const auto out = pool.quantized != nullptr
                       ? paged_decode_quantized(q32, pool.key, pool.value, pool.quantized->key_scale,
                                                pool.quantized->value_scale, tables, lens, scale, step.path)
                       : paged_decode_attention(q32, pool.key, pool.value, tables, lens, scale, step.path);
  return out.to(q.scalar_type());
}

// One sequence's first `num_keys` K or V from the pool through its block table (quantized: dequantized) ->
// [1, Hkv, num_keys, D].
at::Tensor sequence_kv(const at::Tensor& cache, const at::Tensor* scales, const at::Tensor& blocks, int64_t num_keys,
                          at::ScalarType dtype) {
  const auto rows = scales != nullptr ? dequantized_blocks(cache, *scales, blocks, dtype) : cache.index_select(0, blocks);
  return rows.view({-1, cache.size(2), cache.size(3)})
      .slice(0, 0, num_keys)
      .transpose(0, 1)
      .unsqueeze(0)
      .to(dtype);
}

// One SDPA per sequence on its own rows: a fresh prompt attends to this step's K/V as they are (causal); a chunk after
// earlier context reads its sequence's blocks from the pool, this chunk's included, under its shifted causal mask.
// Chunks of at most `skip_rows` rows are left out (their rows unwritten: the native kernel's).
at::Tensor prefill_by_sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Pool& pool,
                              const StepAttention& step, double scale, int64_t skip_rows) {
  auto out = at::empty_like(q);
  const bool gqa = q.size(1) != k.size(1);
  const int64_t block_size = pool.key.size(1);
  const at::Tensor* key_scale = pool.quantized != nullptr ? &pool.quantized->key_scale : nullptr;
  const at::Tensor* value_scale = pool.quantized != nullptr ? &pool.quantized->value_scale : nullptr;
  for (size_t i = 0; i < step.spans.size(); ++i) {
    const auto [start, stop, context] = step.spans[i];
    if (stop - start <= skip_rows) continue;
    const auto rows = [&](const at::Tensor& t) { return t.slice(0, start, stop).transpose(0, 1).unsqueeze(0); };
    at::Tensor o;
    if (context == 0) {
      o = at::scaled_dot_product_attention(rows(q), rows(k), rows(v), {}, 0.0, true, scale, gqa);
    } else {
      const int64_t num_keys = context + stop - start;
      const auto blocks = step.prefill_block_tables->select(0, i).slice(0, 0, (num_keys + block_size - 1) / block_size);
      o = at::scaled_dot_product_attention(
          rows(q), sequence_kv(pool.key, key_scale, blocks, num_keys, q.scalar_type()),
          sequence_kv(pool.value, value_scale, blocks, num_keys, q.scalar_type()), step.chunk_masks[i], 0.0, false,
          scale, gqa);
    }
    out.slice(0, start, stop).copy_(o.select(0, 0).transpose(0, 1));
  }
  return out;
}

// The native prefill kernel over chunks (q: their rows in order) -> q's dtype. bf16 rows of a bf16 pool go to the AMX
// kernel as they are; any other through float32.
at::Tensor prefill_natively(const at::Tensor& q, const Pool& pool, const at::Tensor& tables, const at::Tensor& lens,
                            const at::Tensor& starts, const StepAttention& step, double scale) {
  const bool bf16_rows = q.scalar_type() == at::kBFloat16 && pool.key.scalar_type() == at::kBFloat16 &&
                         step.prefill_path != Isa::kAvx512;
  return paged_prefill_attention(bf16_rows ? q : q.to(at::kFloat), pool.key, pool.value, tables, lens, starts, scale,
                                 step.path, step.prefill_path)
      .to(q.scalar_type());
}

// Each chunk by its own length (layers/attention.py prefill_attention, the same rule): the short ones in one native
// call, the longer ones one SDPA each.
at::Tensor prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Pool& pool,
                      const StepAttention& step, double scale) {
  TORCH_CHECK(pool.quantized == nullptr || step.native_prefill_rows == 0,
              "an 8-bit pool's prefill chunks attend by SDPA only");
  if (step.native_prefill_rows == 0) return prefill_by_sdpa(q, k, v, pool, step, scale, 0);
  TORCH_CHECK(!step.spans.empty(), "prefill rows without their chunks' spans");
  const auto [first, end, context] = step.spans.front();
  if (!step.native_subset.has_value() && end - first <= step.native_prefill_rows)  // every chunk short
    return prefill_natively(q, pool, *step.prefill_block_tables, *step.prefill_seq_lens, *step.prefill_query_starts,
                            step, scale);
  auto out = prefill_by_sdpa(q, k, v, pool, step, scale, step.native_prefill_rows);
  if (step.native_subset.has_value()) {
    const NativeSubset& sub = *step.native_subset;
    out.index_copy_(0, sub.rows,
                    prefill_natively(q.index_select(0, sub.rows), pool, sub.block_tables, sub.seq_lens,
                                     sub.query_starts, step, scale));
  }
  return out;
}


}  // namespace

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& key_cache, const at::Tensor& value_cache,
                              const StepAttention& step, double scale, const c10::optional<at::Tensor>& key_scale,
                              const c10::optional<at::Tensor>& value_scale) {
  TORCH_CHECK(step.decode_rows == q.size(0) || step.prefill_block_tables.has_value(), "rows without a group");
  TORCH_CHECK(key_scale.has_value() == value_scale.has_value(), "a quantized pool has both scales");
  c10::optional<QuantizedPool> quantized;
  at::Tensor keys = k, values = v;  // what the prefill rows attend to: the K/V as the pool stores them
  if (key_scale.has_value()) {
    quantized = QuantizedPool{key_cache, value_cache, *key_scale, *value_scale};
    std::tie(keys, values) = write_kv_quantized_(k, v, *quantized, step.slot_mapping);
  } else {
    write_kv_(k, v, key_cache, value_cache, step.slot_mapping);
  }
  const Pool pool{key_cache, value_cache, quantized.has_value() ? &*quantized : nullptr};
  const int64_t tokens = q.size(0), d = step.decode_rows;
  if (d == tokens) return decode(q, pool, step, scale);
  if (d == 0) return prefill(q, keys, values, pool, step, scale);
  auto out = at::empty_like(q);
  out.narrow(0, 0, d).copy_(decode(q.narrow(0, 0, d), pool, step, scale));
  out.narrow(0, d, tokens - d)
      .copy_(prefill(q.narrow(0, d, tokens - d), keys.narrow(0, d, tokens - d), values.narrow(0, d, tokens - d),
                     pool, step, scale));
  return out;
}
