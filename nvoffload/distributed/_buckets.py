"""Gradients and weights between the ranks, in buckets: averaged gradients in, the owners' new weights out.

Gradients travel in flat buckets of one dtype, at most ``bucket_bytes`` each,
on the communication device (:attr:`Ranks.device`):

* :class:`BackwardAverage` (gradients held in ``.grad``): every bucket is
  all-reduced as soon as its gradients are final (during the last
  micro-batch's backward), and ``.grad`` is the mean over the
  ranks when ``backward()`` returns, as under ``DistributedDataParallel``; so
  clipping, a ``GradScaler``'s checks and ``grad_norm()`` see exactly what one
  process would. Parameters with no gradient on any rank keep none.
* :meth:`GradientBuckets.add` (released gradients, during backward): a gradient
  joins the open bucket of its dtype; a full bucket (or, at the end of the
  backward pass, every open one) is reduced to the owners of its elements
  (one ``reduce`` per owner's run of elements: a reduce-scatter with uneven
  shares), asynchronously, and its entries are handed on with the bucket's
  reduced view and a :class:`PendingReduce` to wait on before reading it. The
  buckets fill in the order gradients arrive, which is the same on every rank
  (the same model and step), so the collectives match.

Buckets in flight are a :class:`~nvoffload.transfer.WriteBehind` of the
transfer engine, within :func:`buckets_budget` bytes (what
:func:`reserve_buckets` counts): a new bucket waits for the oldest to be
written back (held gradients) or copied out by the optimizer's worker
(released ones). On a GPU no host thread waits for a collective on the way:
the readers are ordered after it by events (see :mod:`~nvoffload.distributed._ranks`).

:func:`gather_weights` is the way back: after ``step()`` each owner broadcasts
its updated elements, bucket by bucket in the parameters' order, and every rank
writes the others' into its model (or its streamer's weights).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence

import torch

from nvoffload.core.deferred import Deferred
from nvoffload.device import side_stream, untracked
from nvoffload.distributed._partition import Partition
from nvoffload.distributed._ranks import Ranks
from nvoffload.memory import MemoryManager
from nvoffload.transfer import Future, WriteBehind

DEFAULT_BUCKET_BYTES = 25 << 20  # as DistributedDataParallel's bucket_cap_mb

Deliver = Callable[[torch.Tensor, "PendingReduce"], None]  # (the parameter's reduced flat gradient, its wait)


class PendingReduce:
    """A bucket's reduction in flight, as its readers (the update requests) see it.

    :meth:`wait` (any thread, more than once) returns once the reduced bucket may be read: on a GPU at once
    (the readers' copies are ordered after the reduction by an event, see :meth:`GradientBuckets.add`); on
    the CPU once the reduction is done (a host wait of at most :attr:`Ranks.timeout_s`, naming the bucket).
    The readers :meth:`hold` it and :meth:`release` it once they copied their gradient out; :attr:`freed` is
    done when every one did, and the bucket's memory can go.
    """

    def __init__(self, reduced: Future):
        self._reduced = reduced
        self._lock = threading.Lock()
        self._users = 0
        self._delivered = False
        self.freed = Deferred()

    def wait(self) -> None:
        self._reduced.result()

    def hold(self) -> None:
        with self._lock:
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            self._settle()

    def delivered(self) -> None:
        """Every user holds it now."""
        with self._lock:
            self._delivered = True
            self._settle()

    def _settle(self) -> None:
        if self._delivered and self._users == 0 and self.freed.inner is None:
            self.freed.set(Future.completed())


class _OpenBucket:
    __slots__ = ("entries", "numel")

    def __init__(self):
        self.entries: list[tuple[int, torch.Tensor, Deliver]] = []  # (parameter index, gradient, deliver)
        self.numel = 0


def buckets_budget(params: Sequence[torch.Tensor], bucket_bytes: int) -> int:
    """The bytes of gradient buckets in flight at most: two of at most ``bucket_bytes`` each (a larger
    gradient alone), and never more than twice all the gradients (``params`` that require one)."""
    sizes = [p.numel() * p.element_size() for p in params if p.requires_grad]
    return 2 * min(max(bucket_bytes, max(sizes, default=0)), sum(sizes))


class GradientBuckets:
    """Reduces the gradients of ``partition``'s parameters over ``ranks`` to their owners, in buckets of at most
    ``bucket_bytes``; buckets whose gradients are still read take at most ``budget_bytes`` (a :class:`WriteBehind`:
    a bucket waits for the oldest to be read, see :func:`buckets_budget`)."""

    def __init__(self, ranks: Ranks, partition: Partition, bucket_bytes: int, budget_bytes: int):
        self.ranks = ranks
        self.partition = partition
        self.bucket_bytes = bucket_bytes
        self._open: dict[torch.dtype, _OpenBucket] = {}
        self._pass: int | None = None  # the backward pass whose end flushes the open buckets
        self._launched = 0
        # Launched buckets still read by update requests (no gradients: nothing is ever queued).
        self._read = WriteBehind(max(budget_bytes, 1), "the reduced gradient buckets the optimizer reads")
        self._side = None  # on a GPU: the side stream (device.side_stream) the readers are ordered on

    # ------------------------------------------------------------------ released gradients
    def add(self, index: int, grad: torch.Tensor, deliver: Deliver) -> None:
        """Reduce parameter ``index``'s gradient ``grad`` (final) to the owners of its elements, in a bucket;
        ``deliver(reduced, pending)`` is called once the bucket is launched (call from a backward hook).

        On a GPU ``deliver`` runs with a side stream current that waits for the reduction (NCCL's
        ``work.wait()``): an event it records there (``ComputeDevice.record``) is reached once the reduced
        gradient is there, so a copy queued behind it reads the sum, and neither the host nor the compute
        stream waits for the collective.
        """
        self._flush_at_end_of_pass()
        bucket = self._open.get(grad.dtype)
        if bucket is not None and (bucket.numel + grad.numel()) * grad.element_size() > self.bucket_bytes:
            self._launch(self._open.pop(grad.dtype))  # full: no bucket passes bucket_bytes but a gradient alone
        bucket = self._open.setdefault(grad.dtype, _OpenBucket())
        bucket.entries.append((index, grad, deliver))
        bucket.numel += grad.numel()
        if bucket.numel * grad.element_size() >= self.bucket_bytes:
            self._launch(self._open.pop(grad.dtype))

    def flush(self) -> None:
        """Launch every open bucket (the end of a backward pass)."""
        self._pass = None
        for dtype in list(self._open):
            self._launch(self._open.pop(dtype))

    def _flush_at_end_of_pass(self) -> None:
        task = torch._C._current_graph_task_id()
        if task != -1 and task != self._pass:
            self._pass = task
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)

    def _launch(self, bucket: _OpenBucket) -> None:
        nbytes = bucket.numel * bucket.entries[0][1].element_size()
        self._read.submit(nbytes, lambda: self._reduce(bucket))

    @torch.no_grad()
    def _reduce(self, bucket: _OpenBucket) -> Future:
        """Start reducing ``bucket`` and deliver its entries; the future is done once every reader is done."""
        dtype = bucket.entries[0][1].dtype
        flat = torch.empty(bucket.numel, dtype=dtype, device=self.ranks.device)
        placed = []
        at = 0
        for index, grad, _ in bucket.entries:
            flat[at : at + grad.numel()].copy_(grad.reshape(-1))
            placed.append((index, at))
            at += grad.numel()
        works = [self.ranks.reduce_async(flat[start:end], owner) for owner, start, end in self.partition.runs(placed)]
        self._launched += 1
        what = f"the gradients' reduction (bucket {self._launched})"
        pending = PendingReduce(self.ranks.future(works, what))
        with self._readers_after(pending):
            at = 0
            for _, grad, deliver in bucket.entries:
                deliver(flat[at : at + grad.numel()], pending)
                at += grad.numel()
        pending.delivered()
        return Future([pending.freed], what=f"bucket {self._launched} of reduced gradients, until the optimizer's worker copied it out")

    @contextlib.contextmanager
    def _readers_after(self, pending: PendingReduce):
        """On a GPU: a side stream current that waits for the reduction (the host does not); on the CPU nothing
        (the readers wait on the host, :meth:`PendingReduce.wait`)."""
        if self.ranks.device.type != "cuda":
            yield
            return
        if self._side is None:
            self._side = side_stream(self.ranks.device)
        with self._side:
            pending.wait()  # NCCL's work.wait(): the side stream waits
            yield


class BackwardAverage:
    """Held gradients averaged over the ranks as soon as they are final: during the last micro-batch's backward.

    The buckets are fixed once (:meth:`arrange`: the parameters, by their optimizer index, in the order their
    gradients arrive, the same list on every rank), so that every rank starts the same all-reduces in the same
    order. Every gradient's hook calls :meth:`fired`; bucket ``i`` starts once each of its parameters expected (:meth:`expect`) had its
    last gradient of the step (as many backward passes as in the step before) and every bucket before it started.
    The buckets in flight take at most ``budget_bytes`` of :attr:`Ranks.device` memory (a :class:`WriteBehind`,
    see :func:`buckets_budget`): starting one more writes the oldest back into ``.grad`` first (the mean over
    the ranks). Once the last bucket started, the hook writes them all back: ``.grad`` is the mean when
    ``backward()`` returns, as under ``DistributedDataParallel``. ``on_averaged(indices)`` is told of each
    bucket written back during backward. On a GPU a write-back orders the current stream after the
    all-reduce (no host wait, see :meth:`Ranks.order`).

    :meth:`complete` (at ``step()``) starts and writes back whatever backward did not: all of it in the first
    step, the rest after fewer micro-batches than expected. A gradient that changed after its bucket started
    (more micro-batches than expected, a gradient where none was expected) makes the step :attr:`stray`:
    ``expect(())`` then :meth:`complete` averages every bucket again (the mean of gradients already averaged
    plus this rank's later ones is still the right mean).
    """

    def __init__(self, ranks: Ranks, bucket_bytes: int, budget_bytes: int, on_averaged: Callable[[list[int]], None]):
        self.ranks = ranks
        self.bucket_bytes = bucket_bytes
        self.budget_bytes = max(budget_bytes, 1)  # no gradients: nothing is ever queued
        self._on_averaged = on_averaged
        self._buckets: list[list[tuple[int, torch.Tensor]]] = []  # (index, parameter)
        self._bucket_of: dict[int, int] = {}  # index -> its bucket
        self._missing: list[int] = []  # per bucket, its expected parameters whose last gradient did not come yet
        self._next = 0  # the next bucket to start
        self._in_flight = WriteBehind(self.budget_bytes, "the gradients' all-reduces")
        self._in_backward = False  # the write-backs happen in a backward hook (on_averaged is told)
        self.stray = False  # a gradient changed after its bucket started

    @property
    def arranged(self) -> bool:
        return bool(self._buckets)

    def arrange(self, indexed: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Fix the buckets: ``(index, parameter)`` cut in order (the same list on every rank)."""
        self._buckets = _split(indexed, lambda item: item[1].dtype, lambda item: item[1], self.bucket_bytes)
        self._bucket_of = {index: i for i, bucket in enumerate(self._buckets) for index, _ in bucket}
        self.expect(())

    def expect(self, indices: Sequence[int]) -> None:
        """A new step: its buckets start once the last gradients of parameters ``indices`` came (those of the
        step before; none: every bucket again, at :meth:`complete`). Buckets of a step that was undone still in
        flight are dropped (their collectives keep their memory until they end)."""
        expected = set(indices)
        self._missing = [sum(index in expected for index, _ in bucket) for bucket in self._buckets]
        self._next = 0
        self._in_flight = WriteBehind(self.budget_bytes, "the gradients' all-reduces")
        self.stray = False

    def fired(self, index: int, last: bool) -> None:
        """Parameter ``index``'s gradient is final for this backward pass (call from its hook); ``last``: of
        the step."""
        bucket = self._bucket_of.get(index)
        if bucket is None:
            return
        if bucket < self._next:  # its bucket started before this gradient came
            self.stray = True
            return
        self._missing[bucket] -= last
        if self._missing[self._next] == 0:
            self._in_backward = True
            while self._next < len(self._buckets) and self._missing[self._next] == 0:
                self._start_next()
            if self._next == len(self._buckets):
                self._in_flight.drain()

    def complete(self) -> None:
        """Start the buckets backward did not, and write every one back."""
        self._in_backward = False
        while self._next < len(self._buckets):
            self._start_next()
        self._in_flight.drain()

    @torch.no_grad()
    def _start_next(self) -> None:
        indexed = self._buckets[self._next]
        self._next += 1
        started: list[_HeldBucket] = []  # started once it fits; written back when the queue reaps it

        def start() -> Future:
            started.append(_HeldBucket(self.ranks, indexed))
            return started[0].reduced

        def write_back(error: BaseException | None) -> None:
            if error is not None:  # the all-reduce failed: no write-back, the step stops here
                raise error
            if not started[0].write_back():
                self.stray = True
            if self._in_backward:
                self._on_averaged(started[0].indices)

        self._in_flight.submit(sum(p.numel() * p.element_size() for _, p in indexed), start, write_back)


class _HeldBucket:
    """Held gradients on their way: packed end to end, then one flag per parameter (1: it has a gradient
    here), all-reduced; :attr:`reduced` is the all-reduce's future."""

    def __init__(self, ranks: Ranks, indexed: list[tuple[int, torch.Tensor]]):
        self.ranks = ranks
        self.indices = [index for index, _ in indexed]
        self.params = params = [p for _, p in indexed]
        self.numel = sum(p.numel() for p in params)
        self.packed = [(p.grad, None if p.grad is None else p.grad._version) for p in params]
        self.flat = torch.zeros(self.numel + len(params), dtype=params[0].dtype, device=ranks.device)
        at = 0
        for i, p in enumerate(params):
            if p.grad is not None:
                self.flat[at : at + p.numel()].copy_(p.grad.reshape(-1))
                self.flat[self.numel + i] = 1
            at += p.numel()
        self.reduced = ranks.future([ranks.all_reduce_async(self.flat)], "the gradients' all-reduce")

    def write_back(self) -> bool:
        """Every gradient some rank has becomes the mean (written on the current stream, ordered after the
        all-reduce: the queue waited for :attr:`reduced`). False when a gradient changed since it was packed
        (it is left as it is). The host reads the flags only when a parameter has no gradient here."""
        mean = self.flat[: self.numel].div_(self.ranks.world_size)
        flags = None
        unchanged = True
        at = 0
        for i, (p, (grad, version)) in enumerate(zip(self.params, self.packed)):
            part = mean[at : at + p.numel()].view(p.shape)
            at += p.numel()
            if p.grad is not grad or (grad is not None and grad._version != version):
                unchanged = False
            elif grad is not None:
                p.grad.copy_(part)
            else:  # has another rank a gradient for it?
                if flags is None:
                    self.ranks.settle("the gradients' all-reduce")
                    flags = self.flat[self.numel :].tolist()
                if flags[i]:
                    p.grad = part.to(p.device, copy=True)
        return unchanged


def _split(items: Sequence, dtype_of, param_of, bucket_bytes: int) -> list[list]:
    """``items`` cut into runs of one dtype and at most ``bucket_bytes`` each (a larger parameter alone)."""
    buckets: list[list] = []
    size = 0
    for item in items:
        nbytes = param_of(item).numel() * dtype_of(item).itemsize
        if buckets and dtype_of(buckets[-1][0]) == dtype_of(item) and size + nbytes <= bucket_bytes:
            buckets[-1].append(item)
            size += nbytes
        else:
            buckets.append([item])
            size = nbytes
    return buckets


def reserve_buckets(memory: MemoryManager, ranks: Ranks, params: Sequence[torch.Tensor], bucket_bytes: int,
                    host_slab=None):
    """Count in ``memory`` what the gradient buckets take at most (:func:`buckets_budget`), in the tier of
    :attr:`Ranks.device` (the device with NCCL, host memory with gloo). When the host tier is a slab
    (:meth:`MemoryManager.use_host_slab`), gloo's share is a carve of ``host_slab`` (default: that slab, or a
    carve of it), returned (``close()`` gives it back; else None): the buckets' tensors are torch's, so the
    carve only holds their room in the budget."""
    total = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    tier, budget = ("host", "cpu_memory_bytes") if ranks.device.type == "cpu" else ("device", "device_memory_bytes")
    nbytes = buckets_budget(params, bucket_bytes)
    what = (
        f"the gradient buckets between the ranks (two in flight, each of at most bucket_bytes={bucket_bytes} or"
        f" the {total} bytes of all the gradients: lower bucket_bytes or raise {budget})"
    )
    if tier == "host" and memory.host_slab is not None:
        return (host_slab or memory.host_slab).carve(nbytes, what) if nbytes else None
    memory.allocate(tier, nbytes, what)
    return None


@torch.no_grad()
def gather_weights(ranks: Ranks, partition: Partition, indexed: Sequence[tuple[int, torch.Tensor]], weights,
                   bucket_bytes: int) -> None:  # fmt: skip
    """Give every rank the owners' weights of the parameters ``indexed`` (``(index in partition, parameter)``,
    the same list on every rank). ``weights(param, modify)`` is a context manager yielding the parameter's
    flat weights (device or host memory) to read this rank's elements from, or to write the others' into.

    Each bucket's broadcasts are queued and the current stream ordered after them (:meth:`Ranks.order`: on a GPU
    no host wait), the others' elements copied from there on it; the host waits once, at the end, for the
    current stream (:meth:`Ranks.settle`). Only a copy into host memory (a streamer's weights) waits for its
    bucket, as it must before the host owns the bytes; on the CPU the host is the stream and waits for each."""
    for bucket in _split(indexed, lambda item: item[1].dtype, lambda item: item[1], bucket_bytes):
        dtype = bucket[0][1].dtype
        flat = torch.empty(sum(p.numel() for _, p in bucket), dtype=dtype, device=ranks.device)
        placed = []
        at = 0
        for index, p in bucket:
            lo, hi = partition.owned(index, ranks.rank)
            if hi > lo:
                with weights(p, False) as w:
                    flat[at + lo : at + hi].copy_(w[lo:hi])
            placed.append((index, at))
            at += p.numel()
        works = [ranks.broadcast_async(flat[start:end], owner) for owner, start, end in partition.runs(placed)]
        for work in works:
            ranks.order(work, "the updated weights' broadcast")
        at = 0
        for index, p in bucket:
            lo, hi = partition.owned(index, ranks.rank)
            if lo > 0 or hi < p.numel():
                with weights(p, True) as w:
                    if lo > 0:
                        untracked(w[:lo]).copy_(flat[at : at + lo])
                    if hi < p.numel():
                        untracked(w[hi:]).copy_(flat[at + hi : at + p.numel()])
            at += p.numel()
    ranks.settle("the updated weights' broadcast")
