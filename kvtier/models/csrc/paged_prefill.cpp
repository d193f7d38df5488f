// Paged prefill attention for CPU: sequences with several new tokens (a fresh prompt, or a chunk
// over a cached prefix) attend their keys straight from the block-table KV cache, causally from
// the chunk's offset, with fp32 softmax and sums.
//
// Work item = (sequence, kv head, tile of up to kTileTokens queries): the tile's query rows (its
// tokens x the query heads sharing that kv head) are scored against one page of keys at a time,
// so each page is converted to fp32 once per tile rather than once per query, and nothing is
// gathered. Two passes over the pages, as in paged_decode.cpp: scores, softmax per row over its
// own range, then the weighted values. Registered as torch.ops.kvtier.paged_prefill_attention;
// built by kvtier/models/cpu_kernels.py with -ffast-math (expf vectorizes). Only attended
// positions are read, so pages before a sliding window may hold anything (the null block). It
// takes head_dim 64 or 128 with 16-slot blocks (paged_prefill_supports), and in bf16 with the
// bf16 tiles any block size; the engine sends other shapes to torch.
//
// bf16 caches with head_dim 64 or 128 and any block size take the bf16 tiles of
// paged_prefill_bf16.h where the CPU has AVX512-BF16: AMX tile multiplies where it also has
// AMX-BF16 and the OS lends the tile registers (paged_prefill_amx.h), vdpbf16ps otherwise. On an
// Intel Sapphire Rapids VM (2 cores) the AMX tiles run a 2,048-token prompt in 7.2 ms per layer
// against 8.0 for torch's flash kernel, a 2,048-token chunk over 6,144 cached in 48 vs 74 ms;
// on 2 AMD EPYC cores the vdpbf16ps tiles run them in 15 and 99 ms (torch 42 and 303), 0.8 of
// the bf16 matmul rate.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "paged_prefill.h"
#include "paged_prefill_bf16.h"
#include "softmax_span.h"

namespace {

// 16 floats (one AVX-512 register, two AVX2 ones) for the loops whose sizes are compile-time:
// GCC/Clang vector extensions keep the running sums in registers, where the same loops over
// arrays were spilled to the stack on every step (measured: half the kernel's time).
typedef float Vec16 __attribute__((vector_size(64), aligned(4)));
inline Vec16 load16(const float* p) { return *reinterpret_cast<const Vec16*>(p); }
inline void store16(float* p, Vec16 v) { *reinterpret_cast<Vec16*>(p) = v; }

template <typename scalar_t>
inline float to_float(scalar_t x) {
  return static_cast<float>(x);
}

// bf16 is the top half of an fp32.
template <>
inline float to_float<c10::BFloat16>(c10::BFloat16 x) {
  uint32_t word = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &word, sizeof f);
  return f;
}

// Softmax of each row of `scores` (rows x num_keys, row r = token r / group at first_pos + r /
// group) over its own keys [first_attended(pos, window), pos]; keys outside get weight 0.
void softmax_rows(float* scores, int64_t rows, int64_t num_keys, int64_t group, int64_t first_pos,
                  int64_t lo, int64_t window) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = first_pos + r / group;
    const int64_t begin = first_attended(pos, window) - lo, end = pos + 1 - lo;
    kvtier::softmax_span(scores + r * num_keys, num_keys, begin, end);
  }
}

