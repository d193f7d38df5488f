// Reading an fp8 KV cache (--kv-cache-dtype fp8_e4m3 / fp8_e5m2): each stored byte's value as
// fp32, or as bf16 for the bf16 tiles. Both formats' values are exact in bf16 (at most 3
// mantissa bits, exponents within bf16's range), so the conversions lose nothing.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cstdint>
#include <type_traits>

#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace kvtier {

template <typename T>
constexpr bool is_fp8 = std::is_same_v<T, c10::Float8_e4m3fn> ||
                        std::is_same_v<T, c10::Float8_e5m2>;

// Every byte's value, built once per format from c10's own conversion.
template <typename fp8_t>
struct Fp8Values {
  float f32[256];
  uint16_t bf16[256];  // bf16 bits; entries 0-127 (sign clear) are the AVX512-BW table
  // Their high and low bytes (the AVX512-VBMI tables), and the byte order that makes two
  // in-lane unpacks of 64 converted bytes come out as 64 words in order: position 16L + k
  // holds byte 8L + k, position 16L + 8 + k byte 32 + 8L + k (lane L, k < 8).
  uint8_t bf16_high[128], bf16_low[128], unpack_order[64];

  Fp8Values() {
    for (int i = 0; i < 256; ++i) {
      f32[i] = static_cast<float>(fp8_t(static_cast<uint8_t>(i), fp8_t::from_bits()));
      bf16[i] = c10::BFloat16(f32[i]).x;
    }
    for (int i = 0; i < 128; ++i) {
      bf16_high[i] = static_cast<uint8_t>(bf16[i] >> 8);
      bf16_low[i] = static_cast<uint8_t>(bf16[i] & 0xFF);
    }
    for (int lane = 0; lane < 4; ++lane) {
      for (int k = 0; k < 8; ++k) {
        unpack_order[16 * lane + k] = static_cast<uint8_t>(8 * lane + k);
        unpack_order[16 * lane + 8 + k] = static_cast<uint8_t>(32 + 8 * lane + k);
      }
    }
  }

  static const Fp8Values& get() {
    static const Fp8Values values;
    return values;
  }
};

template <typename fp8_t>
inline void fp8_to_f32(const fp8_t* src, float* dst, int64_t n) {
  const float* values = Fp8Values<fp8_t>::get().f32;
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = values[bytes[i]];
}

// n values as bf16 bits. With AVX512-VBMI, 64 a step: each byte's high and low result bytes
// looked up (vpermi2b over 128-entry tables, which ignores the sign bit), the sign put back
// into the high byte, the bytes interleaved into words; on Intel's cores a quarter of the
// port-5 work of AVX512-BW's word tables (32 a step, below), whose cost made fp8 decode slower
// than bf16.
template <typename fp8_t>
inline void fp8_to_bf16(const fp8_t* src, uint16_t* dst, int64_t n) {
  const Fp8Values<fp8_t>& values = Fp8Values<fp8_t>::get();
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(src);
  int64_t i = 0;
#if defined(__AVX512VBMI__)
  const __m512i high0 = _mm512_loadu_si512(values.bf16_high);
  const __m512i high1 = _mm512_loadu_si512(values.bf16_high + 64);
  const __m512i low0 = _mm512_loadu_si512(values.bf16_low);
  const __m512i low1 = _mm512_loadu_si512(values.bf16_low + 64);
  const __m512i order = _mm512_loadu_si512(values.unpack_order);
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  for (; i + 64 <= n; i += 64) {
    const __m512i b = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(bytes + i));
    const __m512i high = _mm512_or_si512(_mm512_permutex2var_epi8(high0, b, high1),
                                         _mm512_and_si512(b, sign));
    const __m512i low = _mm512_permutex2var_epi8(low0, b, low1);
    _mm512_storeu_si512(dst + i, _mm512_unpacklo_epi8(low, high));
    _mm512_storeu_si512(dst + i + 32, _mm512_unpackhi_epi8(low, high));
  }
#elif defined(__AVX512BW__)
  const uint16_t* table = values.bf16;
  const __m512i t0 = _mm512_loadu_si512(table), t1 = _mm512_loadu_si512(table + 32);
  const __m512i t2 = _mm512_loadu_si512(table + 64), t3 = _mm512_loadu_si512(table + 96);
  const __m512i bit6 = _mm512_set1_epi16(0x40), sign = _mm512_set1_epi16(0x80);
  for (; i + 32 <= n; i += 32) {
    const __m512i b =
        _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + i)));
    // Index bits 0-5 pick one of 64 words (bit 5: the second register); bit 6 the pair.
    const __m512i low = _mm512_permutex2var_epi16(t0, b, t1);
    const __m512i high = _mm512_permutex2var_epi16(t2, b, t3);
    const __m512i magnitude = _mm512_mask_mov_epi16(low, _mm512_test_epi16_mask(b, bit6), high);
    const __m512i sign_bit = _mm512_slli_epi16(_mm512_and_si512(b, sign), 8);
    _mm512_storeu_si512(dst + i, _mm512_or_si512(magnitude, sign_bit));
  }
#endif
  for (; i < n; ++i) dst[i] = values.bf16[bytes[i]];
}

}  // namespace kvtier
