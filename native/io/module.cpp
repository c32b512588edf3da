#include <pybind11/pybind11.h>

PYBIND11_MODULE(_aio, m) { m.doc() = "nvoffload native I/O engine (private)"; }