// One tile of one kv head, over 16-slot blocks. kDim: head dim as a compile-time constant (the
// inner loops become whole vector registers, as does a block's row of scores).
template <typename scalar_t, int64_t kDim>
void attend_tile(const scalar_t* query, const scalar_t* cache, const int64_t* table,
                 int64_t computed, int64_t tile_begin, int64_t tile_end, int64_t kv_head,
                 int64_t window, const Shape& s, float scale, scalar_t* out,
                 std::vector<float>& scratch) {
  static_assert(kDim % 16 == 0, "a row of a V page is whole Vec16s");
  constexpr int64_t dim = kDim, block = 16;  // a page of keys is one Vec16 of scores
  const int64_t group = s.num_heads / s.num_kv_heads;
  const int64_t tokens = tile_end - tile_begin, rows = tokens * group;
  const int64_t row_stride = s.num_heads * dim;  // between consecutive query tokens
  const int64_t page_len = block * s.num_kv_heads * dim, token_len = s.num_kv_heads * dim;
  // Keys [lo, hi) cover every row of the tile; row r (token i) attends
  // [first_attended(pos(i), window), pos(i) + 1).
  const int64_t first_pos = computed + tile_begin, last_pos = computed + tile_end - 1;
  const int64_t lo = first_attended(first_pos, window), hi = last_pos + 1, num_keys = hi - lo;

  scratch.resize(rows * dim * 2 + dim * block + rows * num_keys + 4 * block);
  float* q = scratch.data();              // rows x dim, scaled
  float* acc = q + rows * dim;            // rows x dim
  float* page = acc + rows * dim;         // K page transposed (dim x block), or V page (block x dim)
  float* scores = page + dim * block;     // rows x num_keys
  float* sums = scores + rows * num_keys;  // four rows' scores of one page
  for (int64_t i = 0; i < tokens; ++i) {
    const scalar_t* src = query + (tile_begin + i) * row_stride + kv_head * group * dim;
    for (int64_t j = 0; j < group * dim; ++j) q[i * group * dim + j] = to_float(src[j]) * scale;
  }
  // Visits the pages overlapping [lo, hi): fn(key index of the page's first used token from lo,
  // first used slot, end slot, pointer to this kv head's row of slot 0).
  auto for_each_page = [&](int64_t v_offset, auto&& fn) {
    for (int64_t pos = lo; pos < hi;) {
      const int64_t t_lo = pos % block, t_hi = std::min(block, t_lo + (hi - pos));
      // Pages lie anywhere: fetch this head's rows of the page two ahead while this one is used.
      const int64_t ahead = pos / block + 2;
      if (ahead * block < hi) {
        const char* next = reinterpret_cast<const char*>(
            cache + table[ahead] * page_len + v_offset + kv_head * dim);
        for (int64_t t = 0; t < block; ++t) {
          for (int64_t b = 0; b < dim * static_cast<int64_t>(sizeof(scalar_t)); b += 64) {
            __builtin_prefetch(next + t * token_len * sizeof(scalar_t) + b, 0, 1);
          }
        }
      }
      const scalar_t* base = cache + table[pos / block] * page_len + v_offset + kv_head * dim;
      fn(pos - lo, t_lo, t_hi, base);
      pos += t_hi - t_lo;
    }
  };

  for_each_page(0, [&](int64_t key0, int64_t t_lo, int64_t t_hi, const scalar_t* base) {
    // Transposed K of the used slots; unused slots are zero and their scores are dropped.
    std::fill(page, page + dim * block, 0.f);
    for (int64_t t = t_lo; t < t_hi; ++t) {
      const scalar_t* k = base + t * token_len;
      for (int64_t d = 0; d < dim; ++d) page[d * block + t] = to_float(k[d]);
    }
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {  // four rows share each K load; a page is one Vec16
      Vec16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
      const float *q0 = q + r * dim, *q1 = q0 + dim, *q2 = q1 + dim, *q3 = q2 + dim;
      for (int64_t d = 0; d < dim; ++d) {
        const Vec16 kd = load16(page + d * block);
        a0 += q0[d] * kd;
        a1 += q1[d] * kd;
        a2 += q2[d] * kd;
        a3 += q3[d] * kd;
      }
      store16(sums, a0);
      store16(sums + block, a1);
      store16(sums + 2 * block, a2);
      store16(sums + 3 * block, a3);
      for (int64_t j = 0; j < 4; ++j) {
        std::copy(sums + j * block + t_lo, sums + j * block + t_hi,
                  scores + (r + j) * num_keys + key0);
      }
    }
    for (; r < rows; ++r) {
      std::fill(sums, sums + block, 0.f);
      const float* qr = q + r * dim;
      for (int64_t d = 0; d < dim; ++d) {
        const float* kd = page + d * block;
#pragma omp simd
        for (int64_t t = 0; t < block; ++t) sums[t] += qr[d] * kd[t];
      }
      std::copy(sums + t_lo, sums + t_hi, scores + r * num_keys + key0);
    }
  });

  softmax_rows(scores, rows, num_keys, group, first_pos, lo, window);

  std::fill(acc, acc + rows * dim, 0.f);
  for_each_page(s.v_offset, [&](int64_t key0, int64_t t_lo, int64_t t_hi, const scalar_t* base) {
    for (int64_t t = t_lo; t < t_hi; ++t) {
      const scalar_t* v = base + t * token_len;
      for (int64_t d = 0; d < dim; ++d) page[t * dim + d] = to_float(v[d]);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float* w = scores + r * num_keys + key0 - t_lo;
      float* ar = acc + r * dim;
      Vec16 sum[kDim / 16];  // the row's sums stay in registers over the page
      for (int64_t j = 0; j < kDim / 16; ++j) sum[j] = load16(ar + 16 * j);
      for (int64_t t = t_lo; t < t_hi; ++t) {
        const float wt = w[t];
        const float* vt = page + t * kDim;
        for (int64_t j = 0; j < kDim / 16; ++j) sum[j] += wt * load16(vt + 16 * j);
      }
      for (int64_t j = 0; j < kDim / 16; ++j) store16(ar + 16 * j, sum[j]);
    }
  });
  for (int64_t i = 0; i < tokens; ++i) {
    scalar_t* dst = out + (tile_begin + i) * row_stride + kv_head * group * dim;
    for (int64_t j = 0; j < group * dim; ++j) dst[j] = static_cast<scalar_t>(acc[i * group * dim + j]);
  }
}


