// The bf16 tiles of paged prefill attention (bf16 caches, head dim 64 or 128, any block size),
// on CPUs with AVX512-BF16: vdpbf16ps tiles here, AMX tiles in paged_prefill_amx.h over the same
// packed pages. Included by paged_prefill.cpp only.

#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <array>
#include <cstring>
#include <memory>

#include "paged_prefill.h"
#include "softmax_span.h"

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

using kvtier::exp16;
using kvtier::span_mask;

// The highest of scores [begin, end).
inline float span_max(const float* scores, int64_t begin, int64_t end) {
  __m512 peak16 = _mm512_set1_ps(-INFINITY);
  for (int64_t c = begin / 16 * 16; c < end; c += 16) {
    peak16 = _mm512_mask_max_ps(peak16, span_mask(c, begin, end), peak16,
                                _mm512_loadu_ps(scores + c));
  }
  return _mm512_reduce_max_ps(peak16);
}

// One row of scores (`keys` of them, a multiple of 16) to its unnormalized softmax weights in
// bf16 pairs: exp(scale * (score - peak)) over [begin, end), 0 elsewhere. Returns their sum.
inline float row_weights(const float* scores, int64_t keys, int64_t begin, int64_t end,
                         float peak, float scale, uint32_t* weights) {
  const __m512 peak16 = _mm512_set1_ps(peak), scale16 = _mm512_set1_ps(scale);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t c = 0; c < keys; c += 16) {
    const __m512 x = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(scores + c), peak16), scale16);
    const __m512 w = _mm512_maskz_mov_ps(span_mask(c, begin, end), exp16(x));
    sum = _mm512_add_ps(sum, w);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + c / 2),
                        (__m256i)_mm512_cvtneps_pbh(w));
  }
  return _mm512_reduce_add_ps(sum);
}

// Raw scores of four query rows against kPages consecutive packed pages (16 * kPages keys):
// the 4 x kPages accumulators are independent chains of vdpbf16ps, enough to cover its latency
// (four rows by one page were four chains, each waiting on the previous product).
// Rows j >= n are computed from a repeated row and not stored.
template <int64_t kDim, int kPages>
inline void score_rows(const uint32_t* const* qr, int64_t n, const uint32_t* kp, float* dst,
                       int64_t dst_stride) {
  constexpr int64_t kPairs = kDim / 2, kPageWords = kPairs * 16;
  __m512 acc[4][kPages];
  for (int j = 0; j < 4; ++j) {
    for (int g = 0; g < kPages; ++g) acc[j][g] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < kPairs; ++p) {
    __m512bh k[kPages];
    for (int g = 0; g < kPages; ++g) {
      k[g] = (__m512bh)_mm512_loadu_si512(kp + g * kPageWords + p * 16);
    }
    for (int j = 0; j < 4; ++j) {
      const __m512bh q = (__m512bh)_mm512_set1_epi32(qr[j][p]);
      for (int g = 0; g < kPages; ++g) acc[j][g] = _mm512_dpbf16_ps(acc[j][g], k[g], q);
    }
  }
  for (int j = 0; j < 4; ++j) {
    if (j >= n) break;
    for (int g = 0; g < kPages; ++g) _mm512_storeu_ps(dst + j * dst_stride + g * 16, acc[j][g]);
  }
}

// The tiles walk their keys kKeyChunkPages pages (kKeyChunk keys) at a time. 128 keys: a KV
// head's K and V of one chunk (32 KB at head dim 64) stay in a 48 KB L1 while every row of the
// tile reads them; with 256 keys, on the Zen 5 VM of docs/benchmarks.md, a 2,048-token prompt
// ran at 564-593 GFLOP/s against 644-698 (64 keys: 639-656), runs alternated.
constexpr int64_t kKeyChunkPages = 8, kKeyChunk = kKeyChunkPages * 16;

// What a part of a tile's keys leaves for merge_parts_bf16 (see TileParts): per row, its fp32
// sums of weighted values (kDim), its peak score and its weights' sum relative to that peak.
template <int64_t kDim>
constexpr int64_t kPartFloatsPerRow = kDim + 2;

