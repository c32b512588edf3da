import importlib.util
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
HAS_KVIKIO = HAS_CUDA and importlib.util.find_spec("kvikio") is not None

# Devices found at import: tests parametrized over DEVICES run on the CPU
# everywhere and on the GPU where there is one.
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


def mapping_size(address: int) -> int:
    """Size of the /proc/self/maps mapping that contains ``address`` (a host slab's real footprint)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return hi - lo
    raise LookupError(f"no mapping holds {address:#x}")


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_gds = pytest.mark.skip(reason="needs CUDA and kvikio")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)
        if "gds" in item.keywords and not HAS_KVIKIO:
            item.add_marker(skip_gds)


def flip_stored_byte(store, name: str, at: int = 100) -> None:
    """Flip one bit of the bytes stored under ``name``, on disk."""
    extent = store._records[name].extents[0]
    fd = os.open(extent.swap.file.path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, extent.offset + at)
        os.pwrite(fd, bytes([byte[0] ^ 0x04]), extent.offset + at)
        os.fsync(fd)
    finally:
        os.close(fd)
