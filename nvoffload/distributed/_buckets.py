"""Gradients and weights between the ranks, in buckets: averaged gradients in, the owners' new weights out.

Gradients travel in flat buckets of one dtype, at most ``bucket_bytes`` each,
on the communication device (:attr:`Ranks.device`):

* :meth:`GradientBuckets.average` (gradients held in ``.grad``): every bucket is
  all-reduced, two in flight, and ``.grad`` becomes the mean over the ranks
  on every rank, so that clipping, a ``GradScaler``'s checks and
  ``grad_norm()`` see exactly what one process would. Parameters with no
  gradient on any rank keep none.
* :meth:`GradientBuckets.add` (released gradients, during backward): a gradient
  joins the open bucket of its dtype; a full bucket (or, at the end of the
  backward pass, every open one) is reduced to the owners of its elements
  (one ``reduce`` per owner's run of elements: a reduce-scatter with uneven
  shares), asynchronously, and its entries are handed on with the bucket's
  reduced view and a :class:`PendingReduce` to wait on before reading it. The
  buckets fill in the order gradients arrive, which is the same on every rank
  (the same model and step), so the collectives match.

:func:`gather_weights` is the way back: after ``step()`` each owner broadcasts
its updated elements, bucket by bucket in the parameters' order, and every rank
writes the others' into its model (or its streamer's weights).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

import torch

from nvoffload.device import untracked
from nvoffload.distributed._partition import Partition
from nvoffload.distributed._ranks import Ranks, RankTimeoutError

DEFAULT_BUCKET_BYTES = 25 << 20  # as DistributedDataParallel's bucket_cap_mb

Deliver = Callable[[torch.Tensor, "PendingReduce"], None]  # (the parameter's reduced flat gradient, its wait)


class PendingReduce:
    """A bucket's reduction in flight; :meth:`wait` (any thread, more than once) returns once it is done.

    Its users (the update requests reading the bucket) :meth:`hold` it and :meth:`release` it once they copied
    their gradient out; ``freed`` is set when every one did, and the bucket's memory can go.
    """

    def __init__(self, ranks: Ranks, works: list, what: str):
        self._ranks, self._works, self._what = ranks, works, what
        self._lock = threading.Lock()
        self._users = 0
        self._delivered = False
        self.freed = threading.Event()

    def wait(self) -> None:
        with self._lock:
            works, self._works = self._works, []
        for work in works:
            self._ranks.wait(work, self._what)

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
        if self._delivered and self._users == 0:
            self.freed.set()


class _OpenBucket:
    __slots__ = ("entries", "numel")

    def __init__(self):
        self.entries: list[tuple[int, torch.Tensor, Deliver]] = []  # (parameter index, gradient, deliver)
        self.numel = 0


class GradientBuckets:
    """Averages or reduces the gradients of ``partition``'s parameters over ``ranks``."""

    def __init__(self, ranks: Ranks, partition: Partition, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.ranks = ranks
        self.partition = partition
        self.bucket_bytes = bucket_bytes
        self._open: dict[torch.dtype, _OpenBucket] = {}
        self._pass: int | None = None  # the backward pass whose end flushes the open buckets
        self._launched = 0
        self._inflight: deque[PendingReduce] = deque()  # launched buckets still read by update requests

    # ------------------------------------------------------------------ held gradients
    @torch.no_grad()
    def average(self, params: Sequence[torch.Tensor]) -> None:
        """Make every ``.grad`` of ``params`` (the same list, in the same order, on every rank) the mean over
        the ranks; a parameter with a gradient on some rank only gets one everywhere (zeros counted)."""
        buckets = _split(params, _grad_dtype, lambda p: p, self.bucket_bytes)
        inflight: list[tuple[list[torch.Tensor], torch.Tensor, object]] = []
        for bucket in buckets:
            flat = self._pack_held(bucket)
            inflight.append((bucket, flat, self.ranks.all_reduce_async(flat)))
            if len(inflight) == 2:
                self._unpack_held(*inflight.pop(0))
        for item in inflight:
            self._unpack_held(*item)

    def _pack_held(self, bucket: list[torch.Tensor]) -> torch.Tensor:
        """The bucket's gradients end to end, then one flag per parameter (1: it has a gradient here)."""
        dtype = _grad_dtype(bucket[0])
        numel = sum(p.numel() for p in bucket)
        flat = torch.zeros(numel + len(bucket), dtype=dtype, device=self.ranks.device)
        at = 0
        for i, p in enumerate(bucket):
            if p.grad is not None:
                flat[at : at + p.numel()].copy_(p.grad.reshape(-1))
                flat[numel + i] = 1
            at += p.numel()
        return flat

    def _unpack_held(self, bucket: list[torch.Tensor], flat: torch.Tensor, work) -> None:
        self.ranks.wait(work, "the gradients' all-reduce")
        numel = sum(p.numel() for p in bucket)
        flags = flat[numel:].tolist()
        flat = flat[:numel].div_(self.ranks.world_size)
        at = 0
        for p, flag in zip(bucket, flags):
            mean = flat[at : at + p.numel()].view(p.shape)
            at += p.numel()
            if flag == 0:
                continue
            if p.grad is None:
                p.grad = mean.to(p.device, copy=True)
            else:
                p.grad.copy_(mean)

    # ------------------------------------------------------------------ released gradients
    def add(self, index: int, grad: torch.Tensor, deliver: Deliver) -> None:
        """Reduce parameter ``index``'s gradient ``grad`` (final) to the owners of its elements, in a bucket;
        ``deliver(reduced, pending)`` is called once the bucket is launched (call from a backward hook)."""
        self._flush_at_end_of_pass()
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

    def _make_room(self) -> None:
        """Wait until at most one launched bucket is still read (the worker copies their gradients out in
        order), so that two buckets at most are in device memory: ``2 * max(bucket_bytes, largest gradient)``."""
        while self._inflight and self._inflight[0].freed.is_set():
            self._inflight.popleft()
        while len(self._inflight) >= 2:
            if not self._inflight[0].freed.wait(self.ranks.timeout_s):
                raise RankTimeoutError(self.ranks.failure(
                    "the optimizer's worker to read a reduced gradient bucket", f"not within {self.ranks.timeout_s:g} s"
                ))  # fmt: skip
            self._inflight.popleft()

    @torch.no_grad()
    def _launch(self, bucket: _OpenBucket) -> None:
        self._make_room()
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
        pending = PendingReduce(self.ranks, works, f"the gradients' reduction (bucket {self._launched})")
        at = 0
        for _, grad, deliver in bucket.entries:
            deliver(flat[at : at + grad.numel()], pending)
            at += grad.numel()
        pending.delivered()
        self._inflight.append(pending)


def _grad_dtype(p: torch.Tensor) -> torch.dtype:
    return p.grad.dtype if p.grad is not None else p.dtype


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


@torch.no_grad()
def gather_weights(ranks: Ranks, partition: Partition, indexed: Sequence[tuple[int, torch.Tensor]], weights,
                   bucket_bytes: int) -> None:  # fmt: skip
    """Give every rank the owners' weights of the parameters ``indexed`` (``(index in partition, parameter)``,
    the same list on every rank). ``weights(param, modify)`` is a context manager yielding the parameter's
    flat weights (device or host memory) to read this rank's elements from, or to write the others' into."""
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
            ranks.wait(work, "the updated weights' broadcast")
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