// A tile's keys kChunkPages pages at a time, each chunk's K and V read once for all the tile's
// rows while they are in the core's cache: the rows' scores against the chunk, their weights
// relative to each row's running peak (online softmax: the sums so far rescaled when the peak
// rises), the weighted values added to the rows' fp32 sums; each row's output divided by its
// weights' sum at the end. Scores and weights never exceed one chunk, whatever the context.
// With `part` set, only the tile's key chunks [chunk_begin, chunk_end) are attended and each row's
// sums, peak and weights' sum go to `part` (kPartFloatsPerRow floats a row) instead of `out`; a
// part that does not start at chunk 0 must hold only keys every row of the tile attends.
template <int64_t kDim>
void attend_keys_bf16(const c10::BFloat16* query, const PackedPages& pages, int64_t computed,
                      int64_t tile_begin, int64_t tile_end, int64_t kv_head, int64_t window,
                      const Shape& s, float scale, c10::BFloat16* out,
                      std::vector<float>& scratch, int64_t chunk_begin, int64_t chunk_end,
                      float* part) {
  constexpr int64_t kBlock = 16, kPairs = kDim / 2, kChunks = kDim / 16;
  constexpr int64_t kPageWords = kPairs * kBlock;  // = (kBlock / 2) * kDim
  constexpr int64_t kRowsPV = 256 / kDim;           // rows sharing each V load: 16 accumulators
  constexpr int64_t kChunkPages = kKeyChunkPages, kChunkKeys = kKeyChunk;
  // So every row from first_row on has keys in each chunk: a row's window starts at most
  // kTileTokens - 1 keys after the first row's, inside the first chunk.
  static_assert(kChunkKeys >= kTileTokens + kBlock, "a row's first chunk holds some of its keys");
  const int64_t group = s.num_heads / s.num_kv_heads;
  const int64_t tokens = tile_end - tile_begin, rows = tokens * group;
  const int64_t row_stride = s.num_heads * kDim;
  const int64_t first_pos = computed + tile_begin, last_pos = computed + tile_end - 1;
  const int64_t lo = first_attended(first_pos, window), hi = last_pos + 1;
  const int64_t first_page = lo / kBlock, num_pages = (hi + kBlock - 1) / kBlock - first_page;
  const int64_t first_key = first_page * kBlock;  // key k of the tile is position first_key + k
  const uint32_t* kpages = pages.k + (first_page - pages.first_page) * kPageWords;
  const uint32_t* vpages = pages.v + (first_page - pages.first_page) * kPageWords;

  // 32-bit words: a word holds two bf16, the lower one first.
  scratch.resize(rows * (kPairs + kChunkKeys + kChunkKeys / 2 + kDim + 3));
  uint32_t* q = reinterpret_cast<uint32_t*>(scratch.data());             // rows x kPairs
  float* scores = reinterpret_cast<float*>(q + rows * kPairs);            // rows x kChunkKeys
  // rows x kChunkKeys / 2
  uint32_t* weights = reinterpret_cast<uint32_t*>(scores + rows * kChunkKeys);
  float* acc = reinterpret_cast<float*>(weights + rows * kChunkKeys / 2);  // rows x kDim
  float* peak = acc + rows * kDim;  // per row: its highest score so far (raw, unscaled)
  float* sum = peak + rows;         // its weights' sum so far, relative to that peak
  float* rescale = sum + rows;      // the factor its sums take in this chunk
  for (int64_t i = 0; i < tokens; ++i) {
    const c10::BFloat16* src = query + (tile_begin + i) * row_stride + kv_head * group * kDim;
    std::memcpy(q + i * group * kPairs, src, group * kDim * sizeof(c10::BFloat16));
  }
  std::fill(acc, acc + rows * kDim, 0.f);
  std::fill(sum, sum + rows, 0.f);

  const int64_t page_begin = chunk_begin * kChunkPages;
  const int64_t page_end = std::min(num_pages, chunk_end * kChunkPages);
  for (int64_t page0 = page_begin; page0 < page_end; page0 += kChunkPages) {
    const int64_t chunk_pages = std::min(kChunkPages, num_pages - page0);
    const int64_t key0 = page0 * kBlock, chunk_keys = chunk_pages * kBlock;
    // Causal: the rows of tokens before the chunk's first key see none of it.
    const int64_t first_row =
        group * std::clamp<int64_t>(first_key + key0 - first_pos, 0, tokens);
    const uint32_t* kchunk = kpages + page0 * kPageWords;

    for (int64_t r = first_row; r < rows; r += 4) {
      const int64_t n = std::min<int64_t>(4, rows - r);
      const uint32_t* qr[4];
      for (int64_t j = 0; j < 4; ++j) qr[j] = q + (r + std::min(j, n - 1)) * kPairs;
      float* dst = scores + r * kChunkKeys;
      int64_t page = 0;
      for (; page + 4 <= chunk_pages; page += 4) {
        score_rows<kDim, 4>(qr, n, kchunk + page * kPageWords, dst + page * kBlock, kChunkKeys);
      }
      for (; page < chunk_pages; ++page) {
        score_rows<kDim, 1>(qr, n, kchunk + page * kPageWords, dst + page * kBlock, kChunkKeys);
      }
    }

    for (int64_t r = first_row; r < rows; ++r) {
      const int64_t pos = first_pos + r / group;
      const int64_t begin = std::max<int64_t>(0, first_attended(pos, window) - first_key - key0);
      const int64_t end = std::min(chunk_keys, pos + 1 - first_key - key0);
      // Every row starts in the first chunk (the tile's first key is at or before its first
      // query; a later part's keys are all attended); its sums there start from 0. No
      // infinities: this file builds with -ffast-math.
      const float chunk_peak = span_max(scores + r * kChunkKeys, begin, end);
      rescale[r] = 1.f;
      if (page0 == page_begin) {
        rescale[r] = 0.f;
        peak[r] = chunk_peak;
      } else if (chunk_peak > peak[r]) {
        rescale[r] = std::exp((peak[r] - chunk_peak) * scale);
        peak[r] = chunk_peak;
      }
      sum[r] = sum[r] * rescale[r] +
               row_weights(scores + r * kChunkKeys, chunk_keys, begin, end, peak[r], scale,
                           weights + r * kChunkKeys / 2);
    }

    // Weighted values, kRowsPV rows at a time: each V load serves all of them.
    const uint32_t* vchunk = vpages + page0 * kPageWords;
    for (int64_t r = first_row; r < rows; r += kRowsPV) {
      const int64_t n = std::min(kRowsPV, rows - r);
      __m512 part[kRowsPV][kChunks];
      for (int64_t j = 0; j < kRowsPV; ++j) {
        const int64_t row = r + std::min(j, n - 1);
        const __m512 factor = _mm512_set1_ps(rescale[row]);
        for (int64_t c = 0; c < kChunks; ++c) {
          part[j][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + row * kDim + 16 * c), factor);
        }
      }
      const uint32_t* wr[kRowsPV];
      for (int64_t j = 0; j < kRowsPV; ++j) {
        wr[j] = weights + (r + std::min(j, n - 1)) * kChunkKeys / 2;
      }
      for (int64_t pair = 0; pair < chunk_keys / 2; ++pair) {
        const uint32_t* vp = vchunk + pair * kDim;  // pages are consecutive: pair indexes them all
        __m512bh v[kChunks];
        for (int64_t c = 0; c < kChunks; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vp + 16 * c);
        for (int64_t j = 0; j < kRowsPV; ++j) {
          const __m512bh w = (__m512bh)_mm512_set1_epi32(wr[j][pair]);
          for (int64_t c = 0; c < kChunks; ++c) part[j][c] = _mm512_dpbf16_ps(part[j][c], v[c], w);
        }
      }
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t c = 0; c < kChunks; ++c) {
          _mm512_storeu_ps(acc + (r + j) * kDim + 16 * c, part[j][c]);
        }
      }
    }
  }

  if (part != nullptr) {
    for (int64_t r = 0; r < rows; ++r) {
      float* dst = part + r * kPartFloatsPerRow<kDim>;
      std::memcpy(dst, acc + r * kDim, kDim * sizeof(float));
      dst[kDim] = peak[r];
      dst[kDim + 1] = sum[r];
    }
    return;
  }
  // Row r is token r / group, query head kv_head * group + r % group.
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = r / group, head = kv_head * group + r % group;
    uint16_t* dst = reinterpret_cast<uint16_t*>(out + (tile_begin + token) * row_stride +
                                                head * kDim);
    const __m512 inv = _mm512_set1_ps(1.f / sum[r]);
    for (int64_t c = 0; c < kChunks; ++c) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(acc + r * kDim + 16 * c), inv);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * c), (__m256i)_mm512_cvtneps_pbh(x));
    }
  }
}

