// The Adam update and the bandwidth probe, written once over a small SIMD
// interface `V` that each instruction-set translation unit defines before
// including this file:
//
//   using R = <register>;  static constexpr size_t W = <floats per register>;
//   load, store, set1, add, sub, mul, div, sqrt, fma(a, b, c) = a * b + c,
//   neg, max_nan (NaN-propagating maximum), load_bf16, load_f16, store_bf16,
//   store_f16, store_bf16_pair (two registers; round to nearest even; NaN
//   stays NaN), load_u8 (W bytes zero-extended to W 32-bit integer lanes, in
//   a register's bits), store_u8 (the low byte of each 32-bit lane: W bytes).
//
// Everything here has internal linkage (anonymous namespace): each
// translation unit gets its own copy compiled for its own instruction set,
// and the linker can never substitute one variant's code for another's.
#pragma once

#include <cmath>
#include <cstring>

#include "adam.h"

namespace nvoffload {
namespace adam {
namespace {

constexpr size_t dtype_size(DType t) { return t == DType::kFloat32 ? 4 : 2; }

template <class V, DType G>
inline typename V::R load_grad(const unsigned char* g) {
  if constexpr (G == DType::kFloat32) {
    return V::load(reinterpret_cast<const float*>(g));
  } else if constexpr (G == DType::kBFloat16) {
    return V::load_bf16(reinterpret_cast<const uint16_t*>(g));
  } else {
    return V::load_f16(reinterpret_cast<const uint16_t*>(g));
  }
}

template <class V, DType O>
inline void store_out(unsigned char* out, typename V::R x) {
  if constexpr (O == DType::kBFloat16) {
    V::store_bf16(reinterpret_cast<uint16_t*>(out), x);
  } else if constexpr (O == DType::kFloat16) {
    V::store_f16(reinterpret_cast<uint16_t*>(out), x);
  } else if constexpr (O == DType::kFloat32) {
    V::store(reinterpret_cast<float*>(out), x);
  }
}

// Two registers at once: one wider store (and fewer shuffles) on x86.
template <class V, DType O>
inline void store_out_pair(unsigned char* out, typename V::R x0, typename V::R x1) {
  if constexpr (O == DType::kBFloat16) {
    V::store_bf16_pair(reinterpret_cast<uint16_t*>(out), x0, x1);
  } else if constexpr (O == DType::kFloat16) {
    V::store_f16(reinterpret_cast<uint16_t*>(out), x0);
    V::store_f16(reinterpret_cast<uint16_t*>(out) + V::W, x1);
  }
}

// The stochastic rounding's random bits: the high 16 bits of the element's
// index (its low 32 bits) xor a key, times 2^32 / golden ratio (Fibonacci
// hashing: one multiply a lane; bench/README.md gives what the rounding costs). The key
// is Chris Wellons' lowbias32 hash of the seed and the index's high 32 bits, so
// across steps (seeds) an element's bits are uniform: each rounding is
// unbiased. tests/test_adam_compact.py computes the same in numpy.
constexpr uint32_t kFibonacci = 0x9e3779b1u;

inline uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

inline uint32_t rounding_key(uint64_t seed, uint64_t index) {
  return lowbias32(static_cast<uint32_t>(index >> 32) ^ lowbias32(static_cast<uint32_t>(seed >> 32)) ^
                   static_cast<uint32_t>(seed));
}

inline uint32_t rounding_bits(uint32_t low_index, uint32_t key) { return ((low_index ^ key) * kFibonacci) >> 16; }

template <class V>
struct Consts {
  using R = typename V::R;
  // Copied into a local object so that stores through the byte pointers of
  // the output cannot alias them: the compiler keeps them in registers and
  // can hoist the flag tests out of the loop.
  bool maximize, lerp_small;
  int weight_decay_mode;
  uint64_t sr_seed;
  uint32_t sr_key_high;  // the high 32 bits of the indices whose key sr_key is (computed once per call)
  uint32_t sr_key;
  R grad_scale, decay, l2, lerp_weight, one_minus_lerp, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size;
  explicit Consts(const AdamArgs& a)
      : maximize(a.maximize),
        lerp_small(a.lerp_small),
        weight_decay_mode(a.weight_decay_mode),
        sr_seed(a.sr_seed),
        sr_key_high(static_cast<uint32_t>(a.first_index >> 32)),
        sr_key(rounding_key(a.sr_seed, a.first_index)),
        grad_scale(V::set1(a.grad_scale)),
        decay(V::set1(a.decay)),
        l2(V::set1(a.l2)),
        lerp_weight(V::set1(a.lerp_weight)),
        one_minus_lerp(V::set1(a.one_minus_lerp)),
        beta2(V::set1(a.beta2)),
        one_minus_beta2(V::set1(a.one_minus_beta2)),
        bc2_sqrt(V::set1(a.bias_correction2_sqrt)),
        eps(V::set1(a.eps)),
        neg_step_size(V::set1(a.neg_step_size)) {}
};

// Bytes an element of the weights and of each moment take in state form S.
constexpr size_t param_size(State s) { return s == State::kBf16 ? 2 : 4; }
constexpr size_t moment_size(State s) { return s == State::kFp32 ? 4 : 2; }

template <class V, bool Bf16>
inline typename V::R load_as_float(const unsigned char* p) {
  if constexpr (Bf16) {
    return V::load_bf16(reinterpret_cast<const uint16_t*>(p));
  } else {
    return V::load(reinterpret_cast<const float*>(p));
  }
}

template <class V, bool Bf16>
inline void store_rounded(unsigned char* p, typename V::R x) {
  if constexpr (Bf16) {
    V::store_bf16(reinterpret_cast<uint16_t*>(p), x);
  } else {
    V::store(reinterpret_cast<float*>(p), x);
  }
}

// x (its bits u) to bf16, up (away from zero) with probability (its 16 dropped
// bits) / 2^16: `bits` (16 random bits) added below the cut, then truncated.
// An infinity stays; NaN becomes 0x7fc0 (as round to nearest even gives it).
inline uint16_t bf16_stochastic(uint32_t u, uint32_t bits) {
  const uint32_t magnitude = u & 0x7fffffffu;
  const uint32_t add = magnitude >= 0x7f800000u ? 0u : bits;
  return static_cast<uint16_t>(magnitude > 0x7f800000u ? 0x7fc0u : (u + add) >> 16);
}

// The same over a register's W lanes at once, in the compiler's generic vectors
// (GCC and Clang lower them to the translation unit's instruction set).
template <size_t W>
struct Lanes {
  typedef uint32_t U __attribute__((vector_size(W * 4)));
  typedef uint16_t H __attribute__((vector_size(W * 2)));
};
alignas(64) constexpr uint32_t kLaneIndex[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

// One register of weights stored as bf16, stochastically rounded; `index` is
// the index in its tensor of its first element.
template <class V>
__attribute__((always_inline)) inline void store_stochastic(unsigned char* out, typename V::R x, const Consts<V>& c,
                                                            uint64_t index) {
  constexpr size_t W = V::W;
  using U = typename Lanes<W>::U;
  using H = typename Lanes<W>::H;
  static_assert(sizeof(U) == sizeof(typename V::R) && W <= 16, "a register is W floats");
  U u;
  std::memcpy(&u, &x, sizeof(u));
  const uint32_t high = static_cast<uint32_t>(index >> 32);
  if (high == c.sr_key_high && high == static_cast<uint32_t>((index + W - 1) >> 32)) {  // the call's key, every lane
    U h;
    std::memcpy(&h, kLaneIndex, sizeof(h));
    h += static_cast<uint32_t>(index);
    h = ((h ^ c.sr_key) * kFibonacci) >> 16;  // rounding_bits, lane by lane
    const U magnitude = u & 0x7fffffffu;
    const U finite = (U)(magnitude < 0x7f800000u);  // all ones where finite
    const U nan = (U)(magnitude > 0x7f800000u);
    const U rounded = (u + (h & finite)) >> 16;
    const H bits = __builtin_convertvector((rounded & ~nan) | (nan & 0x7fc0u), H);
    std::memcpy(out, &bits, sizeof(bits));
    return;
  }
  auto* const o = reinterpret_cast<uint16_t*>(out);
  for (size_t k = 0; k < W; ++k) {
    o[k] = bf16_stochastic(u[k], rounding_bits(static_cast<uint32_t>(index + k), rounding_key(c.sr_seed, index + k)));
  }
}

// Which of torch's two formulas an element gets (see adam.h): its vector loop's,
// or its scalar tail's (the last numel % 8 elements of a tensor), which fuses
// the other multiplication of exp_avg_sq's update into the multiply-add.
enum class Part { kBody, kTail };

// The update's arithmetic on registers (see adam.h), shared by every state form. The gradient as used (scaled,
// negated with maximize):
template <class V>
inline typename V::R scaled_grad(const Consts<V>& c, typename V::R g) {
  g = V::mul(g, c.grad_scale);
  return c.maximize ? V::neg(g) : g;
}

// Weight decay: decoupled (p shrinks) or L2 (g grows by l2 * p).
template <class V>
inline void decay(const Consts<V>& c, typename V::R& p, typename V::R& g) {
  if (c.weight_decay_mode == 1) {
    p = V::mul(p, c.decay);
  } else if (c.weight_decay_mode == 2) {
    g = V::fma(p, c.l2, g);
  }
}

// exp_avg after the step: torch's lerp, in its fma form.
template <class V>
inline typename V::R next_exp_avg(const Consts<V>& c, typename V::R g, typename V::R m) {
  return c.lerp_small ? V::fma(c.lerp_weight, V::sub(g, m), m) : V::fma(V::neg(V::sub(g, m)), c.one_minus_lerp, g);
}

// exp_avg_sq after the step, by torch's formula for part P.
template <class V, Part P>
inline typename V::R next_exp_avg_sq(const Consts<V>& c, typename V::R g, typename V::R v) {
  if constexpr (P == Part::kBody) {
    return V::fma(V::mul(c.one_minus_beta2, g), g, V::mul(v, c.beta2));
  } else {
    return V::fma(v, c.beta2, V::mul(V::mul(c.one_minus_beta2, g), g));
  }
}

// The weights after the step, from the new exp_avg and the square root of the new exp_avg_sq.
template <class V>
inline typename V::R stepped(const Consts<V>& c, typename V::R p, typename V::R m, typename V::R root) {
  const typename V::R denom = V::add(V::div(root, c.bc2_sqrt), c.eps);
  return V::add(p, V::div(V::mul(c.neg_step_size, m), denom));
}

// One register's worth of elements at the given (already offset) pointers;
// `index` is the first one's index in its tensor (for the stochastic rounding).
// Returns the updated weights (before any rounding to bf16) for the
// low-precision copy.
template <class V, DType G, State S, Part P>
inline typename V::R update(const Consts<V>& c, unsigned char* p_ptr, const unsigned char* g_ptr, unsigned char* m_ptr,
                            unsigned char* v_ptr, float* vmax_ptr, uint64_t index) {
  using R = typename V::R;
  constexpr bool kBf16Moments = S != State::kFp32;
  constexpr bool kBf16Param = S == State::kBf16;
  R g = scaled_grad(c, load_grad<V, G>(g_ptr));
  R p = load_as_float<V, kBf16Param>(p_ptr);
  decay(c, p, g);
  const R m = next_exp_avg(c, g, load_as_float<V, kBf16Moments>(m_ptr));
  store_rounded<V, kBf16Moments>(m_ptr, m);
  R v = next_exp_avg_sq<V, P>(c, g, load_as_float<V, kBf16Moments>(v_ptr));
  store_rounded<V, kBf16Moments>(v_ptr, v);
  if constexpr (S == State::kFp32) {
    if (vmax_ptr != nullptr) {
      v = V::max_nan(V::load(vmax_ptr), v);
      V::store(vmax_ptr, v);
    }
  }
  p = stepped(c, p, m, V::sqrt(v));
  if constexpr (kBf16Param) {
    store_stochastic<V>(p_ptr, p, c, index);
  } else {
    V::store(reinterpret_cast<float*>(p_ptr), p);
  }
  return p;
}

// Elements [i, end) one register at a time with formula P, the last partial
// register through the same vector code on zero-padded copies, so that it
// rounds exactly like a whole one.
template <class V, DType G, DType O, State S, Part P>
void adam_registers(const AdamArgs& a, const Consts<V>& c, size_t i, size_t end) {
  constexpr size_t W = V::W;
  constexpr size_t gs = dtype_size(G);
  constexpr size_t os = dtype_size(O);
  constexpr size_t ps = param_size(S);
  constexpr size_t ms = moment_size(S);
  float* const vmax = a.max_exp_avg_sq;
  auto* const param = static_cast<unsigned char*>(a.param);
  auto* const exp_avg = static_cast<unsigned char*>(a.exp_avg);
  auto* const exp_avg_sq = static_cast<unsigned char*>(a.exp_avg_sq);
  const auto* const grad = static_cast<const unsigned char*>(a.grad);
  auto* const out = static_cast<unsigned char*>(a.param_out);
  for (; i + W <= end; i += W) {
    const typename V::R p = update<V, G, S, P>(c, param + i * ps, grad + i * gs, exp_avg + i * ms, exp_avg_sq + i * ms,
                                               vmax != nullptr ? vmax + i : nullptr, a.first_index + i);
    if constexpr (O != DType::kNone) store_out<V, O>(out + i * os, p);
  }
  const size_t rest = end - i;
  if (rest == 0) return;
  alignas(64) float xb[W] = {};
  alignas(64) unsigned char pb[W * 4] = {}, mb[W * 4] = {}, vb[W * 4] = {}, gb[W * 4] = {}, ob[W * 4] = {};
  std::memcpy(pb, param + i * ps, rest * ps);
  std::memcpy(mb, exp_avg + i * ms, rest * ms);
  std::memcpy(vb, exp_avg_sq + i * ms, rest * ms);
  std::memcpy(gb, grad + i * gs, rest * gs);
  if (vmax != nullptr) std::memcpy(xb, vmax + i, rest * 4);
  store_out<V, O>(ob, update<V, G, S, P>(c, pb, gb, mb, vb, vmax != nullptr ? xb : nullptr, a.first_index + i));
  std::memcpy(param + i * ps, pb, rest * ps);
  std::memcpy(exp_avg + i * ms, mb, rest * ms);
  std::memcpy(exp_avg_sq + i * ms, vb, rest * ms);
  if (vmax != nullptr) std::memcpy(vmax + i, xb, rest * 4);
  if constexpr (O != DType::kNone) std::memcpy(out + i * os, ob, rest * os);
}

template <class V, DType G, DType O, State S>
void adam_range_typed(const AdamArgs& a, size_t begin, size_t end) {
  constexpr size_t W = V::W;
  constexpr size_t gs = dtype_size(G);
  constexpr size_t os = dtype_size(O);
  constexpr size_t ps = param_size(S);
  constexpr size_t ms = moment_size(S);
  const Consts<V> c(a);
  auto* const param = static_cast<unsigned char*>(a.param);
  auto* const exp_avg = static_cast<unsigned char*>(a.exp_avg);
  auto* const exp_avg_sq = static_cast<unsigned char*>(a.exp_avg_sq);
  float* const vmax = a.max_exp_avg_sq;
  const auto* const grad = static_cast<const unsigned char*>(a.grad);
  auto* const out = static_cast<unsigned char*>(a.param_out);
  const size_t pf = a.prefetch_elems;
  const size_t tail = a.tail_from < begin ? begin : (a.tail_from < end ? a.tail_from : end);
  size_t i = begin;
  // Two registers and whole cache lines (16 floats) per iteration, optionally
  // prefetching pf elements ahead: the update's divisions and square root keep
  // the out-of-order window busy, and prefetches keep memory requests in flight.
  constexpr size_t kLine = 16;
  constexpr size_t kStep = 2 * W > kLine ? 2 * W : kLine;
  static_assert(kStep % kLine == 0 && kStep % (2 * W) == 0, "vectors must tile cache lines");
  for (; i + kStep <= tail; i += kStep) {
    if (pf != 0 && i + pf + kStep <= end) {
      for (size_t l = 0; l < kStep; l += kLine) {
        __builtin_prefetch(param + (i + pf + l) * ps, 1);
        __builtin_prefetch(exp_avg + (i + pf + l) * ms, 1);
        __builtin_prefetch(exp_avg_sq + (i + pf + l) * ms, 1);
        __builtin_prefetch(grad + (i + pf + l) * gs, 0);
      }
    }
    for (size_t j = i; j < i + kStep; j += 2 * W) {
      const size_t k = j + W;
      const typename V::R p0 =
          update<V, G, S, Part::kBody>(c, param + j * ps, grad + j * gs, exp_avg + j * ms, exp_avg_sq + j * ms,
                                       vmax != nullptr ? vmax + j : nullptr, a.first_index + j);
      const typename V::R p1 =
          update<V, G, S, Part::kBody>(c, param + k * ps, grad + k * gs, exp_avg + k * ms, exp_avg_sq + k * ms,
                                       vmax != nullptr ? vmax + k : nullptr, a.first_index + k);
      if constexpr (O != DType::kNone) store_out_pair<V, O>(out + j * os, p0, p1);
    }
  }
  adam_registers<V, G, O, S, Part::kBody>(a, c, i, tail);
  adam_registers<V, G, O, S, Part::kTail>(a, c, tail, end);
}

// ---- 8-bit moments (State::kFp8Moments, State::kFp8; see adam.h)

// Each moment's rounding bits come from a seed of its own: sr_seed xor one of these (the weights' is sr_seed).
constexpr uint64_t kExpAvgSalt = 0x243f6a8885a308d3ull;  // digits of pi
constexpr uint64_t kRootSalt = 0x13198a2e03707344ull;

// The exponent k of a block's scale 2^k: the smallest that brings `absmax` to at most 448 (so the largest value is
// in (224, 448], and a decoded block gets the same k or a smaller one, at which its values are exact). 0 for a block
// of zeros or a NaN; at least -126, so that 2^k and 2^-k are normal floats.
inline int8_t fp8_exponent(float absmax) {
  if (!(absmax > 0.0f) || !(absmax <= 3.4028234663852886e38f)) return 0;
  int e = 0;
  std::frexp(absmax, &e);  // absmax = f 2^e, f in [0.5, 1)
  int k = e - 9;           // absmax 2^-k in [256, 512)
  if (std::ldexp(absmax, -k) > 448.0f) ++k;
  return static_cast<int8_t>(k < -126 ? -126 : k);
}

// The compiler's generic vectors of W floats and W signed ints, beside Lanes<W>'s unsigned ints. (Bytes widen and
// narrow through V::load_u8 and V::store_u8: GCC 12 lowers a conversion of a vector of bytes lane by lane.)
template <size_t W>
struct FloatLanes {
  typedef float F __attribute__((vector_size(W * 4)));
  typedef int32_t I __attribute__((vector_size(W * 4)));
};

// The values of W codes (the first n, zeros after them) times `scale`, W lanes at a time. A code's magnitude bits
// under fp32's exponent, rebiased (7 -> 127), are its value when normal; a subnormal one's (exponent 0: 2^-6 m/8)
// is twice that less 2^-6, exactly. 0x7f (and 0xff) NaN.
template <class V>
__attribute__((always_inline)) inline void fp8_decode(const uint8_t* codes, size_t n, float scale, float* out) {
  constexpr size_t W = V::W;
  using U = typename Lanes<W>::U;
  using F = typename FloatLanes<W>::F;
  U code;
  if (n >= W) {
    const typename V::R r = V::load_u8(codes);
    std::memcpy(&code, &r, sizeof(code));
  } else {
    alignas(64) uint8_t padded[W] = {};
    std::memcpy(padded, codes, n);
    const typename V::R r = V::load_u8(padded);
    std::memcpy(&code, &r, sizeof(code));
  }
  const U magnitude = code & 0x7fu;
  const U normal = (magnitude << 20) + (120u << 23);
  F f;
  std::memcpy(&f, &normal, sizeof(f));
  f = f * 2.0f - 0x1p-6f;
  U subnormal;
  std::memcpy(&subnormal, &f, sizeof(subnormal));
  U u = magnitude < 8u ? subnormal : normal;
  u = magnitude == 0x7fu ? U{} + 0x7fc00000u : u;
  u |= (code & 0x80u) << 24;
  std::memcpy(&f, &u, sizeof(f));
  f *= scale;
  std::memcpy(out, &f, sizeof(f));
}

// W values times `inverse` (each then at most 448, or not finite) to float8 e4m3 codes, rounded stochastically:
// `bits` (16 random bits a lane) added at the top of the bits dropped, then truncated; from 2^-6, the smallest
// normal, 3 of fp32's 23 mantissa bits are kept, below it |x| 2^9 is taken in fixed point with 16 fractional bits
// (8 is the smallest normal's code). NaN and infinities become NaN (e4m3fn has none). `root`: a nonzero value never
// becomes the code 0. The first n (at most W) codes are written.
template <class V>
__attribute__((always_inline)) inline void fp8_encode(const float* values, float inverse, typename Lanes<V::W>::U bits,
                                                      bool root, size_t n, uint8_t* codes) {
  constexpr size_t W = V::W;
  using U = typename Lanes<W>::U;
  using F = typename FloatLanes<W>::F;
  using I = typename FloatLanes<W>::I;
  F x;
  std::memcpy(&x, values, sizeof(x));
  x *= inverse;
  U u;
  std::memcpy(&u, &x, sizeof(u));
  const U sign = (u >> 24) & 0x80u;
  const U magnitude = u & 0x7fffffffu;
  const U r = magnitude + (bits << 4);
  U normal = (r >> 20) - (120u << 3);  // the exponent rebiased (127 -> 7) above the 3 mantissa bits kept
  normal = normal > 0x7eu ? U{} + 0x7eu : normal;
  F a;
  std::memcpy(&a, &magnitude, sizeof(a));
  a = a < 0x1p-6f ? a : F{} + 0x1p-6f;
  const U subnormal = ((U)__builtin_convertvector(a * 0x1p25f, I) + bits) >> 16;
  U code = magnitude >= 0x3c800000u ? normal : subnormal;
  code = magnitude >= 0x7f800000u ? U{} + 0x7fu : code;
  code |= sign;
  if (root) code = (code == 0u) & (x > 0.0f) ? U{} + 1u : code;
  typename V::R lanes;
  std::memcpy(&lanes, &code, sizeof(lanes));
  if (n >= W) {
    V::store_u8(codes, lanes);
  } else {
    alignas(64) uint8_t bytes[W];
    V::store_u8(bytes, lanes);
    std::memcpy(codes, bytes, n);
  }
}

// One updated block's new moments waiting to be rounded to codes (the next block's updates interleave with it, so
// that the rounding's integer work runs beside their divisions): the values, where and at which scales.
struct Fp8Block {
  alignas(64) float m[kFp8Block];
  alignas(64) float r[kFp8Block];
  size_t start = 0, n = 0;  // the block's first element (of the buffers) and its elements
  uint64_t first = 0;       // its first element's index in its tensor (the rounding bits hash it)
  float inverse_m = 0.0f, inverse_r = 0.0f;
  uint32_t key_m = 0, key_r = 0;  // rounding_key of the first index: the block's, when one_key
  bool one_key = false;           // every element's index has the same high 32 bits
  bool pending = false;
};

// The rounding bits of W lanes from `first` on (rounding_bits, lane by lane).
template <size_t W>
__attribute__((always_inline)) inline typename Lanes<W>::U fp8_bits(uint64_t seed, uint64_t first, uint32_t key,
                                                                    bool one_key) {
  using U = typename Lanes<W>::U;
  U bits;
  if (one_key) {
    std::memcpy(&bits, kLaneIndex, sizeof(bits));
    return (((bits + static_cast<uint32_t>(first)) ^ key) * kFibonacci) >> 16;
  }
  for (size_t k = 0; k < W; ++k) {
    bits[k] = rounding_bits(static_cast<uint32_t>(first + k), rounding_key(seed, first + k));
  }
  return bits;
}

// Round register j (elements j .. j + W) of the waiting block `b` to codes.
template <class V>
__attribute__((always_inline)) inline void fp8_round_register(const Fp8Block& b, size_t j, uint64_t seed_m,
                                                              uint64_t seed_r, uint8_t* codes_m, uint8_t* codes_r) {
  constexpr size_t W = V::W;
  const uint64_t index = b.first + j;
  const size_t n = b.n - j;
  fp8_encode<V>(b.m + j, b.inverse_m, fp8_bits<W>(seed_m, index, b.key_m, b.one_key), false, n, codes_m + b.start + j);
  fp8_encode<V>(b.r + j, b.inverse_r, fp8_bits<W>(seed_r, index, b.key_r, b.one_key), true, n, codes_r + b.start + j);
}

// One register's elements: the moments decoded (codes cm, cr at scales 2^k), the update, its new weights stored
// (bf16 ones stochastically) and returned; the new exp_avg and root of exp_avg_sq to m_new and r_new, the bits of
// their largest magnitudes into max_m and max_r (as unsigned integers magnitudes order as their floats do, and a NaN
// above every number: the maximum propagates NaN).
template <class V, DType G, bool Bf16Param>
__attribute__((always_inline)) inline typename V::R fp8_update(const Consts<V>& c, unsigned char* p_ptr,
                                                              const unsigned char* g_ptr, const uint8_t* cm,
                                                              const uint8_t* cr, size_t n, float scale_m,
                                                              float scale_r, float* m_new, float* r_new,
                                                              typename Lanes<V::W>::U& max_m,
                                                              typename Lanes<V::W>::U& max_r, uint64_t index) {
  using R = typename V::R;
  using U = typename Lanes<V::W>::U;
  alignas(64) float m_old[V::W], r_old[V::W];
  fp8_decode<V>(cm, n, scale_m, m_old);
  fp8_decode<V>(cr, n, scale_r, r_old);
  R g = scaled_grad(c, load_grad<V, G>(g_ptr));
  R p = load_as_float<V, Bf16Param>(p_ptr);
  decay(c, p, g);
  const R m = next_exp_avg(c, g, V::load(m_old));
  const R root_old = V::load(r_old);
  const R root = V::sqrt(next_exp_avg_sq<V, Part::kBody>(c, g, V::mul(root_old, root_old)));
  V::store(m_new, m);
  V::store(r_new, root);
  U bits_m, bits_r;
  std::memcpy(&bits_m, &m, sizeof(bits_m));
  std::memcpy(&bits_r, &root, sizeof(bits_r));
  bits_m &= 0x7fffffffu;
  bits_r &= 0x7fffffffu;  // sqrt(-0) is -0
  max_m = bits_m > max_m ? bits_m : max_m;
  max_r = bits_r > max_r ? bits_r : max_r;
  p = stepped(c, p, m, root);
  if constexpr (Bf16Param) {
    store_stochastic<V>(p_ptr, p, c, index);
  } else {
    V::store(reinterpret_cast<float*>(p_ptr), p);
  }
  return p;
}

// The largest of W magnitudes' bits (see fp8_update), as a float.
template <size_t W>
inline float largest_magnitude(const typename Lanes<W>::U& bits) {
  uint32_t best = 0;
  for (size_t k = 0; k < W; ++k) best = bits[k] > best ? bits[k] : best;
  float f;
  std::memcpy(&f, &best, sizeof(f));
  return f;
}

// Elements [begin, end) block by block (begin is a block's first element: the tasks are whole blocks). A block's
// moments are decoded as its registers are updated; its new moments wait (two buffers) and are rounded to codes
// register by register during the next block's updates, the last block's after the loop.
template <class V, DType G, DType O, bool Bf16Param>
void adam_range_fp8(const AdamArgs& a, size_t begin, size_t end) {
  constexpr size_t W = V::W;
  constexpr size_t gs = dtype_size(G);
  constexpr size_t os = dtype_size(O);
  constexpr size_t ps = Bf16Param ? 2 : 4;
  static_assert(kFp8Block % W == 0, "registers tile a block");
  using R = typename V::R;
  const Consts<V> c(a);
  auto* const param = static_cast<unsigned char*>(a.param);
  auto* const codes_m = static_cast<uint8_t*>(a.exp_avg);
  auto* const codes_r = static_cast<uint8_t*>(a.exp_avg_sq);
  int8_t* const exponents = a.moment_exponents;
  const auto* const grad = static_cast<const unsigned char*>(a.grad);
  auto* const out = static_cast<unsigned char*>(a.param_out);
  const uint64_t seed_m = a.sr_seed ^ kExpAvgSalt, seed_r = a.sr_seed ^ kRootSalt;
  Fp8Block blocks[2];
  int current = 0;
  for (size_t start = begin; start < end; start += kFp8Block, current ^= 1) {
    Fp8Block& now = blocks[current];
    const Fp8Block& waiting = blocks[current ^ 1];
    const size_t n = end - start < kFp8Block ? end - start : kFp8Block;
    const size_t block = start / kFp8Block;
    const float scale_m = std::ldexp(1.0f, exponents[block]);
    const float scale_r = std::ldexp(1.0f, exponents[a.nblocks + block]);
    typename Lanes<W>::U max_m = {}, max_r = {};
    size_t j = 0;
    for (; j + 2 * W <= n; j += 2 * W) {  // two registers at a time: two chains of divisions in flight
      const size_t i = start + j, k = i + W;
      const R p0 = fp8_update<V, G, Bf16Param>(c, param + i * ps, grad + i * gs, codes_m + i, codes_r + i, W, scale_m,
                                               scale_r, now.m + j, now.r + j, max_m, max_r, a.first_index + i);
      const R p1 = fp8_update<V, G, Bf16Param>(c, param + k * ps, grad + k * gs, codes_m + k, codes_r + k, W, scale_m,
                                               scale_r, now.m + j + W, now.r + j + W, max_m, max_r, a.first_index + k);
      if constexpr (O != DType::kNone) store_out_pair<V, O>(out + i * os, p0, p1);
      if (waiting.pending) {
        fp8_round_register<V>(waiting, j, seed_m, seed_r, codes_m, codes_r);
        fp8_round_register<V>(waiting, j + W, seed_m, seed_r, codes_m, codes_r);
      }
    }
    for (; j + W <= n; j += W) {
      const size_t i = start + j;
      const R p = fp8_update<V, G, Bf16Param>(c, param + i * ps, grad + i * gs, codes_m + i, codes_r + i, W, scale_m,
                                              scale_r, now.m + j, now.r + j, max_m, max_r, a.first_index + i);
      if constexpr (O != DType::kNone) store_out<V, O>(out + i * os, p);
      if (waiting.pending) fp8_round_register<V>(waiting, j, seed_m, seed_r, codes_m, codes_r);
    }
    if (j < n) {  // the last partial register, through zero-padded copies (zeros leave the maxima as they are)
      const size_t rest = n - j, i = start + j;
      alignas(64) unsigned char pb[W * 4] = {}, gb[W * 4] = {}, ob[W * 4] = {};
      std::memcpy(pb, param + i * ps, rest * ps);
      std::memcpy(gb, grad + i * gs, rest * gs);
      const R p = fp8_update<V, G, Bf16Param>(c, pb, gb, codes_m + i, codes_r + i, rest, scale_m, scale_r, now.m + j,
                                              now.r + j, max_m, max_r, a.first_index + i);
      std::memcpy(param + i * ps, pb, rest * ps);
      if constexpr (O != DType::kNone) {
        store_out<V, O>(ob, p);
        std::memcpy(out + i * os, ob, rest * os);
      }
    }
    if (waiting.pending) {  // a partial block (the range's last): the waiting one's registers past its whole ones
      for (size_t k = j; k < waiting.n; k += W) {
        fp8_round_register<V>(waiting, k, seed_m, seed_r, codes_m, codes_r);
      }
    }
    const int8_t k_m = fp8_exponent(largest_magnitude<W>(max_m));
    const int8_t k_r = fp8_exponent(largest_magnitude<W>(max_r));
    exponents[block] = k_m;
    exponents[a.nblocks + block] = k_r;
    now.start = start;
    now.n = n;
    now.first = a.first_index + start;
    now.inverse_m = std::ldexp(1.0f, -k_m);
    now.inverse_r = std::ldexp(1.0f, -k_r);
    now.one_key = (now.first >> 32) == ((now.first + n - 1) >> 32);
    now.key_m = rounding_key(seed_m, now.first);
    now.key_r = rounding_key(seed_r, now.first);
    now.pending = true;
    blocks[current ^ 1].pending = false;
  }
  const Fp8Block& last = blocks[current ^ 1];
  if (last.pending) {
    for (size_t k = 0; k < last.n; k += W) fp8_round_register<V>(last, k, seed_m, seed_r, codes_m, codes_r);
  }
}

template <class V, DType G>
void adam_range_fp8_out(const AdamArgs& a, size_t begin, size_t end) {
  switch (a.out_dtype) {
    case DType::kBFloat16: return adam_range_fp8<V, G, DType::kBFloat16, false>(a, begin, end);
    case DType::kFloat16: return adam_range_fp8<V, G, DType::kFloat16, false>(a, begin, end);
    default: return adam_range_fp8<V, G, DType::kNone, false>(a, begin, end);
  }
}

template <class V, DType G, DType O>
void probe_range_typed(const ProbeArgs& a, size_t begin, size_t end) {
  constexpr size_t W = V::W;
  constexpr size_t gs = dtype_size(G);
  constexpr size_t os = dtype_size(O);
  const auto* grad = static_cast<const unsigned char*>(a.grad);
  auto* out = static_cast<unsigned char*>(a.out);
  size_t i = begin;
  for (; i + W <= end; i += W) {
    const size_t pf = a.prefetch_elems;
    if (pf != 0 && i % 16 == 0 && i + pf < end) {  // the kernel's prefetches, to compare like with like
      __builtin_prefetch(a.a + i + pf, 1);
      __builtin_prefetch(a.b + i + pf, 1);
      __builtin_prefetch(a.c + i + pf, 1);
      __builtin_prefetch(grad + (i + pf) * gs, 0);
    }
    const typename V::R g = load_grad<V, G>(grad + i * gs);
    const typename V::R x = V::add(V::load(a.a + i), g);
    V::store(a.a + i, x);
    V::store(a.b + i, V::add(V::load(a.b + i), g));
    V::store(a.c + i, V::add(V::load(a.c + i), g));
    if constexpr (O != DType::kNone) store_out<V, O>(out + i * os, x);
  }
  for (; i < end; ++i) {  // the probe's tail only has to move the bytes
    a.a[i] += 1.0f;
    a.b[i] += 1.0f;
    a.c[i] += 1.0f;
    if (out != nullptr) std::memset(out + i * os, 0, os);
  }
}

template <class V, DType G, State S>
void adam_range_out(const AdamArgs& a, size_t begin, size_t end) {
  switch (a.out_dtype) {
    case DType::kBFloat16: return adam_range_typed<V, G, DType::kBFloat16, S>(a, begin, end);
    case DType::kFloat16: return adam_range_typed<V, G, DType::kFloat16, S>(a, begin, end);
    default: return adam_range_typed<V, G, DType::kNone, S>(a, begin, end);
  }
}

template <class V, DType G>
void adam_range_grad(const AdamArgs& a, size_t begin, size_t end) {
  switch (a.state) {
    case State::kBf16Moments: return adam_range_out<V, G, State::kBf16Moments>(a, begin, end);
    case State::kBf16: return adam_range_typed<V, G, DType::kNone, State::kBf16>(a, begin, end);  // no copy: p is bf16
    case State::kFp8Moments: return adam_range_fp8_out<V, G>(a, begin, end);
    case State::kFp8: return adam_range_fp8<V, G, DType::kNone, true>(a, begin, end);  // no copy: p is bf16
    default: return adam_range_out<V, G, State::kFp32>(a, begin, end);
  }
}

template <class V>
void adam_range_dispatch(const AdamArgs& a, size_t begin, size_t end) {
  switch (a.grad_dtype) {
    case DType::kBFloat16: return adam_range_grad<V, DType::kBFloat16>(a, begin, end);
    case DType::kFloat16: return adam_range_grad<V, DType::kFloat16>(a, begin, end);
    default: return adam_range_grad<V, DType::kFloat32>(a, begin, end);
  }
}

template <class V, DType G>
void probe_range_grad(const ProbeArgs& a, size_t begin, size_t end) {
  switch (a.out_dtype) {
    case DType::kBFloat16: return probe_range_typed<V, G, DType::kBFloat16>(a, begin, end);
    case DType::kFloat16: return probe_range_typed<V, G, DType::kFloat16>(a, begin, end);
    default: return probe_range_typed<V, G, DType::kNone>(a, begin, end);
  }
}

template <class V>
void probe_range_dispatch(const ProbeArgs& a, size_t begin, size_t end) {
  switch (a.grad_dtype) {
    case DType::kBFloat16: return probe_range_grad<V, DType::kBFloat16>(a, begin, end);
    case DType::kFloat16: return probe_range_grad<V, DType::kFloat16>(a, begin, end);
    default: return probe_range_grad<V, DType::kFloat32>(a, begin, end);
  }
}

}  // namespace
}  // namespace adam
}  // namespace nvoffload

// Defines the two entry points of one instruction-set variant, e.g.
// NVOFFLOAD_ADAM_ENTRY_POINTS(avx2, Avx2Vec) -> adam_range_avx2, probe_range_avx2.
#define NVOFFLOAD_ADAM_ENTRY_POINTS(isa, Vec)                                  \
  namespace nvoffload {                                                        \
  namespace adam {                                                             \
  void adam_range_##isa(const AdamArgs& args, size_t begin, size_t end) {      \
    adam_range_dispatch<Vec>(args, begin, end);                                \
  }                                                                            \
  void probe_range_##isa(const ProbeArgs& args, size_t begin, size_t end) {    \
    probe_range_dispatch<Vec>(args, begin, end);                               \
  }                                                                            \
  }                                                                            \
  }
