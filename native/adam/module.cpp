// pybind11 face of the fused CPU Adam kernel (private module
// nvoffload.optim._adam; the public API is nvoffload.optim.kernels).
//
// Works on raw addresses and sizes only (no torch headers), checks what it can
// (sizes, null pointers, hyperparameters) and releases the GIL around the work.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "../common/gil.h"
#include "adam.h"
#include "thread_pool.h"

namespace py = pybind11;

namespace nvoffload {
namespace adam {
namespace {

// Elements per task handed to a thread: 64K floats (256 KiB of each fp32
// array) keep the hardware prefetchers streaming and let idle cores steal work.
constexpr size_t kTaskElems = size_t{1} << 16;  // whole blocks of the 8-bit forms (kFp8Block)
static_assert(kTaskElems % kFp8Block == 0, "a task never splits a block");

using AdamFn = void (*)(const AdamArgs&, size_t, size_t);
using ProbeFn = void (*)(const ProbeArgs&, size_t, size_t);

bool cpu_supports(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return true;
#if defined(__x86_64__) || defined(_M_X64)
    case Isa::kAvx2:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case Isa::kAvx512:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx512f");
#endif
#if defined(__aarch64__)
    case Isa::kNeon: return true;
#endif
    default: return false;
  }
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
    case Isa::kNeon: return "neon";
  }
  return "?";
}

Isa best_isa() {
  for (Isa isa : {Isa::kAvx512, Isa::kAvx2, Isa::kNeon}) {
    if (cpu_supports(isa)) return isa;
  }
  return Isa::kScalar;
}

std::atomic<int> g_isa{-1};
std::atomic<size_t> g_prefetch{1024};  // -1: not chosen yet

Isa current_isa() {
  int v = g_isa.load();
  if (v < 0) {
    v = static_cast<int>(best_isa());
    g_isa.store(v);
  }
  return static_cast<Isa>(v);
}

AdamFn adam_fn(Isa isa) {
  switch (isa) {
#if defined(__x86_64__) || defined(_M_X64)
    case Isa::kAvx2: return adam_range_avx2;
    case Isa::kAvx512: return adam_range_avx512;
#endif
#if defined(__aarch64__)
    case Isa::kNeon: return adam_range_neon;
#endif
    default: return adam_range_scalar;
  }
}

ProbeFn probe_fn(Isa isa) {
  switch (isa) {
#if defined(__x86_64__) || defined(_M_X64)
    case Isa::kAvx2: return probe_range_avx2;
    case Isa::kAvx512: return probe_range_avx512;
#endif
#if defined(__aarch64__)
    case Isa::kNeon: return probe_range_neon;
#endif
    default: return probe_range_scalar;
  }
}

template <class Args, class Fn>
struct Job {
  const Args* args;
  Fn fn;
  size_t numel;
  static void task(void* ctx, size_t t) {
    const auto* job = static_cast<const Job*>(ctx);
    const size_t begin = t * kTaskElems;
    const size_t end = begin + kTaskElems < job->numel ? begin + kTaskElems : job->numel;
    job->fn(*job->args, begin, end);
  }
};

template <class Args, class Fn>
void run_parallel(const Args& args, Fn fn, size_t numel) {
  if (numel == 0) return;
  const size_t ntasks = (numel + kTaskElems - 1) / kTaskElems;
  if (ntasks == 1) {  // not worth waking the pool
    fn(args, 0, numel);
    return;
  }
  Job<Args, Fn> job{&args, fn, numel};
  global_pool()->run(ntasks, &Job<Args, Fn>::task, &job);
}

DType dtype_from(int code, const char* what, bool allow_none) {
  if (code == static_cast<int>(DType::kFloat32) || code == static_cast<int>(DType::kBFloat16) ||
      code == static_cast<int>(DType::kFloat16) || (allow_none && code == static_cast<int>(DType::kNone))) {
    return static_cast<DType>(code);
  }
  throw std::invalid_argument(std::string("invalid ") + what + " dtype code " + std::to_string(code));
}

void require_finite(double x, const char* name) {
  if (!std::isfinite(x)) throw std::invalid_argument(std::string(name) + " must be finite, got " + std::to_string(x));
}

template <class T>
T* pointer(uintptr_t address, const char* name, size_t numel) {
  if (address == 0 && numel > 0) throw std::invalid_argument(std::string(name) + " is a null pointer");
  return reinterpret_cast<T*>(address);
}

void adam_step(uintptr_t param, uintptr_t grad, uintptr_t exp_avg, uintptr_t exp_avg_sq, uintptr_t max_exp_avg_sq,
               uintptr_t moment_exponents, uintptr_t param_out, size_t numel, size_t tail_from, int grad_dtype,
               int out_dtype, int state, uint64_t sr_seed, uint64_t first_index, int64_t step, double lr, double beta1,
               double beta2, double eps, double weight_decay, bool decoupled_weight_decay, double grad_scale,
               bool maximize) {
  if (step < 1) throw std::invalid_argument("step must be >= 1 (1-based, as in torch), got " + std::to_string(step));
  if (tail_from > numel) {
    throw std::invalid_argument("tail_from " + std::to_string(tail_from) + " is past numel " + std::to_string(numel));
  }
  require_finite(lr, "lr");
  require_finite(beta1, "beta1");
  require_finite(beta2, "beta2");
  require_finite(eps, "eps");
  require_finite(weight_decay, "weight_decay");
  require_finite(grad_scale, "grad_scale");
  if (state < static_cast<int>(State::kFp32) || state > static_cast<int>(State::kFp8)) {
    throw std::invalid_argument("invalid state code " + std::to_string(state));
  }
  AdamArgs a{};
  a.state = static_cast<State>(state);
  a.param = pointer<void>(param, "param", numel);
  a.grad = pointer<const void>(grad, "grad", numel);
  a.exp_avg = pointer<void>(exp_avg, "exp_avg", numel);
  a.exp_avg_sq = pointer<void>(exp_avg_sq, "exp_avg_sq", numel);
  a.max_exp_avg_sq = reinterpret_cast<float*>(max_exp_avg_sq);
  if (a.max_exp_avg_sq != nullptr && a.state != State::kFp32) {
    throw std::invalid_argument("amsgrad (max_exp_avg_sq) needs the fp32 state");
  }
  const bool eight_bit = a.state == State::kFp8Moments || a.state == State::kFp8;
  a.nblocks = (numel + kFp8Block - 1) / kFp8Block;
  a.moment_exponents = eight_bit ? pointer<int8_t>(moment_exponents, "moment_exponents", numel) : nullptr;
  a.grad_dtype = dtype_from(grad_dtype, "grad", false);
  a.out_dtype = dtype_from(out_dtype, "param_out", true);
  if (a.out_dtype == DType::kFloat32) throw std::invalid_argument("param_out must be bfloat16 or float16");
  if (a.out_dtype != DType::kNone && (a.state == State::kBf16 || a.state == State::kFp8)) {
    throw std::invalid_argument("param_out with bf16 weights: the weights are their own copy");
  }
  a.param_out = a.out_dtype == DType::kNone ? nullptr : pointer<void>(param_out, "param_out", numel);
  a.sr_seed = sr_seed;
  a.first_index = first_index;
  // Scalars exactly as torch computes them (in doubles: its fused kernel's, or
  // _single_tensor_adam's Python floats), rounded to fp32 where torch rounds them.
  const double s = static_cast<double>(step);
  const double bias_correction1 = 1.0 - std::pow(beta1, s);
  const double bias_correction2 = 1.0 - std::pow(beta2, s);
  const double step_size = lr / bias_correction1;
  const double bias_correction2_sqrt = std::pow(bias_correction2, 0.5);
  a.grad_scale = static_cast<float>(grad_scale);
  a.maximize = maximize;
  a.weight_decay_mode = weight_decay == 0.0 ? 0 : (decoupled_weight_decay ? 1 : 2);
  a.decay = static_cast<float>(1.0 - lr * weight_decay);
  a.l2 = static_cast<float>(weight_decay);
  a.lerp_weight = static_cast<float>(1.0 - beta1);
  a.lerp_small = std::fabs(a.lerp_weight) < 0.5f;
  a.one_minus_lerp = 1.0f - a.lerp_weight;
  a.beta2 = static_cast<float>(beta2);
  a.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  a.bias_correction2_sqrt = static_cast<float>(bias_correction2_sqrt);
  a.eps = static_cast<float>(eps);
  a.neg_step_size = static_cast<float>(-step_size);
  a.tail_from = tail_from;
  a.prefetch_elems = g_prefetch.load();
  const AdamFn fn = adam_fn(current_isa());
  nvo_py::ReleaseGil release;  // safe in a daemon thread at interpreter exit
  run_parallel(a, fn, numel);
}

void stream_probe(uintptr_t a, uintptr_t b, uintptr_t c, uintptr_t grad, uintptr_t out, size_t numel, int grad_dtype,
                  int out_dtype) {
  ProbeArgs p{};
  p.a = pointer<float>(a, "a", numel);
  p.b = pointer<float>(b, "b", numel);
  p.c = pointer<float>(c, "c", numel);
  p.grad = pointer<const void>(grad, "grad", numel);
  p.grad_dtype = dtype_from(grad_dtype, "grad", false);
  p.out_dtype = dtype_from(out_dtype, "out", true);
  if (p.out_dtype == DType::kFloat32) throw std::invalid_argument("out must be bfloat16 or float16");
  p.out = p.out_dtype == DType::kNone ? nullptr : pointer<void>(out, "out", numel);
  p.prefetch_elems = g_prefetch.load();
  const ProbeFn fn = probe_fn(current_isa());
  nvo_py::ReleaseGil release;  // safe in a daemon thread at interpreter exit
  run_parallel(p, fn, numel);
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> out;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kNeon}) {
    if (cpu_supports(isa)) out.emplace_back(isa_name(isa));
  }
  return out;
}

