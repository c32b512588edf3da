// AVX2 + FMA + F16C variant (x86-64), compiled for those extensions by the
// target pragma below and only called when the CPU reports all three.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "adam.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

namespace {

struct Avx2Vec {
  using R = __m256;
  static constexpr size_t W = 8;
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, R x) { _mm256_storeu_ps(p, x); }
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R div(R a, R b) { return _mm256_div_ps(a, b); }
  static R sqrt(R a) { return _mm256_sqrt_ps(a); }
  static R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static R neg(R a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
  static R max_nan(R a, R b) {
    return _mm256_blendv_ps(_mm256_max_ps(a, b), _mm256_add_ps(a, b), _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
  }
  static R load_bf16(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static void store_bf16(uint16_t* p, R x) {
    const __m256i r = bf16_bits(x);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static __m256i bf16_bits(R x) {  // round to nearest even in the high half; NaN -> 0x7fc0
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  }
  static void store_bf16_pair(uint16_t* p, R x0, R x1) {
    // packus interleaves 128-bit lanes (x0 lo, x1 lo, x0 hi, x1 hi): permute them back in order.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_bits(x0), bf16_bits(x1)), 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
  }
  static R load_u8(const uint8_t* p) {
    return _mm256_castsi256_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static void store_u8(uint8_t* p, R x) {  // lanes hold bytes: the saturating packs keep them
    const __m256i u = _mm256_castps_si256(x);
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(words, words));
  }
  static R load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_f16(uint16_t* p, R x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

}  // namespace

#include "kernel_body.h"

NVOFFLOAD_ADAM_ENTRY_POINTS(avx2, Avx2Vec)

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // x86-64
