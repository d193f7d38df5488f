// Paged decode attention for CPU: one query token per sequence, keys and values read straight
// from the block-table KV cache (no gathered copy), fp32 softmax and accumulation.
//
// Work item = one sequence. Two passes over its pages: scores (then one max and exp per query
// head), then the weighted values.
// Registered as torch.ops.kvtier.paged_decode_attention; built at first use by
// kvtier/models/cpu_kernels.py. Compiled with -ffast-math so expf vectorizes (libmvec); every
// input is finite (the cache is zero-initialised and only attended positions are read).
//
// bf16 caches with head_dim 64 or 128 and 16-slot blocks take attend_sequence_bf16 where the CPU
// has AVX512-BF16: keys are scored in bf16 (vdpbf16ps, exact products, fp32 sums) sixteen at a
// time, a page's sixteen sums reduced together instead of one horizontal sum per (key, head).
// Values are summed by vdpbf16ps too, two adjacent slots per product (their rows interleaved
// by one unpack), with the softmax weights rounded to bf16 as the prefill tiles and torch's CPU
// flash kernel round them: a quarter less compute than converting each row to fp32 (64
// sequences x 2,048 tokens, cache resident, one thread: 3.9 vs 5.1 ms).
//
// Where the CPU has AMX-BF16 and the OS lends its tiles, bf16 caches of that shape with up to 8
// query heads a kv head take attend_sequence_amx (paged_decode_amx.h) instead: both products as
// tile multiplies over the cache rows as they lie. SmolLM2's shape, 64 sequences of 576 tokens
// in a 30-layer cache far larger than the CPU's caches, 2 cores: 1.9 -> 1.45 ms a layer, the
// reads of the pages themselves 1.1 ms.
//
// An fp8 cache (kv_fp8.h) is read at one byte an element: the generic path converts its rows
// to fp32, the bf16 tiles convert each page to bf16 into a small buffer first (a page of
// SmolLM2's: 6 KB, in L1), so the same tiles run on both.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kv_fp8.h"
#include "softmax_span.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t v_offset;  // elements between K and V of the same slot (cache[1] - cache[0])
};

template <typename scalar_t>
inline void load_row(const scalar_t* src, float* dst, int64_t n) {
  if constexpr (kvtier::is_fp8<scalar_t>) {
    kvtier::fp8_to_f32(src, dst, n);
  } else {
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
  }
}

// bf16 is the top half of an fp32: a shift the compiler vectorizes (BFloat16's own conversion
// does not).
template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* words = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) words[d] = static_cast<uint32_t>(bits[d]) << 16;
}

constexpr int64_t kPrefetchPages = 2;

inline void prefetch(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 1);
}

}  // namespace

#include "paged_decode_amx.h"

