"""GPUDirect Storage through kvikio: NVMe to CUDA memory without a host bounce, for the transfer engine.

kvikio is an optional dependency (``pip install nvoffload[gpu]``), imported
lazily: it needs a GPU driver, and the package works without it. GDS is used
only where kvikio reports that it is *not* in compatibility mode: in that mode
kvikio moves the bytes by POSIX I/O through its own bounce buffer, slower than
the engine's native path through its slab.
"""

from __future__ import annotations

import errno
import functools
import time

import torch

from nvoffload import device

__all__ = ["GDSFile", "compat_mode", "gds_available"]


@functools.cache
def gds_available() -> bool:
    """True when CUDA is present, kvikio imports, and kvikio is not in compatibility mode (:func:`compat_mode`)."""
    if not device.cuda_available():
        return False
    try:
        import kvikio
    except ImportError:
        return False
    return not compat_mode(kvikio)


def compat_mode(kvikio) -> bool:
    """Whether ``kvikio`` would move bytes by POSIX I/O instead of cuFile.

    kvikio 24.12 and later say so with ``defaults.is_compat_mode_preferred()``
    (its ``AUTO`` mode resolved); older ones with ``defaults.compat_mode()``, a
    bool before 24.12. A mode this cannot tell (``AUTO`` without the resolving
    call) counts as compatibility mode: the native path is then the sure one.
    """
    defaults = kvikio.defaults
    preferred = getattr(defaults, "is_compat_mode_preferred", None)
    if preferred is not None:
        return bool(preferred())
    mode = defaults.compat_mode()
    if isinstance(mode, bool):
        return mode
    return getattr(mode, "name", None) != "OFF"


class _KvikioTicket:
    """A kvikio future with the ticket interface of the native engine."""

    def __init__(self, future, nbytes: int, call: str, offset: int):
        self._future, self._nbytes, self._call, self._offset = future, nbytes, call, offset
        self._failure = None
        self._finished = False

    def done(self) -> bool:
        return self._finished or self._future.done()

    def wait(self, timeout_s: float = -1.0) -> bool:
        deadline = None if timeout_s < 0 else time.monotonic() + timeout_s
        while deadline is not None and not self._future.done():
            if time.monotonic() >= deadline:
                return False
            time.sleep(1e-4)
        if not self._finished:
            try:
                moved = self._future.get()
                if moved != self._nbytes:
                    self._failure = (errno.ENODATA if self._call == "cuFileRead" else errno.ENOSPC, self._call, self._offset)
            except OSError as exc:
                self._failure = (exc.errno or errno.EIO, self._call, self._offset)
            except RuntimeError:
                self._failure = (errno.EIO, self._call, self._offset)
            self._finished = True
        return True

    def error(self):
        return self._failure


class GDSFile:
    """A swap file opened for cuFile transfers."""

    def __init__(self, path: str):
        import kvikio

        self._file = kvikio.CuFile(path, "r+")

    def submit(self, buffer: torch.Tensor, offset: int, *, write: bool) -> _KvikioTicket:
        """Queue a transfer between the contiguous CUDA ``buffer`` and the file at ``offset``."""
        nbytes = buffer.numel() * buffer.element_size()
        if write:
            return _KvikioTicket(self._file.pwrite(buffer, nbytes, offset), nbytes, "cuFileWrite", offset)
        return _KvikioTicket(self._file.pread(buffer, nbytes, offset), nbytes, "cuFileRead", offset)

    def close(self) -> None:
        self._file.close()