// A whole tile: every key chunk, the rows' outputs into `out`.
template <int64_t kDim>
void attend_tile_bf16(const c10::BFloat16* query, const PackedPages& pages, int64_t computed,
                      int64_t tile_begin, int64_t tile_end, int64_t kv_head, int64_t window,
                      const Shape& s, float scale, c10::BFloat16* out,
                      std::vector<float>& scratch) {
  attend_keys_bf16<kDim>(query, pages, computed, tile_begin, tile_end, kv_head, window, s, scale,
                         out, scratch, 0, INT64_MAX / kKeyChunk, nullptr);
}

// The rows of one (tile, kv head) from the `num_parts` parts of its keys: each part's sums
// rescaled from its own peak to the highest, summed, divided by the summed weights.
template <int64_t kDim>
void merge_parts_bf16(const float* parts, int64_t num_parts, int64_t rows, int64_t group,
                      int64_t kv_head, int64_t tile_begin, int64_t row_stride, float scale,
                      c10::BFloat16* out) {
  constexpr int64_t kChunks = kDim / 16, kStride = kPartFloatsPerRow<kDim>;
  for (int64_t r = 0; r < rows; ++r) {
    float top = parts[r * kStride + kDim];
    for (int64_t p = 1; p < num_parts; ++p) {
      top = std::max(top, parts[(p * rows + r) * kStride + kDim]);
    }
    __m512 acc[kChunks];
    for (int64_t c = 0; c < kChunks; ++c) acc[c] = _mm512_setzero_ps();
    float sum = 0.f;
    for (int64_t p = 0; p < num_parts; ++p) {
      const float* part = parts + (p * rows + r) * kStride;
      const float factor = std::exp((part[kDim] - top) * scale);
      sum += part[kDim + 1] * factor;
      const __m512 factor16 = _mm512_set1_ps(factor);
      for (int64_t c = 0; c < kChunks; ++c) {
        acc[c] = _mm512_fmadd_ps(_mm512_loadu_ps(part + 16 * c), factor16, acc[c]);
      }
    }
    const int64_t token = r / group, head = kv_head * group + r % group;
    uint16_t* dst = reinterpret_cast<uint16_t*>(out + (tile_begin + token) * row_stride +
                                                head * kDim);
    const __m512 inv = _mm512_set1_ps(1.f / sum);
    for (int64_t c = 0; c < kChunks; ++c) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * c),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[c], inv)));
    }
  }
}

}  // namespace

