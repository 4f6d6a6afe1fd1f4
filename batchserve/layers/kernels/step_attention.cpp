// paged_attention (layer_ops.h): one layer's attention over a step's packed rows. The Python layers
// (layers/attention.py paged_attention, on the CPU) and the native decoder loop call this same function.
#include <string>

#include <torch/extension.h>  // pybind11: this file registers its classes

#include "layer_ops.h"

namespace {

at::Tensor decode(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                     const StepAttention& step, double scale) {
  return paged_decode_attention(q.to(at::kFloat).contiguous(), key_cache, value_cache, *step.decode_block_tables,
                                *step.decode_seq_lens, scale, step.path)
      .to(q.scalar_type());
}

// One sequence's first `num_keys` K or V from the pool through its block table -> [1, Hkv, num_keys, D].
at::Tensor sequence_kv(const at::Tensor& cache, const at::Tensor& blocks, int64_t num_keys,
                          at::ScalarType dtype) {
  return cache.index_select(0, blocks)
      .view({-1, cache.size(2), cache.size(3)})
      .slice(0, 0, num_keys)
      .transpose(0, 1)
      .unsqueeze(0)
      .to(dtype);
}

// One SDPA per sequence on its own rows: a fresh prompt attends to this step's K/V as they are (causal); a chunk after
// earlier context reads its sequence's blocks from the pool, this chunk's included, under its shifted causal mask.
at::Tensor prefill_by_sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& key_cache, const at::Tensor& value_cache,
                              const StepAttention& step, double scale) {
  auto out = at::empty_like(q);
  const bool gqa = q.size(1) != k.size(1);
  const int64_t block_size = key_cache.size(1);
  for (size_t i = 0; i < step.spans.size(); ++i) {
    const auto [start, stop, context] = step.spans[i];
    const auto rows = [&](const at::Tensor& t) { return t.slice(0, start, stop).transpose(0, 1).unsqueeze(0); };
    at::Tensor o;
    if (context == 0) {
      o = at::scaled_dot_product_attention(rows(q), rows(k), rows(v), {}, 0.0, true, scale, gqa);
    } else {
      const int64_t num_keys = context + stop - start;
      const auto blocks = step.prefill_block_tables->select(0, i).slice(0, 0, (num_keys + block_size - 1) / block_size);
      o = at::scaled_dot_product_attention(rows(q), sequence_kv(key_cache, blocks, num_keys, q.scalar_type()),
                                           sequence_kv(value_cache, blocks, num_keys, q.scalar_type()),
                                           step.chunk_masks[i], 0.0, false, scale, gqa);
    }
    out.slice(0, start, stop).copy_(o.select(0, 0).transpose(0, 1));
  }
  return out;
}

at::Tensor prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& key_cache, const at::Tensor& value_cache, const StepAttention& step,
                      double scale) {
  if (!step.native_prefill) return prefill_by_sdpa(q, k, v, key_cache, value_cache, step, scale);
  return paged_prefill_attention(q.to(at::kFloat), key_cache, value_cache, *step.prefill_block_tables,
                                 *step.prefill_seq_lens, *step.prefill_query_starts, scale, step.path)
      .to(q.scalar_type());
}

StepAttention make_step(at::Tensor slot_mapping, int64_t decode_rows, c10::optional<at::Tensor> decode_block_tables,
                        c10::optional<at::Tensor> decode_seq_lens, c10::optional<at::Tensor> prefill_block_tables,
                        c10::optional<at::Tensor> prefill_seq_lens, c10::optional<at::Tensor> prefill_query_starts,
                        std::vector<std::tuple<int64_t, int64_t, int64_t>> spans, bool native_prefill,
                        AttentionPath path) {
  TORCH_CHECK(decode_rows == 0 || (decode_block_tables.has_value() && decode_seq_lens.has_value()),
              "decode rows need their block tables and lengths");
  TORCH_CHECK(!native_prefill || prefill_query_starts.has_value(), "the native prefill kernel needs query starts");
  StepAttention step{std::move(slot_mapping),         decode_rows,          std::move(decode_block_tables),
                     std::move(decode_seq_lens),      std::move(prefill_block_tables), std::move(prefill_seq_lens),
                     std::move(prefill_query_starts), std::move(spans),     native_prefill, path, {}};
  if (!native_prefill)
    for (const auto& [start, stop, context] : step.spans)
      step.chunk_masks.push_back(context == 0 ? c10::optional<at::Tensor>()
                                              : at::ones({stop - start, context + stop - start},
                                                            at::TensorOptions().dtype(at::kBool))
                                                    .tril(context));
  return step;
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& key_cache, const at::Tensor& value_cache,
                              const StepAttention& step, double scale) {
  TORCH_CHECK(step.decode_rows == q.size(0) || step.prefill_block_tables.has_value(), "rows without a group");
  write_kv_(k, v, key_cache, value_cache, step.slot_mapping);
  const int64_t tokens = q.size(0), d = step.decode_rows;
  if (d == tokens) return decode(q, key_cache, value_cache, step, scale);
  if (d == 0) return prefill(q, k, v, key_cache, value_cache, step, scale);
  auto out = at::empty_like(q);
  out.narrow(0, 0, d).copy_(decode(q.narrow(0, 0, d), key_cache, value_cache, step, scale));
  out.narrow(0, d, tokens - d)
      .copy_(prefill(q.narrow(0, d, tokens - d), k.narrow(0, d, tokens - d), v.narrow(0, d, tokens - d), key_cache,
                     value_cache, step, scale));
  return out;
}

void register_step_attention(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<StepAttention>(m, "StepAttention")
      .def(py::init(&make_step), py::arg("slot_mapping"), py::arg("decode_rows"), py::arg("decode_block_tables"),
           py::arg("decode_seq_lens"), py::arg("prefill_block_tables"), py::arg("prefill_seq_lens"),
           py::arg("prefill_query_starts"), py::arg("spans"), py::arg("native_prefill"), py::arg("path"));
  m.def("paged_attention", &paged_attention,
        "one layer's attention over a step: store its K/V, then the decode and the prefill rows on their paths",
        py::call_guard<py::gil_scoped_release>(), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("key_cache"),
        py::arg("value_cache"), py::arg("step"), py::arg("scale"));
}
