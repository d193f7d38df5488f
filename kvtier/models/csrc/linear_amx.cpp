// A bf16 linear layer (y = x W^T + b) as AMX tile multiplies, over a weight packed once into
// the tiles' B layout (kvtier/models/packed_linear.py packs it): for each block of 16 output
// columns, its K/32 tiles one after another, each 16 rows of input pairs by 16 columns by 2
// (the pair), so a thread streams its columns' weights from memory in order.
//
// Why not oneDNN's packed linear, which also runs on AMX here: a decode step's few rows make a
// linear layer a stream of its weights, and oneDNN's reads them at 8-11 GB/s on the 2-core
// Sapphire Rapids VM against 14-15 GB/s here (all of SmolLM2-135M's projections from memory:
// 64 rows 28.0 -> 20.8 ms, 16 rows 22.0 -> 13.9 ms); at prefill sizes it is no faster either
// (1,024 rows 180 -> 160 ms). Products are exact and summed in fp32 over K in order, rounded to
// bf16 once (oneDNN's results for up to 16 rows, bit for bit).
//
// Each step multiplies up to 32 rows (two A tiles) by 32 columns (two B tiles) into four fp32
// accumulator tiles, so every tile loaded feeds two multiplies. Rows are padded to 16.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "amx_tiles.h"

namespace {

constexpr int64_t kTileBytes = 1024;  // 16 rows of 64 bytes
constexpr int64_t kRows = 16, kCols = 16, kDepth = 32;
// Column pairs whose weights a core keeps while every 32 rows pass: 16 pairs of a 576-wide
// layer are 576 KB (L2), of a 1,536-wide one 1.5 MB (8 and 32 measured slower at 2,048 rows).
constexpr int64_t kGroupPairs = 16;

#if defined(KVTIER_HAS_AMX) && defined(__AVX512BF16__)
#define KVTIER_HAS_AMX_LINEAR 1

struct Problem {
  const c10::BFloat16* x;  // (padded rows, K)
  const char* weight;      // packed
  const float* bias;       // (N,) or null
  c10::BFloat16* y;        // (rows, N)
  int64_t rows, k, n;
};

// Accumulator tile (t, c) of row tile t and column block c is tile register 2t + c; A tiles are
// registers 4 and 5, B tiles 6 and 7. kRowTiles, kColBlocks: 1 or 2 each.
template <int kRowTiles, int kColBlocks>
void multiply(const Problem& p, int64_t row0, int64_t block0, float* acc) {
  const int64_t depth_tiles = p.k / kDepth;
  const char* w0 = p.weight + block0 * depth_tiles * kTileBytes;
  const char* w1 = w0 + depth_tiles * kTileBytes;
  const c10::BFloat16* x0 = p.x + row0 * p.k;
  const c10::BFloat16* x1 = x0 + kRows * p.k;
  const int64_t stride = p.k * static_cast<int64_t>(sizeof(c10::BFloat16));
  _tile_zero(0);
  if (kColBlocks > 1) _tile_zero(1);
  if (kRowTiles > 1) _tile_zero(2);
  if (kRowTiles > 1 && kColBlocks > 1) _tile_zero(3);
  for (int64_t d = 0; d < depth_tiles; ++d) {
    _tile_loadd(6, w0 + d * kTileBytes, 64);
    if (kColBlocks > 1) _tile_loadd(7, w1 + d * kTileBytes, 64);
    _tile_loadd(4, x0 + d * kDepth, stride);
    if (kRowTiles > 1) _tile_loadd(5, x1 + d * kDepth, stride);
    _tile_dpbf16ps(0, 4, 6);
    if (kColBlocks > 1) _tile_dpbf16ps(1, 4, 7);
    if (kRowTiles > 1) _tile_dpbf16ps(2, 5, 6);
    if (kRowTiles > 1 && kColBlocks > 1) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, acc, 64);
  if (kColBlocks > 1) _tile_stored(1, acc + kRows * kCols, 64);
  if (kRowTiles > 1) _tile_stored(2, acc + 2 * kRows * kCols, 64);
  if (kRowTiles > 1 && kColBlocks > 1) _tile_stored(3, acc + 3 * kRows * kCols, 64);
}

// The accumulators of rows [row0, row0 + 32) and column blocks block0.. into y, bias added,
// rounded to bf16 (to nearest even).
void write_out(const Problem& p, int64_t row0, int64_t block0, int col_blocks,
               const float* acc) {
  const int64_t rows = std::min<int64_t>(2 * kRows, p.rows - row0);
  for (int c = 0; c < col_blocks; ++c) {
    const int64_t col = (block0 + c) * kCols;
    const __m512 bias = p.bias ? _mm512_loadu_ps(p.bias + col) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      const float* tile = acc + ((r / kRows) * 2 + c) * kRows * kCols;
      const __m512 sum = _mm512_add_ps(_mm512_load_ps(tile + (r % kRows) * kCols), bias);
      const __m256bh out = _mm512_cvtneps_pbh(sum);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.y + (row0 + r) * p.n + col),
                          reinterpret_cast<const __m256i&>(out));
    }
  }
}

