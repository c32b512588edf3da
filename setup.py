"""Builds nvoffload's native core: two small pybind11 extensions with no PyTorch headers.

``nvoffload.io._aio`` (the O_DIRECT I/O engine, from ``native/io``) and
``nvoffload.optim._adam`` (the fused CPU Adam kernel, from ``native/adam``) work
on raw pointers and sizes, so they build in seconds and do not depend on the
torch ABI.
"""

from glob import glob

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

ParallelCompile("NVOFFLOAD_BUILD_JOBS", default=0).install()

# -ffp-contract=off: no multiply-add fused behind the code's back (the Adam kernel rounds as torch does).
COMPILE_ARGS = ["-O3", "-ffp-contract=off", "-fvisibility=hidden", "-pthread", "-Wall", "-Wextra"]


def native_extension(name: str, source_dir: str) -> Pybind11Extension:
    return Pybind11Extension(
        name,
        sorted(glob(f"{source_dir}/*.cpp")),
        depends=sorted(glob(f"{source_dir}/*.h") + glob("native/common/*.h")),  # a changed header rebuilds it too
        include_dirs=[source_dir],
        cxx_std=17,
        extra_compile_args=COMPILE_ARGS,
        extra_link_args=["-pthread"],
    )


setup(
    ext_modules=[
        native_extension("nvoffload.io._aio", "native/io"),
        native_extension("nvoffload.optim._adam", "native/adam"),
    ],
    cmdclass={"build_ext": build_ext},
)
