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

template <class V>
struct Consts {
  using R = typename V::R;
  // Copied into a local object so that stores through the byte pointers of
  // the output cannot alias them: the compiler keeps them in registers and
  // can hoist the flag tests out of the loop.
  bool maximize, lerp_small;
  int weight_decay_mode;
  R grad_scale, decay, l2, lerp_weight, one_minus_lerp, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size;
  explicit Consts(const AdamArgs& a)
      : maximize(a.maximize),
        lerp_small(a.lerp_small),
        weight_decay_mode(a.weight_decay_mode),
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

// Which of torch's two formulas an element gets (see adam.h): its vector loop's,
// or its scalar tail's (the last numel % 8 elements of a tensor), which fuses
// the other multiplication of exp_avg_sq's update into the multiply-add.
enum class Part { kBody, kTail };

// One register's worth of elements at the given (already offset) pointers;
// returns the updated weights for the low-precision copy.
template <class V, DType G, Part P>
inline typename V::R update(const Consts<V>& c, float* p_ptr, const unsigned char* g_ptr, float* m_ptr, float* v_ptr,
                            float* vmax_ptr) {
  using R = typename V::R;
  R g = V::mul(load_grad<V, G>(g_ptr), c.grad_scale);
  if (c.maximize) g = V::neg(g);
  R p = V::load(p_ptr);
  if (c.weight_decay_mode == 1) {
    p = V::mul(p, c.decay);
  } else if (c.weight_decay_mode == 2) {
    g = V::fma(p, c.l2, g);
  }
  R m = V::load(m_ptr);
  if (c.lerp_small) {
    m = V::fma(c.lerp_weight, V::sub(g, m), m);
  } else {
    m = V::fma(V::neg(V::sub(g, m)), c.one_minus_lerp, g);
  }
  V::store(m_ptr, m);
  R v;
  if constexpr (P == Part::kBody) {
    v = V::fma(V::mul(c.one_minus_beta2, g), g, V::mul(V::load(v_ptr), c.beta2));
  } else {
    v = V::fma(V::load(v_ptr), c.beta2, V::mul(V::mul(c.one_minus_beta2, g), g));
  }
  V::store(v_ptr, v);
  if (vmax_ptr != nullptr) {
    v = V::max_nan(V::load(vmax_ptr), v);
    V::store(vmax_ptr, v);
  }
  const R denom = V::add(V::div(V::sqrt(v), c.bc2_sqrt), c.eps);
  p = V::add(p, V::div(V::mul(c.neg_step_size, m), denom));
  V::store(p_ptr, p);
  return p;
}

// Elements [i, end) one register at a time with formula P, the last partial
// register through the same vector code on zero-padded copies, so that it
// rounds exactly like a whole one.
template <class V, DType G, DType O, Part P>
void adam_registers(const AdamArgs& a, const Consts<V>& c, size_t i, size_t end) {
  constexpr size_t W = V::W;
  constexpr size_t gs = dtype_size(G);
  constexpr size_t os = dtype_size(O);
  float* const vmax = a.max_exp_avg_sq;
  const auto* const grad = static_cast<const unsigned char*>(a.grad);
  auto* const out = static_cast<unsigned char*>(a.param_out);
  for (; i + W <= end; i += W) {
    const typename V::R p = update<V, G, P>(c, a.param + i, grad + i * gs, a.exp_avg + i, a.exp_avg_sq + i,
                                            vmax != nullptr ? vmax + i : nullptr);
    if constexpr (O != DType::kNone) store_out<V, O>(out + i * os, p);
  }
  const size_t rest = end - i;
  if (rest == 0) return;
  alignas(64) float pb[W] = {}, mb[W] = {}, vb[W] = {}, xb[W] = {};
  alignas(64) unsigned char gb[W * 4] = {}, ob[W * 4] = {};
  std::memcpy(pb, a.param + i, rest * 4);
  std::memcpy(mb, a.exp_avg + i, rest * 4);
  std::memcpy(vb, a.exp_avg_sq + i, rest * 4);
  std::memcpy(gb, grad + i * gs, rest * gs);
  if (vmax != nullptr) std::memcpy(xb, vmax + i, rest * 4);
  store_out<V, O>(ob, update<V, G, P>(c, pb, gb, mb, vb, vmax != nullptr ? xb : nullptr));
  std::memcpy(a.param + i, pb, rest * 4);
  std::memcpy(a.exp_avg + i, mb, rest * 4);
  std::memcpy(a.exp_avg_sq + i, vb, rest * 4);
  if (vmax != nullptr) std::memcpy(vmax + i, xb, rest * 4);
  if constexpr (O != DType::kNone) std::memcpy(out + i * os, ob, rest * os);
}

template <class V, DType G, DType O>
void adam_range_typed(const AdamArgs& a, size_t begin, size_t end) {
  constexpr size_t W = V::W;
  constexpr size_t gs = dtype_size(G);
  constexpr size_t os = dtype_size(O);
  const Consts<V> c(a);
  float* const param = a.param;
  float* const exp_avg = a.exp_avg;
  float* const exp_avg_sq = a.exp_avg_sq;
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
        __builtin_prefetch(param + i + pf + l, 1);
        __builtin_prefetch(exp_avg + i + pf + l, 1);
        __builtin_prefetch(exp_avg_sq + i + pf + l, 1);
        __builtin_prefetch(grad + (i + pf + l) * gs, 0);
      }
    }
    for (size_t j = i; j < i + kStep; j += 2 * W) {
      const size_t k = j + W;
      const typename V::R p0 = update<V, G, Part::kBody>(c, param + j, grad + j * gs, exp_avg + j, exp_avg_sq + j,
                                                         vmax != nullptr ? vmax + j : nullptr);
      const typename V::R p1 = update<V, G, Part::kBody>(c, param + k, grad + k * gs, exp_avg + k, exp_avg_sq + k,
                                                         vmax != nullptr ? vmax + k : nullptr);
      if constexpr (O != DType::kNone) store_out_pair<V, O>(out + j * os, p0, p1);
    }
  }
  adam_registers<V, G, O, Part::kBody>(a, c, i, tail);
  adam_registers<V, G, O, Part::kTail>(a, c, tail, end);
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

template <class V, DType G>
void adam_range_grad(const AdamArgs& a, size_t begin, size_t end) {
  switch (a.out_dtype) {
    case DType::kBFloat16: return adam_range_typed<V, G, DType::kBFloat16>(a, begin, end);
    case DType::kFloat16: return adam_range_typed<V, G, DType::kFloat16>(a, begin, end);
    default: return adam_range_typed<V, G, DType::kNone>(a, begin, end);
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
