// Paged decode attention as AMX tile multiplies (tdpbf16ps: a 16 x 16 fp32 tile += 16 x 32 bf16
// by 32 x 16 bf16, exact products summed in fp32) for bf16 caches of 16-slot blocks, head dim 64
// or 128, up to 8 query heads a kv head. Both products read the cache's rows where they lie.
// Included by paged_decode.cpp only, after Shape, prefetch and kPrefetchPages.
//
// Scores: A is a page's 16 slots of one kv head by 32 dims (rows at the cache's slot stride); B
// the queries as 16 dim pairs by 16 columns, one per query head of a block of kv heads, zero in
// the columns of the block's other kv heads, so a block's kv heads add into one 16 keys x 16
// heads tile. The softmax takes each head's peak over that key-major layout (a head a lane), then
// transposes each page's scores to a head a row for the exp, and writes the weights as the
// values' head-major A.
// Values: the products sum over keys, and a B row must hold two keys per 32-bit word; the cache
// pairs two dims of one key instead. So B is the V rows as they lie (16 keys by 16 dim pairs)
// and A pairs each key's weight with a zero: row 2j carries head j's weight in the low half of
// each word (so its product takes the even dims), row 2j + 1 in the high half (the odd dims).
// Half the multiplies are by zero, and the tiles still leave the cache's bandwidth the limit.
// Weights are bf16 and unnormalized (exp(score - max)); each head's output is divided by their
// sum, as in the prefill tiles.

#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <vector>

#include "amx_tiles.h"

#if defined(KVTIER_HAS_AMX)

namespace {

// Heads a kv head may have: its weights are 2 rows a head of one A tile.
constexpr int64_t kAmxMaxGroup = 8;
// V pages summed into the output tiles between their loads and stores.
constexpr int64_t kAmxPageChunk = 8;

bool amx_decode_fits(const Shape& s) {
  return s.block_size == 16 && (s.head_dim == 64 || s.head_dim == 128) &&
         s.num_heads / s.num_kv_heads <= kAmxMaxGroup;
}

// r[i] row i of a 16 x 16 fp32 matrix -> r[i] column i.
inline void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 16; i += 2) {  // t[i] / t[i + 1]: rows i, i + 1 interleaved, low / high
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + m], 128-bit lane k: rows i..i+3 of column 4k + m
    u[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 16; i += 8) {  // then whole 128-bit lanes across rows
    for (int m = 0; m < 4; ++m) {
      t[i + m] = _mm512_shuffle_f32x4(u[i + m], u[i + 4 + m], 0x88);
      t[i + 4 + m] = _mm512_shuffle_f32x4(u[i + m], u[i + 4 + m], 0xDD);
    }
  }
  for (int m = 0; m < 8; ++m) {
    r[m] = _mm512_shuffle_f32x4(t[m], t[m + 8], 0x88);
    r[m + 8] = _mm512_shuffle_f32x4(t[m], t[m + 8], 0xDD);
  }
}

// One sequence's decode attention, in phases over its scratch: the queries' tiles, the scores,
// the softmax weights, the weighted values, the output.
template <int64_t kDim>
class AmxDecode {
 public:
  static constexpr int64_t kBlock = 16, kChunks = kDim / 32;  // a chunk: 32 dims, a tile wide

  AmxDecode(const c10::BFloat16* cache, const int64_t* table, int64_t first, int64_t last,
            const Shape& s, std::vector<float>& scratch)
      : cache_(cache), s_(s), heads_(s.num_heads), kv_heads_(s.num_kv_heads),
        group_(heads_ / kv_heads_), kv_per_block_(16 / group_),
        blocks_((kv_heads_ + kv_per_block_ - 1) / kv_per_block_),
        page_len_(kBlock * kv_heads_ * kDim), row_bytes_(kv_heads_ * kDim * 2),
        table_(table + first / kBlock), num_pages_((last + kBlock - 1) / kBlock - first / kBlock),
        keys_(num_pages_ * kBlock), begin_(first % kBlock), end_(last - first / kBlock * kBlock),
        a_rows_(2 * group_), a_tile_(a_rows_ * 16) {
    scratch.resize(kv_heads_ * kChunks * 256 + blocks_ * keys_ * 16 +
                   kv_heads_ * num_pages_ * a_tile_ + kv_heads_ * kChunks * a_tile_ +
                   blocks_ * 16);
    q_tiles_ = reinterpret_cast<uint32_t*>(scratch.data());  // kv head, chunk: 16 x 16
    scores_ = scratch.data() + kv_heads_ * kChunks * 256;     // block, key, 16 heads
    weights_ = reinterpret_cast<uint32_t*>(scores_ + blocks_ * keys_ * 16);  // kv head, page
    acc_ = reinterpret_cast<float*>(weights_ + kv_heads_ * num_pages_ * a_tile_);  // kv, chunk
    sums_ = acc_ + kv_heads_ * kChunks * a_tile_;  // block, 16 heads
  }

