// Shared by paged_prefill.cpp and paged_prefill_bf16.h (included by paged_prefill.cpp only,
// so everything stays in its anonymous namespace).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

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
    float* sr = scores + r * num_keys;
    const float peak = *std::max_element(sr + begin, sr + end);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = begin; t < end; ++t) {
      sr[t] = expf(sr[t] - peak);
      sum += sr[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < begin; ++t) sr[t] = 0.f;
    for (int64_t t = begin; t < end; ++t) sr[t] *= inv;
    for (int64_t t = end; t < num_keys; ++t) sr[t] = 0.f;
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
