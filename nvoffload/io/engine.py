"""The async I/O engine: submit a read or write of a buffer at a file offset, get a :class:`~nvoffload.transfer.Future`."""

from __future__ import annotations

import errno
import functools
import os
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from nvoffload import trace
from nvoffload.core.future import Future
from nvoffload.core.native import native_module
from nvoffload.core.workers import finish_before_exit, finished
from nvoffload.io.config import ALIGNMENT_BYTES, DirectIO, IOConfig
from nvoffload.io.errors import StoreIOError

__all__ = ["IOEngine", "NativePart", "OpenFile"]

_aio = native_module("nvoffload.io._aio")


@dataclass(frozen=True)
class OpenFile:
    """A file opened by :meth:`IOEngine.open`; ``direct`` tells whether O_DIRECT is on."""

    path: str
    fd: int
    direct: bool


class NativePart:
    """One native request as a part of a :class:`~nvoffload.transfer.Future`: its ticket, and where it went.

    With a :mod:`nvoffload.trace` active, the request becomes a span of ``nvme read`` or ``nvme write`` once
    its future collects it (the native ticket keeps when its first block started and its last ended)."""

    __slots__ = ("ticket", "path", "offset", "write", "nbytes")

    def __init__(self, ticket: Any, path: str, offset: int, *, write: bool, nbytes: int):
        self.ticket, self.path, self.offset, self.write, self.nbytes = ticket, path, offset, write, nbytes

    def done(self) -> bool:
        return self.ticket.done()

    def wait(self, timeout_s: float) -> bool:
        return self.ticket.wait(timeout_s)

    def crc(self) -> int:
        """The CRC-32C of the request's valid bytes, computed by the I/O threads block by block (submitted with
        ``checksum=True``; once done)."""
        return self.ticket.crc()

    def error(self, what: str | None) -> StoreIOError | None:
        recording = trace.active()
        if recording is not None and hasattr(self.ticket, "finished_ns") and self.ticket.finished_ns():
            recording.add(
                "nvme write" if self.write else "nvme read", what or os.path.basename(self.path),
                self.ticket.started_ns(), self.ticket.finished_ns(), bytes=self.nbytes,
            )  # fmt: skip
        failure = self.ticket.error()
        if failure is None:
            return None
        err, call, block_offset = failure
        return StoreIOError(err, call, self.path, block_offset, what)


