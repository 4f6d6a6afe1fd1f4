// Operators the Python layers write as torch code (layers/windowed_attention.py, layers/moe.py,
// layers/activation.py), written here as the same ATen calls in the same order on the same tensors, so that the native
// decoder loop (decoder_loop.cpp) computes what those layers compute, bit for bit (tests/models/test_decoder_loop.py).
// A change to either side is a change to both.
#include "aten_pch.h"  // first: the precompiled torch headers (build.py)

#include <algorithm>
#include <limits>
#include <tuple>
#include <vector>

#include "layer_ops.h"

namespace {

constexpr auto kLong = at::kLong;

// windowed_attention.py _visible: causal, and within the window (0: none): key j is visible to the query at p iff
// j <= p and j > p - window
at::Tensor visible(const at::Tensor& key_pos, const at::Tensor& query_pos, int64_t window) {
  const auto mask = key_pos <= query_pos;
  return window <= 0 ? mask : mask & (key_pos > query_pos - window);
}

// windowed_attention.py attend: q [..., Hkv, G, Q, D], k/v [..., K, Hkv, D], mask [..., Q, K] -> [..., Hkv, G, Q, D]
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, double scale,
                  double softcap) {
  const int64_t dims = q.dim(), kv_heads = q.size(dims - 4), groups = q.size(dims - 3), queries = q.size(dims - 2);
  const auto lead = q.sizes().slice(0, dims - 4).vec();
  const auto shape = [&](std::initializer_list<int64_t> tail) {
    auto s = lead;
    s.insert(s.end(), tail);
    return s;
  };
  auto out = at::empty_like(q);
  const auto hidden = mask.unsqueeze(-3).bitwise_not();
  for (int64_t h = 0; h < kv_heads; ++h) {
    const auto q_h = q.select(dims - 4, h).reshape(shape({groups * queries, q.size(dims - 1)}));
    auto scores = at::matmul(q_h, k.select(-2, h).transpose(-1, -2)) * scale;
    if (softcap > 0) scores = at::tanh(scores / softcap) * softcap;
    scores = scores.view(shape({groups, queries, -1})).masked_fill(hidden, -std::numeric_limits<double>::infinity());
    const auto probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
    out.select(dims - 4, h).copy_(at::matmul(probs.flatten(-3, -2), v.select(-2, h)).view(shape({groups, queries, -1})));
  }
  return out;
}

// windowed_attention.py _decode_window: per decode sequence the block ids that hold its window [B, span] and which of
// their slots its query sees [B, 1, span * block_size]; once a step per window
const std::tuple<int64_t, at::Tensor, at::Tensor>& decode_window(const StepAttention& step, int64_t block_size,
                                                                 int64_t window, DecodeWindows& windows) {
  for (const auto& entry : windows)
    if (std::get<0>(entry) == window) return entry;
  const auto& seq_lens = *step.decode_seq_lens;
  const auto& tables = *step.decode_block_tables;
  const int64_t max_blocks = tables.size(1);
  at::Tensor first;
  int64_t span = max_blocks;
  if (window <= 0) {
    first = at::zeros_like(seq_lens);
  } else {
    first = at::floor_divide((seq_lens - window).clamp_min(0), block_size);
    span = std::min(max_blocks, (window + block_size - 1) / block_size + 1);
  }
  const auto index = first.unsqueeze(1) + at::arange(span, at::TensorOptions().dtype(kLong)).unsqueeze(0);
  const auto last = at::floor_divide(seq_lens - 1, block_size).unsqueeze(1);
  const auto window_tables = tables.gather(1, at::minimum(index, last));
  const auto slots = at::arange(block_size, at::TensorOptions().dtype(kLong));
  const auto key_pos = (index.unsqueeze(2) * block_size + slots).flatten(1);
  const auto mask = visible(key_pos, (seq_lens - 1).unsqueeze(1), window);
  windows.emplace_back(window, window_tables, mask.unsqueeze(1));
  return windows.back();
}

// windowed_attention.py _gather: blocks [B, span] of a pool [N, block_size, Hkv, D] -> [B, span * block_size, Hkv, D]
at::Tensor gather_blocks(const at::Tensor& cache, const at::Tensor& tables, at::ScalarType dtype) {
  return cache.index_select(0, tables.reshape(-1))
      .view({tables.size(0), tables.size(1) * cache.size(1), cache.size(2), cache.size(3)})
      .to(dtype);
}

at::Tensor windowed_decode(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const StepAttention& step, double scale, int64_t window, double softcap,
                           DecodeWindows& windows) {
  const auto& [_, tables, mask] = decode_window(step, key_cache.size(1), window, windows);
  const int64_t seqs = q.size(0), heads = q.size(1), head_dim = q.size(2), kv_heads = key_cache.size(2);
  const auto keys = gather_blocks(key_cache, tables, q.scalar_type());
  const auto values = gather_blocks(value_cache, tables, q.scalar_type());
  const auto grouped = q.reshape({seqs, kv_heads, heads / kv_heads, 1, head_dim});
  return attend(grouped, keys, values, mask, scale, softcap).reshape({seqs, heads, head_dim});
}

