// Shared by the native CPU kernels (kernels/cpu/): element types and their fp32 conversions, a fast exp.
#pragma once

#include <cstdint>
#include <cstring>
#include <cmath>

namespace sluice {


enum Dtype : int { kF32 = 0, kBF16 = 1, kF16 = 2, kI8 = 3, kFP8 = 4 };  // kernels/cpu/binding.py DTYPES, QUANTIZED

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);  // inf / NaN
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal half: normalize
    int e = -1;
    do { man <<= 1; ++e; } while (!(man & 0x400u));
    u = sign | uint32_t(112 - e) << 23 | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_f16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);  // NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // overflows to inf (incl. rounding up)
  if (a < 0x38800000u) {  // subnormal or zero in half
    float af;
    std::memcpy(&af, &a, 4);
    // 2^-24 is the half subnormal step; nearbyint rounds half to even
    return uint16_t(sign | uint32_t(std::nearbyint(af * 16777216.0f)));
  }
  uint32_t r = a + 0x0fffu + ((a >> 13) & 1u) - (112u << 23);
  return uint16_t(sign | (r >> 13));
}

// float8 e4m3fn (4 exponent bits, bias 7, 3 mantissa bits, no infinities): its bits, moved into a half's exponent
// and mantissa fields, are a half 2^8 times smaller, subnormals included (NaN, never stored here, is not kept).
inline float fp8_to_f32(uint8_t b) { return f16_to_f32(uint16_t((b & 0x80u) << 8 | (b & 0x7fu) << 7)) * 256.0f; }

inline uint8_t f32_to_fp8(float f) {  // round to nearest even; beyond +-448, the largest finite, saturates
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  const float a = std::fabs(f);
  if (!(a < 448.0f)) return sign | 0x7eu;
  if (a < 0.015625f) return sign | uint8_t(std::nearbyint(a * 512.0f));  // below 2^-6: steps of 2^-9 (8 = 2^-6)
  uint32_t ua;
  std::memcpy(&ua, &a, 4);
  ua += 0x7ffffu + ((ua >> 20) & 1u);  // round 23 mantissa bits to 3
  return sign | uint8_t(((ua >> 23) - 120u) << 3 | ((ua >> 20) & 7u));  // exponent: -127 + 7
}

// exp(x), branch-free so loops over it vectorize: 2^n * e^r with n = round(x / ln 2) and a degree-6
// polynomial for e^r on [-ln2/2, ln2/2] (rel. err ~2e-7). x is clamped to [-87, 88]: below, the result
// is ~1e-38 instead of 0 (negligible next to a softmax's max term, exp(0) = 1, and in silu).
inline float fast_exp(float x) {
  x = x > -87.0f ? x : -87.0f;  // (not std::max: it returns a reference, which blocks vectorizing)
  x = x < 88.0f ? x : 88.0f;
  // round to nearest by adding and removing 1.5 * 2^23 (floorf does not vectorize without -fno-trapping-math)
  float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // x - n * ln2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}

// Element types of the cache: storage type plus its conversion to and from fp32.
struct F32 {
  using T = float;
  static float to(T x) { return x; }
  static T from(float x) { return x; }
};
struct BF16 {
  using T = uint16_t;
  static float to(T x) { return bf16_to_f32(x); }
  static T from(float x) { return f32_to_bf16(x); }
};
struct F16 {
  using T = uint16_t;
  static float to(T x) { return f16_to_f32(x); }
  static T from(float x) { return f32_to_f16(x); }
};

// Quantized cache elements (kernels/reference.py quantize): the stored value; its scale lives beside the block.
struct I8 {
  using T = int8_t;
  static constexpr float kMax = 127.0f;
  static float to(T x) { return float(x); }
  static T from(float x) {  // x within +-kMax: round half away from zero; NaN (non-finite K/V) stores 0
    if (std::isnan(x)) return 0;
    const float r = std::trunc(x + std::copysign(0.5f, x));
    return T(r > kMax ? kMax : (r < -kMax ? -kMax : r));
  }
};
struct FP8 {
  using T = uint8_t;
  static constexpr float kMax = 448.0f;
  static float to(T x) {
    static const auto lut = [] {
      struct { float v[256]; } t;
      for (int i = 0; i < 256; ++i) t.v[i] = fp8_to_f32(uint8_t(i));
      return t;
    }();
    return lut.v[x];
  }
  static T from(float x) { return f32_to_fp8(x); }
};

template <class E>
inline void to_f32(const typename E::T* __restrict__ src, float* __restrict__ dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = E::to(src[i]);
}

}  // namespace sluice