  // The queries' B tiles: row r, column c of (kv head g, chunk k) is the dim pair 16k + r of
  // the block's query head c when that head is one of g's, else zero.
  void query_tiles(const c10::BFloat16* query) {
    const uint32_t* q_words = reinterpret_cast<const uint32_t*>(query);
    std::fill(q_tiles_, q_tiles_ + kv_heads_ * kChunks * 256, 0u);
    for (int64_t h = 0; h < heads_; ++h) {
      const int64_t g = h / group_, column = h - block_head0(g / kv_per_block_);
      for (int64_t k = 0; k < kChunks; ++k) {
        for (int64_t r = 0; r < 16; ++r) {
          q_tiles_[(g * kChunks + k) * 256 + r * 16 + column] = q_words[h * kDim / 2 + 16 * k + r];
        }
      }
    }
  }

  // Scores, two pages at a time: tiles 0 and 4 their scores, 1 and 3 their keys, 2 queries.
  void score_pages() {
    kvtier::load_amx_config();
    for (int64_t page = 0; page < num_pages_; page += 2) {
      const int64_t ahead_end = std::min(num_pages_, page + kPrefetchPages + 2);
      for (int64_t ahead = page + kPrefetchPages; ahead < ahead_end; ++ahead) {
        prefetch(page_rows(ahead, 0), page_len_ * 2);
      }
      const bool pair = page + 1 < num_pages_;  // else the second tile repeats the last page
      const c10::BFloat16* rows0 = page_rows(page, 0);
      const c10::BFloat16* rows1 = pair ? page_rows(page + 1, 0) : rows0;
      for (int64_t b = 0; b < blocks_; ++b) {
        _tile_zero(0);
        _tile_zero(4);
        for (int64_t g = b * kv_per_block_; g < std::min(kv_heads_, (b + 1) * kv_per_block_);
             ++g) {
          for (int64_t k = 0; k < kChunks; ++k) {
            const int64_t offset = g * kDim + 32 * k;
            _tile_loadd(2, q_tiles_ + (g * kChunks + k) * 256, 64);
            _tile_loadd(1, rows0 + offset, row_bytes_);
            _tile_loadd(3, rows1 + offset, row_bytes_);
            _tile_dpbf16ps(0, 1, 2);
            _tile_dpbf16ps(4, 3, 2);
          }
        }
        _tile_stored(0, scores_ + (b * keys_ + page * kBlock) * 16, 64);
        if (pair) _tile_stored(4, scores_ + (b * keys_ + (page + 1) * kBlock) * 16, 64);
      }
    }
  }

