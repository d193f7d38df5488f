// Fused elementwise ops of the Llama decoder for CPU: each reads its input once instead of once
// per torch op. Every intermediate is rounded to the tensor's dtype exactly where the unfused
// torch code rounds it, so results equal the torch path (kvtier/models/fused_ops.py) up to the
// order of one fp32 sum.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Conversions the compiler can vectorize. c10::BFloat16's own are branchy (NaN checks); these
// are its round-to-nearest-even on the bits (inputs are finite).
template <typename scalar_t>
inline float to_float(scalar_t x) {
  return static_cast<float>(x);
}

template <typename scalar_t>
inline scalar_t from_float(float x) {
  return static_cast<scalar_t>(x);
}

template <>
inline float to_float<c10::BFloat16>(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return c10::BFloat16(static_cast<uint16_t>(bits >> 16), c10::BFloat16::from_bits());
}

// A float rounded to the storage dtype and back: one rounding step of the torch path.
template <typename scalar_t>
inline float round_to(float x) {
  return to_float(from_float<scalar_t>(x));
}

template <typename scalar_t>
void rms_norm_rows(const scalar_t* in, const scalar_t* w, scalar_t* out, int64_t rows,
                   int64_t width, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* row = in + r * width;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < width; ++i) {
        const float v = to_float(row[i]);
        squares += v * v;
      }
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(width) + eps);
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        const float normed = round_to<scalar_t>(to_float(row[i]) * inv);
        out[r * width + i] = from_float<scalar_t>(to_float(w[i]) * normed);
      }
    }
  });
}

template <typename scalar_t>
void silu_and_mul_rows(const scalar_t* in, scalar_t* out, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* gate = in + r * 2 * width;
      const scalar_t* up = gate + width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        const float g = to_float(gate[i]);
        const float act = round_to<scalar_t>(g / (1.f + expf(-g)));
        out[r * width + i] = from_float<scalar_t>(act * to_float(up[i]));
      }
    }
  });
}

// Token t's heads start at in + t * token_stride (a row of the fused qkv projection's output:
// q and k are strided views of it), each head's D values contiguous; out is contiguous.
template <typename scalar_t>
void rotary_rows(const scalar_t* in, int64_t token_stride, const scalar_t* cos,
                 const scalar_t* sin, scalar_t* out, int64_t tokens, int64_t heads,
                 int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* c = cos + t * dim;
      const scalar_t* s = sin + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const scalar_t* v = in + t * token_stride + h * dim;
        scalar_t* res = out + (t * heads + h) * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) {
          const float rot = i < half ? -to_float(v[i + half])
                                     : to_float(v[i - half]);
          const float a = round_to<scalar_t>(to_float(v[i]) * to_float(c[i]));
          const float b = round_to<scalar_t>(rot * to_float(s[i]));
          res[i] = from_float<scalar_t>(a + b);
        }
      }
    }
  });
}

void check_contiguous(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.is_contiguous() && x.dim() >= 1, name, " must be contiguous");
}

// weight * rms_norm(x) over the last dim: normalised in fp32 and rounded, then scaled.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_contiguous(x, "x");
  check_contiguous(weight, "weight");
  const int64_t width = x.size(-1);
  TORCH_CHECK(weight.numel() == width && weight.scalar_type() == x.scalar_type(),
              "weight must match the last dim and dtype of x");
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                  x.numel() / width, width, static_cast<float>(eps));
  });
  return out;
}

// x (..., 2n) = [gate | up] -> silu(gate) * up (..., n), silu rounded before the product.
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_contiguous(x, "x");
  const int64_t width = x.size(-1) / 2;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = width;
  at::Tensor out = at::empty(shape, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul",
                                  [&] {
    silu_and_mul_rows(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                      x.numel() / x.size(-1), width);
  });
  return out;
}

// Rotate-half rotary embedding: x * cos + cat(-x2, x1) * sin, each product rounded.
// x (T, heads, D) with its heads' values contiguous (any stride between tokens: a strided view
// is read in place, not copied first); cos, sin: T * D values. The result is contiguous.
at::Tensor rotary(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin) {
  check_contiguous(cos, "cos");
  check_contiguous(sin, "sin");
  TORCH_CHECK(x_in.dim() == 3 && cos.numel() == x_in.size(0) * x_in.size(2) &&
                  sin.numel() == cos.numel() && cos.scalar_type() == x_in.scalar_type() &&
                  sin.scalar_type() == x_in.scalar_type(),
              "rotary expects x (T, heads, D) and cos, sin of T x D values in x's dtype");
  const bool rows_in_place = x_in.stride(2) == 1 && x_in.stride(1) == x_in.size(2) &&
                             x_in.stride(0) >= x_in.size(1) * x_in.size(2);
  const at::Tensor x = rows_in_place ? x_in : x_in.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    rotary_rows(x.data_ptr<scalar_t>(), x.stride(0), cos.data_ptr<scalar_t>(),
                sin.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0), x.size(1),
                x.size(2));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvtier, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvtier, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary", &rotary);
}