std::string set_isa(const std::string& name) {
  const std::string previous = isa_name(current_isa());
  Isa chosen;
  if (name == "auto") {
    chosen = best_isa();
  } else {
    bool found = false;
    for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kNeon}) {
      if (name == isa_name(isa)) {
        chosen = isa;
        found = true;
      }
    }
    if (!found) throw std::invalid_argument("unknown instruction set '" + name + "' (scalar, avx2, avx512, neon, auto)");
    if (!cpu_supports(chosen)) throw std::invalid_argument("this CPU does not support '" + name + "'");
  }
  g_isa.store(static_cast<int>(chosen));
  return previous;
}

}  // namespace
}  // namespace adam
}  // namespace nvoffload

PYBIND11_MODULE(_adam, m) {
  using namespace nvoffload::adam;
  m.doc() = "nvoffload fused CPU Adam kernel (private; use nvoffload.optim.kernels)";
  m.attr("FLOAT32") = static_cast<int>(DType::kFloat32);
  m.attr("BFLOAT16") = static_cast<int>(DType::kBFloat16);
  m.attr("FLOAT16") = static_cast<int>(DType::kFloat16);
  m.attr("NONE") = static_cast<int>(DType::kNone);
  m.attr("STATE_FP32") = static_cast<int>(State::kFp32);
  m.attr("STATE_BF16_MOMENTS") = static_cast<int>(State::kBf16Moments);
  m.attr("STATE_BF16") = static_cast<int>(State::kBf16);
  m.attr("STATE_FP8_MOMENTS") = static_cast<int>(State::kFp8Moments);
  m.attr("STATE_FP8") = static_cast<int>(State::kFp8);
  m.attr("FP8_BLOCK") = kFp8Block;
  m.def("adam_step", &adam_step, py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("max_exp_avg_sq"), py::arg("moment_exponents"), py::arg("param_out"), py::arg("numel"),
        py::arg("tail_from"), py::arg("grad_dtype"), py::arg("out_dtype"), py::arg("state"), py::arg("sr_seed"),
        py::arg("first_index"), py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("decoupled_weight_decay"), py::arg("grad_scale"), py::arg("maximize"),
        "One fused Adam/AdamW step over numel elements at the given addresses, those from tail_from on with the"
        " arithmetic of torch's scalar tail (GIL released).");
  m.def("stream_probe", &stream_probe, py::arg("a"), py::arg("b"), py::arg("c"), py::arg("grad"), py::arg("out"),
        py::arg("numel"), py::arg("grad_dtype"), py::arg("out_dtype"),
        "Bandwidth probe with the update's memory traffic: a, b, c += grad; out = a (GIL released).");
  m.def("supported_isas", &supported_isas, "Instruction sets this CPU can run, e.g. ['scalar', 'avx2'].");
  m.def("current_isa", [] { return std::string(isa_name(current_isa())); }, "Instruction set in use.");
  m.def("set_isa", &set_isa, py::arg("name"), "Use the named instruction set ('auto' = best); returns the previous one.");
  m.def("set_num_threads", &set_num_threads, py::arg("num_threads"), "Kernel threads (0 = the CPUs this process may use).");
  m.def("_set_prefetch", [](size_t n) { g_prefetch.store(n); });
  m.def("get_num_threads", &num_threads, "Kernel threads in use.");
}
