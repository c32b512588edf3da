// Portable variant: one float at a time, baseline instruction set. Used where
// the CPU has neither AVX2+FMA+F16C nor NEON, and as the reference the
// vector variants are tested against.
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct ScalarVec {
  using R = float;
  static constexpr size_t W = 1;
  static R load(const float* p) { return *p; }
  static void store(float* p, R x) { *p = x; }
  static R set1(float x) { return x; }
  static R add(R a, R b) { return a + b; }
  static R sub(R a, R b) { return a - b; }
  static R mul(R a, R b) { return a * b; }
  static R div(R a, R b) { return a / b; }
  static R sqrt(R a) { return std::sqrt(a); }
  static R fma(R a, R b, R c) { return std::fma(a, b, c); }
  static R neg(R a) { return -a; }
  static R max_nan(R a, R b) { return (std::isnan(a) || std::isnan(b)) ? a + b : (a > b ? a : b); }
  static R load_bf16(const uint16_t* p) { return float_of(static_cast<uint32_t>(*p) << 16); }
  static void store_bf16(uint16_t* p, R x) {
    const uint32_t u = bits_of(x);
    *p = std::isnan(x) ? uint16_t{0x7fc0} : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  static void store_bf16_pair(uint16_t* p, R x0, R x1) {
    store_bf16(p, x0);
    store_bf16(p + W, x1);
  }
  static R load_u8(const uint8_t* p) { return float_of(*p); }
  static void store_u8(uint8_t* p, R x) { *p = static_cast<uint8_t>(bits_of(x)); }
  static R load_f16(const uint16_t* p) {
    const uint32_t h = *p;
    const uint32_t sign = (h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu;
    const uint32_t mantissa = h & 0x3ffu;
    if (exponent == 0x1f) return float_of(sign | 0x7f800000u | (mantissa << 13));
    if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24 is exact in fp32
      const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
      return float_of(sign | bits_of(magnitude));
    }
    return float_of(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  }
  static void store_f16(uint16_t* p, R x) {
    const uint32_t u = bits_of(x);
    const uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    uint16_t h;
    if (a > 0x7f800000u) {
      h = static_cast<uint16_t>(sign | 0x7e00u);  // NaN
    } else if (a >= 0x477ff000u) {
      h = static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to infinity
    } else if (a < 0x38800000u) {
      // Below fp16's smallest normal: adding 0.5 puts the value's fp16 ulp
      // (2^-24) at fp32's last bit, so the FPU does the rounding to nearest even.
      const float t = float_of(a) + 0.5f;
      h = static_cast<uint16_t>(sign | (bits_of(t) - 0x3f000000u));
    } else {
      a += 0xc8000fffu + ((a >> 13) & 1u);  // rebias 127 -> 15, round to nearest even
      h = static_cast<uint16_t>(sign | (a >> 13));
    }
    *p = h;
  }
};

}  // namespace

#include "kernel_body.h"

NVOFFLOAD_ADAM_ENTRY_POINTS(scalar, ScalarVec)
