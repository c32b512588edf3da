// Private binding of the I/O engine: every blocking call releases the GIL
// (with nvo_py::ReleaseGil, which is safe in a daemon thread at interpreter exit).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <unistd.h>

#include <cstring>

#include "../common/gil.h"
#include "crc32c.h"
#include "engine.h"

namespace py = pybind11;
using nvo::Engine;
using nvo::Fault;
using nvo::Ticket;

namespace {

void raise_errno(int err, const std::string& call, const std::string& path) {
  PyErr_SetObject(PyExc_OSError,
                  py::make_tuple(err, call + ": " + std::strerror(err), path).ptr());
  throw py::error_already_set();
}

Fault parse_fault(const std::string& name) {
  if (name == "enospc") return Fault::kEnospc;
  if (name == "eio") return Fault::kEio;
  if (name == "short_read") return Fault::kShortRead;
  throw py::value_error("unknown fault '" + name + "'; use enospc, eio or short_read");
}

}  // namespace

PYBIND11_MODULE(_aio, m) {
  m.doc() = "nvoffload native I/O engine (private)";

  py::class_<Ticket, std::shared_ptr<Ticket>>(m, "Ticket")
      .def("done", &Ticket::done, py::call_guard<nvo_py::ReleaseGil>())
      .def("wait", &Ticket::wait, py::arg("timeout_s") = -1.0, py::call_guard<nvo_py::ReleaseGil>())
      .def("started_ns", &Ticket::started_ns)
      .def("finished_ns", &Ticket::finished_ns)
      .def("crc",
           [](Ticket& t) {
             if (!t.checksummed()) throw py::value_error("the request was submitted without checksum=True");
             if (!t.done()) throw py::value_error("the request is not done yet");
             return t.crc();
           })
      .def("error", [](Ticket& t) -> py::object {
        if (t.error() == 0) return py::none();
        return py::make_tuple(t.error(), std::string(t.failed_call()), t.failed_offset());
      });

  py::class_<Engine>(m, "Engine")
      .def(py::init<int, size_t, size_t>(), py::arg("num_threads"), py::arg("block_size_bytes"),
           py::arg("queue_depth"))
      .def(
          "submit",
          [](Engine& e, int fd, uintptr_t ptr, size_t nbytes, size_t valid_bytes, int64_t offset, bool write,
             bool checksum) {
            if (valid_bytes > nbytes) throw py::value_error("valid_bytes exceeds nbytes");
            return e.submit(fd, reinterpret_cast<char*>(ptr), nbytes, valid_bytes, offset, write, checksum);
          },
          py::arg("fd"), py::arg("ptr"), py::arg("nbytes"), py::arg("valid_bytes"), py::arg("offset"), py::arg("write"),
          py::arg("checksum") = false,
          py::call_guard<nvo_py::ReleaseGil>())
      .def(
          "inject_fault",
          [](Engine& e, const std::string& fault, int64_t after_ops) { e.inject_fault(parse_fault(fault), after_ops); },
          py::arg("fault"), py::arg("after_ops") = 0);

  m.def(
      "open_file",
      [](const std::string& path, bool create, bool direct) {
        int fd = -1, err;
        {
          nvo_py::ReleaseGil release;
          err = nvo::open_file(path, create, direct, &fd);
        }
        if (err) raise_errno(err, direct ? "open(O_DIRECT)" : "open", path);
        return fd;
      },
      py::arg("path"), py::arg("create"), py::arg("direct"));
  m.def(
      "allocate_file",
      [](int fd, int64_t offset, int64_t nbytes, const std::string& path) {
        int err;
        {
          nvo_py::ReleaseGil release;
          err = nvo::allocate_file(fd, offset, nbytes);
        }
        if (err) raise_errno(err, "posix_fallocate", path);
      },
      py::arg("fd"), py::arg("offset"), py::arg("nbytes"), py::arg("path"));
  m.def("close_file", [](int fd) { ::close(fd); }, py::arg("fd"));
  m.def("inject_direct_refusal", &nvo::inject_direct_refusal);
  m.def(
      "crc32c",
      [](uintptr_t ptr, size_t nbytes, uint32_t crc, bool hardware) {
        const void* data = reinterpret_cast<const void*>(ptr);
        return hardware ? nvo::crc32c(data, nbytes, crc) : nvo::crc32c_software(data, nbytes, crc);
      },
      py::arg("ptr"), py::arg("nbytes"), py::arg("crc") = 0, py::arg("hardware") = true,
      py::call_guard<nvo_py::ReleaseGil>());
  m.def("crc32c_combine", &nvo::crc32c_combine, py::arg("crc_a"), py::arg("crc_b"), py::arg("len_b"));
}
