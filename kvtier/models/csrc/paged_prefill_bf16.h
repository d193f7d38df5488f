// The bf16 tiles of paged prefill attention (bf16 caches, head dim 64 or 128, any block size),
// on CPUs with AVX512-BF16: vdpbf16ps tiles here, AMX tiles in paged_prefill_amx.h over the same
// packed pages. Included by paged_prefill.cpp only.

#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <array>
#include <cstring>

#include "paged_prefill.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

// bf16 models on CPUs with AVX512-BF16: both products run as vdpbf16ps (two bf16 products summed
// into each fp32 lane), twice the fp32 FMA rate. Scores: a lane is a key, the pair two adjacent
// dims, so the scores are exact products of the stored bf16 values summed in fp32 as in
// attend_tile. Values: a lane is a dim, the pair two adjacent keys, and the softmax weights are
// rounded to bf16 for the product (as torch's CPU flash attention does); sums stay fp32.
// Each (sequence, kv head)'s pages are packed once into those pair layouts (pack_pages_bf16),
// shared by all its tiles; a tile's scores are laid out page-aligned so whole vectors are stored
// and read.
struct PackedPages {
  const uint32_t* k;   // page, dim pair, slot
  const uint32_t* v;   // page, slot pair, dim
  int64_t first_page;  // the sequence's page held first
};

// Pages [page_begin, page_end) of one (sequence, kv head), whose last token is end_pos - 1, into
// kpages / vpages (the words of page_begin). A packed page is 16 consecutive key positions,
// whatever the cache's block size: position pos is slot pos % block_size of block
// table[pos / block_size]. Slots from end_pos on are zero: they may hold another request's stale
// data, and a zero weight times a non-finite value would still be NaN.
template <int64_t kDim>
void pack_pages_bf16(const c10::BFloat16* cache, const int64_t* table, int64_t page_begin,
                     int64_t page_end, int64_t end_pos, int64_t kv_head, const Shape& s,
                     uint32_t* kpages, uint32_t* vpages) {
  constexpr int64_t kPage = 16, kPairs = kDim / 2, kPageWords = kPairs * kPage;
  const int64_t block_len = s.block_size * s.num_kv_heads * kDim;
  const int64_t token_len = s.num_kv_heads * kDim;
  const int64_t num_pages = page_end - page_begin;
  std::fill(kpages, kpages + num_pages * kPageWords, 0u);
  std::fill(vpages, vpages + num_pages * kPageWords, 0u);
  for (int64_t page = 0; page < num_pages; ++page) {
    const int64_t first_pos = (page_begin + page) * kPage;
    const int64_t used = std::min(kPage, end_pos - first_pos);
    uint32_t* kp = kpages + page * kPageWords;
    uint32_t* vp = vpages + page * kPageWords;
    for (int64_t t = 0; t < used; ++t) {
      const int64_t pos = first_pos + t;
      const uint16_t* k_row = reinterpret_cast<const uint16_t*>(
          cache + table[pos / s.block_size] * block_len + (pos % s.block_size) * token_len +
          kv_head * kDim);
      const uint32_t* k = reinterpret_cast<const uint32_t*>(k_row);
      for (int64_t p = 0; p < kPairs; ++p) kp[p * kPage + t] = k[p];
      const uint16_t* v = k_row + s.v_offset;
      const int shift = (t & 1) * 16;
      uint32_t* vrow = vp + (t / 2) * kDim;
      for (int64_t d = 0; d < kDim; ++d) vrow[d] |= uint32_t(v[d]) << shift;
    }
  }
}

