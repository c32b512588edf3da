// The Adam update and the bandwidth probe, written once over a small SIMD
// interface `V` that each instruction-set translation unit defines before
// including this file:
//
//   using R = <register>;  static constexpr size_t W = <floats per register>;
//   load, store, set1, add, sub, mul, div, sqrt, fma(a, b, c) = a * b + c,
//   neg, max_nan (NaN-propagating maximum), load_bf16, load_f16, store_bf16,
//   store_f16, store_bf16_pair (two registers; round to nearest even; NaN
//   stays NaN).
//
// Everything here has internal linkage (anonymous namespace): each
// translation unit gets its own copy compiled for its own instruction set,
// and the linker can never substitute one variant's code for another's.
#pragma once

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
  R g = V::mul(load_grad<V, G>(g_ptr), c.grad_scale);
  if (c.maximize) g = V::neg(g);
  R p = load_as_float<V, kBf16Param>(p_ptr);
  if (c.weight_decay_mode == 1) {
    p = V::mul(p, c.decay);
  } else if (c.weight_decay_mode == 2) {
    g = V::fma(p, c.l2, g);
  }
  R m = load_as_float<V, kBf16Moments>(m_ptr);
  if (c.lerp_small) {
    m = V::fma(c.lerp_weight, V::sub(g, m), m);
  } else {
    m = V::fma(V::neg(V::sub(g, m)), c.one_minus_lerp, g);
  }
  store_rounded<V, kBf16Moments>(m_ptr, m);
  R v;
  if constexpr (P == Part::kBody) {
    v = V::fma(V::mul(c.one_minus_beta2, g), g, V::mul(load_as_float<V, kBf16Moments>(v_ptr), c.beta2));
  } else {
    v = V::fma(load_as_float<V, kBf16Moments>(v_ptr), c.beta2, V::mul(V::mul(c.one_minus_beta2, g), g));
  }
  store_rounded<V, kBf16Moments>(v_ptr, v);
  if constexpr (S == State::kFp32) {
    if (vmax_ptr != nullptr) {
      v = V::max_nan(V::load(vmax_ptr), v);
      V::store(vmax_ptr, v);
    }
  }
  const R denom = V::add(V::div(V::sqrt(v), c.bc2_sqrt), c.eps);
  p = V::add(p, V::div(V::mul(c.neg_step_size, m), denom));
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
