// The one work scheduler of the attention kernels: how a decode batch is cut into work items, and how any list of
// items is spread over the threads. Each instruction-set file keeps only its vector maths and asks this header for
// its items, so every path splits and schedules the same way.
//
// Policy (one for all paths): items are claimed one at a time from a shared counter, costliest first. The threads end
// together however the costs are spread (a batch lists its sequences oldest, longest context, first: contiguous runs
// or a static round robin gave one thread the long contexts), and a thread the OS preempts holds up only the item it
// is on. benchmarks/work_split.py times it on mixed context lengths against another build's kernels.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

// Decode over a long context is cut into partitions: fixed runs of kDecodePartitionTokens (rounded up to whole
// blocks) from position 0, each scored on its own (its max, its sum of exp(s - max), its unnormalised P.V), and the
// partials merged in partition order (combine_partitions). A sequence is cut by its own length alone, never by the
// batch or the thread count, so its result is the same bits alone, in any batch and on any number of threads; one
// sequence's partitions are what lets two threads share a batch-1 step. A context of one partition is computed
// whole, as before partitions existed.
constexpr int64_t kDecodePartitionTokens = 1024;

inline int64_t decode_partition_tokens(int64_t block_size) {
  return (kDecodePartitionTokens + block_size - 1) / block_size * block_size;
}

// One work item: tokens [first_block * block_size, + len) of one sequence, for kv heads first_kv.. (heads_per_item).
struct DecodeItem {
  int64_t seq, first_kv, first_block, len;
  int64_t partial;  // a partition's rows in DecodeSplit::partials (query head h: partial + h); -1: a whole context
};

// A decode batch's items: (sequence, partition) with all its kv heads (its tokens are then read as contiguous runs
// of whole rows), or (sequence, partition, kv head) where there are fewer such items than 4 per thread, so that
// every thread has work. Which of the two changes only who computes a head, never its arithmetic.
struct DecodeSplit {
  int64_t heads_per_item;  // kv heads per item
  int64_t num_heads, head_dim;
  std::vector<DecodeItem> items;
  // per partitioned sequence: its first partial row (-1: whole) and its partition count
  std::vector<int64_t> partial_base, partitions;
  std::vector<float> partials;  // [rows, head_dim]: one row per (partition, query head) of a partitioned sequence
  std::vector<float> stats;     // [rows, 2]: each row's max and sum

  int64_t num_items() const { return static_cast<int64_t>(items.size()); }

  // Where query head `head` of `item` writes its head_dim outputs: the output row of a whole context, else its
  // partial row.
  float* row(const DecodeItem& item, int64_t head, float* out) {
    if (item.partial < 0) return out + (item.seq * num_heads + head) * head_dim;
    return partials.data() + (item.partial + head) * head_dim;
  }

  // The factor the head's sums take on their way to row(): 1 / sum for a whole context; 1 for a partition, whose
  // max and sum are kept for combine_partitions.
  float finish(const DecodeItem& item, int64_t head, float max, float sum) {
    if (item.partial < 0) return 1.f / sum;
    stats[2 * (item.partial + head)] = max;
    stats[2 * (item.partial + head) + 1] = sum;
    return 1.f;
  }
};

// per_head: one kv head per item whatever the batch (kernels whose inner loop takes one kv head at a time)
inline DecodeSplit split_decode(const int64_t* seq_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                int64_t head_dim, int64_t block_size, bool per_head = false) {
  DecodeSplit split{1, num_heads, head_dim, {}, std::vector<int64_t>(num_seqs, -1), std::vector<int64_t>(num_seqs, 1),
                    {}, {}};
  const int64_t span = decode_partition_tokens(block_size), span_blocks = span / block_size;
  int64_t pieces = 0, rows = 0;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    split.partitions[seq] = std::max<int64_t>(1, (seq_lens[seq] + span - 1) / span);
    pieces += split.partitions[seq];
    if (split.partitions[seq] == 1) continue;
    split.partial_base[seq] = rows;
    rows += split.partitions[seq] * num_heads;
  }
  const int64_t splits = per_head || pieces < 4 * at::get_num_threads() ? num_kv_heads : 1;
  split.heads_per_item = num_kv_heads / splits;
  split.items.reserve(pieces * splits);
  for (int64_t seq = 0; seq < num_seqs; ++seq)
    for (int64_t part = 0; part < split.partitions[seq]; ++part)
      for (int64_t s = 0; s < splits; ++s) {
        const int64_t len = std::min(span, seq_lens[seq] - part * span);
        const int64_t base = split.partial_base[seq];  // + the query head: that head's row of this partition
        split.items.push_back({seq, s * split.heads_per_item, part * span_blocks, std::max<int64_t>(len, 0),
                               base < 0 ? -1 : base + part * num_heads});
      }
  split.partials.resize(rows * head_dim);
  split.stats.resize(2 * rows);
  return split;
}

