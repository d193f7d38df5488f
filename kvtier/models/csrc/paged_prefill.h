// Shared by paged_prefill.cpp and paged_prefill_bf16.h (included by paged_prefill.cpp only,
// so everything stays in its anonymous namespace).

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace {

constexpr int64_t kTileTokens = 32;

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t v_offset;  // elements between K and V of the same slot
};

// The first key a query at `pos` attends: 0, or the start of its sliding window (window > 0).
inline int64_t first_attended(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

struct Item {
  int64_t seq, first_query;  // first_query: index of the tile's first token within its chunk
};

// One call's sequences and tiles (see paged_prefill_attention).
struct Batch {
  const int64_t *table, *starts, *computed, *lens;
  const std::vector<Item>& items;
  int64_t window;
  float scale;
};

// A tile's query tokens, its first query's position, and the keys its rows attend together (from
// its first row's first key to its last row).
struct TileSpan {
  int64_t tokens, first_pos, keys;
};

inline TileSpan tile_span(const Batch& b, const Item& item) {
  const int64_t tokens = std::min(b.lens[item.seq], item.first_query + kTileTokens) -
                         item.first_query;
  const int64_t first_pos = b.computed[item.seq] + item.first_query;
  return {tokens, first_pos, first_pos + tokens - first_attended(first_pos, b.window)};
}

// Work items handed to the threads one at a time, largest first. A causal prompt's tiles grow
// with their position, and at::parallel_for's even split of the item list gave the last thread
// three times the first one's work (a 2,048-token prompt ran 1.5x its balanced time).
class WorkQueue {
 public:
  // sizes[n]: item n's work, in any unit.
  explicit WorkQueue(const std::vector<int64_t>& sizes) : order_(sizes.size()) {
    std::iota(order_.begin(), order_.end(), 0);
    std::stable_sort(order_.begin(), order_.end(),
                     [&](int64_t a, int64_t c) { return sizes[a] > sizes[c]; });
  }

  // The (tile, kv head) items of a batch: item n is tile n / num_kv_heads, kv head n %
  // num_kv_heads, sized by its query tokens x attended keys.
  WorkQueue(const Batch& b, int64_t num_kv_heads) : WorkQueue(tile_sizes(b, num_kv_heads)) {}

  // Runs worker(next) on each of at::parallel_for's threads; next() returns the index of an
  // item not yet taken, or -1 once all are.
  template <typename Worker>
  void run(const Worker& worker) const {
    std::atomic<size_t> taken{0};
    auto next = [&]() -> int64_t {
      const size_t i = taken.fetch_add(1, std::memory_order_relaxed);
      return i < order_.size() ? order_[i] : -1;
    };
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) { worker(next); });
  }

 private:
  static std::vector<int64_t> tile_sizes(const Batch& b, int64_t num_kv_heads) {
    std::vector<int64_t> sizes(b.items.size() * num_kv_heads);
    for (size_t i = 0; i < b.items.size(); ++i) {
      const TileSpan span = tile_span(b, b.items[i]);
      std::fill_n(sizes.begin() + i * num_kv_heads, num_kv_heads, span.tokens * span.keys);
    }
    return sizes;
  }

  std::vector<int64_t> order_;
};

}  // namespace
