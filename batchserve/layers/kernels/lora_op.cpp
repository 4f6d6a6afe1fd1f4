// LoRA deltas on a projection's output (layer_ops.h lora_add_): the tensors the Python layers and the native decoder
// loop hand over, checked, as the raw arguments of the kernel (lora_kernels.cpp). Python's LoRASlots.add_delta calls
// this on the CPU, and the loop calls it after each projection that serves adapters, so the two ways of running a
// step add the same deltas, bit for bit.
#include "aten_pch.h"  // first: the precompiled torch headers (build.py)

#include <algorithm>
#include <cstring>
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

// Slice i's B [r, size] of a slot of rank r, unpacked from its panels (lora_args.h): a copy
at::Tensor unpacked_b(const LoraWeights& w, int64_t slot, int64_t i, int64_t rank) {
  const LoraSlice& slice = w.slices[i];
  const int64_t padded = lora_padded(slice.size);
  const auto panels = w.b[slot].narrow(0, rank * slice.packed, rank * padded);
  return panels.view({padded / kLoraPanel, rank, kLoraPanel}).permute({1, 0, 2}).reshape({rank, padded})
      .narrow(1, 0, slice.size);
}

// The rows a group's GEMMs run on: its count rounded up to a power of two (at least 32). oneDNN builds (and
// JIT-compiles) a primitive for each new shape, which cost a prompt step more than its GEMMs when every group's row
// count was a shape of its own; with the counts in a few buckets its cache finds them, and the padding rows are
// a few cheap rows of a small GEMM.
int64_t gemm_rows(int64_t count) {
  int64_t rows = 32;
  while (rows < count) rows *= 2;
  return rows;
}

// A thread's tensors for the GEMM path, kept between calls (re-made when a shape or dtype changes): a group's x rows
// and y rows gathered contiguous, padded to the bucket. Fresh tensors of a few MB a call came from the kernel as
// zeroed pages each time.
struct GemmScratch {
  at::Tensor x, y;
};

at::Tensor scratch_of(at::Tensor& held, int64_t rows, int64_t cols, at::ScalarType dtype) {
  if (!held.defined() || held.size(0) != rows || held.size(1) != cols || held.scalar_type() != dtype)
    held = at::zeros({rows, cols}, at::TensorOptions().dtype(dtype));
  return held;
}

// dst's first `count` rows = src's rows `rows` (row by row, raw copies: an index_select or index_copy_ would
// dispatch per call and allocate); with `back`, the other way round
void copy_rows(const at::Tensor& whole, const at::Tensor& packed, const int64_t* rows, int64_t count, bool back) {
  const int64_t bytes = whole.size(1) * whole.element_size();
  auto* base = static_cast<char*>(whole.data_ptr());
  auto* dense = static_cast<char*>(packed.data_ptr());
  const int64_t whole_stride = whole.stride(0) * whole.element_size();
  const int64_t dense_stride = packed.stride(0) * packed.element_size();
  for (int64_t i = 0; i < count; ++i) {
    char* far = base + rows[i] * whole_stride;
    char* near = dense + i * dense_stride;
    std::memcpy(back ? far : near, back ? near : far, bytes);
  }
}

// A group of many rows (a prompt's): shrink and expand as library GEMMs (oneDNN's; AMX tiles for bf16 where the CPU
// has them), which the vector kernel's loads cannot match at that size. The group's x and y rows are gathered into
// the thread's scratch (padded to gemm_rows), the expand adds into the gathered y in place (y += scale * u @ B,
// summed in float32 and rounded once) and the rows go back: one shrink and one expand a slice, whatever runs of
// rows the group has. The shrink is rounded to x's dtype, as layers/lora.py's torch code rounds it.
void gemm_group(const at::Tensor& x, const at::Tensor& y, const LoraWeights& w, const LoraBatch& batch, size_t g) {
  thread_local GemmScratch scratch;
  const int64_t rank = batch.rank[g], used = rank * static_cast<int64_t>(w.slices.size());
  const int64_t first = batch.offsets[g], count = batch.offsets[g + 1] - first, padded = gemm_rows(count);
  const int64_t* rows = batch.rows.data_ptr<int64_t>() + first;
  const auto xs = scratch_of(scratch.x, padded, x.size(1), x.scalar_type());
  const auto ys = scratch_of(scratch.y, padded, y.size(1), y.scalar_type());
  copy_rows(x, xs, rows, count, false);
  copy_rows(y, ys, rows, count, false);
  const auto u = at::matmul(xs, w.a[batch.slot[g]].narrow(0, 0, used).t());
  for (int64_t i = 0; i < static_cast<int64_t>(w.slices.size()); ++i) {
    const auto b = unpacked_b(w, batch.slot[g], i, rank);
    ys.narrow(1, w.slices[i].offset, w.slices[i].size).addmm_(u.narrow(1, i * rank, rank), b, 1.0, batch.scale[g]);
  }
  copy_rows(y, ys, rows, count, true);
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
                          at::Tensor rows, std::vector<int64_t> offsets, Isa path, int64_t gemm_min_rows) {
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
          std::move(rows), max_row, path, std::max<int64_t>(gemm_min_rows, 0)};
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
                      batch.gemm_min_rows,
                      swiglu_panels};
  lora_add(args, batch.path);
  for (size_t g = 0; g < batch.slot.size() && args.gemm_min_rows > 0; ++g) {
    const int64_t count = batch.offsets[g + 1] - batch.offsets[g];
    if (count >= batch.gemm_min_rows && w.present.data_ptr<uint8_t>()[batch.slot[g]]) gemm_group(x, y, w, batch, g);
  }
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
  TORCH_CHECK(!batch.has_gemm_groups(), "lora_add_swiglu_panels_: a group takes the GEMMs, which write whole slices");
  add_deltas(x, y, w, batch, true);
}