// Each partitioned sequence's heads merged into `out` [num_seqs, num_heads, head_dim], partitions in order:
// out = sum_p exp(m_p - m) acc_p / sum_p exp(m_p - m) l_p, m the largest m_p.
inline void combine_partitions(const DecodeSplit& split, float* out) {
  const int64_t H = split.num_heads, D = split.head_dim;
  for (int64_t seq = 0; seq < static_cast<int64_t>(split.partitions.size()); ++seq) {
    if (split.partial_base[seq] < 0) continue;
    const int64_t parts = split.partitions[seq];
    for (int64_t h = 0; h < H; ++h) {
      const auto at = [&](int64_t part) { return split.partial_base[seq] + part * H + h; };
      float max = split.stats[2 * at(0)];
      for (int64_t p = 1; p < parts; ++p) max = std::max(max, split.stats[2 * at(p)]);
      float* o = out + (seq * H + h) * D;
      std::fill(o, o + D, 0.f);
      float sum = 0.f;
      for (int64_t p = 0; p < parts; ++p) {
        const float w = std::exp(split.stats[2 * at(p)] - max);
        sum += w * split.stats[2 * at(p) + 1];
        const float* acc = split.partials.data() + at(p) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * acc[d];
      }
      const float inv = 1.f / sum;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  }
}

// The items in the order they are handed out, and the counter the threads claim them from.
class WorkQueue {
 public:
  explicit WorkQueue(std::vector<int64_t> order) : order_(std::move(order)) {}

  // The next unclaimed item into `item`; false once every item is claimed.
  bool next(int64_t& item) {
    const int64_t claimed = next_.fetch_add(1, std::memory_order_relaxed);
    if (claimed >= static_cast<int64_t>(order_.size())) return false;
    item = order_[claimed];
    return true;
  }

  // The item the next claim would get, without claiming it (another thread may take it first); false if none.
  bool peek(int64_t& item) const {
    const int64_t claimed = next_.load(std::memory_order_relaxed);
    if (claimed >= static_cast<int64_t>(order_.size())) return false;
    item = order_[claimed];
    return true;
  }

  int64_t size() const { return static_cast<int64_t>(order_.size()); }

 private:
  std::vector<int64_t> order_;
  std::atomic<int64_t> next_{0};
};

// Items 0..num_items-1 on min(threads, items) threads, costliest first (cost(item), any ordered type; ties keep
// their index order). worker(queue) runs once on each thread: it sets up its scratch once, then claims items with
// `for (int64_t item; queue.next(item);)`.
template <typename Cost, typename Worker>
void run_costliest_first(int64_t num_items, Cost&& cost, Worker&& worker) {
  if (num_items <= 0) return;
  std::vector<int64_t> order(num_items);
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost(a) > cost(b); });
  WorkQueue queue(std::move(order));
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    if (begin < end) worker(queue);
  });
}

// A decode batch's items (split_decode) costliest first (an item costs its token count), then the partitioned
// sequences merged into `out`.
template <typename Worker>
void run_decode_items(DecodeSplit& split, float* out, Worker&& worker) {
  run_costliest_first(split.num_items(), [&](int64_t item) { return split.items[item].len; }, worker);
  combine_partitions(split, out);
}
