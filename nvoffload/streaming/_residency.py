"""The device tier of parameter streaming: which blocks are on the device, who holds them, the copies that
bring them (double buffered through the transfer engine), and gradients' bytes."""

from __future__ import annotations

import functools
import threading
import time
import weakref

import torch
from torch import nn

from nvoffload.memory import MemoryBudgetError, MemoryManager
from nvoffload.streaming import _guard
from nvoffload.streaming._blocks import Block
from nvoffload.streaming._host_cache import HostCache
from nvoffload.transfer import WAIT_LIMIT_S, FreeBehind, Future, ReadAhead, TransferEngine

__all__ = ["DeviceResidency", "GradientLedger"]


_LANDED = Future.completed()  # a block kept on the device: nothing to copy
_NONE_HELD: dict[str, int] = {}


class _Parked:
    """A parked block's device side, found once (the hooks use it every call): the storage its parameters view,
    one flat byte tensor over it (the copies' destination, with a version counter of its own: their writes do not
    bump autograd's), its parameters with their own classes (given back on the device), its names in messages."""

    __slots__ = ("storage", "flat", "homes", "name", "what")

    def __init__(self, block: Block, storage: torch.Tensor, homes: list[tuple[nn.Parameter, type]]):
        self.storage = storage.untyped_storage()
        self.flat = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(self.storage, 0, (block.nbytes,), (1,))
        self.homes = homes
        self.name = str(block)
        self.what = f"the weights of {self.name}"


class _Counted(weakref.ref):
    """One counted gradient, the ledger's record of it: a weak reference to the gradient (whose callback uncounts
    it once freed), its parameter and its bytes (set once made: no Python constructor runs per gradient)."""

    __slots__ = ("nbytes", "param")
    __hash__ = object.__hash__  # the record is the handle: its identity, never the gradient's (nor its id())
    __eq__ = object.__eq__