// Column blocks [2 * pair0, 2 * pair1) (the last one alone when N has an odd number), all rows:
// kGroupPairs pairs at a time (their weights stay in the core's cache) for each 32 rows (which
// stay in L1 across the group).
void run_pairs(const Problem& p, int64_t pair0, int64_t pair1) {
  load_amx_config();
  alignas(64) float acc[4 * kRows * kCols];
  const int64_t blocks = p.n / kCols;
  for (int64_t group = pair0; group < pair1; group += kGroupPairs) {
    const int64_t group_end = std::min(pair1, group + kGroupPairs);
    for (int64_t row0 = 0; row0 < p.rows; row0 += 2 * kRows) {
      const bool tall = p.rows - row0 > kRows;
      for (int64_t pair = group; pair < group_end; ++pair) {
        const int64_t block0 = 2 * pair;
        const bool two = block0 + 1 < blocks;
        if (tall && two) multiply<2, 2>(p, row0, block0, acc);
        else if (tall) multiply<2, 1>(p, row0, block0, acc);
        else if (two) multiply<1, 2>(p, row0, block0, acc);
        else multiply<1, 1>(p, row0, block0, acc);
        write_out(p, row0, block0, two ? 2 : 1, acc);
      }
    }
  }
  _tile_release();
}

#endif  // KVTIER_HAS_AMX && __AVX512BF16__

bool amx_linear_supported() {
#if defined(KVTIER_HAS_AMX_LINEAR)
  return amx_permitted();
#else
  return false;
#endif
}

// x (M, K) bf16; packed (N / 16, K / 32, 16, 16, 2) bf16; bias (N,) or None -> (M, N) bf16.
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_linear_supported(), "amx_linear: this CPU (or build) has no AMX bf16 tiles");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "amx_linear: x must be 2-D bf16");
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous() && packed.size(2) == kRows && packed.size(3) == kCols &&
                  packed.size(4) == 2,
              "amx_linear: packed must be a contiguous (N/16, K/32, 16, 16, 2) bf16 tensor");
  const int64_t rows = x.size(0), k = x.size(1), n = packed.size(0) * kCols;
  TORCH_CHECK(packed.size(1) * kDepth == k, "amx_linear: x has ", k, " columns, the weight ",
              packed.size(1) * kDepth);
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0) return y;
#if defined(KVTIER_HAS_AMX_LINEAR)
  const int64_t padded = (rows + kRows - 1) / kRows * kRows;
  at::Tensor input = x.contiguous();
  if (padded != rows) {  // tiles read 16 rows: the missing ones are zeros
    input = at::zeros({padded, k}, x.options());
    input.narrow(0, 0, rows).copy_(x);
  }
  at::Tensor bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "amx_linear: bias has ", bias->numel(), " values, not ", n);
    bias32 = bias->to(at::kFloat).contiguous();
  }
  const Problem p{input.data_ptr<c10::BFloat16>(), static_cast<const char*>(packed.data_ptr()),
                  bias32.defined() ? bias32.data_ptr<float>() : nullptr,
                  y.data_ptr<c10::BFloat16>(), rows, k, n};
  const int64_t pairs = (n / kCols + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) { run_pairs(p, begin, end); });
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvtier, m) {
  m.def("amx_linear_supported() -> bool", &amx_linear_supported);
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvtier, CPU, m) { m.impl("amx_linear", &amx_linear); }
