// Host pages -> paged KV cache blocks, every (block, layer) page of a load in one call on all of
// the caller's threads. The offload connector's numpy path copies one run of blocks per layer
// and call: a load into scattered device blocks (an 8k-token host hit: 511 blocks x 30 layers)
// paid ~1.3 us of call overhead per 12 KB page, on one thread.
//
// Host block (the standard layout, kvtier.offload.layout): num_layers pages, each its parts in
// order (K then V), each part contiguous. Cache of a layer: (parts, num_blocks, ...) contiguous,
// so a block's part is one contiguous row of the same bytes.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// memcpy whose stores bypass the caches where AVX-512 can stream whole aligned lines: a load is
// far larger than the caches and its pages are read back only by the next forward, so a normal
// store's read of each target line before writing it is wasted traffic.
void copy_streaming(uint8_t* target, const uint8_t* source, int64_t bytes) {
#if defined(__AVX512F__)
  if (reinterpret_cast<uintptr_t>(target) % 64 == 0 && bytes % 64 == 0) {
    for (int64_t b = 0; b < bytes; b += 64) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(target + b),
                          _mm512_loadu_si512(source + b));
    }
    return;
  }
#endif
  std::memcpy(target, source, bytes);
}

void load_pages(const at::Tensor& host, const at::Tensor& host_offsets,
                const at::Tensor& block_ids, at::TensorList caches) {
  TORCH_CHECK(host.device().is_cpu() && host.scalar_type() == at::kByte && host.dim() == 1 &&
                  host.is_contiguous(),
              "load_pages: host must be a contiguous 1-D uint8 CPU tensor");
  TORCH_CHECK(host_offsets.scalar_type() == at::kLong && block_ids.scalar_type() == at::kLong &&
                  host_offsets.dim() == 1 && block_ids.dim() == 1 &&
                  host_offsets.is_contiguous() && block_ids.is_contiguous() &&
                  host_offsets.numel() == block_ids.numel(),
              "load_pages: host_offsets and block_ids must be contiguous int64 vectors of one "
              "length");
  const int64_t num_layers = static_cast<int64_t>(caches.size());
  const int64_t n = block_ids.numel();
  if (n == 0 || num_layers == 0) {
    return;
  }
  const at::Tensor& first = caches[0];
  TORCH_CHECK(first.dim() >= 2, "load_pages: a cache is (parts, num_blocks, ...)");
  const int64_t parts = first.size(0);
  const int64_t num_blocks = first.size(1);
  const int64_t part_bytes = first.stride(1) * first.element_size();
  std::vector<uint8_t*> layers(num_layers);
  for (int64_t l = 0; l < num_layers; ++l) {
    const at::Tensor& cache = caches[l];
    TORCH_CHECK(cache.device().is_cpu() && cache.is_contiguous() &&
                    cache.sizes() == first.sizes() && cache.dtype() == first.dtype(),
                "load_pages: every cache must be contiguous, on the CPU, of one shape and dtype");
    layers[l] = static_cast<uint8_t*>(cache.data_ptr());
  }
  const int64_t page_bytes = parts * part_bytes;
  const int64_t block_bytes = num_layers * page_bytes;
  const int64_t* offsets = host_offsets.data_ptr<int64_t>();
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < num_blocks, "load_pages: block id ", ids[i],
                " outside the cache's ", num_blocks, " blocks");
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] + block_bytes <= host.numel(),
                "load_pages: host offset ", offsets[i], " leaves no room for a block of ",
                block_bytes, " bytes");
  }
  const uint8_t* source = host.data_ptr<uint8_t>();
  // One (block, layer) page a unit: 12 KB for SmolLM2, enough work to hand out in small grains.
  at::parallel_for(0, n * num_layers, 16, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t i = unit / num_layers, layer = unit % num_layers;
      const uint8_t* page = source + offsets[i] + layer * page_bytes;
      uint8_t* target = layers[layer] + ids[i] * part_bytes;
      for (int64_t p = 0; p < parts; ++p) {
        copy_streaming(target + p * num_blocks * part_bytes, page + p * part_bytes, part_bytes);
      }
    }
#if defined(__AVX512F__)
    _mm_sfence();  // the streamed stores are visible before the forward reads them
#endif
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvtier, m) {
  m.def("load_pages(Tensor host, Tensor host_offsets, Tensor block_ids, Tensor(a!)[] caches) -> ()");
}

TORCH_LIBRARY_IMPL(kvtier, CPU, m) {
  m.impl("load_pages", &load_pages);
}