class GradientLedger:
    """Gradients counted in the device tier from the moment autograd accumulates them until they are freed.

    :meth:`track` is called from post-accumulate-grad hooks that run before the
    optimizer's, so it sees each gradient while its parameter still holds it.
    Gradients whose parameter no longer holds them are *queued*: the optimizer
    took them and frees them as its updates finish. One record per gradient
    (:class:`_Counted`), kept until the gradient is freed; each parameter's
    latest is found by the parameter, so a gradient accumulated into again is
    counted once.
    """

    def __init__(self, memory: MemoryManager, model: nn.Module):
        self.memory = memory
        self._model = model  # names the parameters in messages
        self._lock = threading.Lock()
        self._freeing = threading.Condition(self._lock)  # notified as each gradient is freed
        self.frees = 0  # gradients freed so far
        self._counted: dict[_Counted, None] = {}  # the records of the gradients not freed yet, oldest first
        self._latest: dict[nn.Parameter, _Counted] = {}  # each parameter's latest record

    def track(self, param: nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return
        latest = self._latest.get(param)
        if latest is not None and latest() is grad:  # accumulated into the same tensor again
            return
        record = _Counted(grad, self._freed)
        record.param, record.nbytes = param, grad.nbytes
        with self._lock:
            self._counted[record] = None
            self._latest[param] = record
        self.memory.track("device", record.nbytes)

    def _freed(self, record: _Counted) -> None:
        self.memory.untrack("device", record.nbytes)  # before the waiters wake: they find the room
        with self._lock:
            del self._counted[record]
            self.frees += 1
            self._freeing.notify_all()

    def wait_freed(self, frees: int, timeout_s: float) -> bool:
        """Wait until a gradient is freed after the first ``frees`` (:attr:`frees` read before), at most
        ``timeout_s``; False when none was."""
        with self._lock:
            return self._freeing.wait_for(lambda: self.frees != frees, timeout_s)

    def _split(self) -> tuple[list[tuple[str, int]], int]:
        """(parameter, bytes) of the gradients their parameters still hold, and the bytes of the others."""
        held, queued = [], 0
        with self._lock:
            records = list(self._counted)
        for record in records:
            if record.param.grad is not None and record.param.grad is record():
                held.append((record.param, record.nbytes))
            else:
                queued += record.nbytes
        return held, queued

    def queued_bytes(self) -> int:
        return self._split()[1]

    def describe(self) -> str:
        held, queued = self._split()
        names = {p: n for n, p in self._model.named_parameters()}
        names = ", ".join(names.get(p, "?") for p, _ in held[:5]) + (", ..." if len(held) > 5 else "")
        attached = f" ({names}; freed when the optimizer takes them or at zero_grad())" if held else ""
        return (
            f"{sum(b for _, b in held)} bytes of gradients held by their parameters{attached}, {queued} queued for the"
            " optimizer (or in a gradient bucket between the ranks)"
        )


class DeviceResidency:
    """Which streamed blocks are on the device, who holds each there, and the device bytes they take.

    A block's parameters are views of one device storage, zero bytes while the
    block is off the device. A block comes to the device on its first
    :meth:`hold` and leaves at its last :meth:`unhold`; each hold names its
    reason (``"forward"``, ``"backward"``, ``"load_state_dict"``), and blocks are
    counted per reason, so a block called twice or held by a forward and a
    backward at once stays until both let go. Off the device a block's parameters
    keep their identity, but refuse reads (:mod:`~nvoffload.streaming._guard`).

    Double buffering: :meth:`stage` plans the block that comes next on a
    :class:`~nvoffload.transfer.ReadAhead` (the transfer engine's queue), which
    starts its copy (host to device on the transfer engine's copy stream, chained after its
    store read when the host cache is still reading it) while the current block
    computes, if the device budget has room for it; :meth:`hold` takes it and has
    the compute stream wait for the copy's event (on a GPU the host does not
    wait). A block that was not staged is copied the same way when it is held.
    The host copy stays pinned in the cache until its copy is done. The
    read-ahead's budget is one block (whatever its size: what the device budget
    leaves for the blocks coming next is the device budget's to say): staging
    another, or :meth:`close`, lets the previous one go, and a block kept on the
    device after its last hold (``unhold(stay=True)``) is counted as staged.

    When a block does not fit, :meth:`hold` waits only while gradients queued for
    the optimizer could free enough and keep being freed; otherwise it raises
    :class:`~nvoffload.memory.MemoryBudgetError` at once, naming what holds the device memory.
    """

    def __init__(self, memory: MemoryManager, cache: HostCache, transfer: TransferEngine, device: torch.device,
                 model: nn.Module, resident_bytes: int):  # fmt: skip
        self.memory = memory
        self.cache = cache
        self.transfer = transfer
        self.device = device
        self.gradients = GradientLedger(memory, model)  # the model names the parameters in messages
        self._resident_bytes = resident_bytes
        self._lock = threading.RLock()
        self._holds: dict[Block, dict[str, int]] = {}  # blocks held on the device: the holds of each reason (> 0)
        self._parked: dict[Block, _Parked] = {}
        # Blocks on the device (or arriving) and held by no one yet: one at a time (budget 0: one read alone).
        self._ahead = ReadAhead(0, lambda block: block.nbytes, self._start_ahead, self._drop_ahead)
        self._headroom_bytes = 0  # the headroom of the stage() whose read-ahead is starting
        self._copies: dict[Block, Future] = {}  # copies whose host source is still pinned
        # Blocks gone from the device whose last copy may still run: their memory and host copy go behind it.
        self._frees = FreeBehind("the device memory of blocks taken off the device")
        self._leaving: dict[Block, Future] = {}
        self._updates: dict[Block, list[Future]] = {}  # the optimizer's rewrites of a block's host copy in flight
        self._placements: list[_guard.Placement] = []
        self.grad_wait_s = 0.0  # time spent waiting for the optimizer to free gradients' device memory
        self.io_wait_s = 0.0  # time holds waited for blocks to arrive (on a GPU: their store reads)

    def park(self, block: Block) -> None:
        """Take a new block's parameters off the device (its weights are in the store): they become views of one
        device storage of the block, zero bytes until the block arrives."""
        storage = torch.empty(block.nbytes, dtype=torch.uint8, device=self.device)
        for p, view in zip(block.params, block.views(storage)):
            p.data = view
        placements, homes = _guard.attach_all(block.params, block.param_names, block.index)
        self._placements += placements
        parked = self._parked[block] = _Parked(block, storage, homes)
        parked.storage.resize_(0)

    def hold(self, block: Block, why: str, *, headroom_bytes: int = 0) -> None:
        """Keep ``block`` on the device for ``why`` (bringing it there), with ``headroom_bytes`` more to follow.

        Compute issued after this call sees the block's weights."""
        with self._lock:
            holds = self._holds.get(block)
            if holds is None:
                if self._holds:  # (only held blocks' copies are reaped)
                    self._reap()
                self._arrive(block, headroom_bytes)
                holds = self._holds[block] = {}
            holds[why] = holds.get(why, 0) + 1

    def stage(self, block: Block | None, *, headroom_bytes: int = 0) -> None:
        """Start bringing ``block`` to the device ahead of its :meth:`hold`, if the device budget has room for it
        and ``headroom_bytes`` more; let a block staged before and not held since go (None: just that)."""
        with self._lock:
            self._frees.reap()  # the memory of blocks gone whose copies ended: room for the one staged
            self._headroom_bytes = headroom_bytes
            self._ahead.plan([] if block is None else [block])
            self._ahead.pump()

    def unhold(self, block: Block, why: str, *, stay: bool = False) -> None:
        """Drop one hold of ``block`` for ``why``; the last one takes the block off the device, or, with ``stay``
        and no block staged, leaves it there as the staged block (the next hold needs no copy)."""
        with self._lock:
            holds = self._holds.get(block, _NONE_HELD)
            count = holds.get(why, 0)
            if count <= 0:
                raise RuntimeError(f"{block} is not held on the device for {why}")
            if count > 1:
                holds[why] = count - 1
                return
            del holds[why]
            if not holds:
                del self._holds[block]
                if stay and self._ahead.keep(block, _LANDED, block.nbytes):  # already on the device
                    _guard.guard_all(block.params)
                else:
                    self._leave(block)

    def updating(self, block: Block, done: Future) -> None:
        """The optimizer rewrites part of ``block``'s host copy until ``done`` (an update deferred past
        ``step()``): the block's next copy to the device waits for it, and fails with its error. The wait is
        the training thread's, when the block is held (a block is not staged while its update runs), never the
        transfer engine's dispatcher: the update may need that one for the host cache's write-backs."""
        with self._lock:
            self._updates.setdefault(block, []).append(done)
            if block in self._ahead.waiting():
                self.stage(None)  # staged before its update: copied again when held

    def settled(self) -> None:
        """No update given to :meth:`updating` is in flight any more (the optimizer landed them, or undid them)."""
        with self._lock:
            self._updates.clear()

    def updated(self, block: Block) -> Future | None:
        """A future for the updates of ``block``'s host copy still in flight or failed (None: none is)."""
        with self._lock:
            pending = [f for f in self._updates.get(block, ()) if not f.done() or f.exception(0) is not None]
            if not pending:
                self._updates.pop(block, None)
                return None
            self._updates[block] = pending
            return pending[0] if len(pending) == 1 else Future.all_of(pending, what=f"the updates of {block}")

    def wait_updated(self, block: Block) -> None:
        """Wait for the optimizer's updates of ``block``'s host copy in flight (raise their error)."""
        update = self.updated(block)
        if update is not None:
            update.result()

    def held(self) -> list[Block]:
        """The blocks held on the device now (a forward or a backward is running them)."""
        with self._lock:
            return list(self._holds)

    def holds(self, block: Block, why: str) -> int:
        with self._lock:
            return self._holds.get(block, _NONE_HELD).get(why, 0)

    def close(self) -> None:
        """Take every block off the device; the parameters' reads say the weights are gone from now on."""
        with self._lock:
            self.stage(None)
            for block in list(self._holds):
                del self._holds[block]
                self._leave(block)
            self._frees.drain()
            for placement in self._placements:
                placement.closed = True

    def describe(self) -> str:
        """What holds the device memory, for error messages."""
        with self._lock:
            blocks = [f"{b.index} ({', '.join(sorted(h))})" for b, h in self._holds.items()]
            blocks += [f"{b.index} (read ahead)" for b in self._ahead.waiting()]
        return (
            f"device memory in use: {self._resident_bytes} bytes of parameters outside the blocks; "
            f"parameter blocks on the device: {', '.join(blocks) or 'none'}; {self.gradients.describe()}"
        )

    # ------------------------------------------------------------------ internals (caller holds the lock)
    def _start_ahead(self, block: Block) -> tuple[Future | None, int] | None:
        """:class:`ReadAhead`'s ``start``: reserve the block's device memory (with the stage's headroom) and start
        its copy; (None, 0) for a block held already, None when the device or the host has no room now (the
        block is copied when it is held)."""
        if block in self._holds:
            return None, 0
        if block in self._updates and self.updated(block) is not None:
            return None  # copied when held, once its update is done (or raising its failure)
        if block in self._leaving:
            return None  # its last copy is still running: copied when held
        try:
            name = self._parked[block].name
            self.memory.allocate("device", block.nbytes, f"{name} (read ahead)", headroom_bytes=self._headroom_bytes)
        except MemoryBudgetError:
            return None
        try:
            self._bring(block)
        except MemoryBudgetError:  # no host room to read it ahead
            self._leave(block)
            return None
        except BaseException:
            self._leave(block)
            raise
        return self._copies[block], block.nbytes

    def _drop_ahead(self, block: Block, copy: Future) -> None:
        """:class:`ReadAhead`'s ``drop``: a staged block no hold took leaves the device (its copy landed first)."""
        self._leave(block)

    def _arrive(self, block: Block, headroom_bytes: int) -> None:
        """Reserve the block's device memory (a staged block has it: only the headroom), copy it unless staged,
        and order compute after the copy."""
        staged = self._ahead.take(block) is not None
        if not staged:
            self._settle(block)
        nbytes = 0 if staged else block.nbytes
        try:
            if nbytes or headroom_bytes:  # a staged block has its bytes counted
                self._reserve(block, nbytes, headroom_bytes)
        except BaseException:
            if staged:
                self._leave(block)
            raise
        try:
            start = time.perf_counter()
            if not staged:
                if block in self._updates:
                    self.wait_updated(block)  # the optimizer's update of its weights (deferred past step())
                self._bring(block)
            copy = self._copies.get(block)  # none when it stayed from its last hold
            if copy is not None:
                self.transfer.wait(copy)
            self.io_wait_s += time.perf_counter() - start
        except BaseException:
            self._leave(block)
            raise
        _guard.unguard_all(self._parked[block].homes)

    def _bring(self, block: Block) -> None:
        """Give the block's storage its bytes and start the copy from its host copy (after the store read, if one
        is running); the host copy stays pinned until the copy is done."""
        parked = self._parked[block]
        parked.storage.resize_(block.nbytes)
        host, loading = self.cache.pin_loading(block)
        dst, what = parked.flat, parked.what
        try:
            if loading is None:
                copy = self.transfer.to_device(dst, host, what=what)
            else:  # once the read is done, queued behind the compute so far (the last readers of this memory)
                after = self.transfer.record()
                copy = self.transfer.then(
                    loading, lambda _: self.transfer.to_device(dst, host, after=after, what=what), what=what
                )
        except BaseException:
            self.cache.unpin(block, modified=False)
            raise
        self._copies[block] = copy

    def _leave(self, block: Block) -> None:
        """Take the block off the device: its parameters refuse reads now; its storage and device bytes are freed
        and its host copy unpinned behind its last copy (if one is out), without a host wait: the copy may still
        write the storage and read the host copy."""
        _guard.guard_all(block.params)
        copy = self._copies.pop(block, None)
        if copy is not None:
            self._leaving[block] = copy
        self._frees.free(copy, functools.partial(self._gone, block, copy), block.nbytes)

    def _gone(self, block: Block, copy: Future | None) -> None:
        """:meth:`_leave`'s release, once ``copy`` (the block's last, if any) is done."""
        if copy is not None:
            del self._leaving[block]
            self._unpin(block, copy)
        self._parked[block].storage.resize_(0)
        self.memory.free("device", block.nbytes)

    def _settle(self, block: Block) -> None:
        """Before ``block`` comes back: run the release its leaving queued, waiting (bounded) for the copy that last
        brought it if that is still running (a block brought back at once; else it ended long ago)."""
        leaving = self._leaving.get(block)
        if leaving is not None:
            leaving.exception()
            self._frees.reap()

    def _reap(self) -> None:
        """Unpin the host copies of held blocks whose copies are done (compute waited for them already); give back
        what blocks taken off the device hold once their copies are done."""
        self._frees.reap()
        for block in [b for b, copy in self._copies.items() if b in self._holds and copy.done()]:
            self._unpin(block, self._copies.pop(block))

    def _unpin(self, block: Block, copy: Future) -> None:
        """Unpin the block's host copy, read by ``copy``, which is done."""
        try:
            copy.exception()  # a failure was raised by the hold that waited for it
        finally:
            self.cache.unpin(block, modified=False)

    def _reserve(self, block: Block, nbytes: int, headroom_bytes: int) -> None:
        """Count ``nbytes`` of the block's in the device tier, with ``headroom_bytes`` more to follow. Short of
        room, wait while the gradients queued for the optimizer could free enough: woken by each gradient freed
        (no polling), given up when none is freed for ``WAIT_LIMIT_S``."""
        needed = nbytes + headroom_bytes
        start = time.perf_counter()
        while True:
            frees = self.gradients.frees
            try:
                self.memory.allocate("device", nbytes, self._parked[block].name, headroom_bytes=headroom_bytes)
                break
            except MemoryBudgetError as e:
                if self._frees.wait_oldest():  # a block taken off the device, its copy still running
                    continue
                pending = self.gradients.queued_bytes() >= needed - self.memory.available_bytes("device")
                if not pending or not self.gradients.wait_freed(frees, WAIT_LIMIT_S):
                    why = "nothing that could free it is pending" if not pending else f"no gradient was freed for {WAIT_LIMIT_S:g} s (NVOFFLOAD_WAIT_LIMIT_S)"
                    raise MemoryBudgetError(f"{e} ({why}); {self.describe()}") from None
        self.grad_wait_s += time.perf_counter() - start
