// LoRA's shrink and expand (lora_args.h) for the step's groups of tokens that share an adapter, written once for
// every instruction set's vectors (lora_vectors.h) and instantiated by one file per instruction set
// (lora_kernels_<isa>.cpp), so that the instruction sets' kernels compile side by side instead of in one long file.
//
// A group's rows go in tiles of up to kTile: each row of A and of B is read once for the tile's rows, so a group of
// many tokens (an adapter's prefill, or its many decodes) reads its adapter's weights once per tile instead of once
// per token: what grouping tokens by adapter buys. Per row, the shrink (x . A_j, j over the slice's rank rows) and
// the expand (u @ B into the slice's own columns, B packed in panels: lora_args.h) accumulate in float32, and y
// gets scale * delta added and is rounded to its type once (the AVX512-BF16 path rounds u to bfloat16 between them,
// as the torch code's bfloat16 shrink is rounded: lora_pairs.h). The sums of a pass are kept in registers, several rows
// of A (or vectors of B's columns) by the tile's rows, so that no sum waits on its own previous FMA and every weight
// loaded serves the whole tile; the weights ahead are prefetched, as they come from memory once a step. On the vector
// paths every row's result depends on its own values only, never on the batch or the tile around it; the plain C++
// path's sums are the compiler's to reorder (-ffast-math), tile height by tile height, within float32 rounding.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "lora_args.h"
#include "lora_pairs.h"
#include "lora_vectors.h"
#include "work_split.h"

