// nvoffload fused CPU Adam/AdamW: shared declarations of the native core.
//
// The kernel is a stateless function on raw pointers. Every instruction-set
// variant (scalar, AVX2, AVX-512, NEON) lives in its own translation unit,
// compiled for that instruction set with a target pragma, and exports one
// range function; `adam.cpp` picks the variant at run time from the CPU's
// features, so a build made on one machine runs on any x86-64 or aarch64.
#pragma once

#include <cstddef>
#include <cstdint>

namespace nvoffload {
namespace adam {

// Element types of the gradient and of the optional low-precision weight copy.
enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kNone = 3 };

enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kNeon = 3 };

// How the state is kept. kFp32 is exact AdamW (the default). The compact forms
// trade exactness for bytes, each rounding the result of the same fp32
// arithmetic: kBf16Moments stores exp_avg and exp_avg_sq as bf16 (round to
// nearest even) beside the fp32 master; kBf16 also has no fp32 master: the
// weights are bf16, updated in place and rounded stochastically (the bits of
// a hash of sr_seed and the element's index in its tensor), so that updates
// smaller than half a bf16 ulp still move the weights on average.
//
// kFp8Moments (fp32 master) and kFp8 (bf16 weights, as kBf16) keep each moment
// in one byte an element: float8 e4m3 bits (torch.float8_e4m3fn: sign, 4
// exponent bits of bias 7, 3 mantissa bits, subnormals, 448 the largest,
// 0x7f NaN) of the value divided by its block's scale, a power of two 2^k
// (k one signed byte per block of kFp8Block elements from the buffer's
// start). exp_avg_sq is kept as its square root, whose range an 8-bit format
// covers twice as well. The update runs on the decoded moments with the exact
// arithmetic (its vector loop's formula for every element); each block's new
// scale is the smallest power of two that brings its largest magnitude to at
// most 448, and the values are rounded stochastically (16 random bits from
// sr_seed and the element's index, as the bf16 weights'), so the moments'
// small increments are kept on average; a nonzero root never rounds to zero
// (its square is a denominator).
enum class State : int { kFp32 = 0, kBf16Moments = 1, kBf16 = 2, kFp8Moments = 3, kFp8 = 4 };

constexpr size_t kFp8Block = 256;

// Per-call constants, already rounded to fp32 exactly where torch rounds them,
// so every variant reproduces the arithmetic of torch's fused CPU Adam(W)
// (torch.optim.AdamW(fused=True)) bit for bit:
//   g  = grad * grad_scale;  g = -g if maximize
//   p  = p * decay                   (decoupled weight decay, AdamW)
//   g  = fma(p, l2, g)               (L2 weight decay, Adam)
//   m  = lerp(m, g, 1 - beta1)       (torch's lerp: fma form)
//   v  = fma((1 - beta2) * g, g, v * beta2)       (torch's vector loop)
//   v  = fma(v, beta2, (1 - beta2) * g * g)       (its scalar tail: elements from tail_from on)
//   vm = max(vmax, v)                (amsgrad only; stored back to vmax)
//   d  = sqrt(v or vm) / bias_correction2_sqrt + eps
//   p  = p + (-step_size * m) / d
//   out = round_nearest_even(p)      (optional bf16/fp16 copy)
// (the compact State forms round m and v to bf16, and with kBf16 p
// stochastically, when they are stored).
// Every multiply-add the compiler could fuse would change a rounding: the
// kernel is built with -ffp-contract=off, and its FMAs are the explicit ones.
struct AdamArgs {
  void* param;            // fp32, or bf16 with State::kBf16 and State::kFp8
  const void* grad;
  void* exp_avg;          // fp32, bf16 with a bf16 State, float8 e4m3 bits with an 8-bit one
  void* exp_avg_sq;       // as exp_avg
  float* max_exp_avg_sq;  // nullptr unless amsgrad (State::kFp32 only)
  int8_t* moment_exponents;  // the 8-bit forms: each block's k, exp_avg's blocks then exp_avg_sq's (nullptr else)
  size_t nblocks;            // blocks of kFp8Block elements (the last may be partial)
  void* param_out;        // nullptr unless out_dtype != kNone (never with State::kBf16)
  DType grad_dtype;
  DType out_dtype;
  State state;
  uint64_t sr_seed;       // bf16 weights, 8-bit moments: the stochastic rounding's seed (one per tensor and step)
  uint64_t first_index;   // the index in its tensor of element 0 (the stochastic rounding hashes it)
  float grad_scale;
  bool maximize;
  int weight_decay_mode;  // 0: none, 1: decoupled (param *= decay), 2: L2 (g += l2 * p)
  float decay;            // 1 - lr * weight_decay
  float l2;               // weight_decay
  float lerp_weight;      // 1 - beta1
  bool lerp_small;        // |1 - beta1| < 0.5 selects torch's first lerp form
  float one_minus_lerp;   // 1 - lerp_weight (second lerp form)
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;
  float eps;
  float neg_step_size;
  size_t tail_from;       // first element (of [0, numel)) of torch's tail: the tensor's last numel % 8
  size_t prefetch_elems;  // software prefetch distance (0: none)
};

// Arguments of the bandwidth probe: the update's exact memory traffic
// (read param, exp_avg, exp_avg_sq and grad; write the first three back and
// optionally a low-precision copy) with trivial arithmetic.
struct ProbeArgs {
  float* a;
  float* b;
  float* c;
  const void* grad;
  void* out;
  DType grad_dtype;
  DType out_dtype;
  size_t prefetch_elems;
};

// One variant per instruction set; each processes elements [begin, end).
void adam_range_scalar(const AdamArgs& args, size_t begin, size_t end);
void probe_range_scalar(const ProbeArgs& args, size_t begin, size_t end);
#if defined(__x86_64__) || defined(_M_X64)
void adam_range_avx2(const AdamArgs& args, size_t begin, size_t end);
void probe_range_avx2(const ProbeArgs& args, size_t begin, size_t end);
void adam_range_avx512(const AdamArgs& args, size_t begin, size_t end);
void probe_range_avx512(const ProbeArgs& args, size_t begin, size_t end);
#endif
#if defined(__aarch64__)
void adam_range_neon(const AdamArgs& args, size_t begin, size_t end);
void probe_range_neon(const ProbeArgs& args, size_t begin, size_t end);
#endif

}  // namespace adam
}  // namespace nvoffload