template <int64_t kDim>
void attend_tile_bf16(const c10::BFloat16* query, const PackedPages& pages, int64_t computed,
                      int64_t tile_begin, int64_t tile_end, int64_t kv_head, int64_t window,
                      const Shape& s, float scale, c10::BFloat16* out,
                      std::vector<float>& scratch) {
  constexpr int64_t kBlock = 16, kPairs = kDim / 2, kChunks = kDim / 16;
  constexpr int64_t kPageWords = kPairs * kBlock;  // = (kBlock / 2) * kDim
  constexpr int64_t kRowsPV = 256 / kDim;           // rows sharing each V load: 16 accumulators
  const int64_t group = s.num_heads / s.num_kv_heads;
  const int64_t tokens = tile_end - tile_begin, rows = tokens * group;
  const int64_t row_stride = s.num_heads * kDim;
  const int64_t first_pos = computed + tile_begin, last_pos = computed + tile_end - 1;
  auto row_lo = [&](int64_t pos) { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; };
  const int64_t lo = row_lo(first_pos), hi = last_pos + 1;
  const int64_t first_page = lo / kBlock, num_pages = (hi + kBlock - 1) / kBlock - first_page;
  const int64_t keys = num_pages * kBlock;  // scores row r, column c = key first_page * 16 + c
  const uint32_t* kpages = pages.k + (first_page - pages.first_page) * kPageWords;
  const uint32_t* vpages = pages.v + (first_page - pages.first_page) * kPageWords;

  // 32-bit words: a word holds two bf16, the lower one first.
  scratch.resize(rows * kPairs + rows * keys + rows * keys / 2 + rows * kDim);
  uint32_t* q = reinterpret_cast<uint32_t*>(scratch.data());  // rows x kPairs
  float* scores = reinterpret_cast<float*>(q + rows * kPairs);  // rows x keys
  uint32_t* weights = reinterpret_cast<uint32_t*>(scores + rows * keys);   // rows x keys / 2
  float* acc = reinterpret_cast<float*>(weights + rows * keys / 2);         // rows x kDim
  for (int64_t i = 0; i < tokens; ++i) {
    const c10::BFloat16* src = query + (tile_begin + i) * row_stride + kv_head * group * kDim;
    std::memcpy(q + i * group * kPairs, src, group * kDim * sizeof(c10::BFloat16));
  }

  // Scores, four rows by one page: each K load serves four rows.
  const __m512 scale16 = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < rows; r += 4) {
    const int64_t n = std::min<int64_t>(4, rows - r);
    const uint32_t* qr[4];
    for (int64_t j = 0; j < 4; ++j) qr[j] = q + (r + std::min(j, n - 1)) * kPairs;
    for (int64_t page = 0; page < num_pages; ++page) {
      const uint32_t* kp = kpages + page * kPageWords;
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t p = 0; p < kPairs; ++p) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512(kp + p * kBlock);
        a0 = _mm512_dpbf16_ps(a0, k, (__m512bh)_mm512_set1_epi32(qr[0][p]));
        a1 = _mm512_dpbf16_ps(a1, k, (__m512bh)_mm512_set1_epi32(qr[1][p]));
        a2 = _mm512_dpbf16_ps(a2, k, (__m512bh)_mm512_set1_epi32(qr[2][p]));
        a3 = _mm512_dpbf16_ps(a3, k, (__m512bh)_mm512_set1_epi32(qr[3][p]));
      }
      const __m512 a[4] = {a0, a1, a2, a3};
      for (int64_t j = 0; j < n; ++j) {
        _mm512_storeu_ps(scores + (r + j) * keys + page * kBlock, _mm512_mul_ps(a[j], scale16));
      }
    }
  }

  softmax_rows(scores, rows, keys, group, first_pos, first_page * kBlock, row_lo);
  for (int64_t i = 0; i < rows * keys; i += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + i / 2),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(scores + i)));
  }

  // Weighted values, kRowsPV rows at a time: each V load serves all of them.
  for (int64_t r = 0; r < rows; r += kRowsPV) {
    const int64_t n = std::min(kRowsPV, rows - r);
    __m512 sum[kRowsPV][kChunks];
    for (int64_t j = 0; j < kRowsPV; ++j) {
      for (int64_t c = 0; c < kChunks; ++c) sum[j][c] = _mm512_setzero_ps();
    }
    const uint32_t* wr[kRowsPV];
    for (int64_t j = 0; j < kRowsPV; ++j) wr[j] = weights + (r + std::min(j, n - 1)) * keys / 2;
    for (int64_t pair = 0; pair < keys / 2; ++pair) {
      const uint32_t* vp = vpages + pair * kDim;  // pages are consecutive: pair indexes them all
      __m512bh v[kChunks];
      for (int64_t c = 0; c < kChunks; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vp + 16 * c);
      for (int64_t j = 0; j < kRowsPV; ++j) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(wr[j][pair]);
        for (int64_t c = 0; c < kChunks; ++c) sum[j][c] = _mm512_dpbf16_ps(sum[j][c], v[c], w);
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t c = 0; c < kChunks; ++c) {
        _mm512_storeu_ps(acc + (r + j) * kDim + 16 * c, sum[j][c]);
      }
    }
  }
  for (int64_t i = 0; i < tokens; ++i) {
    c10::BFloat16* dst = out + (tile_begin + i) * row_stride + kv_head * group * kDim;
    const float* src = acc + i * group * kDim;
    for (int64_t j = 0; j < group * kDim; ++j) dst[j] = static_cast<c10::BFloat16>(src[j]);
  }
}

}  // namespace