namespace lora_tiles {

using namespace lora_vectors;

constexpr int kTile = 8;  // a group's rows shrunk and expanded together

// u[t][j] = x_t . a_j for J rows of A and the tile's N rows at once: J * N independent sums (a single sum waits on
// its previous FMA at every step), each in the order of one row alone. `next`: rows to prefetch alongside.
template <class V, class T, int N, int J>
void shrink_block(const float* xf, int64_t xf_stride, const T* a, const T* next, int64_t in, float* u,
                  int64_t u_stride) {
  typename V::Vec acc[J][N];
  for (int jj = 0; jj < J; ++jj)
    for (int t = 0; t < N; ++t) acc[jj][t] = V::zero();
  const int64_t whole = in / V::kWidth * V::kWidth;
  for (int64_t k = 0; k < whole; k += V::kWidth) {
    for (int jj = 0; jj < J; ++jj) __builtin_prefetch(next + jj * in + k, 0, 3);
    typename V::Vec xv[N];
    for (int t = 0; t < N; ++t) xv[t] = V::load(xf + t * xf_stride + k);
    for (int jj = 0; jj < J; ++jj) {
      const auto w = V::load(a + jj * in + k);
      for (int t = 0; t < N; ++t) acc[jj][t] = V::fmadd(xv[t], w, acc[jj][t]);
    }
  }
  if (whole < in) {  // the rows' last, shorter vector (x is padded with zeros)
    for (int jj = 0; jj < J; ++jj) {
      const auto w = load_n<V>(a + jj * in + whole, in - whole);
      for (int t = 0; t < N; ++t) acc[jj][t] = V::fmadd(V::load(xf + t * xf_stride + whole), w, acc[jj][t]);
    }
  }
  store_sums<V, N, J>(acc, u, u_stride);
}

// u[t][j] = x_t . a_j for the slot's first `used` rows of A
template <class V, class T, int N>
void shrink(const float* xf, int64_t xf_stride, const T* a, int64_t used, int64_t in, float* u, int64_t u_stride) {
  constexpr int J = kRowBlock<N>;
  int64_t j = 0;
  for (; j + J <= used; j += J) {
    const T* next = a + (j + 2 * J <= used ? j + J : j) * in;  // the next block's rows, or these again at the end
    shrink_block<V, T, N, J>(xf, xf_stride, a + j * in, next, in, u + j, u_stride);
  }
  for (; j < used; ++j) shrink_block<V, T, N, 1>(xf, xf_stride, a + j * in, a + j * in, in, u + j, u_stride);
}

// C vectors of a slice's columns, from column c of it (the last vector `last` wide), of the tile's N rows:
// y_t += scale * sum_j u_t[j] * B[j], j over the slice's rank rows, each column summed in j's order. `b`: the slice's
// packed B (lora_args.h), so each vector's rows are kLoraPanel apart; `next`: the next block's values to prefetch
// (the block after this one is contiguous with it), or null.
template <class V, class T, int N, int C>
void expand_block(const float* u, int64_t u_stride, const T* b, int64_t rank, int64_t c, int64_t last, const T* next,
                  typename V::Vec scale, T* const* y, int64_t pitch) {
  const T* base[C];
  for (int cc = 0; cc < C; ++cc) {
    const int64_t col = c + cc * V::kWidth;  // a vector never straddles two panels (kLoraPanel % kWidth == 0)
    base[cc] = b + col / kLoraPanel * rank * kLoraPanel + col % kLoraPanel;
  }
  typename V::Vec acc[N][C];
  for (int t = 0; t < N; ++t)
    for (int cc = 0; cc < C; ++cc) acc[t][cc] = V::zero();
  for (int64_t j = 0; j < rank; ++j) {
    if (next != nullptr) prefetch_lines(next + j * C * V::kWidth, C * V::kWidth);
    typename V::Vec w[C];
    for (int cc = 0; cc + 1 < C; ++cc) w[cc] = V::load(base[cc] + j * kLoraPanel);
    w[C - 1] = last == V::kWidth ? V::load(base[C - 1] + j * kLoraPanel)
                                 : load_n<V>(base[C - 1] + j * kLoraPanel, last);
    for (int t = 0; t < N; ++t) {
      const auto ut = V::set1(u[t * u_stride + j]);
      for (int cc = 0; cc < C; ++cc) acc[t][cc] = V::fmadd(ut, w[cc], acc[t][cc]);
    }
  }
  for (int t = 0; t < N; ++t)
    for (int cc = 0; cc < C; ++cc) {
      const int64_t col = c + cc * V::kWidth;  // y's column of it: panels `pitch` apart (kLoraPanel: contiguous)
      T* p = y[t] + col / kLoraPanel * pitch + col % kLoraPanel;
      const int64_t width = cc + 1 < C ? V::kWidth : last;
      store_n<V>(p, V::fmadd(scale, acc[t][cc], load_n<V>(p, width)), width);
    }
}

// y_t[slice i's columns] += scale * u_t[slice i's rows] @ B_i
template <class V, class T, int N>
void expand(const float* u, int64_t u_stride, const T* b_slot, const LoraArgs& args, int64_t i, int64_t rank,
            float scale, T* const* y) {
  const auto s = V::set1(scale);
  constexpr int C = kColBlock<N>;
  constexpr int64_t kBlockWidth = C * V::kWidth;
  const LoraSlice& slice = args.slices[i];
  const T* b = b_slot + rank * slice.packed;
  // the rows from the slice's first column, and the distance between two of its panels there
  const int64_t first = args.swiglu_panels ? i * kLoraPanel : slice.offset;
  const int64_t pitch = args.swiglu_panels ? args.num_slices * kLoraPanel : kLoraPanel;
  T* ys[N];
  for (int t = 0; t < N; ++t) ys[t] = y[t] + first;
  int64_t c = 0;
  for (; c + kBlockWidth <= slice.size; c += kBlockWidth) {
    // blocks of whole panels: the next block's values follow this one's
    const bool whole = kBlockWidth % kLoraPanel == 0 && c + 2 * kBlockWidth <= slice.size;
    const T* next = whole ? b + (c + kBlockWidth) * rank : nullptr;
    expand_block<V, T, N, C>(u, u_stride, b, rank, c, V::kWidth, next, s, ys, pitch);
  }
  for (; c < slice.size; c += V::kWidth)
    expand_block<V, T, N, 1>(u, u_stride, b, rank, c, std::min(V::kWidth, slice.size - c), nullptr, s, ys, pitch);
}

// One work item: up to kTile rows of group g, from its row list's index `first`, in one slice of the projection's
// output (a slice's shrink rows and expand columns are its own: q, k and v, or gate and up, are independent items,
// which spreads even one token's deltas over the threads)
struct Item {
  int64_t group, first, count, slice;
};

// A thread's scratch, kept between calls (a step makes some hundred of them): the tile's widened x and its u (and u
// in bfloat16 pairs, for the pair expand)
struct Scratch {
  std::vector<float> x, u;
  std::vector<c10::BFloat16> u_pairs;
};

template <class V, class T, int N>
void run_rows(const LoraArgs& args, const Item& item, const T* const* xs, T* const* ys, Scratch& scratch) {
  const int64_t g = item.group, slot = args.slot[g], rank = args.rank[g], first = item.slice * rank;
  const T* a = static_cast<const T*>(args.a) + (slot * args.rows_per_slot + first) * args.in;
  const T* b = static_cast<const T*>(args.b) + slot * args.b_per_slot;
  // u: the tile's shrink of this item's slice only (an item is one slice), max_rank a row
  float* u = scratch.u.data();
  const int64_t u_stride = args.rows_per_slot / args.num_slices;
#ifdef BATCHSERVE_ISA_AVX512_BF16
  if constexpr (std::is_same_v<V, Avx512Bf16>) {
    shrink_pairs<N>(xs, a, rank, args.in, u, u_stride);
    const int64_t ub_stride = u_stride + 1;  // room for an odd rank's zero
    round_shrink<N>(u, u_stride, rank, scratch.u_pairs.data(), ub_stride);
    expand_pairs<N>(scratch.u_pairs.data(), ub_stride, b, args, item.slice, rank, args.scale[g], ys);
  } else
#endif
  {
    const int64_t xf_stride = (args.in + V::kWidth - 1) / V::kWidth * V::kWidth;
    widen_rows(xs, N, args.in, scratch.x.data(), xf_stride);
    shrink<V, T, N>(scratch.x.data(), xf_stride, a, rank, args.in, u, u_stride);
    expand<V, T, N>(u, u_stride, b, args, item.slice, rank, args.scale[g], ys);
  }
}

template <class V, class T, int N = 1>
void run_height(const LoraArgs& args, const Item& item, const T* const* xs, T* const* ys, Scratch& scratch) {
  if constexpr (N < kTile) {
    if (item.count > N) return run_height<V, T, N + 1>(args, item, xs, ys, scratch);
  }
  run_rows<V, T, N>(args, item, xs, ys, scratch);
}

template <class V, class T>
void run_tile(const LoraArgs& args, const Item& item, Scratch& scratch) {
  const T* xs[kTile];
  T* ys[kTile];
  for (int64_t t = 0; t < item.count; ++t) {
    const int64_t row = args.rows[item.first + t];
    xs[t] = static_cast<const T*>(args.x) + row * args.x_stride;
    ys[t] = static_cast<T*>(args.y) + row * args.y_stride;
  }
  scratch.x.resize(kTile * ((args.in + V::kWidth - 1) / V::kWidth * V::kWidth));
  scratch.u.resize(kTile * (args.rows_per_slot / args.num_slices));
  scratch.u_pairs.resize(kTile * (args.rows_per_slot / args.num_slices + 1));
  run_height<V, T>(args, item, xs, ys, scratch);
}

template <class V, class T>
void run(const LoraArgs& args) {
  thread_local std::vector<Item> items;  // the caller's: kept between calls
  items.clear();
  for (int64_t g = 0; g < args.num_groups; ++g) {
    const int64_t count = args.offsets[g + 1] - args.offsets[g];
    if (!args.present[args.slot[g]]) continue;  // the adapter leaves this projection as it is
    for (int64_t i = args.offsets[g]; i < args.offsets[g + 1]; i += kTile)
      for (int64_t slice = 0; slice < args.num_slices; ++slice)
        items.push_back({g, i, std::min<int64_t>(kTile, args.offsets[g + 1] - i), slice});
  }
  const auto& work = items;
  const auto cost = [&](int64_t i) {  // a slice's weights: rank rows of A (in wide) and of B (its size wide)
    return work[i].count * args.rank[work[i].group] * (args.in + args.slices[work[i].slice].size);
  };
  run_costliest_first(static_cast<int64_t>(work.size()), cost, [&](WorkQueue& queue) {
    thread_local Scratch scratch;
    for (int64_t i; queue.next(i);) run_tile<V, T>(args, work[i], scratch);
  });
}

template <class V>
void run_on(const LoraArgs& args) {
  if (args.bf16) return run<V, c10::BFloat16>(args);
  run<V, float>(args);
}

}  // namespace lora_tiles
