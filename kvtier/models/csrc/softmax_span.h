// The softmax pieces the attention kernels share: one row of scores in place (any CPU), and
// with AVX-512 a 16-lane exp and the lane mask of a key span.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvtier {

#if defined(__AVX512F__)
// exp of 16 lanes: 2^n * 2^f with n = round(x log2 e), |f| <= 1/2, 2^f by its Taylor series to
// f^6 (relative error ~1e-7, far below the bf16 rounding of the weights); large negative x
// gives 0.
inline __m512 exp16(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// The lanes of keys [c, c + 16) inside [begin, end).
inline __mmask16 span_mask(int64_t c, int64_t begin, int64_t end) {
  const uint32_t from_begin = begin <= c ? 0xffffu : begin - c >= 16 ? 0u : 0xffffu << (begin - c);
  const uint32_t before_end = end - c >= 16 ? 0xffffu : end <= c ? 0u : (1u << (end - c)) - 1;
  return static_cast<__mmask16>(from_begin & before_end);
}
#endif  // __AVX512F__

// Row `scores` of `size` slots: softmax over [begin, end) in place (fp32), every slot outside
// it set to weight 0. With AVX-512 sixteen slots a step through exp16 (libmvec's expf, which
// -ffast-math vectorizes the loop below into, runs 8 lanes a call there: ~2.5x slower).
inline void softmax_span(float* scores, int64_t size, int64_t begin, int64_t end) {
#if defined(__AVX512F__)
  const __m512 none = _mm512_set1_ps(-INFINITY);
  __m512 peak16 = none;
  for (int64_t c = begin / 16 * 16; c < end; c += 16) {
    peak16 = _mm512_max_ps(peak16, _mm512_mask_loadu_ps(none, span_mask(c, begin, end),
                                                        scores + c));
  }
  const __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(peak16));
  __m512 sum16 = _mm512_setzero_ps();
  for (int64_t c = 0; c < size; c += 16) {
    const __mmask16 live = span_mask(c, begin, end), in_row = span_mask(c, 0, size);
    const __m512 x = _mm512_maskz_loadu_ps(live, scores + c);
    const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(x, peak)));
    sum16 = _mm512_add_ps(sum16, e);
    _mm512_mask_storeu_ps(scores + c, in_row, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum16));
  for (int64_t c = begin / 16 * 16; c < end; c += 16) {
    const __mmask16 live = span_mask(c, begin, end);
    _mm512_mask_storeu_ps(scores + c, live, _mm512_mul_ps(_mm512_maskz_loadu_ps(live, scores + c),
                                                          inv));
  }
#else
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
#endif
}


}  // namespace kvtier