#include "paged_prefill_amx.h"

namespace {

// One work item of the bf16 tiles: a (tile, kv head)'s keys, all of them or one part.
struct TilePart {
  int64_t item, kv_head;
  int64_t chunk_begin, chunk_end;  // the key chunks attended (a part's)
  int64_t size;                    // query tokens x keys, for the work queue
  int64_t offset;                  // its rows' floats in the parts buffer; -1: a whole tile
};

// A (tile, kv head) attended in parts, merged once every part has run.
struct SplitTile {
  int64_t item, kv_head, offset, num_parts, rows;
};

// The work items of a batch. When its (tile, kv head) items are fewer than twice the threads (a
// few new tokens over a long prefix: a prefix hit's last block, a short later turn), each one's
// keys are split on key-chunk boundaries into parts that run as items of their own, up to two
// per thread: three items on two threads left one idle for a third of the call. Only the keys
// before the tile's first query are split (every row attends all of them), so only without a
// window; not for the AMX tiles, which attend whole tiles.
struct TileParts {
  std::vector<TilePart> parts;
  std::vector<SplitTile> split;
  int64_t part_floats = 0;

  TileParts(const Batch& b, const Shape& s, bool may_split, int64_t floats_per_row) {
    const int64_t num_items = static_cast<int64_t>(b.items.size()) * s.num_kv_heads;
    const int64_t want = 2 * at::get_num_threads();
    const bool split_all = may_split && b.window == 0 && num_items < want;
    const int64_t group = s.num_heads / s.num_kv_heads;
    for (size_t i = 0; i < b.items.size(); ++i) {
      const auto [tokens, first_pos, keys] = tile_span(b, b.items[i]);
      const int64_t prefix_chunks = split_all ? first_pos / kKeyChunk : 0;
      const int64_t num_parts = std::min(prefix_chunks, (want + num_items - 1) / num_items);
      for (int64_t h = 0; h < s.num_kv_heads; ++h) {
        if (num_parts < 2) {
          parts.push_back({static_cast<int64_t>(i), h, 0, 0, tokens * keys, -1});
          continue;
        }
        const int64_t rows = tokens * group, all_chunks = (keys + kKeyChunk - 1) / kKeyChunk;
        split.push_back({static_cast<int64_t>(i), h, part_floats, num_parts, rows});
        for (int64_t p = 0; p < num_parts; ++p) {
          const int64_t begin = p * prefix_chunks / num_parts;
          const int64_t end =
              p + 1 == num_parts ? all_chunks : (p + 1) * prefix_chunks / num_parts;
          const int64_t part_keys = std::min(keys, end * kKeyChunk) - begin * kKeyChunk;
          parts.push_back({static_cast<int64_t>(i), h, begin, end, tokens * part_keys,
                           part_floats});
          part_floats += rows * floats_per_row;
        }
      }
    }
  }