#include "paged_prefill_amx.h"

namespace {

// The bf16 tiles: each (sequence, kv head)'s pages packed once (in page runs, in parallel), then
// the tiles over them, as AMX tiles where the CPU and the OS allow them.
template <int64_t kDim>
void run_bf16_tiles(const c10::BFloat16* q, const c10::BFloat16* cache, const Batch& b,
                    const Shape& s, c10::BFloat16* out) {
  constexpr int64_t kPageWords = 8 * kDim, kPagesPerTask = 32;
  const int64_t num_seqs = b.items.empty() ? 0 : b.items.back().seq + 1;
  // stride: num_pages plus one zero page, which the AMX tiles read to make a page pair.
  struct SeqPages { int64_t first_page, num_pages, stride, offset; };
  std::vector<SeqPages> seqs(num_seqs);
  std::vector<std::array<int64_t, 3>> tasks;  // (sequence, kv head, first page of the run)
  int64_t words = 0;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t first_key = b.window > 0 ? std::max<int64_t>(0, b.computed[seq] - b.window + 1)
                                           : 0;
    const int64_t end_pos = b.computed[seq] + b.lens[seq];
    const int64_t first_page = first_key / 16;
    const int64_t num_pages = b.lens[seq] > 0 ? (end_pos + 15) / 16 - first_page : 0;
    seqs[seq] = {first_page, num_pages, num_pages + 1, words};
    words += 2 * (num_pages + 1) * kPageWords * s.num_kv_heads;
    for (int64_t h = 0; h < s.num_kv_heads; ++h) {
      for (int64_t page = 0; page < num_pages; page += kPagesPerTask) tasks.push_back({seq, h, page});
    }
  }
  std::vector<uint32_t> packed(words);  // zeros: the pages after each sequence's stay so
  // A (sequence, kv head)'s K pages, then its V pages.
  auto k_words = [&](int64_t seq, int64_t h) {
    return packed.data() + seqs[seq].offset + 2 * h * seqs[seq].stride * kPageWords;
  };
  auto pages_of = [&](int64_t seq, int64_t h) {
    const uint32_t* k = k_words(seq, h);
    return PackedPages{k, k + seqs[seq].stride * kPageWords, seqs[seq].first_page};
  };
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const auto [seq, h, page] = tasks[n];
      const SeqPages& p = seqs[seq];
      const int64_t page_end = std::min(p.num_pages, page + kPagesPerTask);
      uint32_t* k = k_words(seq, h) + page * kPageWords;
      pack_pages_bf16<kDim>(cache, b.table + seq * s.max_blocks, p.first_page + page,
                            p.first_page + page_end, b.computed[seq] + b.lens[seq], h, s, k,
                            k + p.stride * kPageWords);
    }
  });
  const int64_t num_items = static_cast<int64_t>(b.items.size()) * s.num_kv_heads;
  auto attend = attend_tile_bf16<kDim>;
#if defined(KVTIER_HAS_AMX)
  const bool amx = use_amx();
  if (amx) attend = attend_tile_amx<kDim>;
#endif
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
#if defined(KVTIER_HAS_AMX)
    if (amx) load_amx_config();
#endif
    for (int64_t n = begin; n < end; ++n) {
      const Item& item = b.items[n / s.num_kv_heads];
      const int64_t seq = item.seq, h = n % s.num_kv_heads, row0 = b.starts[seq] * s.num_heads * kDim;
      const int64_t tile_end = std::min(b.lens[seq], item.first_query + kTileTokens);
      attend(q + row0, pages_of(seq, h), b.computed[seq], item.first_query, tile_end, h,
             b.window, s, b.scale, out + row0, scratch);
    }
#if defined(KVTIER_HAS_AMX)
    if (amx) _tile_release();
#endif
  });
}

}  // namespace

#endif  // __AVX512BF16__
