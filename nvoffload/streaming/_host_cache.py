"""The host tier of parameter streaming: copies of blocks in the transfer engine's host slab, within the host budget."""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from collections.abc import Callable, Iterable

import torch

from nvoffload.core.deferred import Deferred
from nvoffload.io import TensorStore
from nvoffload.memory import MemoryBudgetError
from nvoffload.streaming._blocks import Block
from nvoffload.transfer import Future, ReadAhead, TransferEngine, WriteBehind
from nvoffload.transfer.engine import Lane

__all__ = ["HostCache"]

_CACHED = Future.completed()  # the read-ahead of a block cached already


class _Entry:
    """A block's host copy: the buffer, the read filling it or the write-back from it (if not settled), and who
    uses it."""

    __slots__ = ("host", "loading", "writing", "written", "dirty", "pins", "holds")

    def __init__(self, host: torch.Tensor, loading=None):
        self.host = host  # the block's bytes, flat uint8
        self.loading = loading  # future of the store read into ``host``
        self.writing = None  # future of the write-back of ``host`` to the store, on its way out
        self.written: set[int] = set()  # the block's parts that write-back writes
        self.dirty: set[int] = set()  # the block's parts newer than the store (and not being written back)
        self.pins = 0  # users that must not see it evicted
        self.holds: list[Future] = []  # readers on other threads that hold its weights as they are (HostCache.hold)


