// The softmax both attention kernels take over one row of scores.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace kvtier {

// Row `scores` of `size` slots: softmax over [begin, end) in place (fp32; expf vectorizes
// under -ffast-math), every slot outside it set to weight 0.
inline void softmax_span(float* scores, int64_t size, int64_t begin, int64_t end) {
  const float peak = *std::max_element(scores + begin, scores + end);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = begin; t < end; ++t) {
    scores[t] = expf(scores[t] - peak);
    sum += scores[t];
  }
  const float inv = 1.f / sum;
  for (int64_t t = 0; t < begin; ++t) scores[t] = 0.f;
  for (int64_t t = begin; t < end; ++t) scores[t] *= inv;
  for (int64_t t = end; t < size; ++t) scores[t] = 0.f;
}

}  // namespace kvtier
