// LoRA deltas on a projection's output (layer_ops.h lora_add_): the tensors the Python layers and the native decoder
// loop hand over, checked, as the raw arguments of the kernel (lora_tiles.h). Python's LoRASlots.add_delta calls
// this on the CPU, and the loop calls it after each projection that serves adapters, so the two ways of running a
// step add the same deltas, bit for bit.
#include "aten_pch.h"  // first: the precompiled torch headers (build.py)

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "layer_ops.h"

namespace {

bool lora_path_built(Isa path) {
  for (const auto& [op, format, isa] : kernel_table())
    if (op == "lora" && isa == path) return cpu_runs(path);
  return false;
}

int64_t lora_out(const LoraWeights& w) {
  int64_t out = 0;
  for (const auto& slice : w.slices) out = std::max(out, slice.offset + slice.size);
  return out;
}

}  // namespace

LoraWeights make_lora_weights(at::Tensor a, at::Tensor b, at::Tensor present,
                              const std::vector<std::tuple<int64_t, int64_t>>& slices) {
  TORCH_CHECK_VALUE(a.dim() == 3 && b.dim() == 2 && a.size(0) == b.size(0),
                    "LoRA slots: a [S, R, in] and b [S, packed values]");
  TORCH_CHECK_VALUE(a.scalar_type() == b.scalar_type() &&
                        (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16),
                    "LoRA slots: a and b both float32 or both bfloat16");
  TORCH_CHECK_VALUE(a.is_contiguous() && b.is_contiguous() && a.device().is_cpu() && b.device().is_cpu(),
                    "LoRA slots: contiguous CPU tensors");
  TORCH_CHECK_VALUE(present.scalar_type() == at::kByte && present.is_contiguous() && present.numel() == a.size(0),
                    "LoRA slots: present is one uint8 a slot");
  TORCH_CHECK_VALUE(!slices.empty() && a.size(1) % static_cast<int64_t>(slices.size()) == 0,
                    "LoRA slots: rows a multiple of the slices");
  const int64_t max_rank = a.size(1) / static_cast<int64_t>(slices.size());
  LoraWeights weights{std::move(a), std::move(b), std::move(present), {}};
  int64_t packed = 0;
  for (const auto& [offset, size] : slices) {
    TORCH_CHECK_VALUE(offset >= 0 && size > 0, "LoRA slice out of range");
    weights.slices.push_back({offset, size, packed});
    packed += lora_padded(size);
  }
  TORCH_CHECK_VALUE(weights.b.size(1) == max_rank * packed, "LoRA slots: b holds ", weights.b.size(1),
                    " values a slot, the slices packed at rank ", max_rank, " take ", max_rank * packed);
  return weights;
}

LoraBatch make_lora_batch(std::vector<int64_t> slot, std::vector<int64_t> rank, const std::vector<double>& scale,
                          at::Tensor rows, std::vector<int64_t> offsets, Isa path) {
  const size_t groups = slot.size();
  TORCH_CHECK_VALUE(rank.size() == groups && scale.size() == groups && offsets.size() == groups + 1,
                    "LoRA groups: one slot, rank and scale a group, and its offsets");
  TORCH_CHECK_VALUE(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous() &&
                        rows.device().is_cpu() && offsets.front() == 0 && offsets.back() == rows.numel(),
                    "LoRA groups: rows a contiguous int64 CPU vector that the offsets cover");
  TORCH_CHECK_VALUE(lora_path_built(path), "LoRA kernel path not built here or not runnable on this CPU");
  for (size_t g = 0; g < groups; ++g)
    TORCH_CHECK_VALUE(offsets[g] <= offsets[g + 1] && slot[g] >= 0 && rank[g] > 0, "LoRA group ", g, " malformed");
  const int64_t* r = rows.data_ptr<int64_t>();
  int64_t max_row = -1;
  for (int64_t i = 0; i < rows.numel(); ++i) {
    TORCH_CHECK_VALUE(r[i] >= 0, "LoRA groups: a negative row");
    max_row = std::max(max_row, r[i]);
  }
  return {std::move(slot), std::move(rank), std::move(offsets), std::vector<float>(scale.begin(), scale.end()),
          std::move(rows), max_row, path};
}

namespace {

void add_deltas(const at::Tensor& x, const at::Tensor& y, const LoraWeights& w, const LoraBatch& batch,
                bool swiglu_panels) {
  const int64_t slots = w.a.size(0), rows_per_slot = w.a.size(1), n_slices = w.slices.size();
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && batch.max_row < x.size(0),
              "lora_add_: x [T, in] and y [T, out] covering the groups' rows");
  TORCH_CHECK(x.size(1) == w.a.size(2) && y.size(1) == lora_out(w), "lora_add_: x or y of another projection");
  TORCH_CHECK(x.scalar_type() == w.a.scalar_type() && y.scalar_type() == w.a.scalar_type(),
              "lora_add_: x, y and the slots in one dtype");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "lora_add_: rows contiguous");
  for (size_t g = 0; g < batch.slot.size(); ++g)
    TORCH_CHECK(batch.slot[g] < slots && batch.rank[g] * n_slices <= rows_per_slot, "lora_add_: group ", g,
                " has slot ", batch.slot[g], " and rank ", batch.rank[g], " beyond the slots");
  const LoraArgs args{x.data_ptr(),
                      y.data_ptr(),
                      x.stride(0),
                      y.stride(0),
                      x.scalar_type() == at::kBFloat16,
                      w.a.data_ptr(),
                      w.b.data_ptr(),
                      rows_per_slot,
                      w.a.size(2),
                      w.b.size(1),
                      w.slices.data(),
                      n_slices,
                      w.present.data_ptr<uint8_t>(),
                      batch.slot.data(),
                      batch.rank.data(),
                      batch.scale.data(),
                      batch.offsets.data(),
                      batch.rows.data_ptr<int64_t>(),
                      static_cast<int64_t>(batch.slot.size()),
                      swiglu_panels};
  lora_add(args, batch.path);
}

}  // namespace

void lora_add_(const at::Tensor& x, const at::Tensor& y, const LoraWeights& w, const LoraBatch& batch) {
  if (batch.empty() || !w.defined()) return;
  add_deltas(x, y, w, batch, false);
}

void lora_add_swiglu_panels_(const at::Tensor& x, const at::Tensor& y, const LoraWeights& w, const LoraBatch& batch) {
  if (batch.empty() || !w.defined()) return;
  TORCH_CHECK(w.slices.size() == 2 && w.slices[0].size == w.slices[1].size && w.slices[0].size % kLoraPanel == 0,
              "lora_add_swiglu_panels_: gate and up of one width, whole panels");
  add_deltas(x, y, w, batch, true);
}
