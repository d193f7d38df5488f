// Shared by paged_prefill.cpp and paged_prefill_bf16.h (included by paged_prefill.cpp only,
// so everything stays in its anonymous namespace).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "softmax_span.h"

namespace {

constexpr int64_t kTileTokens = 32;

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t v_offset;  // elements between K and V of the same slot
};

struct Item {
  int64_t seq, first_query;  // first_query: index of the tile's first token within its chunk
};

// Softmax of each row of `scores` (rows x num_keys, row r = token r / group at first_pos + r /
// group) over its own keys [row_lo(pos), pos]; keys outside get weight 0.
template <typename RowLo>
void softmax_rows(float* scores, int64_t rows, int64_t num_keys, int64_t group, int64_t first_pos,
                  int64_t lo, const RowLo& row_lo) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = first_pos + r / group;
    const int64_t begin = row_lo(pos) - lo, end = pos + 1 - lo;
    kvtier::softmax_span(scores + r * num_keys, num_keys, begin, end);
  }
}

// One call's sequences and tiles (see paged_prefill_attention).
struct Batch {
  const int64_t *table, *starts, *computed, *lens;
  const std::vector<Item>& items;
  int64_t window;
  float scale;
};


}  // namespace