namespace {

// Attention of one sequence over keys [first, last): each page is converted once, whole (all
// kv heads, contiguous: the reads stream), and every query head is scored against it.
// kDim > 0: the head dim as a compile-time constant (fully unrolled inner loops); 0: s.head_dim.
template <typename scalar_t, typename cache_t, int64_t kDim>
void attend_sequence(const scalar_t* query, const cache_t* cache, const int64_t* table,
                     int64_t first, int64_t last, const Shape& s, float scale, scalar_t* out,
                     std::vector<float>& scratch) {
  const int64_t heads = s.num_heads, group = s.num_heads / s.num_kv_heads;
  const int64_t dim = kDim > 0 ? kDim : s.head_dim;
  const int64_t num_keys = last - first, row_len = s.num_kv_heads * dim;
  const int64_t page_len = s.block_size * row_len;
  // scratch: queries (Hq x D), one page (block_size x Hkv x D), scores (Hq x keys), outputs.
  scratch.resize(heads * dim * 2 + page_len + heads * num_keys);
  float* q = scratch.data();
  float* acc = q + heads * dim;
  float* page = acc + heads * dim;
  float* scores = page + page_len;
  load_row(query, q, heads * dim);
  for (int64_t i = 0; i < heads * dim; ++i) q[i] *= scale;
  // Visits the attended tokens page by page: fn(token index from `first`, its fp32 row).
  auto for_each_row = [&](int64_t v_offset, auto&& fn) {
    for (int64_t pos = first; pos < last;) {
      const int64_t lo = pos % s.block_size;
      const int64_t hi = std::min(s.block_size, lo + (last - pos));
      // Pages lie anywhere, so the hardware cannot guess the next one: fetch it (into L2)
      // kPrefetchPages ahead while this one is used.
      const int64_t ahead = pos / s.block_size + kPrefetchPages;
      if (ahead * s.block_size < last) {
        prefetch(cache + table[ahead] * page_len + v_offset,
                 page_len * static_cast<int64_t>(sizeof(cache_t)));
      }
      // Tokens [lo, hi) of the page, all kv heads, to fp32 rows of Hkv * D.
      load_row(cache + table[pos / s.block_size] * page_len + v_offset + lo * row_len, page,
               (hi - lo) * row_len);
      for (int64_t t = lo; t < hi; ++t) fn(pos - first + (t - lo), page + (t - lo) * row_len);
      pos += hi - lo;
    }
  };
  for_each_row(0, [&](int64_t t, const float* row) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* qh = q + h * dim;
      const float* kh = row + (h / group) * dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < dim; ++d) dot += qh[d] * kh[d];
      scores[h * num_keys + t] = dot;
    }
  });
  for (int64_t h = 0; h < heads; ++h) {
    kvtier::softmax_span(scores + h * num_keys, num_keys, 0, num_keys);
  }
  std::fill(acc, acc + heads * dim, 0.f);
  for_each_row(s.v_offset, [&](int64_t t, const float* row) {
    for (int64_t h = 0; h < heads; ++h) {
      const float w = scores[h * num_keys + t];
      const float* vh = row + (h / group) * dim;
      float* ah = acc + h * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) ah[d] += w * vh[d];
    }
  });
  for (int64_t i = 0; i < heads * dim; ++i) out[i] = static_cast<scalar_t>(acc[i]);
}

#if defined(__AVX512BF16__)
// v[t] holds sixteen partial sums of key t; returns the sixteen totals, lane t = key t. Four
// rounds, each adding pairs of registers after moving half of each into the other's place.
inline __m512 sum_each(__m512 v[16]) {
  __m512 w[8], u[4], z[2];
  for (int i = 0; i < 8; ++i) {  // lanes 0-7: key 2i, 8-15: key 2i + 1
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
  for (int j = 0; j < 4; ++j) {  // 128-bit quarter q: key 4j + q
    u[j] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0xDD));
  }
  for (int k = 0; k < 2; ++k) {  // quarter q: lanes 0-1 key 8k + q, lanes 2-3 key 8k + 4 + q
    z[k] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * k], u[2 * k + 1], 0x88),
                         _mm512_shuffle_ps(u[2 * k], u[2 * k + 1], 0xDD));
  }
  // Lane 4q + e: key q + 4e.
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88),
                                    _mm512_shuffle_ps(z[0], z[1], 0xDD));
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, sums);
}

// Slots [lo, hi) of one kv head's page (`rows`: its slot 0, slots row_len apart) and the bf16
// weight pairs of its query heads (a head's keys / 2 words apart).
struct ValuePairs {
  const uint16_t* rows;
  int64_t row_len;
  const uint32_t* weights;
  int64_t keys, lo, hi;
};

