#include <pybind11/pybind11.h>

PYBIND11_MODULE(_adam, m) { m.doc() = "nvoffload fused CPU Adam kernel (private)"; }
