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
#include <cstdint>
#include <numeric>
#include <vector>

// A decode batch's items: one sequence with all its kv heads (its tokens are then read as contiguous runs of whole
// rows), or one (sequence, kv head) where there are fewer sequences than 4 per thread, so that every thread has work.
struct DecodeSplit {
  int64_t splits;          // items per sequence: 1 or num_kv_heads
  int64_t heads_per_item;  // kv heads per item
  int64_t num_items;

  int64_t seq(int64_t item) const { return item / splits; }
  int64_t first_kv(int64_t item) const { return item % splits * heads_per_item; }
};

// per_head: one kv head per item whatever the batch (kernels whose inner loop takes one kv head at a time)
inline DecodeSplit split_decode(int64_t num_seqs, int64_t num_kv_heads, bool per_head = false) {
  const int64_t splits = per_head || num_seqs < 4 * at::get_num_threads() ? num_kv_heads : 1;
  return {splits, num_kv_heads / splits, num_seqs * splits};
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

// A decode batch's items (split_decode) costliest first: an item costs its sequence's context length.
template <typename Worker>
void run_decode_items(const DecodeSplit& split, const int64_t* seq_lens, Worker&& worker) {
  run_costliest_first(split.num_items, [&](int64_t item) { return seq_lens[split.seq(item)]; }, worker);
}