  std::vector<int64_t> sizes() const {
    std::vector<int64_t> out(parts.size());
    for (size_t n = 0; n < parts.size(); ++n) out[n] = parts[n].size;
    return out;
  }
};

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
    const int64_t first_key = first_attended(b.computed[seq], b.window);
    const int64_t end_pos = b.computed[seq] + b.lens[seq];
    const int64_t first_page = first_key / 16;
    const int64_t num_pages = b.lens[seq] > 0 ? (end_pos + 15) / 16 - first_page : 0;
    seqs[seq] = {first_page, num_pages, num_pages + 1, words};
    words += 2 * (num_pages + 1) * kPageWords * s.num_kv_heads;
    for (int64_t h = 0; h < s.num_kv_heads; ++h) {
      for (int64_t page = 0; page < num_pages; page += kPagesPerTask) tasks.push_back({seq, h, page});
    }
  }
  // Not zeroed here: each page run's task writes all of its pages, and the last one the zero page
  // after them (zero-filling the whole buffer first cost ~0.3 ms a layer for an 8k context).
  std::unique_ptr<uint32_t[]> packed(new uint32_t[words]);
  // A (sequence, kv head)'s K pages, then its V pages.
  auto k_words = [&](int64_t seq, int64_t h) {
    return packed.get() + seqs[seq].offset + 2 * h * seqs[seq].stride * kPageWords;
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
      if (page_end == p.num_pages) {
        std::fill_n(k + (page_end - page) * kPageWords, kPageWords, 0u);
        std::fill_n(k + (p.stride + page_end - page) * kPageWords, kPageWords, 0u);
      }
    }
  });
  auto attend = attend_tile_bf16<kDim>;
  bool amx = false;
#if defined(KVTIER_HAS_AMX)
  amx = use_amx();
  if (amx) attend = attend_tile_amx<kDim>;
#endif
  TileParts plan(b, s, /*may_split=*/!amx, kPartFloatsPerRow<kDim>);
  std::vector<float> partials(plan.part_floats);
  WorkQueue(plan.sizes()).run([&](const auto& next) {
    std::vector<float> scratch;
#if defined(KVTIER_HAS_AMX)
    if (amx) load_amx_config();
#endif
    for (int64_t n; (n = next()) >= 0;) {
      const TilePart& part = plan.parts[n];
      const Item& item = b.items[part.item];
      const int64_t seq = item.seq, h = part.kv_head;
      const int64_t row0 = b.starts[seq] * s.num_heads * kDim;
      const int64_t tile_end = std::min(b.lens[seq], item.first_query + kTileTokens);
      if (part.offset < 0) {
        attend(q + row0, pages_of(seq, h), b.computed[seq], item.first_query, tile_end, h,
               b.window, s, b.scale, out + row0, scratch);
      } else {
        attend_keys_bf16<kDim>(q + row0, pages_of(seq, h), b.computed[seq], item.first_query,
                               tile_end, h, b.window, s, b.scale, out + row0, scratch,
                               part.chunk_begin, part.chunk_end, partials.data() + part.offset);
      }
    }
#if defined(KVTIER_HAS_AMX)
    if (amx) _tile_release();
#endif
  });
  const int64_t num_split = static_cast<int64_t>(plan.split.size());
  at::parallel_for(0, num_split, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const SplitTile& tile = plan.split[n];
      const Item& item = b.items[tile.item];
      merge_parts_bf16<kDim>(partials.data() + tile.offset, tile.num_parts, tile.rows,
                             s.num_heads / s.num_kv_heads, tile.kv_head, item.first_query,
                             s.num_heads * kDim, b.scale,
                             out + b.starts[item.seq] * s.num_heads * kDim);
    }
  });
}

}  // namespace

#endif  // __AVX512BF16__