// The page's value rows weighted for kHeads query heads and added to their sums (kHeads x kDim
// fp32, in the unpack order below). kHeads a compile-time count keeps the sums in registers
// across the slots (a count known only at run time left them on the stack: 10% slower).
template <int64_t kDim, int64_t kHeads>
inline void sum_value_pairs(const ValuePairs& p, float* out) {
  constexpr int64_t kChunks = kDim / 16, kPairChunks = kDim / 32;
  __m512 sums[kHeads][kChunks];
  for (int64_t j = 0; j < kHeads; ++j) {
    for (int64_t c = 0; c < kChunks; ++c) sums[j][c] = _mm512_loadu_ps(out + j * kDim + 16 * c);
  }
  const int64_t row_len = p.row_len;
  for (int64_t pair = p.lo / 2; pair < (p.hi + 1) / 2; ++pair) {
    const uint16_t* row = p.rows + 2 * pair * row_len;
    __m512bh v[kChunks];
    for (int64_t c = 0; c < kPairChunks; ++c) {
      const __m512i a = _mm512_loadu_si512(row + 32 * c);
      const __m512i b = _mm512_loadu_si512(row + row_len + 32 * c);
      v[2 * c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
      v[2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
    for (int64_t j = 0; j < kHeads; ++j) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(p.weights[j * p.keys / 2 + pair]);
      for (int64_t c = 0; c < kChunks; ++c) sums[j][c] = _mm512_dpbf16_ps(sums[j][c], v[c], w);
    }
  }
  for (int64_t j = 0; j < kHeads; ++j) {
    for (int64_t c = 0; c < kChunks; ++c) _mm512_storeu_ps(out + j * kDim + 16 * c, sums[j][c]);
  }
}

// attend_sequence for bf16 queries over a bf16 or fp8 cache (cache_t), 16-slot pages and head
// dim kDim (64 or 128). Scores are kept per page-aligned key: column c of a head's row is key
// first_page * 16 + c.
template <int64_t kDim, typename cache_t>
void attend_sequence_bf16(const c10::BFloat16* query, const cache_t* cache,
                          const int64_t* table, int64_t first, int64_t last, const Shape& s,
                          float scale, c10::BFloat16* out, std::vector<float>& scratch) {
  constexpr int64_t kBlock = 16, kPairChunks = kDim / 32, kChunks = kDim / 16;
  constexpr int64_t kHeadsPV = 16 / kChunks;  // query heads whose sums fit 16 registers
  const int64_t heads = s.num_heads, group = s.num_heads / s.num_kv_heads;
  const int64_t row_len = s.num_kv_heads * kDim, page_len = kBlock * row_len;
  const int64_t first_page = first / kBlock, num_pages = (last + kBlock - 1) / kBlock - first_page;
  const int64_t keys = num_pages * kBlock;
  constexpr bool kConvert = kvtier::is_fp8<cache_t>;
  // + an fp8 page converted to bf16 (page_len halves of a float).
  scratch.resize(heads * keys + heads * keys / 2 + heads * kDim + (kConvert ? page_len / 2 : 0));
  float* scores = scratch.data();  // heads x keys
  uint32_t* weights = reinterpret_cast<uint32_t*>(scores + heads * keys);  // heads x keys / 2
  float* acc = reinterpret_cast<float*>(weights + heads * keys / 2);  // heads x kDim
  uint16_t* converted = reinterpret_cast<uint16_t*>(acc + heads * kDim);
  const uint16_t* q = reinterpret_cast<const uint16_t*>(query);
  const __m512 scale16 = _mm512_set1_ps(scale);
  // Visits the pages: fn(page index from first_page, first used slot, end slot, slot 0's row).
  auto for_each_page = [&](int64_t v_offset, auto&& fn) {
    for (int64_t page = 0; page < num_pages; ++page) {
      const int64_t page_pos = (first_page + page) * kBlock;
      if (page + kPrefetchPages < num_pages) {
        prefetch(cache + table[first_page + page + kPrefetchPages] * page_len + v_offset,
                 page_len * static_cast<int64_t>(sizeof(cache_t)));
      }
      const int64_t lo = std::max(first, page_pos) - page_pos;
      const int64_t hi = std::min(last, page_pos + kBlock) - page_pos;
      const cache_t* rows = cache + table[first_page + page] * page_len + v_offset;
      if constexpr (kConvert) {
        kvtier::fp8_to_bf16(rows, converted, page_len);
        fn(page, lo, hi, static_cast<const uint16_t*>(converted));
      } else {
        fn(page, lo, hi, reinterpret_cast<const uint16_t*>(rows));
      }
    }
  };
  for_each_page(0, [&](int64_t page, int64_t, int64_t, const uint16_t* rows) {
    for (int64_t h = 0; h < heads; ++h) {
      const uint16_t* k_head = rows + (h / group) * kDim;
      __m512bh qh[kPairChunks];
      for (int64_t c = 0; c < kPairChunks; ++c) {
        qh[c] = (__m512bh)_mm512_loadu_si512(q + h * kDim + 32 * c);
      }
      // Every slot of the page, used or not (a slot outside [lo, hi) holds finite data of the
      // same block, and its column is never read): a fixed count keeps the sums in registers.
      __m512 dots[kBlock];
      for (int64_t t = 0; t < kBlock; ++t) {
        const uint16_t* k = k_head + t * row_len;
        dots[t] = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(k), qh[0]);
        for (int64_t c = 1; c < kPairChunks; ++c) {
          dots[t] = _mm512_dpbf16_ps(dots[t], (__m512bh)_mm512_loadu_si512(k + 32 * c), qh[c]);
        }
      }
      _mm512_storeu_ps(scores + h * keys + page * kBlock,
                       _mm512_mul_ps(sum_each(dots), scale16));
    }
  });
  const int64_t begin = first - first_page * kBlock, end = last - first_page * kBlock;
  for (int64_t h = 0; h < heads; ++h) {
    // Slots outside [begin, end) get weight 0: the value pass takes whole slot pairs.
    kvtier::softmax_span(scores + h * keys, keys, begin, end);
  }
  // The weights as bf16, two adjacent keys to a 32-bit word (keys is a multiple of 16).
  for (int64_t i = 0; i < heads * keys; i += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + i / 2),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(scores + i)));
  }
  std::fill(acc, acc + heads * kDim, 0.f);
  for_each_page(s.v_offset, [&](int64_t page, int64_t lo, int64_t hi, const uint16_t* rows) {
    for (int64_t kv_head = 0; kv_head < s.num_kv_heads; ++kv_head) {
      // The kv head's query heads, kHeadsPV at a time: each pair of V rows serves them all.
      for (int64_t h0 = kv_head * group; h0 < (kv_head + 1) * group; h0 += kHeadsPV) {
        const int64_t n = std::min(kHeadsPV, (kv_head + 1) * group - h0);
        const ValuePairs pairs{rows + kv_head * kDim, row_len,
                               weights + (h0 * keys + page * kBlock) / 2, keys, lo, hi};
        float* sums = acc + h0 * kDim;
        if (n == 1) sum_value_pairs<kDim, 1>(pairs, sums);
        else if (n == 2) sum_value_pairs<kDim, 2>(pairs, sums);
        else if (n == 3) sum_value_pairs<kDim, 3>(pairs, sums);
        else sum_value_pairs<kDim, kHeadsPV>(pairs, sums);
      }
    }
  });
  // acc is in the unpack order: lane 4q + e of vector 2c (2c + 1) is dim 32c + 8q + e (+ 4).
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t c = 0; c < kPairChunks; ++c) {
      for (int64_t lane = 0; lane < 16; ++lane) {
        const int64_t dim = 32 * c + 8 * (lane / 4) + lane % 4;
        const float* src = acc + h * kDim + 32 * c;
        out[h * kDim + dim] = static_cast<c10::BFloat16>(src[lane]);
        out[h * kDim + dim + 4] = static_cast<c10::BFloat16>(src[16 + lane]);
      }
    }
  }
}
#endif  // __AVX512BF16__

