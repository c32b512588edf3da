"""TensorStore: named tensors in aligned extents of swap files, striped over directories."""

from __future__ import annotations

import errno
import math
import os
import re
import shutil
import signal
import threading
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nvoffload.core.buffers import aligned_empty, byte_view, round_up
from nvoffload.core.deferred import Deferred
from nvoffload.core.extents import Extents
from nvoffload.core.future import Future
from nvoffload.io.checksum import crc32c_combine
from nvoffload.io.config import IOConfig
from nvoffload.io.engine import IOEngine, NativePart, OpenFile
from nvoffload.io.errors import ChecksumError, StoreIOError
from nvoffload.io.ownership import LOCK_NAME, claim

__all__ = ["ExtentIO", "StorePin", "TensorStore", "swap_directories"]

ExtentIO = Callable[[str, int, int, int], Any]
"""``io(path, offset, start, nbytes)``: the transfer of bytes ``[start, start + nbytes)`` of a tensor to or from
``path`` at ``offset``, submitted by someone other than the store (the transfer engine, by GPUDirect Storage);
returns a ticket like the native engine's: ``done()``, ``wait(timeout_s)``, ``error()`` -> None or
``(errno, call, offset)``."""


def _share_bytes(total_bytes: int, count: int) -> int:
    """Each of ``count`` swap files' aligned share of ``total_bytes``."""
    return round_up(math.ceil(total_bytes / count))