class IOEngine:
    """A pool of native threads doing pread/pwrite, with O_DIRECT where the file system allows.

    >>> import tempfile, torch
    >>> from nvoffload.io import IOEngine, aligned_empty
    >>> with IOEngine() as engine, tempfile.TemporaryDirectory() as d:
    ...     f = engine.open(f"{d}/data", create=True)
    ...     buf = aligned_empty(8192).fill_(7)
    ...     engine.pwrite(f, buf, 0).result()
    ...     back = aligned_empty(8192)
    ...     _ = engine.pread(f, back, 0).result()
    ...     engine.close_file(f)
    ...     bool((back == 7).all())
    True
    """

    def __init__(self, config: IOConfig | None = None):
        self.config = config or IOConfig()
        self._native = _aio.Engine(self.config.num_threads, self.config.block_size_bytes, self.config.queue_depth)
        self._warned_paths: set[str] = set()
        # At exit, an engine still open (its store never closed) finishes its blocks before the host slabs they
        # read into are unmapped (core.workers); held weakly: a dropped engine drains as it is freed.
        self._at_exit = weakref.ref(self, finished)
        finish_before_exit(self._at_exit, functools.partial(_close_if_alive, self._at_exit))

    def open(self, path: str | os.PathLike, *, create: bool = False) -> OpenFile:
        """Open ``path`` read-write (``create``: a new file, failing if it exists).

        With ``DirectIO.AUTO`` a file system that refuses O_DIRECT gets buffered
        I/O and one warning per directory; with ``DirectIO.ON`` it raises.
        """
        path = os.fspath(path)
        mode = self.config.direct_io
        if mode is not DirectIO.OFF:
            try:
                return OpenFile(path, _aio.open_file(path, create, True), True)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                if create:
                    # Linux creates the file before it checks O_DIRECT, and O_EXCL
                    # made it ours: remove it so neither the retry nor the error leaves it.
                    try:
                        os.unlink(path)
                    except FileNotFoundError:
                        pass
                if mode is DirectIO.ON:
                    raise
                directory = os.path.dirname(path) or "."
                if directory not in self._warned_paths:
                    self._warned_paths.add(directory)
                    warnings.warn(
                        f"the file system of {directory} refuses O_DIRECT; nvoffload falls back to "
                        "buffered I/O there (slower, and it fills the page cache)",
                        RuntimeWarning,
                        stacklevel=2,
                    )
        return OpenFile(path, _aio.open_file(path, create, False), False)

    def close_file(self, file: OpenFile) -> None:
        _aio.close_file(file.fd)

    def allocate(self, file: OpenFile, offset: int, nbytes: int) -> None:
        """Reserve disk space for ``[offset, offset + nbytes)`` (raises ENOSPC when full)."""
        _aio.allocate_file(file.fd, offset, nbytes, file.path)

    def pread(self, file: OpenFile, buffer: torch.Tensor, offset: int) -> Future:
        """Read ``buffer.nbytes`` bytes at ``offset`` into the contiguous CPU ``buffer``."""
        return Future([self.submit(file, buffer, offset, write=False)], keepalive=buffer)

    def pwrite(self, file: OpenFile, buffer: torch.Tensor, offset: int) -> Future:
        """Write the contiguous CPU ``buffer`` at ``offset``."""
        return Future([self.submit(file, buffer, offset, write=True)], keepalive=buffer)

    def submit(
        self, file: OpenFile, buffer: torch.Tensor, offset: int, *, write: bool, nbytes: int | None = None,
        checksum: bool = False,
    ) -> NativePart:
        """Queue one transfer of ``nbytes`` at ``offset`` and return it as a part of a :class:`~nvoffload.transfer.Future`.

        ``buffer`` (contiguous, CPU) backs the first bytes of the transfer;
        ``nbytes`` (default: the buffer's size) may pad it: zeros are written
        and the bytes read are dropped. On an O_DIRECT file ``offset`` and
        ``nbytes`` must be multiples of 4 KiB. The buffer's address need not be
        aligned: blocks of an unaligned or padded buffer pass through each
        worker thread's aligned bounce buffer (a copy, on the I/O threads).
        With ``checksum`` each I/O thread also computes the CRC-32C of the
        buffer's bytes in its blocks (a write's before writing them, a read's
        once read), joined per request by :meth:`NativePart.crc`.
        """
        native = self._native
        if native is None:
            raise RuntimeError(f"the IOEngine is closed: cannot {'write' if write else 'read'} {file.path}")
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError("I/O buffers must be contiguous CPU tensors")
        valid = buffer.numel() * buffer.element_size()
        nbytes = valid if nbytes is None else nbytes
        if nbytes < valid:
            raise ValueError(f"nbytes ({nbytes}) is smaller than the buffer ({valid} bytes)")
        if file.direct and (nbytes % ALIGNMENT_BYTES or offset % ALIGNMENT_BYTES):
            raise ValueError(
                f"O_DIRECT I/O on {file.path} needs sizes and offsets in multiples of 4 KiB "
                f"(got {nbytes} bytes at offset {offset})"
            )
        ticket = native.submit(file.fd, buffer.data_ptr(), nbytes, valid, offset, write, checksum)
        return NativePart(ticket, file.path, offset, write=write, nbytes=nbytes)

    def inject_fault(self, fault: str, after_ops: int = 0) -> None:
        """Testing hook: one block operation fails, after ``after_ops`` others it applies to.

        ``fault`` is ``"enospc"`` (writes), ``"eio"`` (reads or writes) or
        ``"short_read"`` (reads: the file ends early).
        """
        self._native.inject_fault(fault, after_ops)

    @staticmethod
    def inject_direct_refusal() -> None:
        """Testing hook: the next O_DIRECT open fails with EINVAL, like tmpfs of old kernels."""
        _aio.inject_direct_refusal()

    def close(self) -> None:
        """Stop the worker threads once every queued block has run. Idempotent."""
        self._native = None  # the native destructor drains the queue and joins the threads
        finished(self._at_exit)

    def __enter__(self) -> IOEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _close_if_alive(ref: weakref.ref) -> None:
    engine = ref()
    if engine is not None:
        engine.close()