// Runs the sequences through attend_sequence_bf16 when it can take them; false: the generic one.
template <typename scalar_t, typename cache_t, typename Run>
bool run_bf16_sequences(const scalar_t*, const cache_t*, const Shape&, const Run&) {
  return false;
}

#if defined(__AVX512BF16__)
template <typename cache_t, typename Run>
bool run_bf16_sequences(const c10::BFloat16*, const cache_t*, const Shape& s, const Run& run) {
  if constexpr (std::is_same_v<cache_t, c10::BFloat16> || kvtier::is_fp8<cache_t>) {
    if (s.block_size != 16 || (s.head_dim != 64 && s.head_dim != 128)) return false;
#if defined(KVTIER_HAS_AMX)
    if constexpr (std::is_same_v<cache_t, c10::BFloat16>) {
      if (amx_decode_fits(s) && kvtier::use_amx()) {
        if (s.head_dim == 64) run(attend_sequence_amx<64>);
        else run(attend_sequence_amx<128>);
        return true;
      }
    }
#endif
    if (s.head_dim == 64) run(attend_sequence_bf16<64, cache_t>);
    else run(attend_sequence_bf16<128, cache_t>);
    return true;
  }
  return false;
}
#endif

// Every sequence of the batch, queries scalar_t, cache cache_t.
template <typename scalar_t, typename cache_t>
void attend_all(const at::Tensor& query, const at::Tensor& kv_cache, const int64_t* table,
                const int64_t* firsts, const int64_t* lens, const Shape& s, double scale,
                at::Tensor& out) {
  const scalar_t* q = query.data_ptr<scalar_t>();
  const cache_t* cache = kv_cache.data_ptr<cache_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t seq_stride = s.num_heads * s.head_dim;
  auto run = [&](auto attend) {
    at::parallel_for(0, query.size(0), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch;
      for (int64_t b = begin; b < end; ++b) {
        attend(q + b * seq_stride, cache, table + b * s.max_blocks, firsts[b], lens[b], s,
               static_cast<float>(scale), o + b * seq_stride, scratch);
      }
    });
  };
  if (run_bf16_sequences(q, cache, s, run)) return;
  switch (s.head_dim) {
    case 64: run(attend_sequence<scalar_t, cache_t, 64>); break;
    case 128: run(attend_sequence<scalar_t, cache_t, 128>); break;
    default: run(attend_sequence<scalar_t, cache_t, 0>);
  }
}

