"""The activation offload context manager: saved tensors to NVMe or host memory."""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import itertools
import threading
import weakref

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.multiprocessing.reductions import StorageWeakRef

from ..io.store import swap_directories
from ..memory import retain_freed_host_memory
from ..transfer import Future, ReadAhead, TransferEngine, WriteBehind
from ._ledger import ModuleBuffers, StorageLedger
from ._tier import Load, Tier, Write
from .config import ActivationOffloadConfig, OffloadStats

__all__ = ["offload_activations", "ActivationIOError"]


class ActivationIOError(OSError, RuntimeError):
    """A saved activation's write or read failed on an OSError: its errno and file kept, the tensor named; a
    RuntimeError too, as backward's other failures are."""

    def __str__(self) -> str:
        return self.strerror


def _failed(what: str, e: Exception) -> RuntimeError:
    """The error that ``what`` failed because of ``e`` (its cause): an :class:`ActivationIOError` for an OSError."""
    if isinstance(e, OSError):
        error = ActivationIOError(e.errno, f"{what} failed: {e}", e.filename)
    else:
        error = RuntimeError(f"{what} failed: {e}")
    error.__cause__ = e
    return error

_instance_ids = itertools.count()


class _State(enum.Enum):
    HELD = "held in memory"  # recent: kept, not written (yet)
    WRITING = "being written"
    STORED = "stored"
    RELEASED = "released"


class _Record:
    """One offloaded tensor (one storage extent), shared by deduplicated saves."""

    __slots__ = (
        "handle", "name", "key", "nbytes", "numel", "size", "stride", "dtype", "device", "version",
        "offset", "dense", "state", "original", "original_key", "write", "load", "loaded_key", "live", "pending",
        "error", "written", "host", "host_reader", "kept", "avoided_in", "shareable",
    )  # fmt: skip

    def __init__(self, handle: int, name: str, key: tuple, tensor: torch.Tensor, dense: bool):
        self.handle = handle
        self.name = name
        self.key = key
        self.numel = tensor.numel()
        self.nbytes = self.numel * tensor.element_size()
        self.size = tuple(tensor.shape)
        self.stride = tuple(tensor.stride()) if dense else _contiguous_strides(self.size)
        self.offset = tensor.storage_offset()
        self.dense = dense  # written as its storage span [offset, offset + numel)
        self.dtype = tensor.dtype
        self.device = tensor.device
        self.version = tensor._version
        self.state = _State.HELD
        self.original: torch.Tensor | None = tensor
        self.original_key = None
        self.write: Write | None = None
        self.load: Load | None = None
        self.loaded_key = None  # ledger key of the load's device tensor
        self.live = 0  # packed handles alive in some graph
        self.pending = 0  # live handles not unpacked yet in this backward pass
        self.error: BaseException | None = None
        self.written = False
        self.host = None  # the slab buffer holding the stored data (kept in host memory, not in a store)
        self.host_reader = None  # the future of the last copy out of ``host``
        self.kept = False  # read-ahead reached it while its write was in flight: the original stays for backward
        self.avoided_in = 0  # the backward pass that last used the original instead of reading it back
        self.shareable = True  # a later save of the same tensor may use this record (no read has failed since)

    def describe(self) -> str:
        return f"saved activation #{self.handle} ({self.name}: {list(self.size)} {self.dtype}, {self.nbytes} bytes)"


class _Ticket:
    """What a packed handle's finalizer needs: the record and how often backward unpacked it.

    ``view`` is None when the saved tensor is the record's own; for a tensor
    lying inside a record's extent it is its ``(size, stride, storage_offset)``.
    """

    __slots__ = ("record", "view", "uses")

    def __init__(self, record: _Record, view: tuple | None = None):
        self.record = record
        self.view = view
        self.uses = 0  # backward passes that unpacked it (more than one through a retained graph)