// The shapes paged_prefill_attention takes in every dtype: those its fp32 loops are vectorised
// for (the bf16 tiles take any block size, see below). Measured on 2 AMD EPYC cores, a loop over
// runtime sizes (8- or 32-slot pages, head dims 32 or 96) ran 4-10x slower than torch's
// scaled_dot_product_attention on the same work, so those shapes go there.
bool vectorised_head_dim(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }

bool paged_prefill_supports(int64_t head_dim, int64_t block_size) {
  return block_size == 16 && vectorised_head_dim(head_dim);
}

// Whether paged_prefill_attention takes the vdpbf16ps tiles for this cache: then it is the
// fastest path at every prefill length, and callers need no flash-kernel fallback for long ones.
// Any block size: the keys are packed into 16-key pages first (pack_pages_bf16).
bool paged_prefill_has_bf16_tiles(at::ScalarType dtype, int64_t head_dim, int64_t block_size) {
#if defined(__AVX512BF16__)
  return dtype == at::kBFloat16 && block_size > 0 && vectorised_head_dim(head_dim);
#else
  return false;
#endif
}

// Runs the tiles through the bf16 tiles when they can take them; false: use attend_tile.
template <typename scalar_t>
bool try_bf16_tiles(const scalar_t*, const scalar_t*, const Batch&, const Shape&, scalar_t*) {
  return false;
}

#if defined(__AVX512BF16__)
template <>
bool try_bf16_tiles(const c10::BFloat16* q, const c10::BFloat16* cache, const Batch& b,
                    const Shape& s, c10::BFloat16* out) {
  if (!paged_prefill_has_bf16_tiles(at::kBFloat16, s.head_dim, s.block_size)) return false;
  if (s.head_dim == 64) run_bf16_tiles<64>(q, cache, b, s, out);
  else run_bf16_tiles<128>(q, cache, b, s, out);
  return true;
}
#endif