  // Softmax over keys [begin, end): each page's scores transposed to a head a row, their
  // weights written into the value A tiles of the heads' kv heads.
  void softmax(float scale) {
    const __m512 scale16 = _mm512_set1_ps(scale);
    for (int64_t b = 0; b < blocks_; ++b) {
      const float* block_scores = scores_ + b * keys_ * 16;
      const int64_t head0 = block_head0(b);
      const int64_t block_heads = std::min(heads_ - head0, kv_per_block_ * group_);
      __m512 peak16 = _mm512_set1_ps(-INFINITY);
      for (int64_t key = begin_; key < end_; ++key) {
        peak16 = _mm512_max_ps(peak16, _mm512_loadu_ps(block_scores + key * 16));
      }
      float peak[16], sum[16] = {};
      _mm512_storeu_ps(peak, peak16);
      for (int64_t page = 0; page < num_pages_; ++page) {
        __m512 x[16];
        for (int64_t t = 0; t < kBlock; ++t) {
          x[t] = _mm512_loadu_ps(block_scores + (page * kBlock + t) * 16);
        }
        transpose16(x);
        const __mmask16 live = kvtier::span_mask(page * kBlock, begin_, end_);
        for (int64_t j = 0; j < block_heads; ++j) {
          const __m512 shifted = _mm512_mul_ps(_mm512_sub_ps(x[j], _mm512_set1_ps(peak[j])),
                                               scale16);
          const __m512 e = _mm512_maskz_mov_ps(live, kvtier::exp16(shifted));
          sum[j] += _mm512_reduce_add_ps(e);
          const int64_t h = head0 + j, g = h / group_;
          const __m512i w = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e));
          uint32_t* dst = weights_ + (g * num_pages_ + page) * a_tile_ + 2 * (h - g * group_) * 16;
          _mm512_storeu_si512(dst, w);
          _mm512_storeu_si512(dst + 16, _mm512_slli_epi32(w, 16));
        }
      }
      std::copy(sum, sum + 16, sums_ + b * 16);
    }
  }

  // Values: tile 3 a kv head's weights on a page, 1 and 2 its V rows, 4.. its output chunks,
  // kept in the tiles over kAmxPageChunk pages at a time.
  void sum_values() {
    const uint8_t w = static_cast<uint8_t>(a_rows_);
    kvtier::load_amx_config({16, 16, 16, w, w, w, w, w});
    for (int64_t chunk = 0; chunk < num_pages_; chunk += kAmxPageChunk) {
      const int64_t chunk_end = std::min(num_pages_, chunk + kAmxPageChunk);
      for (int64_t g = 0; g < kv_heads_; ++g) {
        float* a = acc_ + g * kChunks * a_tile_;
        if (chunk == 0) {
          zero_outputs();
        } else {
          load_outputs(a);
        }
        for (int64_t page = chunk; page < chunk_end; ++page) {
          if (g == 0 && page + kPrefetchPages < num_pages_) {
            prefetch(page_rows(page + kPrefetchPages, s_.v_offset), page_len_ * 2);
          }
          const c10::BFloat16* rows = page_rows(page, s_.v_offset) + g * kDim;
          _tile_loadd(3, weights_ + (g * num_pages_ + page) * a_tile_, 64);
          _tile_loadd(1, rows, row_bytes_);
          _tile_loadd(2, rows + 32, row_bytes_);
          _tile_dpbf16ps(4, 3, 1);
          _tile_dpbf16ps(5, 3, 2);
          if constexpr (kChunks == 4) {
            _tile_loadd(1, rows + 64, row_bytes_);
            _tile_loadd(2, rows + 96, row_bytes_);
            _tile_dpbf16ps(6, 3, 1);
            _tile_dpbf16ps(7, 3, 2);
          }
        }
        store_outputs(a);
      }
    }
    _tile_release();
  }

  // Output chunk k of kv head g: row 2j (2j + 1), column n is head g * group + j's dim
  // 32k + 2n (+ 1); each head divided by its weights' sum.
  void write(c10::BFloat16* out) const {
    uint16_t* dst = reinterpret_cast<uint16_t*>(out);
    for (int64_t h = 0; h < heads_; ++h) {
      const int64_t g = h / group_, j = h - g * group_, b = g / kv_per_block_;
      const __m512 inv = _mm512_set1_ps(1.f / sums_[b * 16 + h - block_head0(b)]);
      for (int64_t k = 0; k < kChunks; ++k) {
        const float* rows = acc_ + (g * kChunks + k) * a_tile_ + 2 * j * 16;
        const __m512 even = _mm512_mul_ps(_mm512_loadu_ps(rows), inv);
        const __m512 odd = _mm512_mul_ps(_mm512_loadu_ps(rows + 16), inv);
        // Word n: dim 2n in the low half, 2n + 1 in the high half.
        const __m512i words = _mm512_or_si512(
            _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(even)),
            _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(odd)), 16));
        _mm512_storeu_si512(dst + h * kDim + 32 * k, words);
      }
    }
  }

 private:
  int64_t block_head0(int64_t b) const { return b * kv_per_block_ * group_; }

  const c10::BFloat16* page_rows(int64_t page, int64_t offset) const {
    return cache_ + table_[page] * page_len_ + offset;
  }

  void zero_outputs() {
    _tile_zero(4);
    _tile_zero(5);
    if constexpr (kChunks == 4) {
      _tile_zero(6);
      _tile_zero(7);
    }
  }

  void load_outputs(const float* a) {
    _tile_loadd(4, a, 64);
    _tile_loadd(5, a + a_tile_, 64);
    if constexpr (kChunks == 4) {
      _tile_loadd(6, a + 2 * a_tile_, 64);
      _tile_loadd(7, a + 3 * a_tile_, 64);
    }
  }

  void store_outputs(float* a) {
    _tile_stored(4, a, 64);
    _tile_stored(5, a + a_tile_, 64);
    if constexpr (kChunks == 4) {
      _tile_stored(6, a + 2 * a_tile_, 64);
      _tile_stored(7, a + 3 * a_tile_, 64);
    }
  }

  const c10::BFloat16* cache_;
  const Shape& s_;
  const int64_t heads_, kv_heads_, group_, kv_per_block_, blocks_, page_len_, row_bytes_;
  const int64_t* table_;  // from the sequence's first attended page
  const int64_t num_pages_, keys_, begin_, end_;  // keys [begin, end) of the pages' slots
  const int64_t a_rows_, a_tile_;  // a kv head's weights on one page: 2 rows a query head
  uint32_t* q_tiles_;
  float* scores_;
  uint32_t* weights_;
  float* acc_;
  float* sums_;
};

// attend_sequence_bf16's signature, for the bf16 cache only.
template <int64_t kDim>
void attend_sequence_amx(const c10::BFloat16* query, const c10::BFloat16* cache,
                         const int64_t* table, int64_t first, int64_t last, const Shape& s,
                         float scale, c10::BFloat16* out, std::vector<float>& scratch) {
  AmxDecode<kDim> decode(cache, table, first, last, s, scratch);
  decode.query_tiles(query);
  decode.score_pages();
  decode.softmax(scale);
  decode.sum_values();
  decode.write(out);
}

}  // namespace

#endif  // KVTIER_HAS_AMX