def spare_bytes(needed_bytes: int) -> int:
    """The room the free-space check asks for beyond ``needed_bytes``: 1/64 of it, at least 64 MiB.

    A tensor being replaced holds its old extents until its new copy is written (a block of weights written
    back while the optimizer's two generations are at their peak, measured one block over the count), and the
    file system's own blocks (ext4's extent tree) come out of the same free space. Other writers on the file
    system are not counted: when they take the room, the store's put fails with ENOSPC naming the swap file and
    the bytes.
    """
    return max(needed_bytes // 64, 64 << 20)


def swap_directories(swap_dirs, *, needed_bytes: int = 0, what: str = "swap files") -> list[str]:
    """The directories ``swap_dirs`` names, checked before anything is written to them.

    Args:
        swap_dirs: one path (``str`` or ``os.PathLike``) or a sequence of them.
        needed_bytes: bytes that will be spread evenly over the directories; each
            file system must have free space for the shares of the directories on it,
            and :func:`spare_bytes` more.
        what: what needs the space, for the error message.

    Raises:
        TypeError: ``swap_dirs`` is not a path or a sequence of paths.
        ValueError: an empty sequence.
        FileNotFoundError, NotADirectoryError, PermissionError: a directory that
            is missing, not a directory, or not writable (nothing is created).
        OSError: ``ENOSPC`` when a file system has too little free space.
    """
    if isinstance(swap_dirs, (str, os.PathLike)):
        entries = [swap_dirs]
    elif isinstance(swap_dirs, Sequence) and not isinstance(swap_dirs, (bytes, bytearray)):
        entries = list(swap_dirs)
    else:
        raise TypeError(f"swap directories must be a path or a list of paths, got {swap_dirs!r}")
    if not entries:
        raise ValueError("give at least one swap directory")
    dirs = []
    for entry in entries:
        if not isinstance(entry, (str, os.PathLike)):
            raise TypeError(f"swap directories must be paths (str or os.PathLike), got {entry!r}")
        d = os.fspath(entry)
        if not os.path.exists(d):
            raise FileNotFoundError(errno.ENOENT, f"swap directory {d} does not exist (create it on an NVMe drive)", d)
        if not os.path.isdir(d):
            raise NotADirectoryError(errno.ENOTDIR, f"swap directory {d} is not a directory", d)
        if not os.access(d, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, f"swap directory {d} is not writable", d)
        dirs.append(d)
    if needed_bytes > 0:
        share = _share_bytes(needed_bytes, len(dirs))
        by_fs: dict[int, list[str]] = {}
        for d in dirs:  # two directories on one file system share its free space
            by_fs.setdefault(os.stat(d).st_dev, []).append(d)
        for group in by_fs.values():
            free = shutil.disk_usage(group[0]).free
            spare = spare_bytes(share * len(group))
            if free < share * len(group) + spare:
                names = ("swap directory " if len(group) == 1 else "swap directories ") + ", ".join(group)
                raise OSError(
                    errno.ENOSPC,
                    f"{names} {'needs' if len(group) == 1 else 'need'} {share * len(group)} bytes for {what}"
                    f" and {spare} bytes to spare but the file system has only {free} bytes free",
                    group[0],
                )
    return dirs


@dataclass
class _SwapFile:
    file: OpenFile
    capacity_bytes: int | None  # None: grows as needed
    extents: Extents = field(default_factory=Extents)


@dataclass(frozen=True)
class _Extent:
    swap: _SwapFile
    offset: int
    data_bytes: int  # bytes of the tensor in this extent
    nbytes: int  # data_bytes rounded up to the alignment


@dataclass
class _Record:
    """One stored tensor: its type, where its bytes are, and the I/O still touching them."""

    name: str
    dtype: torch.dtype
    shape: torch.Size
    nbytes: int
    extents: list[_Extent]
    checksum: int | None = None  # CRC-32C of its bytes (with checksums), set when its write ended
    seq: int = 0  # order of submission among puts (a later put of a name wins)
    in_flight: list[Future] = field(default_factory=list)
    pins: int = 0  # the StorePins holding it: its extents are not reused while there are any
    dropped: bool = False  # deleted or replaced while pinned: its extents are freed with its last pin


class TensorStore:
    """Named host tensors stored in preallocated swap files, one per directory (like a kvikio ``CuFile``).

    Each tensor lives in 4 KiB-aligned extents; tensors of at least
    ``config.stripe_min_bytes`` are split evenly over the directories so that
    several NVMe drives add their bandwidth. ``put`` and ``get`` take and give
    CPU tensors and return :class:`Future`\\ s; failures raise from
    ``result()`` naming the tensor, the file and the offset. The store has no
    device code: a device tensor moves with
    :meth:`nvoffload.transfer.TransferEngine.save` and
    :meth:`~nvoffload.transfer.TransferEngine.load` (through the engine's slab
    and copy streams, or by GPUDirect Storage through :meth:`put_by` and
    :meth:`get_by`).

    Args:
        swap_dirs: one directory or a list of them (one swap file each).
        capacity_bytes: total bytes to preallocate, checked against free space
            before anything is written; ``None`` grows the files as needed.
        checksum: store a CRC-32C of each tensor and verify it on every read (a mismatch raises
            :class:`ChecksumError`). On by default. The I/O threads compute it,
            each over the blocks it moves (a write's before they go out, a
            read's once they are in), joined per tensor without reading its
            bytes again (``bench/results/bench_io.md`` has its cost). The transfer engine then
            moves CUDA tensors through host memory, where they are checksummed,
            instead of by GPUDirect Storage; ``checksum=False`` trades the check for GDS.
        config: the I/O engine's settings.

    Raises:
        ValueError: a negative ``capacity_bytes``.

    >>> import tempfile, torch
    >>> from nvoffload.io import TensorStore
    >>> with tempfile.TemporaryDirectory() as d, TensorStore(d) as store:
    ...     store.put("w", torch.arange(10, dtype=torch.bfloat16)).result()
    ...     store.get("w").result().tolist()[:3]
    [0.0, 1.0, 2.0]

    A tensor handed to ``put`` must stay alive and unmodified until its future
    is done; an ``out`` tensor handed to ``get`` must not be read before then.

    The store's lock guards its records and extents only: native requests are
    submitted after it is released (a submit blocks while the native queue is
    full), so a read never waits behind another caller's writes for the lock.
    """

    def __init__(
        self,
        swap_dirs: str | os.PathLike | Sequence[str | os.PathLike],
        capacity_bytes: int | None = None,
        *,
        checksum: bool = True,
        config: IOConfig | None = None,
    ):
        if capacity_bytes is not None and (not isinstance(capacity_bytes, int) or capacity_bytes < 0):
            raise ValueError(f"capacity_bytes must be a non-negative int or None, got {capacity_bytes!r}")
        dirs = swap_directories(swap_dirs, needed_bytes=capacity_bytes or 0, what="its share of the store's capacity")
        share = None if capacity_bytes is None else _share_bytes(capacity_bytes, len(dirs))
        releases: list = []
        try:
            for d in dirs:
                releases.append(claim(d))  # refuses a directory another live process holds
        except BaseException:
            _release_all(releases)
            raise
        self._swaps: list[_SwapFile] = []
        # A store never closed (the script ends without close(), or drops it) still removes its files.
        self._clean_up = weakref.finalize(self, _clean_up, self._swaps, releases)
        for d in dirs:
            _warn_about_orphans(d)
        _exit_cleanly_on_sigterm()

        self.checksum = checksum
        self._engine = IOEngine(config)
        self.config = self._engine.config
        self._lock = threading.Lock()
        self._records: dict[str, _Record] = {}
        self._pending_puts: dict[str, Future] = {}
        self._next_dir = 0
        self._seq = 0
        self._dirs = dirs
        self._closed = False
        self._close_hooks: list[Callable[[], None]] = []
        try:
            for d in dirs:
                path = os.path.join(d, f"nvoffload-{os.getpid()}-{uuid.uuid4().hex[:12]}.swap")
                swap = _SwapFile(self._engine.open(path, create=True), share)
                self._swaps.append(swap)
                if share:
                    self._engine.allocate(swap.file, 0, share)
                    swap.extents.end = share
                    swap.extents.give(0, share)
        except BaseException:
            self._remove_files()
            raise

    # -- public API ---------------------------------------------------------

    @property
    def swap_files(self) -> list[str]:
        """Paths of the swap files, one per directory."""
        return [s.file.path for s in self._swaps]

    @property
    def direct_io(self) -> bool:
        """True when every swap file uses O_DIRECT (False after a buffered fallback)."""
        return all(s.file.direct for s in self._swaps)

    @property
    def capacity_bytes(self) -> int:
        """Bytes the swap files hold now (preallocated or grown)."""
        return sum(s.extents.end for s in self._swaps)

    @property
    def used_bytes(self) -> int:
        """Bytes of the swap files in use by stored tensors (aligned extents)."""
        with self._lock:
            return sum(s.extents.end - s.extents.free_bytes for s in self._swaps)

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._records or name in self._pending_puts

    def __len__(self) -> int:
        with self._lock:
            return len(self._records.keys() | self._pending_puts.keys())

    def put(self, name: str, tensor: torch.Tensor) -> Future:
        """Write host ``tensor`` under ``name``; ``result()`` returns None once it is on disk.

        Any dtype but the quantized ones, any shape, size and contiguity, in
        CPU memory (a device tensor is refused: :meth:`nvoffload.transfer.TransferEngine.save`
        moves it). An older tensor of the same name is replaced once this write
        succeeds (of concurrent puts of one name, the one submitted last wins).
        The caller keeps ``tensor`` alive and unmodified until the future is
        done. I/O failures (disk full, I/O error) raise from ``result()`` naming
        the tensor, file and offset.
        """
        if not isinstance(name, str):
            raise TypeError(f"tensor names are str, got {type(name).__name__}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"put({name!r}) needs a torch.Tensor, got {type(tensor).__name__}")
        if tensor.is_sparse or tensor.layout != torch.strided or tensor.is_nested:
            raise ValueError(f"put({name!r}): only dense (strided) tensors can be stored")
        if tensor.is_quantized:
            # Their bytes mean nothing without the quantizer (scale, zero point), and torch hands
            # out a broken byte view of them: slicing it crashes the interpreter.
            raise TypeError(
                f"put({name!r}): quantized tensors ({tensor.dtype}) cannot be stored; "
                "store tensor.int_repr() and the quantization parameters instead"
            )
        _refuse_device("put", name, tensor)
        source = byte_view(tensor.detach().contiguous())  # the I/O threads bounce unaligned blocks themselves
        return self._write(name, tensor, lambda extents: self._submit(extents, source, write=True), source)

    def put_by(self, name: str, tensor: torch.Tensor, io: ExtentIO) -> Future:
        """Write the contiguous ``tensor`` under ``name``, each transfer submitted by ``io`` (:data:`ExtentIO`).

        For the transfer engine's GPUDirect Storage path
        (:meth:`nvoffload.transfer.TransferEngine.save`): ``tensor`` (device
        memory) is final when this is called. Otherwise as :meth:`put`.

        Raises:
            ValueError: a store with checksums (computed in host memory: the
                tensor moves through it), or a non-contiguous ``tensor``.
        """
        self._check_direct("put_by", name, tensor)
        return self._write(name, tensor, lambda extents: self._submit_by(extents, io, write=True), tensor)

    def get(self, name: str, out: torch.Tensor | None = None) -> Future:
        """Read the tensor stored under ``name``; ``result()`` returns it.

        Without ``out`` the result is a new CPU tensor of the stored dtype and
        shape. ``out`` (CPU, any shape and contiguity; a device tensor is
        refused: :meth:`nvoffload.transfer.TransferEngine.load` moves it) must
        have the stored dtype and number of elements; it is filled in row-major
        order and returned, and must not be read before the future is done. A
        name never written (or deleted) raises KeyError here; I/O failures and
        checksum mismatches raise from ``result()`` naming the tensor, file and offset.
        """
        if out is not None:
            _refuse_device("get", name, out)
        return self._read(name, out, None)

    def get_by(self, name: str, out: torch.Tensor, io: ExtentIO) -> Future:
        """Read ``name`` into the contiguous ``out``, each transfer submitted by ``io`` (:data:`ExtentIO`).

        For the transfer engine's GPUDirect Storage path
        (:meth:`nvoffload.transfer.TransferEngine.load`): ``out`` (device memory)
        is no longer read by anyone when this is called. Otherwise as :meth:`get`.

        Raises:
            ValueError: as :meth:`put_by`.
        """
        self._check_direct("get_by", name, out)
        return self._read(name, out, io)

    def delete(self, name: str) -> None:
        """Forget ``name`` and free its extents for reuse (after its I/O in flight ends; a pinned tensor's once its
        last :class:`StorePin` is released)."""
        self._wait_pending_put(name)
        with self._lock:
            self._check_open("delete", name)
            record = self._records.pop(name, None)
        if record is None:
            raise KeyError(f"no tensor named {name!r} in the store")
        self._release(record)

    def pin(self, names: Sequence[str]) -> StorePin:
        """Hold the tensors stored under ``names`` as they are now, for reading later with :meth:`StorePin.get`
        while the names are deleted or written again meanwhile: their extents are not reused until
        :meth:`StorePin.release` (a background checkpoint holds a generation of the optimizer's state this way
        while the next steps commit theirs). A put of a name in flight is waited for first.

        Raises:
            KeyError: a name not in the store (nothing is pinned).
        """
        for name in names:
            self._wait_pending_put(name)
        with self._lock:
            self._check_open("pin", names[0] if names else "")
            missing = [n for n in names if n not in self._records]
            if missing:
                raise KeyError(f"pin: no tensor named {missing[0]!r} in the store (never written, or deleted)")
            records = {n: self._records[n] for n in names}
            for record in records.values():
                record.pins += 1
        return StorePin(self, records)

    def on_close(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` when the store closes, once its I/O in flight is done and before its swap files are removed.

        For what holds the swap files open besides the store (the transfer
        engine's cuFile handles): a file removed while a handle is open keeps
        its disk space until that handle closes. A store already closed calls
        ``hook`` at once.
        """
        with self._lock:
            if not self._closed:
                self._close_hooks.append(hook)
                return
        hook()

    def close(self) -> None:
        """Wait for I/O in flight, run the :meth:`on_close` hooks, then close and remove the swap files. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._pending_puts.values())
            records = list(self._records.values())
            hooks, self._close_hooks = self._close_hooks, []
        for future in pending + [f for r in records for f in r.in_flight]:
            _settle(future)
        self._records.clear()
        try:
            for hook in hooks:
                hook()
        finally:
            self._engine.close()  # drains blocks no future tracks any more (a put replaced in flight)
            self._remove_files()

    def __enter__(self) -> TensorStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def inject_fault(self, fault: str, after_ops: int = 0) -> None:
        """Testing hook: see :meth:`IOEngine.inject_fault`."""
        self._engine.inject_fault(fault, after_ops)

    # -- internals ----------------------------------------------------------

    def _check_open(self, op: str, name: str) -> None:
        if self._closed:
            raise RuntimeError(f"{op}({name!r}): the TensorStore over {', '.join(self._dirs)} is closed")

    def _check_direct(self, op: str, name: str, tensor: torch.Tensor) -> None:
        if self.checksum:
            raise ValueError(
                f"{op}({name!r}): this TensorStore checksums its tensors in host memory: move {name!r} through "
                "host memory (TransferEngine.save/load with a staging buffer), or make the store with checksum=False"
            )
        if not tensor.is_contiguous():
            raise ValueError(f"{op}({name!r}): the tensor must be contiguous")

    def _write(self, name: str, tensor: torch.Tensor, submit: Callable[[list[_Extent]], list], keepalive) -> Future:
        """Store ``tensor``'s type under ``name`` in new extents, its bytes moved by ``submit(extents)`` (with checksums,
        the requests' CRC-32Cs, computed by the I/O threads, are the record's)."""
        self._wait_pending_put(name)
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            self._check_open("put", name)
            try:
                extents = self._allocate(nbytes)
            except StoreIOError as exc:
                return Future.failed(exc)
            except OSError as exc:
                return Future.failed(
                    StoreIOError(exc.errno or errno.EIO, "allocate", exc.filename or "", -1, name, str(exc.strerror))
                )
            self._seq += 1
            record = _Record(name, tensor.dtype, tensor.shape, nbytes, extents, seq=self._seq)
            requests: list[NativePart] = []

            def finish(error: BaseException | None) -> None:
                if error is None and self.checksum:
                    record.checksum = _joined_crc(requests, extents)
                with self._lock:
                    if self._pending_puts.get(name) is future:
                        del self._pending_puts[name]
                    old = self._records.get(name)
                    if error is not None or self._closed or (old is not None and old.seq > record.seq):
                        self._free(record.extents)  # failed, or a later put of this name already landed
                        return
                    self._records[name] = record
                if old is not None:
                    self._release(old)

            submitted = Deferred()
            future = Future([submitted], finish, what=name, keepalive=keepalive)
            self._pending_puts[name] = future
        _start(submitted, future, lambda: _kept(requests, submit(extents)))
        return future

    def _read(
        self, name: str, out: torch.Tensor | None, io: ExtentIO | None, pinned: _Record | None = None
    ) -> Future:
        """Read ``name`` (or the ``pinned`` record of a :class:`StorePin`) into ``out`` (None: a new CPU tensor),
        natively or, with ``io``, by it."""
        if pinned is None:
            self._wait_pending_put(name)
        with self._lock:
            self._check_open("get", name)
            record = pinned if pinned is not None else self._records.get(name)
            if record is None:
                raise KeyError(f"no tensor named {name!r} in the store (never written, or deleted)")
            padded = sum(e.nbytes for e in record.extents)
            copy_back = False
            if out is None:  # read straight into a new aligned tensor
                target = aligned_empty(padded)[: record.nbytes]
                out = target.view(record.dtype).view(record.shape)
            else:
                self._check_out(record, out)
                if out.is_contiguous():
                    target = byte_view(out)
                else:  # a non-contiguous view: read into an aligned buffer, then copy
                    target, copy_back = aligned_empty(padded)[: record.nbytes], True

            def finish(error: BaseException | None) -> torch.Tensor:
                if error is not None:
                    raise error
                if self.checksum and record.checksum is not None:
                    actual = _joined_crc(requests, record.extents)
                    if actual != record.checksum:
                        first = record.extents[0]
                        raise ChecksumError(first.swap.file.path, first.offset, name, record.checksum, actual)
                if copy_back and record.nbytes:
                    out.copy_(target.view(record.dtype).view(out.shape))
                return out

            submitted = Deferred()
            requests: list[NativePart] = []
            future = Future([submitted], finish, what=name, keepalive=target)
            # The extents stay this record's until the read ends: a delete or a replacing put waits for it.
            record.in_flight = [f for f in record.in_flight if not f.done()] + [future]
        if io is None:
            _start(submitted, future, lambda: _kept(requests, self._submit(record.extents, target, write=False)))
        else:
            _start(submitted, future, lambda: self._submit_by(record.extents, io, write=False))
        return future

    @staticmethod
    def _check_out(record: _Record, out: torch.Tensor) -> None:
        if out.dtype != record.dtype or out.numel() * out.element_size() != record.nbytes:
            raise ValueError(
                f"get({record.name!r}): out has dtype {out.dtype} and {out.numel()} elements, "
                f"the stored tensor has dtype {record.dtype} and shape {tuple(record.shape)}"
            )

    def _wait_pending_put(self, name: str) -> None:
        with self._lock:
            future = self._pending_puts.get(name)
        if future is not None:
            _settle(future)

    def _release(self, record: _Record) -> None:
        """Free the extents of ``record`` (deleted or replaced) once its I/O in flight ends, or mark it dropped
        while a :class:`StorePin` holds it (its last release frees them)."""
        for future in record.in_flight:
            _settle(future)
        with self._lock:
            if record.pins:
                record.dropped = True
            else:
                self._free(record.extents)

    def _unpin(self, records: list[_Record]) -> None:
        """A :class:`StorePin` of ``records`` is released: free those dropped meanwhile that it held last."""
        for record in records:
            for future in record.in_flight:
                _settle(future)
        with self._lock:
            for record in records:
                record.pins -= 1
                if not record.pins and record.dropped and not self._closed:
                    self._free(record.extents)

    def _allocate(self, nbytes: int) -> list[_Extent]:
        """Extents for ``nbytes`` (caller holds the lock): striped when large enough."""
        if nbytes == 0:
            return []
        if nbytes >= self.config.stripe_min_bytes and len(self._swaps) > 1:
            per_dir = round_up(math.ceil(nbytes / len(self._swaps)))
            sizes = [min(per_dir, nbytes - i * per_dir) for i in range(len(self._swaps))]
            targets = [(swap, size) for swap, size in zip(self._swaps, sizes) if size > 0]
        else:
            # Round-robin, but prefer a file with a free range that fits over
            # growing (or failing on) a full one.
            n = len(self._swaps)
            order = [self._swaps[(self._next_dir + i) % n] for i in range(n)]
            self._next_dir = (self._next_dir + 1) % n
            aligned = round_up(nbytes)
            fits = [s for s in order if s.extents.fits(aligned)]
            holds = [s for s in order if s.extents.free_bytes >= aligned]
            targets = [((fits or holds or order)[0], nbytes)]
        extents: list[_Extent] = []
        try:
            for swap, size in targets:
                extents += self._take(swap, size)
        except OSError:
            self._free(extents)
            raise
        return extents

    def _take(self, swap: _SwapFile, data_bytes: int) -> list[_Extent]:
        """Extents of ``swap`` for ``data_bytes``: one free range that holds them, else the free ranges (largest
        first) and, for the rest, a growth of the file. The file never grows while its free ranges hold the
        tensor, so it stays as large as the peak of the bytes stored at once (what the free-space check counts),
        however fragmented the free ranges are."""
        nbytes = round_up(data_bytes)
        offset = swap.extents.take(nbytes)
        if offset is not None:
            return [_Extent(swap, offset, data_bytes, nbytes)]
        if swap.capacity_bytes is not None and swap.extents.free_bytes < nbytes:
            raise OSError(
                errno.ENOSPC,
                f"the store's swap file {swap.file.path} is full: {nbytes} bytes needed, "
                f"{swap.extents.free_bytes} free of its {swap.capacity_bytes} bytes "
                "(raise capacity_bytes, or pass None to grow)",
                swap.file.path,
            )
        pieces = swap.extents.take_pieces(nbytes)
        grow = nbytes - sum(size for _, size in pieces)
        if grow:
            try:
                self._grow(swap, grow)
            except OSError:
                for offset, size in pieces:
                    swap.extents.give(offset, size)
                raise
            pieces.append((swap.extents.end - grow, grow))
        padding = nbytes - data_bytes  # at the end of the last piece
        return [
            _Extent(swap, offset, size - (padding if i == len(pieces) - 1 else 0), size)
            for i, (offset, size) in enumerate(pieces)
        ]

    def _grow(self, swap: _SwapFile, nbytes: int) -> None:
        """Add ``nbytes`` to the end of the swap file (raises ENOSPC naming the file and the bytes)."""
        offset = swap.extents.end
        try:
            self._engine.allocate(swap.file, offset, nbytes)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            stat = os.fstatvfs(swap.file.fd)
            free = stat.f_bavail * stat.f_frsize
            raise OSError(
                errno.ENOSPC,
                f"No space left on device: growing the swap file to {offset + nbytes} bytes needs {nbytes} bytes"
                f" more and its file system has {free} bytes free (other files took the room counted when"
                " the swap directories were checked)",
                swap.file.path,
            ) from None
        swap.extents.end += nbytes

    def _free(self, extents: list[_Extent]) -> None:
        for e in extents:
            e.swap.extents.give(e.offset, e.nbytes)

    def _submit(self, extents: list[_Extent], buffer: torch.Tensor, *, write: bool) -> list[NativePart]:
        """The native transfers of a tensor stored in ``extents``, from or into ``buffer`` (its bytes, flat ``uint8``
        on the CPU), one per extent, each padded to the extent's aligned size (zeros written, padding read dropped);
        with checksums, each I/O thread checksums the bytes of its blocks (see :func:`_joined_crc`)."""
        return [
            self._engine.submit(
                e.swap.file, buffer[start : start + e.data_bytes], e.offset, write=write, nbytes=e.nbytes,
                checksum=self.checksum,
            )
            for e, start in _starts(extents)
        ]  # fmt: skip

    @staticmethod
    def _submit_by(extents: list[_Extent], io: ExtentIO, *, write: bool) -> list[NativePart]:
        """The transfers of a tensor stored in ``extents``, one per extent, each submitted by ``io`` (unpadded)."""
        return [
            NativePart(io(e.swap.file.path, e.offset, start, e.data_bytes), e.swap.file.path, e.offset, write=write,
                       nbytes=e.data_bytes)
            for e, start in _starts(extents)
        ]  # fmt: skip

    def _remove_files(self) -> None:
        swaps = list(self._swaps)
        self._clean_up()  # while the files are open: one whose directory was renamed is found by its descriptor
        for swap in swaps:
            self._engine.close_file(swap.file)
        self._swaps = []


class StorePin:
    """Tensors of a :class:`TensorStore` held as they were when :meth:`TensorStore.pin` was called: readable
    with :meth:`get` (from any thread) until :meth:`release`, whatever is deleted or written under their names
    meanwhile. Their bytes stay on disk meanwhile: a deleted or replaced one holds its extents (the store grows
    by them when the space is needed) until the release."""

    def __init__(self, store: TensorStore, records: dict[str, _Record]):
        self._store = store
        self._records: dict[str, _Record] | None = records

    def get(self, name: str, out: torch.Tensor | None = None) -> Future:
        """Read the pinned tensor ``name`` (checked against its CRC-32C, as :meth:`TensorStore.get`)."""
        if self._records is None:
            raise RuntimeError(f"get({name!r}): the StorePin is released")
        if out is not None:
            _refuse_device("get", name, out)
        return self._store._read(name, out, None, pinned=self._records[name])

    def release(self) -> None:
        """Let the store reuse the extents of the tensors deleted or replaced since the pin (after the reads in
        flight). Idempotent."""
        records, self._records = self._records, None
        if records is not None:
            self._store._unpin(list(records.values()))


def _starts(extents: list[_Extent]) -> Iterator[tuple[_Extent, int]]:
    """Each extent with the offset in the tensor of its first byte (the tensor's bytes are the extents' back to back)."""
    start = 0
    for e in extents:
        yield e, start
        start += e.data_bytes


def _kept(requests: list[NativePart], submitted: list[NativePart]) -> list[NativePart]:
    """``submitted``, also kept in ``requests`` (for the completion step's checksum)."""
    requests.extend(submitted)
    return submitted


def _joined_crc(requests: list[NativePart], extents: list[_Extent]) -> int:
    """The CRC-32C of a tensor's bytes, joined from those of its requests (one per extent, in order), which the I/O
    threads computed block by block as they moved them: the bytes are not read again for it."""
    crc = 0
    for request, extent in zip(requests, extents, strict=True):
        crc = crc32c_combine(crc, request.crc(), extent.data_bytes)
    return crc


def _start(submitted: Deferred, future: Future, submit: Callable[[], list]) -> None:
    """Submit ``future``'s requests (``submit()``), outside the store's lock: a native submit blocks while the native
    queue is full, and a read that compute waits for must not wait for the lock behind it. A submit that raises
    settles ``future`` (its completion step gives back its extents) and raises."""
    try:
        submitted.set(Future(submit(), what=future.what))
    except BaseException as exc:
        submitted.set(Future.failed(exc))
        _settle(future)
        raise


def _refuse_device(op: str, name: str, tensor: torch.Tensor) -> None:
    if tensor.device.type != "cpu":
        raise ValueError(
            f"{op}({name!r}): the TensorStore holds host tensors, and this one is on {tensor.device}: move it with "
            f"TransferEngine.{'save' if op == 'put' else 'load'} (nvoffload.transfer), which stages it through host "
            "memory or moves it by GPUDirect Storage"
        )


_SWAP_NAME = re.compile(r"nvoffload-(\d+)-[0-9a-f]{12}\.swap")


def _warn_about_orphans(directory: str) -> None:
    """Warn about swap files whose process no longer runs (it was killed): they hold disk space until removed."""
    orphans = []
    for entry in os.scandir(directory):
        match = _SWAP_NAME.fullmatch(entry.name)
        pid = int(match.group(1)) if match else None
        if pid is None or pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            orphans.append(entry)
        except (PermissionError, OverflowError):
            pass  # another user's live process (or no such pid at all: OverflowError)
    if orphans:
        gib = sum(_size_bytes(e.path) for e in orphans) / 2**30
        names = ", ".join(e.name for e in orphans[:3]) + (", ..." if len(orphans) > 3 else "")
        warnings.warn(
            f"{directory} holds {len(orphans)} swap file(s) ({gib:.2f} GiB) of processes that no longer run on this"
            f" machine, probably killed: {names}. Delete them unless another machine shares this directory.",
            stacklevel=3,
        )


def _size_bytes(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:  # removed meanwhile
        return 0


def _exit_cleanly_on_sigterm() -> None:
    """Make SIGTERM unwind the program as SIGINT does (``SystemExit(143)``), so that stores close and their swap
    files go: by default it ends the process on the spot and leaves them behind. Only from the main thread, and
    only where no handler was installed (a program's own stays)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_signal)


def _exit_on_signal(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def _release_all(releases: list) -> None:
    for release in releases:
        release()


def _clean_up(swaps: list[_SwapFile], releases: list) -> None:
    """Remove the swap files (still open), then release the directories; what a directory made unusable meanwhile
    (replaced by a file, its permissions taken, renamed) keeps is named in one warning for it, instead of a
    traceback at exit or nothing at all."""
    left: dict[str, list[str]] = {}
    reasons: dict[str, str] = {}

    def keep(path: str, what: str, reason: str) -> None:
        directory = os.path.realpath(os.path.dirname(path))
        left.setdefault(directory, []).append(what)
        reasons.setdefault(directory, reason)

    for swap in swaps:
        what = f"swap file {os.path.basename(swap.file.path)} ({swap.extents.end} bytes)"
        try:
            os.unlink(swap.file.path)
        except FileNotFoundError:
            moved = _moved_to(swap.file.fd)
            if moved is not None:
                keep(moved, what, f"moved there from {os.path.dirname(swap.file.path)}")
                if os.path.exists(os.path.join(os.path.dirname(moved), LOCK_NAME)):
                    keep(moved, f"its lock {LOCK_NAME}", "")
        except OSError as exc:
            keep(swap.file.path, what, exc.strerror or str(exc))
    for release in releases:
        try:
            release()
        except OSError as exc:
            keep(exc.filename or "", f"its lock {os.path.basename(exc.filename or '')}", exc.strerror or str(exc))
    for directory, items in left.items():
        warnings.warn(
            f"swap directory {directory} could not be cleaned up ({reasons[directory]}): {', '.join(items)} left"
            " there: delete them by hand",
            stacklevel=2,
        )


def _moved_to(fd: int) -> str | None:
    """The path of the open file ``fd`` when it still has one (its directory was renamed), else None."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}") if os.fstat(fd).st_nlink else None
    except OSError:
        return None


def _settle(future: Future) -> None:
    """Wait for a future whose errors belong to whoever holds it."""
    try:
        future.result()
    except Exception:
        pass
