"""The optimizer's worker thread: reads chunks ahead, runs their updates, writes them back.

The rest of the optimizer talks to it through a narrow interface: ``submit``
an update request, ``set_plan`` (the order in which chunks are read ahead),
``mark`` (a future for the weights of the updates queued so far),
``wait_idle``, ``lend`` a slot to the training thread, ``take_error``, and
``stop``/``join``. The worker holds the chunk I/O, the update strategy and its
slots, never the optimizer, so a dropped optimizer is collected (and stops its
worker) while the thread runs.

Its reads ahead and writes behind are the transfer engine's queues
(:class:`~nvoffload.transfer.ReadAhead`, :class:`~nvoffload.transfer.WriteBehind`)
over one pool of slots: a chunk read ahead holds a slot until its update takes
it, an update's writes hold theirs until the state is on disk and the weights
reached the model. Reads ahead hold at most ``prefetch_chunks`` of the
``prefetch_chunks + 2`` slots, so when none is free a write holds one, and the
worker waits for the oldest write.

The slots and what moves through them are :class:`_Slots`' (the :class:`Pipeline` is the thread, its queue and
the update itself); each holds a chunk's state as an :class:`~nvoffload.optim._chunk_state.InSlot`. A request's
transfers start before its turn: at the previous request's, before that one's update runs
(``_Slots.stage_next``), the next request takes its slot (its chunk's read ahead, or a free one) and starts its
state's read (unless read ahead), its kept gradient's read and its gradient's copy to the host, so the copy
runs while the kernel computes. A read ahead dropped gives its slot back once it ended (a
:class:`~nvoffload.transfer.FreeBehind`), not by a wait.

A request that only keeps a gradient (``update=False``) is taken ahead of the
updates queued before it: its gradient is device memory that backward may be
waiting for, and what it writes (the step's kept gradient) is not what those
updates read (delayed updates read the other of a chunk's two kept gradients;
every other mode has no update queued when a gradient is kept).

No wait on the worker is unbounded: each raises a RuntimeError naming what it
waited for as soon as the worker thread ends, or when the worker made no
progress for :data:`~nvoffload.transfer.WAIT_LIMIT_S` (``NVOFFLOAD_WAIT_LIMIT_S``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import queue
import threading
import time
from collections.abc import Callable

import torch

from nvoffload import trace
from nvoffload.core.deferred import Deferred
from nvoffload.core.workers import start_thread
from nvoffload.optim._chunk_io import ChunkIO
from nvoffload.optim._chunk_state import Chunk, InSlot, Slot
from nvoffload.optim._updates import Request, Update
from nvoffload.transfer import WAIT_LIMIT_S, FreeBehind, Future, ReadAhead, WriteBehind

THREAD_NAME = "nvoffload-optimizer"


class _Handover:
    """A slot lent to the training thread: ``slot`` (or ``error``) set by the worker, ``given_back`` by the lender."""

    __slots__ = ("slot", "error", "given_back")

    def __init__(self):
        self.slot: Slot | None = None
        self.error: BaseException | None = None
        self.given_back = threading.Event()


class _Staged:
    """A request's transfers started ahead of its update: its chunk's state in its slot (``held``, the state's
    read started or not), and the futures of its ``grad``'s copy to the host and its ``kept`` gradient's read."""

    __slots__ = ("held", "grad", "kept")

    def __init__(self, held: InSlot):
        self.held = held
        self.grad: Future | None = None
        self.kept: Future | None = None


class _Slots:
    """The worker's slots and what moves through them: chunks' state read ahead (a :class:`ReadAhead`), a request's
    transfers started ahead of its update (:class:`_Staged`), the updates' writes behind (a :class:`WriteBehind`),
    and the reads ahead dropped (a :class:`FreeBehind`). Used from the worker thread only; errors of reads and
    writes go to ``errors`` (the pipeline's, reported from ``step()``)."""

    def __init__(self, io: ChunkIO, slots: list[Slot], prefetch_chunks: int, errors: list[BaseException]):
        self._io = io
        self._chunks = io.chunks
        self._errors = errors
        self._free = slots
        self._slot_bytes = io.chunks.layout.slot_bytes
        # The slots bound the writes in flight: the budget never holds one back.
        self._writes = WriteBehind(len(slots) * self._slot_bytes, "the optimizer's updates", keep_errors=False)
        self._read_ahead = ReadAhead(prefetch_chunks * self._slot_bytes, lambda chunk: self._slot_bytes,
                                     self._start_read, self._drop_read)  # fmt: skip
        self._ahead: dict[Chunk, InSlot] = {}  # the chunks read ahead: their state in their slots
        self._frees = FreeBehind("the optimizer's slots of reads ahead dropped")  # free once their reads ended
        self._prefetch = prefetch_chunks
        self._short_of_slots = False  # the last pump stopped at a read that found no free slot
        self._next: tuple[Request, _Staged] | None = None  # the next request, its transfers started (stage_next)

    def plan(self, chunks: list[Chunk]) -> None:
        """Read ``chunks`` ahead in this order (the reads ahead so far are dropped: read at the generations of
        before, and a new plan follows a commit or a load)."""
        self._read_ahead.clear()
        self._read_ahead.plan(chunks if self._prefetch else ())

    def drain(self) -> None:
        """Wait for every write behind and every dropped read to end."""
        self._writes.drain()
        self._frees.drain()

    def stop(self) -> None:
        """Drop the reads ahead, and :meth:`drain`."""
        self._read_ahead.clear()
        self.drain()

    def idle(self) -> None:
        """Give back what dropped requests still hold once their transfers end (a gradient's copy keeps the
        gradient, device memory a backward may be waiting for)."""
        self._frees.drain()

    def read_on(self) -> bool:
        """Start the reads ahead that the budget and the free slots allow; when one finds no free slot, wait for
        the oldest write (or dropped read) to free one. True when it waited (a read ahead can start now)."""
        return self.pump() and (self._frees.wait_oldest() or self._writes.wait_oldest())

    def pump(self) -> bool:
        """Start the planned reads ahead that the budget and the free slots allow; True when one waits for a slot."""
        self._short_of_slots = False
        try:
            self._read_ahead.pump()
        except BaseException as exc:  # noqa: BLE001 - reported from step()
            self._errors.append(exc)
        return self._short_of_slots

    def _start_read(self, chunk: Chunk) -> tuple[Future | None, int] | None:
        """:class:`ReadAhead`'s ``start``: read ``chunk``'s committed state into a free slot."""
        if self._errors:
            return None  # the step fails: nothing more to read for it
        if chunk.gen is None or chunk.pending_gen is not None:
            return None, 0  # no state yet (its first update initializes it), or updated already this step
        if not self._free:
            self._writes.poll()
            self._frees.reap()
        if not self._free:
            self._short_of_slots = True
            return None
        held = self._chunks.hold(chunk, self._free.pop())
        try:
            future = held.read(ahead=True)
        except BaseException:
            self._free.append(held.slot)
            raise
        self._ahead[chunk] = held
        return future, self._slot_bytes

    def _drop_read(self, chunk: Chunk, future: Future) -> None:
        """:class:`ReadAhead`'s ``drop``: a read ahead that no update took; its slot is free once it ended."""
        held = self._ahead.pop(chunk)
        held.count()  # read for nothing, but read
        self._frees.free(future, functools.partial(self._free.append, held.slot))  # its error does not matter

    def write_behind(self, slot: Slot, future: Future) -> None:
        """Hand ``future`` (writes out of ``slot``) to the write-behind queue; the slot is free once it finished."""
        self._writes.submit(self._slot_bytes, lambda: future, functools.partial(self._written, slot))

    def _written(self, slot: Slot, error: BaseException | None) -> None:
        if error is not None:
            self._errors.append(error)  # reported from step()
        self._free.append(slot)

    def take_slot(self) -> Slot:
        """A free slot, waiting for the oldest writes when none is (see the module docs)."""
        while not self._free and (self._frees.wait_oldest() or self._writes.wait_oldest()):
            pass
        return self._free.pop()

    def give_back(self, slot: Slot) -> None:
        """``slot`` (from :meth:`take_slot`) is free again."""
        self._free.append(slot)

    def _stage(self, req: Request, *, wait: bool) -> _Staged | None:
        """Take ``req``'s slot (its chunk's read ahead, or a free one) and start what it reads: its state (unless read
        ahead), its kept gradient, its gradient's copy to the host. Without ``wait`` (ahead of its turn): None when
        no slot is free now or its chunk has no state yet, and the gradient of a reduction in flight is left for
        its turn (its wait is the host's, on the CPU)."""
        chunk = req.chunk
        if not wait and req.update and chunk.gen is None:
            return None  # initialized in its turn, from the model's weights
        ahead = req.update and self._read_ahead.take(chunk) is not None
        if ahead:
            held = self._ahead.pop(chunk)
            held.count()
        else:
            if not wait and not self._free:
                self._writes.poll()
                self._frees.reap()
                if not self._free:
                    return None
            held = self._chunks.hold(chunk, self.take_slot())
        staged = _Staged(held)
        try:
            if req.update and not ahead and chunk.gen is not None:
                held.read()
            if req.grad is None or req.add_kept:
                staged.kept = held.read_kept(req.kept)
            if req.grad is not None and (wait or req.comm is None):
                if req.comm is not None:
                    req.comm.wait()
                staged.grad = self._io.grad_to_host(req.grad, held.slot, req.ready)
        except BaseException:
            self.unstage(staged)
            raise
        return staged

    def staged_for(self, req: Request) -> _Staged:
        """What :meth:`stage_next` started for ``req``, or all of it started now."""
        if self._next is not None and self._next[0] is req:
            staged, self._next = self._next[1], None
            return staged
        return self._stage(req, wait=True)

    def stage_next(self, req: Request, peek: Callable[[], object]) -> None:
        """Start the reads and copies of the item after ``req`` (``peek()``, when it is a request for another
        chunk), so that its gradient's copy runs while ``req``'s update computes."""
        if self._next is not None:
            return
        nxt = peek()
        if isinstance(nxt, Request) and nxt.chunk is not req.chunk:
            staged = self._stage(nxt, wait=False)
            if staged is not None:
                self._next = (nxt, staged)

    def unstage(self, staged: _Staged) -> None:
        """Give ``staged``'s slot back once what was started into it ended (its errors are not this one's)."""
        started = [f for f in (staged.held.future, staged.grad, staged.kept) if f is not None]
        self._frees.free(Future.all_of(started), functools.partial(self._free.append, staged.held.slot))

    def gradient(self, req: Request, staged: _Staged) -> tuple[torch.Tensor, Future | None]:
        """The request's gradient in host memory (summed with the kept one when asked; the kept one alone
        without a device gradient), its norm measured into ``chunk.grad_norm``, and the write
        that keeps it (None when not asked)."""
        held = staged.held
        if req.grad is None:
            return staged.kept.result(), None
        if staged.grad is None:  # left for its turn: a reduction in flight (see _stage)
            req.comm.wait()
            staged.grad = self._io.grad_to_host(req.grad, held.slot, req.ready)
        grad = staged.grad.result()
        if req.add_kept:
            grad = staged.kept.result().add_(grad)
        elif req.keep:
            grad = held.kept_grad().copy_(grad)
        req.chunk.grad_norm = float(torch.linalg.vector_norm(grad, dtype=torch.float32))
        return grad, held.write_kept(grad, req.kept) if req.keep else None

    def drop_staged(self, req: Request) -> None:
        """``req`` will not run (the step failed): give back what :meth:`stage_next` started for it, if anything."""
        if self._next is not None and self._next[0] is req:
            self.unstage(self._next[1])
            self._next = None


class Pipeline:
    """One worker thread over ``slots``; errors of updates are collected for ``take_error``, not lost."""

    def __init__(self, io: ChunkIO, update: Update, slots: list[Slot], prefetch_chunks: int):
        self._io = io
        self._update = update
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # put() is safe from a finalizer
        self._keeps: collections.deque[Request] = collections.deque()  # requests that only keep a gradient, first
        self._peeked: collections.deque = collections.deque()  # items taken off the queue to look at, in order
        self._errors: list[BaseException] = []  # of updates, reads and writes, for step()
        self._slots = _Slots(io, slots, prefetch_chunks, self._errors)
        self._lock = threading.Condition()
        self._pending = 0  # requests and drains queued and not done
        self._progress = 0  # requests, drains and lends done: a wait's limit counts from the last one
        self._uploads: list[Future] = []  # the updates' writes of weights to the model since the last mark or drain
        self._then_error: BaseException | None = None  # of stop()'s ``then``, for join()
        self._stopped = False  # stop() was called
        self._then: Callable[[], None] | None = None  # stop()'s, until it runs
        self._ended = False  # the worker thread left its loop
        self._death: BaseException | None = None  # what ended the worker thread, if not stop()
        self._thread = start_thread(THREAD_NAME, self._run, self.stop)  # stopped and joined at exit, if still running

    # ---- called from the training thread (and autograd hooks)
    def submit(self, req: Request) -> None:
        self._check_running()
        with self._lock:
            self._pending += 1
        if req.update:
            self._queue.put(req)
        else:  # taken ahead of the updates queued (see the module docs); the marker wakes an idle worker
            self._keeps.append(req)
            self._queue.put(("keep", None))

    def set_plan(self, plan: list[Chunk]) -> None:
        """Read ``plan``'s chunks ahead, in this order, from now on (read-ahead so far is dropped)."""
        self._check_running()
        self._queue.put(("plan", plan))

    def mark(self, what: str) -> Future:
        """A future done once the updates queued so far have written their new weights to the model (their state
        may still be on its way to the store); it fails with the first error of an update since the last
        ``take_error``, which ``take_error`` still reports. Waiting for it is bounded like every transfer's wait."""
        self._check_running()
        reached = Deferred()
        self._queue.put(("mark", reached))
        return Future([reached], what=what)

    def wait_idle(self) -> None:
        """Wait until every queued update ran and its writes are on disk."""
        self._check_running()
        with self._lock:
            self._pending += 1
        self._queue.put(("drain", None))
        self._wait(lambda: self._pending == 0, "the queued updates to run and their writes to finish")

    @property
    def failed(self) -> bool:
        """Whether an update or a read since the last ``take_error`` failed."""
        return bool(self._errors)

    def take_error(self) -> BaseException | None:
        """The first error since the last call (call while idle), and forget the others."""
        first = self._errors[0] if self._errors else None
        self._errors.clear()  # the list the slots report to
        return first

    @contextlib.contextmanager
    def lend(self):
        """A slot for the training thread's own transfers (restoring weights, state dicts), so that host
        memory stays within the budget; the worker waits, idle, until it is given back."""
        self._check_running()
        handover = _Handover()
        try:
            self._queue.put(("lend", handover))
            self._wait(lambda: handover.slot is not None or handover.error is not None, "a free staging slot")
            if handover.error is not None:
                raise handover.error
            yield handover.slot
        finally:
            handover.given_back.set()  # also when the wait failed: the worker must not wait for it

    def stop(self, then: Callable[[], None] | None = None) -> None:
        """Let the worker finish what is queued, then run ``then`` on the worker thread and end.
        Returns at once; safe to call from a finalizer (takes no lock) and more than once."""
        if not self._stopped:
            self._stopped = True
            self._then = then
            self._queue.put(("stop", None))

    def join(self) -> None:
        """Wait for the worker thread to end after ``stop``; raise what ``then`` raised. If the worker
        died before it could run ``then``, run it here."""
        if threading.current_thread() is self._thread:
            return
        self._thread.join(WAIT_LIMIT_S)
        if self._thread.is_alive():
            raise RuntimeError(
                f"nvoffload: the optimizer's worker thread did not stop within {WAIT_LIMIT_S:g} s"
                " (NVOFFLOAD_WAIT_LIMIT_S)"
            )
        self._run_then()
        if self._then_error is not None:
            raise self._then_error

    def _check_running(self) -> None:
        if self._stopped:
            raise RuntimeError("the OffloadOptimizer is closed")

    def _wait(self, done: Callable[[], bool], what: str) -> None:
        """Wait until ``done()``; raise RuntimeError if the worker ends first or makes no progress
        for WAIT_LIMIT_S."""
        with self._lock:
            while not (done() or self._ended):
                seen = self._progress
                if not self._lock.wait_for(lambda seen=seen: done() or self._ended or self._progress != seen, WAIT_LIMIT_S):
                    raise RuntimeError(
                        f"nvoffload: the optimizer's worker thread made no progress for {WAIT_LIMIT_S:g} s"
                        f" (NVOFFLOAD_WAIT_LIMIT_S) while waiting for {what}; it is stuck (in I/O?)"
                    )
            if done():
                return
        if self._death is None:
            raise RuntimeError("the OffloadOptimizer is closed")
        raise RuntimeError(f"nvoffload: the optimizer's worker thread died while waiting for {what}") from self._death

    # ---- worker thread
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - reported by the waits, which it ends
            self._death = exc
        finally:
            with self._lock:
                self._ended = True
                self._lock.notify_all()

    def _loop(self) -> None:
        while True:
            item = self._next_item()
            if isinstance(item, Request):
                self._run_request(item)
                continue
            kind, arg = item
            if kind == "keep":
                continue  # its request was taken already, or is the next item
            if kind == "stop":
                self._slots.stop()
                self._run_then()
                return
            if kind == "plan":
                self._slots.plan(arg)
            elif kind == "lend":
                self._lend(arg)
            elif kind == "mark":
                arg.set(Future.failed(self._errors[0]) if self._errors else Future.all_of(self._uploads))
                self._uploads = []
            else:  # drain: writes stay in flight while updates come in (reads ahead overlap them)
                self._slots.drain()
                self._uploads = []
                self._done()

    def _next_item(self):
        """The next queued item. While none is queued, read ahead, and when a read waits for a slot, wait for
        the oldest write to free one and read on; idle (waiting for the next item) once reading ahead is done."""
        while True:
            if self._keeps:
                return self._keeps.popleft()
            if self._peeked:
                return self._peeked.popleft()
            try:
                return self._queue.get_nowait()
            except queue.Empty:
                pass
            if not self._slots.read_on():
                self._slots.idle()  # idle: first what dropped requests hold goes; stop() ends the wait after
                return self._queue.get()

    def _peek(self):
        """The item :meth:`_next_item` returns next, if one is queued (None: none is)."""
        if self._keeps:
            return self._keeps[0]
        if not self._peeked:
            try:
                self._peeked.append(self._queue.get_nowait())
            except queue.Empty:
                return None
        return self._peeked[0]

    def _run_request(self, req: Request) -> None:
        try:
            if not self._errors:
                self._process(req)
            else:
                self._slots.drop_staged(req)
        except BaseException as exc:  # noqa: BLE001 - reported from step()
            self._errors.append(exc)
        # The gradient is device memory that backward, short of budget, may be waiting for: neither the request
        # (held until the next one comes) nor a failure's frames (held until step()) may keep it.
        req.grad = None
        if req.comm is not None:
            req.comm.release()  # its gradient was copied out (or never will be): the bucket may go
        self._done()

    def _done(self) -> None:
        with self._lock:
            self._pending -= 1
            self._progress += 1
            self._lock.notify_all()

    def _run_then(self) -> None:
        then, self._then = self._then, None
        if then is None:
            return
        try:
            then()
        except BaseException as exc:  # noqa: BLE001 - raised by join()
            self._then_error = exc

    def _lend(self, handover: _Handover) -> None:
        try:
            slot = self._slots.take_slot()
        except BaseException as exc:  # noqa: BLE001 - raised by lend()
            handover.error = exc
            slot = None
        else:
            handover.slot = slot
        with self._lock:
            self._progress += 1
            self._lock.notify_all()
        if slot is not None:
            # The lender gives the slot back in a ``finally``, and each of its own waits is bounded; how long it
            # keeps the slot is its own (a state dict streamed to a slow checkpoint takes as long as it takes).
            handover.given_back.wait()
            self._slots.give_back(slot)

    def _process(self, req: Request) -> None:
        if not req.update:
            self._keep_only(req)
            return
        chunk, io = req.chunk, self._io
        slots = self._slots
        staged = slots.staged_for(req)
        held = staged.held
        try:
            if chunk.gen is None:
                held.first(io.model_weights(chunk.record, modify=False), after=req.ready)
            slots.stage_next(req, self._peek)  # the next request's copies and reads overlap this update
            state = held.state()
            with io.model_weights(chunk.record, modify=True, update=True) as weights:
                held.master_from(weights, state, after=req.ready)
                grad, kept = slots.gradient(req, staged)
                out = held.applying(weights, state)
                slots.stage_next(req, self._peek)  # if the next request came in meanwhile
                updated = self._run_update(req, state, grad, out)
                upload = weights.write(chunk.elements, updated, held.slot, after=req.ready)
            written = held.write()
            if kept is not None:
                written = Future.all_of([written, kept])
        except BaseException:
            slots.unstage(staged)
            raise
        self._uploads.append(upload)
        # The slot is free again once the weights reached the model and the state is on disk.
        slots.write_behind(held.slot, Future.all_of([upload, written], what=f"the update of {chunk.record.name}"))
        # Keep reading ahead while the next update computes (the next update would wait for the oldest write
        # anyway, and then read without overlap).
        if slots.read_on():
            slots.pump()

    def _run_update(self, req: Request, state, grad: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """The update strategy on ``req``'s chunk, recorded as a span when tracing."""
        started_ns = time.monotonic_ns()
        updated = self._update(req, state, grad, out)
        recording = trace.active()
        if recording is not None:
            name = f"parameter {req.chunk.record.index} chunk {req.chunk.index}"
            recording.add("adam", name, started_ns, time.monotonic_ns(), elements=req.chunk.numel)
        return updated

    def _keep_only(self, req: Request) -> None:
        """A micro-batch before the step's last: add the gradient to the kept one, no update."""
        slots = self._slots
        staged = slots.staged_for(req)
        try:
            slots.stage_next(req, self._peek)
            _, kept = slots.gradient(req, staged)
        except BaseException:
            slots.unstage(staged)
            raise
        slots.write_behind(staged.held.slot, kept)
