// Pages of an fp8 KV cache gathered and converted to the model dtype in one pass: the prefill
// kernels read model-dtype pages, and torch's own fp8 conversion is scalar (2.7 ns an element
// measured: staging a 128-token chunk's 1,152 keys cost twice the chunk's attention).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "kv_fp8.h"

namespace {

template <typename fp8_t>
void convert_row(const fp8_t* src, at::Tensor& out, int64_t row, int64_t n,
                 std::vector<float>& scratch) {
  switch (out.scalar_type()) {
    case at::kBFloat16:
      kvtier::fp8_to_bf16(src, reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()) +
                                   row * n, n);
      break;
    case at::kFloat:
      kvtier::fp8_to_f32(src, out.data_ptr<float>() + row * n, n);
      break;
    default: {  // fp16
      scratch.resize(n);
      kvtier::fp8_to_f32(src, scratch.data(), n);
      c10::Half* dst = out.data_ptr<c10::Half>() + row * n;
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<c10::Half>(scratch[i]);
    }
  }
}

// pages (N, P) fp8, rows (n,) int64 -> (n, P) of `dtype` (bf16, fp32 or fp16): row i is page
// rows[i], converted.
at::Tensor gather_fp8_pages(const at::Tensor& pages, const at::Tensor& rows,
                            at::ScalarType dtype) {
  TORCH_CHECK(pages.dim() == 2 && pages.is_contiguous() && rows.dim() == 1 &&
                  rows.is_contiguous() && rows.scalar_type() == at::kLong,
              "pages must be (N, P) contiguous and rows (n,) int64");
  TORCH_CHECK(pages.scalar_type() == at::kFloat8_e4m3fn || pages.scalar_type() == at::kFloat8_e5m2,
              "pages must be float8_e4m3fn or float8_e5m2");
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat || dtype == at::kHalf,
              "dtype must be bfloat16, float32 or float16");
  const int64_t n = pages.size(1), count = rows.size(0), num_pages = pages.size(0);
  at::Tensor out = at::empty({count, n}, pages.options().dtype(dtype));
  const int64_t* ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < num_pages, "row ", ids[i], " is outside the pages");
  }
  const uint8_t* base = static_cast<const uint8_t*>(pages.data_ptr());
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* src = base + ids[i] * n;
      if (pages.scalar_type() == at::kFloat8_e4m3fn) {
        convert_row(reinterpret_cast<const c10::Float8_e4m3fn*>(src), out, i, n, scratch);
      } else {
        convert_row(reinterpret_cast<const c10::Float8_e5m2*>(src), out, i, n, scratch);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvtier, m) {
  m.def("gather_fp8_pages(Tensor pages, Tensor rows, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvtier, CPU, m) {
  m.impl("gather_fp8_pages", &gather_fp8_pages);
}