class HostCache:
    """Host copies of blocks, least recently used first out, within the slab of ``transfer``.

    The buffers come from the slab of ``transfer`` (page-locked with CUDA, so
    copies to the device run asynchronously; 4 KiB-aligned for the store's
    direct I/O), counted there only: the slab is the host tier's accounting
    (:meth:`MemoryManager.use_host_slab`, or a carve of that slab). The store holds every
    block. :meth:`pin` gives a block's host copy, its flat bytes (read from the
    store if not cached; ``Block.view`` gives each parameter's part), and keeps
    it cached until :meth:`unpin`;
    ``unpin(modified=True)`` marks it changed (``part=``: only that part of the
    block's ``parts``), and the changed parts of a block are written back before it
    leaves (or at :meth:`flush`): a LoRA layer whose adapters changed writes them,
    never its frozen base weights. :meth:`pin_loading` pins without
    waiting for the read, for a copy to the device chained after it. :meth:`read_ahead`
    reads the blocks a pass needs next through a :class:`~nvoffload.transfer.ReadAhead`
    (at most ``read_ahead_bytes`` of blocks read or kept for the pass and not used
    yet). Room is made without waiting (:meth:`_make_room`): a changed block that must
    leave starts its write-back and leaves once it is done (a later call), a clean one
    leaves at once; the write-backs are submitted from the transfer engine's write
    lane (a submit may wait for an earlier write of the block and for room in the
    I/O queue), never from the training thread's hooks, and copies to the device
    never queue behind them. A hook that needs a block now waits (bounded) only when
    every cached block that could leave is already on its way out. A failed write-back
    leaves the block cached and changed, and raises from the next call that needs its
    room, pins it or flushes. Thread-safe: the optimizer's worker pins blocks while the
    training thread brings them to the device; every wait for the store (a read, a
    write-back, room) happens outside the cache's lock, which the hooks take every block.

    Delayed updates write a block's new weights to its twin (:meth:`Block.twin`):
    :meth:`pin_next` makes it from the block's current weights on first use and
    keeps it like any cached block (evicted, its trained parts are written to the
    twin's own store entries), while forward and backward still read the block;
    :meth:`promote` makes every twin the block's weights (the updates landed), and
    :meth:`drop_next` forgets them (the updates were undone).

    A background checkpoint reads the weights of one step while the next steps change them: :meth:`hold` keeps
    the cached blocks whose weights the store does not have yet as they are, for a reader on another thread,
    until it lets each go; their writers (``pin(writing=True)``, :meth:`promote`) wait for it, and a block that
    needs the room of a held one waits as for a write-back.
    """

    def __init__(self, store: TensorStore, transfer: TransferEngine, read_ahead_bytes: int):
        self.store = store
        self.transfer = transfer
        self.slab = transfer.slab
        self._lock = threading.RLock()  # taken before the read-ahead's
        self._lru: collections.OrderedDict[Block, _Entry] = collections.OrderedDict()
        # A read not used is let go as a cached block like any other (least recently used first out): no drop.
        self._ahead = ReadAhead(read_ahead_bytes, lambda b: b.nbytes, self._start_ahead, lambda block, read: None)
        self._order: list[Block] | None = None  # the pass the read-ahead follows
        # Every write-back, oldest first; its buffer is a cached block's, counted in the slab already. A
        # failed one is raised by the next call that needs its block (_settle_write), not by the queue.
        self._writes = WriteBehind(self.slab.capacity_bytes, "parameter blocks' write-backs", keep_errors=False)
        # delayed updates: each block to have next weights, and its twin once made, until promote() or drop_next()
        self._next: dict[Block, Block | None] = {}
        self.bytes_read = 0
        self.bytes_written = 0

    def install(self, block: Block, fill: Callable[[torch.Tensor], None]) -> None:
        """Store a new block: ``fill`` writes its weights into a flat host buffer, which is written to the store
        and stays cached."""
        host = self._buffer(block)
        try:
            fill(host)
            self._write_back(block, host, range(len(block.parts)))
        except BaseException:
            with self._lock:
                self._give_back(block, host)
            raise
        with self._lock:
            self._lru[block] = _Entry(host)

    def pin(self, block: Block, *, writing: bool = False) -> torch.Tensor:
        """The block's weights in host memory, its flat bytes (read from the store when not cached); cached until
        :meth:`unpin`. Its read and write-back are waited for outside the cache's lock: the training thread's hooks
        keep using the cache meanwhile. ``writing``: the caller changes them, once every :meth:`hold` of them
        let them go (waited for too)."""
        entry = self._pinned_entry(block)
        try:
            if writing:
                _wait_for_holds(block, entry.holds)
            self._settle_write_unlocked(entry)  # the caller may change the bytes being written
            self._settle_unlocked(entry)
        except BaseException:
            with self._lock:
                entry.pins -= 1
                if not entry.pins and self._read_failed(entry) and self._lru.get(block) is entry:
                    self._drop(block)  # its read failed (raised here): read again when next needed
            raise
        return entry.host

    def pin_loading(self, block: Block) -> tuple[torch.Tensor, Future | None]:
        """Like :meth:`pin`, without waiting for the store: the flat host buffer, and the read that fills it
        (None when it holds the weights already). Unpin it even when the read fails."""
        entry = self._pinned_entry(block)
        return entry.host, entry.loading

    def unpin(self, block: Block, *, modified: bool, part: int | None = None) -> None:
        """Let the block's host copy go again; ``modified``: its weights changed (written back before it leaves),
        those of ``part`` only (an index in ``block.parts``) when given."""
        with self._lock:
            entry = self._lru[block]
            entry.pins -= 1
            if modified:
                entry.dirty.update(range(len(block.parts)) if part is None else (part,))
            elif entry.loading is not None and self._read_failed(entry) and not entry.pins:
                self._drop(block)  # its read failed, which its pinners saw: read again when next needed

    def expect_next(self, block: Block) -> None:
        """A delayed update will write next weights of ``block`` (its twin is made when it does)."""
        with self._lock:
            self._next.setdefault(block, None)

    def pin_next(self, block: Block) -> torch.Tensor:
        """The flat bytes of the twin that holds ``block``'s next weights (made from its current weights on first
        use since the last :meth:`promote` or :meth:`drop_next`), cached until ``unpin(next_of(block), ...)``."""
        with self._lock:
            twin = self._next.get(block)
        if twin is None:  # made outside the lock (it waits for the block's read and for room)
            twin = block.twin()
            with self.pinned(block) as current:
                host = self._buffer(twin)
                host.copy_(current)
            with self._lock:
                entry = self._lru[twin] = _Entry(host)
                # its own store entries hold nothing yet: evicted, it writes them
                entry.dirty = {k for k, part in enumerate(twin.parts) if part[0] != block.parts[k][0]}
                self._next[block] = twin
        return self.pin(twin)

    def next_of(self, block: Block) -> Block:
        """The twin that holds next weights of ``block`` (made by :meth:`pin_next`)."""
        with self._lock:
            return self._next[block]

    def expects_next(self, block: Block) -> bool:
        """Whether a delayed update that has not landed writes (or will write) next weights of ``block``."""
        with self._lock:
            return block in self._next

    def promote(self) -> None:
        """Every twin's weights become its block's (the delayed updates landed): the block's old host copy is
        dropped, the twin's is the block's, and so are its store entries (the old ones are the next twin's); a
        :meth:`hold` of an old one is waited for first."""
        with self._lock:
            old = [(b, self._lru[b].holds) for b in self._next if b in self._lru]
        for block, holds in old:  # outside the lock: the reader lets go under it
            _wait_for_holds(block, holds)
        with self._lock:
            self._check_unpinned()
            for block, twin in self._next.items():
                if twin is None:  # expected, never written (a parameter without a gradient): the block stays
                    continue
                old, new = self._lru.pop(block, None), self._lru.pop(twin, None)
                if old is not None:  # the old weights: a read or write-back of them still running ends first
                    self._ahead.take(block)
                    self._settle_quietly(old)
                    self._give_back(block, old.host)
                if new is not None:
                    with contextlib.suppress(Exception):  # a failed write-back left its parts changed: written later
                        self._settle_write(new)  # (it reads the twin's names, which become the block's)
                    self._lru[block] = new
                block.parts = twin.parts
            self._next.clear()

    def drop_next(self) -> None:
        """Forget every twin (the delayed updates were undone): the blocks keep their weights."""
        with self._lock:
            self._check_unpinned()
            for twin in filter(None, self._next.values()):
                entry = self._lru.get(twin)
                if entry is not None:
                    self._settle_quietly(entry)
                    self._drop(twin)
            self._next.clear()

    def _check_unpinned(self) -> None:
        in_use = [b for b, twin in self._next.items() for x in (b, twin) if x in self._lru and self._lru[x].pins]
        if in_use:
            raise RuntimeError(
                f"nvoffload: the delayed updates cannot land or be undone while {in_use[0]} is in use (on its way to"
                " the device, or in a forward or backward): land them between steps (optimizer.step() or"
                " synchronize())"
            )

    def hold(self, blocks: Iterable[Block]) -> list[tuple[Block, torch.Tensor, Callable[[], None]]]:
        """Hold the weights of those of ``blocks`` the cache has and the store does not (changed, or their write-back
        still running) as they are now, for a reader on another thread (a background checkpoint), until the reader
        calls the let-go returned with each: ``(block, its flat bytes, let go)``, least recently used first. Meanwhile
        their writers wait (``pin(writing=True)``, :meth:`promote`, :meth:`close`) and they stay cached (a block
        that needs their room waits, as for a write-back). The other blocks' weights are the store's. Call it
        between steps, every delayed update landed."""
        wanted = set(blocks)
        held = []
        with self._lock:
            if self._next:
                raise RuntimeError("nvoffload: the weights cannot be held while delayed updates are in flight: land them first")
            for block, entry in self._lru.items():
                if block in wanted and (entry.dirty or entry.writing is not None):
                    released = Deferred()
                    hold = Future([released], what=f"a reader's hold of the weights of {block}")
                    entry.holds.append(hold)
                    held.append((block, entry.host, functools.partial(self._let_go, entry, hold, released)))
        return held

    def _let_go(self, entry: _Entry, hold: Future, released: Deferred) -> None:
        with self._lock:
            if hold in entry.holds:  # (idempotent)
                entry.holds.remove(hold)
                released.set(Future.completed())

    @contextlib.contextmanager
    def pinned(self, block: Block, *, modified: bool = False):
        """:meth:`pin` and :meth:`unpin` around a ``with`` body (``modified``: pinned ``writing``)."""
        host = self.pin(block, writing=modified)
        try:
            yield host
        finally:
            self.unpin(block, modified=modified)

    def read_ahead(self, order: list[Block], used: Block) -> None:
        """A pass that runs the blocks in ``order`` (the same list each time: forward's, backward's) uses ``used``
        now: start reading the blocks after it, in order, while the read-ahead budget and the host budget have
        room without waiting (changed blocks that must leave first start their write-back, and the reads wait
        for a later call). A pass begins at ``order[0]`` or where the order changes."""
        with self._lock:
            if order is not self._order or used is order[0]:
                self._order = order
                self._ahead.plan(order)
            self._ahead.skip_to(used)
            self._ahead.pump()

    def flush(self) -> None:
        """Write every changed cached block back to the store."""
        with self._lock:
            for block, entry in self._lru.items():
                self._settle_write(entry)
                self._settle(entry)
                if entry.dirty:
                    self._write_back(block, entry.host, entry.dirty)
                    entry.dirty = set()

    def close(self) -> None:
        """Give back every host copy (changed ones are not written back: the store goes with the streamer), once
        the readers that :meth:`hold` some let them go."""
        with self._lock:
            held = [(b, e.holds) for b, e in self._lru.items() if e.holds]
        for block, holds in held:
            _wait_for_holds(block, holds)
        with self._lock:
            self._ahead.clear()
            for block, entry in list(self._lru.items()):
                self._settle_quietly(entry)
                self._drop(block)

    # ------------------------------------------------------------------ internals that take the lock themselves
    def _pinned_entry(self, block: Block) -> _Entry:
        """``block``'s entry, pinned: cached, or its read started once there is room (waited for outside the lock)."""
        while True:
            with self._lock:
                entry = self._lru.get(block)
                if entry is None:
                    blocker = self._make_room(block)
                    if blocker is None:
                        entry = self._start_read(block)
                if entry is not None:
                    self._ahead.take(block)
                    entry.pins += 1
                    self._lru.move_to_end(block)
                    return entry
            _wait_for_room(block, blocker)

    def _buffer(self, block: Block) -> torch.Tensor:
        """A slab buffer for ``block``'s host copy, once there is room (waited for outside the lock)."""
        while True:
            with self._lock:
                blocker = self._make_room(block)
                if blocker is None:
                    return self.slab.allocate(block.nbytes, f"host copy of {block}")
            _wait_for_room(block, blocker)

    def _settle_write_unlocked(self, entry: _Entry) -> None:
        """:meth:`_settle_write` of a pinned entry, waiting outside the lock (the caller does not hold it)."""
        writing = entry.writing
        if writing is not None:
            writing.exception()  # the wait; its error is raised below, once
            with self._lock:
                if entry.writing is writing:
                    self._settle_write(entry)

    def _settle_unlocked(self, entry: _Entry) -> None:
        """Wait for a pinned entry's read outside the lock (the caller does not hold it); raise its error."""
        loading = entry.loading
        if loading is not None:
            loading.result()
            with self._lock:
                if entry.loading is loading:
                    entry.loading = None

    # ------------------------------------------------------------------ internals (caller holds the lock)
    def _start_ahead(self, block: Block) -> tuple[Future | None, int] | None:
        """The read-ahead's start: read ``block`` (a cached one is kept as recently used instead: it counts against
        the read-ahead like a read, so reading further never evicts it); None when the host has no room now."""
        if block in self._lru:
            self._lru.move_to_end(block)
            return _CACHED, block.nbytes
        try:
            if self._make_room(block) is not None:
                return None  # no room to read ahead yet: the block is read now or when it is needed
        except MemoryBudgetError:
            return None
        return self._start_read(block).loading, block.nbytes

    @staticmethod
    def _read_failed(entry: _Entry) -> bool:
        """Whether the entry's read ended in failure; one that ended well is settled (checked once per read)."""
        loading = entry.loading
        if loading is None or not loading.done():
            return False
        if loading.exception(0) is None:
            entry.loading = None
            return False
        return True

    def _start_read(self, block: Block) -> _Entry:
        """Start reading ``block`` into a new buffer (:meth:`_make_room` made room for it)."""
        host = self.slab.allocate(block.nbytes, f"host copy of {block}")
        reads = [self.store.get(name, out=host[start:end]) for name, start, end in block.parts]
        entry = self._lru[block] = _Entry(host, reads[0] if len(reads) == 1 else Future.all_of(reads, what=str(block)))
        self.bytes_read += sum(end - start for _, start, end in block.parts)
        return entry

    def _settle_quietly(self, entry: _Entry) -> None:
        """Let the entry's write-back and read end, whatever they raise (its buffer is given up next)."""
        for settle in (self._settle_write, self._settle):
            with contextlib.suppress(Exception):
                settle(entry)

    @staticmethod
    def _settle(entry: _Entry) -> None:
        if entry.loading is not None:
            loading, entry.loading = entry.loading, None
            loading.result()

    def _put(self, block: Block, host: torch.Tensor, parts: list[int]) -> Future:
        """Start writing ``parts`` (indices in ``block.parts``) of the block's host copy to the store."""
        writes = [self.store.put(name, host[start:end]) for name, start, end in (block.parts[i] for i in parts)]
        return writes[0] if len(writes) == 1 else Future.all_of(writes, what=str(block))

    def _submit(self, block: Block, host: torch.Tensor, parts: Iterable[int], *, behind: bool) -> Future:
        """Queue the write-back of ``parts`` (indices in ``block.parts``) of the block's host copy on the
        write-behind; ``behind``: submitted from the transfer engine's dispatcher thread (not from the calling
        thread: the training thread's hooks), else from the calling thread."""
        parts = sorted(parts)
        nbytes = sum(block.parts[i][2] - block.parts[i][1] for i in parts)
        self.bytes_written += nbytes
        if behind:
            return self._writes.submit(nbytes, lambda: self.transfer.then(
                Future.completed(), lambda _: self._put(block, host, parts), what=f"the write-back of {block}",
                lane=Lane.WRITE,
            ))  # fmt: skip
        return self._writes.submit(nbytes, lambda: self._put(block, host, parts))

    def _write_back(self, block: Block, host: torch.Tensor, parts: Iterable[int]) -> None:
        written = self._submit(block, host, parts, behind=False)
        self._writes.wait_for(written)
        written.result()

    def _start_write_back(self, block: Block, entry: _Entry) -> None:
        entry.writing = self._submit(block, entry.host, entry.dirty, behind=True)
        entry.written, entry.dirty = entry.dirty, set()

    def _settle_write(self, entry: _Entry) -> None:
        """Wait for the entry's write-back; when it failed its parts are changed again (and the error raised)."""
        if entry.writing is not None:
            writing, entry.writing = entry.writing, None
            try:
                writing.result()
            except BaseException:
                entry.dirty.update(entry.written)
                raise
            finally:
                self._writes.poll()  # the write-backs done, oldest first, leave the write-behind's count

    def _give_back(self, block: Block, host: torch.Tensor) -> None:
        self.slab.free(host)

    def _drop(self, block: Block) -> None:
        self._ahead.take(block)  # a block read ahead and let go unused no longer counts against the read-ahead
        self._give_back(block, self._lru.pop(block).host)

    def _fits(self, block: Block) -> bool:
        return self.slab.fits(block.nbytes)

    def _make_room(self, block: Block) -> Future | None:
        """Evict least recently used unpinned blocks until ``block`` fits, without waiting: a changed block starts
        its write-back (submitted from the transfer engine's dispatcher) and leaves once it is done, a block being
        read leaves once read (a later call). None once ``block`` fits; else a write-back or read in flight that
        makes room when done, to wait for outside the lock (the rare case: the blocks that could leave are all on
        their way out). Raises MemoryBudgetError when none is."""
        in_flight = None
        for cached, entry in list(self._lru.items()):
            if self._fits(block):
                return None
            if entry.pins:
                continue
            running = next((f for f in (entry.writing, entry.loading, *entry.holds) if f is not None and not f.done()), None)
            if running is not None:
                in_flight = in_flight or running
                continue
            self._settle_write(entry)  # done: a failed one raises (its parts changed again)
            if entry.loading is not None:  # read ahead, never pinned: a failed read leaves nothing behind
                with contextlib.suppress(Exception):
                    self._settle(entry)
            if entry.dirty:  # one write-back at a time makes the room: each holds its old extents until written
                if in_flight is None:
                    self._start_write_back(cached, entry)
                    in_flight = entry.writing
                continue
            self._drop(cached)
        if self._fits(block):
            return None
        if in_flight is not None:
            return in_flight
        pinned = [str(b.index) for b, e in self._lru.items() if e.pins]
        raise MemoryBudgetError(
            f"{block} needs {block.nbytes} bytes of host memory, but {self.slab.available_bytes} are left in "
            f"{self.slab.what} and the cached blocks in use cannot leave (pinned: {', '.join(pinned) or 'none'})"
        )


def _wait_for_holds(block: Block, holds: list[Future]) -> None:
    """Wait (bounded by ``WAIT_LIMIT_S``) until every reader holding ``block``'s weights let them go."""
    for hold in list(holds):
        try:
            hold.result()
        except TimeoutError as e:
            raise TimeoutError(f"the weights of {block} waited for a reader that holds them (a background checkpoint): {e}") from None


def _wait_for_room(block: Block, blocker: Future) -> None:
    """Wait (bounded by ``WAIT_LIMIT_S``) for the write-back or read whose end makes room for ``block``; its own
    failure is raised by the next call that needs that block, not here."""
    try:
        blocker.exception()
    except TimeoutError as e:
        raise TimeoutError(f"{block} waited for host memory in the block cache, freed by a block on its way out: {e}") from None