// query, out (T, Hq, D); kv_cache (2, num_blocks, block_size, Hkv, D); block_table (S, n) int64;
// query_start, num_computed, query_lens (S,) int64: sequence s's queries are rows
// [query_start[s], query_start[s] + query_lens[s]) at positions num_computed[s] onwards, each
// attending keys up to itself (and no further back than `window` when window > 0). Writes those
// rows of `out` only.
void paged_prefill_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                             const at::Tensor& block_table, const at::Tensor& query_start,
                             const at::Tensor& num_computed, const at::Tensor& query_lens,
                             int64_t window, double scale, at::Tensor& out) {
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5, "query must be (T, Hq, D) and kv_cache "
              "(2, num_blocks, block_size, Hkv, D)");
  TORCH_CHECK(query.is_contiguous() && kv_cache.is_contiguous() && block_table.is_contiguous() &&
                  out.is_contiguous(),
              "query, kv_cache, block_table and out must be contiguous");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() &&
                  out.scalar_type() == query.scalar_type() && out.sizes() == query.sizes(),
              "query, kv_cache and out must share a dtype, query and out a shape");
  for (const at::Tensor* t : {&block_table, &query_start, &num_computed, &query_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "block_table, query_start, num_computed and query_lens must be contiguous int64");
  }
  const int64_t num_seqs = query_lens.size(0);
  Shape s{query.size(1), kv_cache.size(3), kv_cache.size(4), kv_cache.size(2),
          block_table.size(1), kv_cache.stride(0)};
  TORCH_CHECK(query.size(2) == s.head_dim && s.num_heads % s.num_kv_heads == 0,
              "query heads must be a multiple of kv heads with the same head_dim");
  TORCH_CHECK(paged_prefill_supports(s.head_dim, s.block_size) ||
                  paged_prefill_has_bf16_tiles(query.scalar_type(), s.head_dim, s.block_size),
              "paged_prefill_attention takes head_dim 64 or 128 with 16-slot blocks, or any "
              "block size in bf16 where it has the bf16 tiles (see paged_prefill_supports and "
              "paged_prefill_has_bf16_tiles); got head_dim ", s.head_dim, " with ",
              s.block_size, "-slot blocks");
  const int64_t* starts = query_start.data_ptr<int64_t>();
  const int64_t* computed = num_computed.data_ptr<int64_t>();
  const int64_t* lens = query_lens.data_ptr<int64_t>();
  std::vector<Item> items;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    for (int64_t i = 0; i < lens[seq]; i += kTileTokens) items.push_back({seq, i});
  }
  const Batch batch{block_table.data_ptr<int64_t>(), starts, computed, lens, items, window,
                    static_cast<float>(scale)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_prefill",
                                  [&] {
    const scalar_t* q = query.data_ptr<scalar_t>();
    const scalar_t* cache = kv_cache.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    if (try_bf16_tiles(q, cache, batch, s, o)) return;
    auto run = [&](auto attend) {
      WorkQueue(batch, s.num_kv_heads).run([&](const auto& next) {
        std::vector<float> scratch;
        for (int64_t n; (n = next()) >= 0;) {
          const Item& item = items[n / s.num_kv_heads];
          const int64_t seq = item.seq, row0 = starts[seq];
          const int64_t tile_end = std::min(lens[seq], item.first_query + kTileTokens);
          attend(q + row0 * s.num_heads * s.head_dim, cache, batch.table + seq * s.max_blocks,
                 computed[seq], item.first_query, tile_end, n % s.num_kv_heads, window, s,
                 batch.scale, o + row0 * s.num_heads * s.head_dim, scratch);
        }
      });
    };
    if (s.head_dim == 64) run(attend_tile<scalar_t, 64>);
    else run(attend_tile<scalar_t, 128>);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvtier, m) {
  m.def("paged_prefill_supports(int head_dim, int block_size) -> bool", &paged_prefill_supports);
  m.def("paged_prefill_has_bf16_tiles(ScalarType dtype, int head_dim, int block_size) -> bool",
        &paged_prefill_has_bf16_tiles);
  m.def("paged_prefill_attention(Tensor query, Tensor kv_cache, Tensor block_table, "
        "Tensor query_start, Tensor num_computed, Tensor query_lens, int window, float scale, "
        "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(kvtier, CPU, m) {
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}
