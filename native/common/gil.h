// Releasing the GIL around native work in a way that is safe at interpreter exit.
//
// While the interpreter finalizes, CPython before 3.14 ends every other thread
// that asks for the GIL back (PyEval_RestoreThread) with pthread_exit(). That
// unwinds the thread's stack with a "forced unwind", and a forced unwind that
// reaches a noexcept frame calls std::terminate. pybind11's gil_scoped_release
// takes the GIL back in its destructor, which is noexcept: a daemon Python
// thread that is inside a native call when the main thread starts finalizing
// aborts the whole process ("terminate called without an active exception",
// SIGABRT) instead of vanishing quietly. `ReleaseGil` catches that unwind where
// it starts and parks the thread until the process ends, as Python 3.14 does
// for such threads; the interpreter's own thread (and any thread before
// finalization) takes the GIL back as usual.
#pragma once

#include <Python.h>
#include <cxxabi.h>
#include <unistd.h>

namespace nvo_py {

// Blocks the calling thread until the process exits.
[[noreturn]] inline void park_forever() {
  for (;;) pause();
}

// Takes back the GIL released by PyEval_SaveThread, or never returns when the
// interpreter is finalizing and ends this thread (see above).
__attribute__((noinline)) inline void restore_thread(PyThreadState* state) {
  try {
    PyEval_RestoreThread(state);
  } catch (abi::__forced_unwind&) {
    // The thread must not unwind through noexcept frames (our destructor,
    // pybind11's dispatcher state): keep it here, holding nothing, until exit.
    park_forever();
  }
}

// Releases the GIL for its lifetime; usable as py::call_guard<nvo_py::ReleaseGil>.
class ReleaseGil {
 public:
  ReleaseGil() : state_(PyEval_SaveThread()) {}
  ~ReleaseGil() { restore_thread(state_); }
  ReleaseGil(const ReleaseGil&) = delete;
  ReleaseGil& operator=(const ReleaseGil&) = delete;

 private:
  PyThreadState* state_;
};

}  // namespace nvo_py