// query (B, Hq, D); kv_cache (2, num_blocks, block_size, Hkv, D); block_table (B, max_blocks)
// int64; first_key, seq_lens (B,) int64: sequence b attends keys [first_key[b], seq_lens[b]).
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                                  const at::Tensor& block_table, const at::Tensor& first_key,
                                  const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5, "query must be (B, Hq, D) and kv_cache "
              "(2, num_blocks, block_size, Hkv, D)");
  TORCH_CHECK(query.is_contiguous() && kv_cache.is_contiguous() && block_table.is_contiguous(),
              "query, kv_cache and block_table must be contiguous");
  const at::ScalarType cache_type = kv_cache.scalar_type();
  TORCH_CHECK(cache_type == query.scalar_type() || cache_type == at::kFloat8_e4m3fn ||
                  cache_type == at::kFloat8_e5m2,
              "kv_cache must have the query's dtype or be float8_e4m3fn / float8_e5m2");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && first_key.scalar_type() == at::kLong &&
                  seq_lens.scalar_type() == at::kLong,
              "block_table, first_key and seq_lens must be int64");
  Shape s{query.size(1), kv_cache.size(3), kv_cache.size(4), kv_cache.size(2),
          block_table.size(1), kv_cache.stride(0)};
  TORCH_CHECK(query.size(2) == s.head_dim && s.num_heads % s.num_kv_heads == 0,
              "query heads must be a multiple of kv heads with the same head_dim");
  at::Tensor out = at::empty_like(query);
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* firsts = first_key.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode",
                                  [&] {
    if (cache_type == at::kFloat8_e4m3fn) {
      attend_all<scalar_t, c10::Float8_e4m3fn>(query, kv_cache, table, firsts, lens, s, scale,
                                               out);
    } else if (cache_type == at::kFloat8_e5m2) {
      attend_all<scalar_t, c10::Float8_e5m2>(query, kv_cache, table, firsts, lens, s, scale, out);
    } else {
      attend_all<scalar_t, scalar_t>(query, kv_cache, table, firsts, lens, s, scale, out);
    }
  });
  return out;
}

// Whether the bf16 attention kernels (decode and prefill) multiply AMX tiles: the CPU has
// AMX-BF16 and the OS lends its registers. `enable` false (tests) keeps them on vdpbf16ps until
// enabled again. Returns whether they use AMX from now on.
bool use_amx_tiles(bool enable) {
#if defined(KVTIER_HAS_AMX)
  kvtier::amx_enabled.store(enable);
  return kvtier::use_amx();
#else
  (void)enable;
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(kvtier, m) {
  m.def("paged_decode_attention(Tensor query, Tensor kv_cache, Tensor block_table, "
        "Tensor first_key, Tensor seq_lens, float scale) -> Tensor");
  m.def("use_amx_tiles(bool enable) -> bool", &use_amx_tiles);
}

TORCH_LIBRARY_IMPL(kvtier, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