// windowed_attention.py _sequence_range: one sequence's K or V at positions lo .. hi - 1 -> [hi - lo, Hkv, D]
at::Tensor sequence_range(const at::Tensor& cache, const at::Tensor& block_table, int64_t lo, int64_t hi,
                          at::ScalarType dtype) {
  const int64_t block_size = cache.size(1), first = lo / block_size, last = (hi + block_size - 1) / block_size;
  const auto blocks = block_table.slice(0, first, last);
  const int64_t offset = lo - first * block_size;
  return cache.index_select(0, blocks).view({-1, cache.size(2), cache.size(3)}).slice(0, offset, offset + hi - lo).to(
      dtype);
}

at::Tensor windowed_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const StepAttention& step, double scale, int64_t window,
                            double softcap, int64_t query_tile) {
  auto out = at::empty_like(q);
  const int64_t heads = q.size(1), head_dim = q.size(2), kv_heads = k.size(1);
  const auto dtype = q.scalar_type();
  const auto positions = at::TensorOptions().dtype(kLong);
  for (size_t i = 0; i < step.spans.size(); ++i) {
    const auto [start, stop, context] = step.spans[i];
    for (int64_t a = start; a < stop; a += query_tile) {
      const int64_t b = std::min(a + query_tile, stop);
      const int64_t first_pos = context + a - start, end_pos = context + b - start;
      const int64_t lo = window <= 0 ? 0 : std::max<int64_t>(0, first_pos - window + 1);
      at::Tensor keys, values;
      if (context == 0) {
        keys = k.slice(0, start + lo, start + end_pos);
        values = v.slice(0, start + lo, start + end_pos);
      } else {
        const auto table = step.prefill_block_tables->select(0, static_cast<int64_t>(i));
        keys = sequence_range(key_cache, table, lo, end_pos, dtype);
        values = sequence_range(value_cache, table, lo, end_pos, dtype);
      }
      const auto query_pos = at::arange(first_pos, end_pos, positions).unsqueeze(1);
      const auto mask = visible(at::arange(lo, end_pos, positions).unsqueeze(0), query_pos, window);
      const auto tile = q.slice(0, a, b).reshape({b - a, kv_heads, heads / kv_heads, head_dim}).permute({1, 2, 0, 3});
      const auto o = attend(tile, keys, values, mask, scale, softcap);
      out.slice(0, a, b).copy_(o.permute({2, 0, 1, 3}).reshape({b - a, heads, head_dim}));
    }
  }
  return out;
}

}  // namespace

at::Tensor windowed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& key_cache,
                              const at::Tensor& value_cache, const StepAttention& step, double scale, int64_t window,
                              double softcap, int64_t query_tile, DecodeWindows& decode_windows) {
  TORCH_CHECK(query_tile > 0, "a positive query tile");
  auto out = at::empty_like(q);
  const int64_t tokens = q.size(0), d = step.decode_rows;
  if (d > 0)
    out.slice(0, 0, d).copy_(
        windowed_decode(q.slice(0, 0, d), key_cache, value_cache, step, scale, window, softcap, decode_windows));
  if (d < tokens) {
    TORCH_CHECK(step.prefill_block_tables.has_value(), "rows without a group");
    out.slice(0, d, tokens)
        .copy_(windowed_prefill(q.slice(0, d, tokens), k.slice(0, d, tokens), v.slice(0, d, tokens), key_cache,
                                value_cache, step, scale, window, softcap, query_tile));
  }
  return out;
}

at::Tensor moe_mlp(const at::Tensor& x, const at::Tensor& router, const std::vector<Projection>& experts, int64_t top_k,
                   bool normalize) {
  const int64_t num_experts = static_cast<int64_t>(experts.size() / 2);
  TORCH_CHECK(num_experts > 0 && experts.size() % 2 == 0, "each expert: a gate/up and a down projection");
  // Router.forward: softmax over the experts' logits in float32, the top k, renormalised
  const auto probs = at::softmax(at::linear(x, router).to(at::kFloat), -1);
  auto [weights, ids] = at::topk(probs, top_k, -1);
  if (normalize) weights = weights / weights.sum(at::IntArrayRef{-1}, true);
  // (token, expert) pairs sorted by expert, each expert's run through its projections
  const auto flat = ids.reshape(-1);
  const auto order = at::argsort(flat, /*stable=*/true);
  const auto tokens = at::floor_divide(order, top_k);
  const auto counts = at::bincount(flat, {}, num_experts).contiguous();
  const auto* count = counts.data_ptr<int64_t>();
  const auto gathered = x.index_select(0, tokens);
  auto outputs = at::empty_like(gathered);
  int64_t start = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    if (count[e] == 0) continue;
    const int64_t end = start + count[e];
    const auto& gate_up = experts[2 * e];
    const auto& down = experts[2 * e + 1];
    outputs.slice(0, start, end).copy_(down(gate_up.silu_and_mul_of(gathered.slice(0, start, end))));
    start = end;
  }
  const auto weighted = outputs.to(at::kFloat) * weights.reshape(-1).index_select(0, order).unsqueeze(1);
  return at::zeros(x.sizes(), x.options().dtype(at::kFloat)).index_add_(0, tokens, weighted).to(x.scalar_type());
}

at::Tensor gelu_tanh_and_mul(const at::Tensor& gate_up) {
  const auto halves = gate_up.chunk(2, -1);
  return at::gelu(halves[0], "tanh") * halves[1];
}
