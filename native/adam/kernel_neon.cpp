// NEON variant (aarch64, where NEON and fp16 conversion are baseline).
#if defined(__aarch64__)
#include <arm_neon.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "adam.h"

namespace {

struct NeonVec {
  using R = float32x4_t;
  static constexpr size_t W = 4;
  static R load(const float* p) { return vld1q_f32(p); }
  static void store(float* p, R x) { vst1q_f32(p, x); }
  static R set1(float x) { return vdupq_n_f32(x); }
  static R add(R a, R b) { return vaddq_f32(a, b); }
  static R sub(R a, R b) { return vsubq_f32(a, b); }
  static R mul(R a, R b) { return vmulq_f32(a, b); }
  static R div(R a, R b) { return vdivq_f32(a, b); }
  static R sqrt(R a) { return vsqrtq_f32(a); }
  static R fma(R a, R b, R c) { return vfmaq_f32(c, a, b); }
  static R neg(R a) { return vnegq_f32(a); }
  static R max_nan(R a, R b) { return vmaxq_f32(a, b); }  // FMAX propagates NaN
  static R load_bf16(const uint16_t* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
  static void store_bf16(uint16_t* p, R x) {
    const uint32x4_t u = vreinterpretq_u32_f32(x);
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    const uint16x4_t r = vshrn_n_u32(vaddq_u32(u, vaddq_u32(lsb, vdupq_n_u32(0x7fff))), 16);
    const uint16x4_t not_nan = vmovn_u32(vceqq_f32(x, x));
    vst1_u16(p, vbsl_u16(not_nan, r, vdup_n_u16(0x7fc0)));
  }
  static void store_bf16_pair(uint16_t* p, R x0, R x1) {
    store_bf16(p, x0);
    store_bf16(p + W, x1);
  }
  static R load_u8(const uint8_t* p) {
    uint32_t word;
    std::memcpy(&word, p, 4);
    const uint16x8_t halves = vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(word)));
    return vreinterpretq_f32_u32(vmovl_u16(vget_low_u16(halves)));
  }
  static void store_u8(uint8_t* p, R x) {
    const uint16x4_t halves = vmovn_u32(vreinterpretq_u32_f32(x));
    const uint32_t word = vget_lane_u32(vreinterpret_u32_u8(vmovn_u16(vcombine_u16(halves, halves))), 0);
    std::memcpy(p, &word, 4);
  }
  static R load_f16(const uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
  static void store_f16(uint16_t* p, R x) { vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(x))); }
};

}  // namespace

#include "kernel_body.h"

NVOFFLOAD_ADAM_ENTRY_POINTS(neon, NeonVec)
#endif  // aarch64