class _Packed:
    """What autograd stores instead of an offloaded tensor."""

    __slots__ = ("ticket", "__weakref__")

    def __init__(self, ticket: _Ticket):
        self.ticket = ticket


class _Resident:
    """A saved tensor left in place, tracked only to count its memory."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _extent_key(key: tuple) -> tuple:
    """(storage, dtype, version) of a record key: what tensors lying in one extent share."""
    return key[0], key[4], key[5]


def _weak_hooks(hooks: offload_activations):
    """Pack and unpack functions that do not keep ``hooks`` alive.

    Bound methods would make a reference cycle (the context holds its hooks),
    and a context dropped after backward would keep its swap store open until
    the cyclic garbage collector ran. Every handle that needs the context holds
    it through its finalizer: once the context is gone, only plain tensors remain.
    """
    ref = weakref.ref(hooks)

    def pack(tensor: torch.Tensor):
        return ref()._pack(tensor)  # packing runs inside the with block, which holds the context

    def unpack(packed):
        owner = ref()
        return packed if owner is None else owner._unpack(packed)

    return pack, unpack


def _weak_method(obj, name: str):
    """``obj.<name>`` called through a weak reference: a queue of ``obj``'s holding it does not keep ``obj`` alive
    (no reference cycle: a dropped context closes its store at once, not at the next garbage collection)."""
    ref = weakref.ref(obj)

    def call(*args):
        return getattr(ref(), name)(*args)

    return call


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(size):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _is_dense(tensor: torch.Tensor) -> bool:
    """True when the tensor covers a gap-free, non-overlapping span of its storage."""
    dims = sorted((st, n) for n, st in zip(tensor.shape, tensor.stride()) if n != 1)
    expected = 1
    for st, n in dims:
        if st != expected:
            return False
        expected *= n
    return True


class offload_activations(saved_tensors_hooks):  # noqa: N801 - named like torch.autograd.graph.save_on_cpu
    """Context manager that moves the tensors forward saves for backward off the device.

    Used like :class:`torch.autograd.graph.save_on_cpu`, around forward. Each
    saved tensor is replaced by a small handle; its data goes to NVMe
    (``target="nvme"``, through a :class:`~nvoffload.io.TensorStore`) or to host
    memory (``target="cpu"``), or to host memory while ``host_resident_bytes``
    has room and to NVMe beyond it, and comes back when backward asks for it.

    Every copy goes through a :class:`~nvoffload.transfer.TransferEngine` (see
    :mod:`nvoffload.activations._tier`): device->host on its device-to-host
    stream as forward saves, host->device on its host-to-device stream ahead of
    backward, host memory from its page-locked slab.

    - Parameters, leaves that require grad (and views of them), the buffers of
      modules that run inside the block, and tensors under ``min_bytes`` stay
      where they are.
    - Tensors that share storage, offset, size and stride (the same tensor saved
      by several ops) are written once, and so are views lying inside the
      storage span of a dense tensor already saved (``h.t()``, a slice of ``h``).
    - The most recent ``keep_recent_bytes`` of saved tensors, which backward needs
      first, stay in memory and make no round trip.
    - During backward, the next tensors (in reverse order of saving) are
      brought back to the device ahead of use, up to ``prefetch_bytes`` of
      device memory (and, from NVMe, as far as the host slab has room).
    - Saved tensors on another device than the engine's (the first offloaded
      tensor's, without ``transfer``) stay where they are.
    - A tensor's space is released when autograd drops it: as backward consumes
      it, or when the graph is freed without backward. An exception inside the
      ``with`` block releases what that block saved; :meth:`close` releases all.

    Backward may run after the ``with`` block (as with ``save_on_cpu``). Use one
    object for the whole training loop: the swap store it opens stays open from
    step to step (released tensors free their space in it for reuse, so the
    swap files stop growing at the largest step's size). It is closed, its
    files removed, by :meth:`close`, or as soon as the object is dropped and no
    graph holds one of its tensors; a :class:`~nvoffload.io.TensorStore` passed
    as ``swap_dir`` is never closed here.
    Works with ``torch.utils.checkpoint``, nested contexts, several forwards
    before one backward, ``retain_graph=True`` and double backward.

    Args:
        swap_dir: an existing directory (or a list of them, one per NVMe) for
            the swap files, or an open ``TensorStore``. Required for
            ``target="nvme"``; must be ``None`` for ``target="cpu"``.
        target: ``"nvme"`` or ``"cpu"``.
        min_bytes, keep_recent_bytes, prefetch_bytes, max_pending_write_bytes, retain_host_memory:
            see :class:`~nvoffload.activations.ActivationOffloadConfig`.
        host_memory_bytes, host_resident_bytes: see :class:`~nvoffload.activations.ActivationOffloadConfig`
            (``host_resident_bytes``: keep tensors in host memory up to it, NVMe beyond).
        config: a whole ``ActivationOffloadConfig`` instead of the keywords.
        transfer: a shared :class:`~nvoffload.transfer.TransferEngine` (its slab
            is the host memory; it is left open). Default: an engine of this
            object's own, over ``host_memory_bytes``, opened at the first write
            and closed with the store.

    Example::

        >>> import tempfile, torch
        >>> from nvoffload.activations import offload_activations
        >>> model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 1))
        >>> x = torch.randn(1024, 512)
        >>> with tempfile.TemporaryDirectory() as swap:
        ...     offload = offload_activations(swap, min_bytes=1 << 16, keep_recent_bytes=0)
        ...     with offload:
        ...         loss = model(x).square().mean()
        ...     print(offload.stats().offloaded_bytes > 0)
        ...     loss.backward()    # reads each back; a tensor whose write is still running is used from memory
        ...     print(offload.stats().live_records)  # nothing held (a write in flight ends, then its space is freed)
        True
        0
    """

    def __init__(
        self,
        swap_dir=None,
        *,
        target: str | None = None,
        min_bytes: int | None = None,
        keep_recent_bytes: int | None = None,
        prefetch_bytes: int | None = None,
        max_pending_write_bytes: int | None = None,
        retain_host_memory: bool | None = None,
        host_memory_bytes: int | None = None,
        host_resident_bytes: int | None = None,
        config: ActivationOffloadConfig | None = None,
        transfer: TransferEngine | None = None,
    ) -> None:
        overrides = {
            k: v
            for k, v in dict(
                target=target,
                min_bytes=min_bytes,
                keep_recent_bytes=keep_recent_bytes,
                prefetch_bytes=prefetch_bytes,
                max_pending_write_bytes=max_pending_write_bytes,
                retain_host_memory=retain_host_memory,
                host_memory_bytes=host_memory_bytes,
                host_resident_bytes=host_resident_bytes,
            ).items()
            if v is not None
        }
        if config is not None and overrides:
            raise ValueError(f"give either config or keywords, not both (got config and {sorted(overrides)})")
        self.config = config if config is not None else ActivationOffloadConfig(**overrides)
        if self.config.retain_host_memory:
            retain_freed_host_memory()

        self._store = None  # a user's TensorStore (never closed here)
        self._swap_dirs: list[str] | None = None
        if self.config.target == "cpu":
            if swap_dir is not None:
                raise ValueError("swap_dir is only used with target='nvme'; leave it out for target='cpu'")
        elif swap_dir is None:
            raise ValueError("target='nvme' needs swap_dir: a directory on an NVMe drive, or a TensorStore")
        elif hasattr(swap_dir, "put") and hasattr(swap_dir, "get"):
            self._store = swap_dir
        else:
            self._swap_dirs = swap_directories(swap_dir)

        self._transfer = transfer
        self._device = None if transfer is None else transfer.device.device  # where offloaded tensors live
        self._tier: Tier | None = None  # opened at the first write
        self._close_tier = None  # finalizer: gives back host memory, closes what the tier owns
        self._uid = next(_instance_ids)
        self._handles = itertools.count()
        self._lock = threading.Lock()
        self._freed: collections.deque[_Ticket | StorageWeakRef] = collections.deque()
        self._records: dict[int, _Record] = {}
        self._by_key: dict[tuple, _Record] = {}
        self._by_extent: dict[tuple, list[_Record]] = {}  # dense records by storage, dtype and version
        self._window: collections.OrderedDict[int, _Record] = collections.OrderedDict()
        self._window_bytes = 0
        # Writes in flight, oldest first: pack waits for the oldest past max_pending_write_bytes.
        self._writes = WriteBehind(
            max(1, self.config.max_pending_write_bytes), "activation offload's writes", keep_errors=False
        )
        # Reads ahead of backward, in reverse order of saving, within prefetch_bytes; keyed by record handle.
        self._read_ahead = ReadAhead(
            self.config.prefetch_bytes, _weak_method(self, "_read_size"), _weak_method(self, "_start_read"),
            _weak_method(self, "_drop_read"),
        )  # fmt: skip
        self._plan_stale = True  # records to read back were added since the read-ahead's plan was made
        self._passes = 0  # backward passes seen through the live graphs
        self._ledger = StorageLedger()
        self._offloaded_bytes = 0
        self._peak_offloaded_bytes = 0
        self._bytes_written = 0
        self._host_bytes_written = 0
        self._bytes_read = 0
        self._host_bytes_read = 0
        self._tensors_written = 0
        self._tensors_forwarded = 0
        self._dedup_hits = 0
        self._reads_prefetched = 0
        self._reads_avoided = 0
        self._marks: list[int] = []  # first handle of each open ``with`` block
        self._closed = False
        self._buffers = ModuleBuffers()
        super().__init__(*_weak_hooks(self))

    # ----------------------------------------------------------------- context

    def __enter__(self) -> offload_activations:
        with self._locked():
            if self._closed:
                raise RuntimeError("this offload_activations was closed; create a new one")
            self._marks.append(next(self._handles))
        self._buffers.__enter__()
        super().__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        super().__exit__(exc_type, exc, tb)
        self._buffers.__exit__(exc_type, exc, tb)
        with self._locked():
            first = self._marks.pop()
            if exc_type is not None:
                for record in [r for h, r in self._records.items() if h >= first]:
                    self._release(record)

    def close(self) -> None:
        """Release every offloaded tensor (waiting for I/O in flight) and close an owned store.

        A backward that later needs one of them raises ``RuntimeError``.
        """
        with self._locked():
            self._closed = True
            for record in list(self._records.values()):
                self._release(record)
            self._writes.drain()  # the writes of those released (their done hooks free the rest)
            if self._close_tier is not None:
                self._close_tier()
            self._tier = None

    # ------------------------------------------------------------------- stats

    def stats(self) -> OffloadStats:
        """Current counters; see :class:`~nvoffload.activations.OffloadStats`."""
        self._drain()  # apply releases queued by finalizers first
        with self._lock:
            return OffloadStats(
                resident_bytes=self._ledger.bytes,
                peak_resident_bytes=self._ledger.peak_bytes,
                offloaded_bytes=self._offloaded_bytes,
                peak_offloaded_bytes=self._peak_offloaded_bytes,
                bytes_written=self._bytes_written,
                host_bytes_written=self._host_bytes_written,
                bytes_read=self._bytes_read,
                host_bytes_read=self._host_bytes_read,
                tensors_written=self._tensors_written,
                tensors_forwarded=self._tensors_forwarded,
                dedup_hits=self._dedup_hits,
                reads_prefetched=self._reads_prefetched,
                reads_avoided=self._reads_avoided,
                live_records=len(self._records),
            )

    def reset_peaks(self) -> None:
        """Restart the peak counters from the current values."""
        with self._locked():
            self._ledger.reset_peak()
            self._peak_offloaded_bytes = self._offloaded_bytes

    # ----------------------------------------------------------------- locking

    @contextlib.contextmanager
    def _locked(self):
        with self._lock:
            yield
        self._drain()

    def _drain(self) -> None:
        # Finalizers only queue; whoever can take the lock applies the queue.
        # A finalizer that runs while this thread holds the lock finds it taken
        # and leaves the work to the _drain() after that section.
        while self._freed:
            if not self._lock.acquire(blocking=False):
                return
            try:
                while self._freed:
                    item = self._freed.popleft()
                    if isinstance(item, _Ticket):
                        self._handle_freed(item)
                    else:
                        self._ledger.remove(item)
            finally:
                self._lock.release()

    def _on_free(self, item) -> None:
        self._freed.append(item)
        self._drain()

    # -------------------------------------------------------------------- pack

    def _offloadable(self, tensor: torch.Tensor) -> bool:
        """Whether a saved tensor that is not model state (see ``ModuleBuffers.holds``) is worth moving."""
        if type(tensor) is not torch.Tensor or tensor.layout != torch.strided:
            return False
        if tensor.device.type not in ("cpu", "cuda") or tensor.device != (self._device or tensor.device):
            return False
        nbytes = tensor.numel() * tensor.element_size()
        # min_bytes of 0 still skips empty tensors; overlapping ones (expanded) stay.
        return 0 < nbytes and nbytes >= self.config.min_bytes and nbytes <= tensor.untyped_storage().nbytes()

    def _pack(self, tensor: torch.Tensor):
        with self._locked():
            self._reap_writes()
            if self._buffers.holds(tensor):
                return tensor.detach()
            if not self._offloadable(tensor):
                resident = _Resident(tensor.detach())
                key = self._ledger.add(resident.tensor)
                weakref.finalize(resident, self._on_free, key).atexit = False
                return resident
            t = tensor.detach()
            storage = StorageWeakRef(t.untyped_storage())
            key = (storage, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)
            record, view = self._by_key.get(key), None
            if record is not None and not record.shareable:
                record = None
            if record is None and (record := self._container_of(t, key)) is not None:
                view = (tuple(t.shape), t.stride(), t.storage_offset())
            if record is not None:
                self._dedup_hits += 1
            else:
                handle = next(self._handles)
                self._device = t.device
                record = _Record(handle, f"act{self._uid}-{handle}", key, t, _is_dense(t))
                record.original_key = self._ledger.add(t)
                self._records[handle] = record
                self._by_key[key] = record
                if record.dense:
                    self._by_extent.setdefault(_extent_key(key), []).append(record)
                self._window[handle] = record
                self._window_bytes += record.nbytes
                while self._window and self._window_bytes > self.config.keep_recent_bytes:
                    self._start_write(self._window.popitem(last=False)[1])
            record.live += 1
            record.pending += 1
            ticket = _Ticket(record, view)
            packed = _Packed(ticket)
            weakref.finalize(packed, self._on_free, ticket).atexit = False
            return packed

    def _container_of(self, t: torch.Tensor, key: tuple) -> _Record | None:
        """A live record whose written extent holds every element of ``t`` (same storage, dtype and version)."""
        first = t.storage_offset()
        last = first + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
        for record in self._by_extent.get(_extent_key(key), ()):
            if record.shareable and record.error is None and record.offset <= first and last < record.offset + record.numel:
                return record
        return None

    def _open_tier(self) -> Tier:
        if self._tier is None:
            store, owns_store = self._store, False
            if self.config.target == "nvme" and store is None:
                from ..io import TensorStore

                store, owns_store = TensorStore(self._swap_dirs if len(self._swap_dirs) > 1 else self._swap_dirs[0]), True
            engine, owns_engine = self._transfer, False
            if engine is None:
                try:
                    engine = TransferEngine(self.config.host_bytes(), self._device, what="activation offload host memory")
                except BaseException:
                    if owns_store:
                        store.close()
                    raise
                owns_engine = True
            self._tier = Tier(engine, store, self._writes.wait_oldest, owns_engine=owns_engine, owns_store=owns_store,
                              resident_bytes=self.config.host_resident_bytes)  # fmt: skip
            self._close_tier = weakref.finalize(self, self._tier.close)
        return self._tier

    def _start_write(self, record: _Record) -> None:
        self._window_bytes -= record.nbytes
        if record.original._version != record.version:
            record.error = self._modified_error(record, record.original._version)
            self._drop_original(record)
            record.state = _State.STORED  # nothing to read; unpack raises record.error
            return
        tier = self._open_tier()
        t = record.original
        copy_key = None
        if record.dense:
            flat = t.as_strided((record.numel,), (1,), t.storage_offset())
        else:
            flat = t.contiguous().view(-1)
            copy_key = self._ledger.add(flat)

        def start():
            try:
                record.write = tier.write(record.name, flat)
            except BaseException:
                if copy_key is not None:
                    self._ledger.remove(copy_key)
                raise
            record.write.copy_key = copy_key
            if record.write.host is not None:
                self._host_bytes_written += record.nbytes
            return record.write.future

        # Waits first for the oldest writes until this one fits beside them within max_pending_write_bytes.
        self._writes.submit(record.nbytes, start, functools.partial(_weak_method(self, "_finish_write"), record))
        record.state = _State.WRITING
        record.written = True
        self._plan_stale = True
        self._offloaded_bytes += record.nbytes
        self._peak_offloaded_bytes = max(self._peak_offloaded_bytes, self._offloaded_bytes)
        self._bytes_written += record.nbytes
        self._tensors_written += 1
        while self._writes.in_flight_bytes > self.config.max_pending_write_bytes and self._writes.wait_oldest():
            pass  # a write larger than max_pending_write_bytes alone (any, at 0) is waited for at once

    def _reap_writes(self) -> None:
        if self._tier is not None:
            self._tier.reap()
        self._writes.poll()

    def _finish_write(self, record: _Record, error: BaseException | None) -> None:
        """``record``'s write ended (the write-behind's done hook, with its ``error``): keep its host buffer
        (target="cpu") or give its staging buffer back. Nothing to do for a write that did not start."""
        write, record.write = record.write, None
        if write is None:  # its start raised: the record keeps its original, pack raises
            return
        if write.copy_key is not None:
            self._ledger.remove(write.copy_key)
        if error is not None:  # the I/O error surfaces when backward needs this tensor
            record.error = _failed(f"writing {record.describe()}", error)
        if write.host is not None and record.error is None:  # kept in host memory
            record.host = write.host
        else:
            self._tier.release_host(write.host, None)
        if record.state is _State.RELEASED:  # released while it was written
            self._forget(record)
            return
        if record.error is None and record.original._version != record.version:
            record.error = self._modified_error(record, record.original._version)
        record.state = _State.STORED
        if record.error is not None:
            record.kept = False
        if not record.kept:
            self._drop_original(record)

    def _drop_original(self, record: _Record) -> None:
        if record.original is not None:
            record.original = None
            self._ledger.remove(record.original_key)
            record.original_key = None

    @staticmethod
    def _modified_error(record: _Record, version: int) -> RuntimeError:
        return RuntimeError(
            f"{record.describe()} was modified by an inplace operation after forward saved it "
            f"(version {record.version} when saved, {version} now); autograd needs the saved value"
        )

    # ------------------------------------------------------------------ unpack

    def _unpack(self, packed) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _Resident):
            return packed.tensor
        ticket = packed.ticket
        record = ticket.record
        with self._locked():
            if ticket.uses == self._passes:  # the first backward, or a handle used again: a retained graph's next
                self._passes += 1
                for live in self._records.values():
                    live.pending = live.live  # each live handle is unpacked once a pass
                self._plan_stale = True  # what the last pass read is read again
            if record.state is _State.RELEASED:
                raise RuntimeError(
                    f"{record.describe()} was released before backward used it "
                    "(offload_activations was closed, or its with-block raised)"
                )
            self._reap_writes()
            if record.error is not None:
                raise record.error
            if record.original is not None:
                if record.original._version != record.version:
                    raise self._modified_error(record, record.original._version)
                # An alias even of the whole tensor: the finalizer below must see autograd drop it, not the record
                # (a write in flight holds the record, which would keep this context alive through that finalizer).
                original = record.original
                result = original.as_strided(*(ticket.view or (original.size(), original.stride(), original.storage_offset())))
                if not record.written:
                    self._tensors_forwarded += 1
                elif record.avoided_in != self._passes:  # counted once a pass, however many handles share it
                    record.avoided_in = self._passes
                    self._reads_avoided += 1
                if record.written and not record.kept and record.pending > 1:
                    # Its other handles come later in this pass: keep the original rather than drop it when
                    # the write ends and read it back for them.
                    record.kept = True
                self._read_ahead_of(record.handle)  # the tensors after the ones kept in memory
            else:
                if record.load is None:
                    self._start_load(record)
                elif record.load.prefetched:
                    record.load.prefetched = False
                    self._reads_prefetched += 1
                self._read_ahead_of(record.handle)
                try:
                    self._tier.engine.wait(record.load.future)  # compute reads the device tensor after its copy
                except Exception as e:
                    record.error = _failed(f"reading {record.describe()} back", e)
                    for other in self._records.values():  # what is on disk may be damaged: a tensor saved
                        other.shareable = False  # again (a reused input) is written anew, not shared with these
                    raise record.error from e
                flat = record.load.device
                size, stride, offset = ticket.view or (record.size, record.stride, record.offset)
                result = flat.as_strided(size, stride, flat.storage_offset() + offset - record.offset)
            # Counted until autograd drops it (the load's own count ends when every handle was unpacked).
            weakref.finalize(result, self._on_free, self._ledger.add(result)).atexit = False
            ticket.uses += 1
            record.pending -= 1
            if record.pending == 0:
                self._drop_load(record)
            return result

    def _start_load(self, record: _Record, prefetch: bool = False) -> bool:
        """Start bringing ``record`` back to the device; False when a prefetch finds no host memory for it."""
        load = self._tier.read(record.name, record.host, record.numel, record.dtype, record.device, prefetch=prefetch)
        if load is None:
            return False
        record.load = load
        if record.host is not None:
            record.host_reader = load.future
        record.loaded_key = self._ledger.add(load.device)
        self._bytes_read += record.nbytes
        self._host_bytes_read += record.nbytes if record.host is not None else 0
        return True

    def _read_ahead_of(self, handle: int) -> None:
        """Backward uses ``handle`` now: read ahead, within ``prefetch_bytes``, the tensors it needs next.

        Those are the records saved before ``handle``, nearest first, that it
        would have to read back (:meth:`_to_read`). The read-ahead's plan is
        made again only when records to read were added since (writes started,
        a new backward pass); else it moves past ``handle``.
        """
        self._read_ahead.take(handle)  # in use: no longer counted against the bytes read ahead
        if self.config.prefetch_bytes == 0:
            return
        if self._plan_stale:
            self._plan_stale = False
            self._read_ahead.plan(h for h, r in reversed(self._records.items()) if h < handle and self._to_read(r))
        else:
            self._read_ahead.skip_to(handle)
        self._read_ahead.pump()

    def _to_read(self, record: _Record) -> bool:
        """Whether backward, in this pass, would read ``record`` back: stored and not on the device, or still
        being written (then it is kept on the device instead)."""
        if record.pending == 0 or record.error is not None or record.kept or record.load is not None:
            return False
        return record.state is _State.WRITING or (record.state is _State.STORED and record.original is None)

    def _read_size(self, handle: int) -> int:
        """:class:`ReadAhead`'s ``size``."""
        record = self._records.get(handle)
        return 0 if record is None else record.nbytes

    def _start_read(self, handle: int) -> tuple[Future | None, int] | None:
        """:class:`ReadAhead`'s ``start``: read ``handle``'s tensor back ahead of use, or keep it on the device when
        its write is still in flight; None when the slab has no room now."""
        record = self._records.get(handle)
        if record is None or not self._to_read(record):  # released, or used, kept or read since the plan was made
            return None, 0
        if record.state is _State.WRITING:
            record.kept = True  # its original stays when the write ends, instead of being read back
            return Future.completed(), record.nbytes
        if not self._start_load(record, prefetch=True):
            return None
        return record.load.future, record.nbytes

    def _drop_read(self, handle: int, future: Future) -> None:
        """:class:`ReadAhead`'s ``drop``: a read ahead (or a tensor kept) that backward will not take; a read still
        running frees its device tensor once it ended (:meth:`_drop_load`), without a wait here."""
        record = self._records.get(handle)
        if record is not None:
            self._drop_load(record)

    def _drop_load(self, record: _Record) -> None:
        """Free what ``record`` read back or kept on the device for backward (taken off the read-ahead)."""
        self._read_ahead.take(record.handle)
        if record.kept:
            record.kept = False
            if record.state is _State.STORED:  # written: drop the original (a write in flight drops it when done)
                self._drop_original(record)
        if record.load is not None:
            load, key = record.load, record.loaded_key
            record.load = record.loaded_key = None
            # Counted and kept until its copy ended (a read ahead dropped may still be running); its staging
            # buffers were retired behind its transfers when they started.
            self._tier.frees.free(load.future, functools.partial(_uncount, self._ledger, key, load))

    # ----------------------------------------------------------------- release

    def _handle_freed(self, ticket: _Ticket) -> None:
        record = ticket.record
        if record.state is _State.RELEASED:
            return
        record.live -= 1
        if ticket.uses < max(self._passes, 1):  # not unpacked in this pass
            record.pending -= 1
            if record.pending == 0:
                self._drop_load(record)
        if record.live == 0:
            self._release(record)

    def _release(self, record: _Record) -> None:
        """Forget ``record``: its handles are gone. What it holds is freed behind the transfers that use it: a read
        back behind its copy (:meth:`_drop_load`), its stored copy and its original behind its write in flight
        (:meth:`_finish_write` calls :meth:`_forget`), never by a wait here."""
        if record.state is _State.RELEASED:
            return
        if record.handle in self._window:
            del self._window[record.handle]
            self._window_bytes -= record.nbytes
        self._drop_load(record)
        record.state = _State.RELEASED
        del self._records[record.handle]
        if self._by_key.get(record.key) is record:
            del self._by_key[record.key]
        if record.dense:
            extent = _extent_key(record.key)
            self._by_extent[extent].remove(record)
            if not self._by_extent[extent]:
                del self._by_extent[extent]
        if record.write is None:
            self._forget(record)
        else:  # the tier's close (also when this context is dropped first) waits for the write to end
            self._tier.frees.free(record.write.future, _nothing)

    def _forget(self, record: _Record) -> None:
        """Free a released record's original and stored copy (its write, if it had one, ended)."""
        self._drop_original(record)
        if record.written:
            self._tier.delete(record.name)
            self._tier.release_host(record.host, record.host_reader)
            record.host = record.host_reader = None
            self._offloaded_bytes -= record.nbytes


def _nothing() -> None:
    """A release with nothing to give back: the transfer is only waited for by the tier's close."""


def _uncount(ledger: StorageLedger, key, load: Load) -> None:
    """A tensor read back is freed: its copy ended (``load``, kept until then)."""
    ledger.remove(key)
