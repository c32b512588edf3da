"""The ranks an engine trains with: a ``torch.distributed`` process group, and the few collectives nvoffload runs.

Every collective here waits at most :attr:`Ranks.timeout_s` and then raises a
:class:`RankTimeoutError` naming what it waited for, so that a rank that died
or took another path never leaves the others waiting forever (gloo also fails
at once when a peer's connection closes). Collectives run in the same order on
every rank: the callers issue them from the same points of the same step.

Who waits for a collective (see :meth:`Ranks.order` and :meth:`Ranks.wait`):

* on a GPU (NCCL) the host does not, on the hot path: ``work.wait()`` without a
  timeout makes the current stream wait for the collective, and an event
  recorded there after it orders whatever reads the result (the gradient's copy
  to the host is queued on the copy stream behind that event);
* the host waits only where it reads the result itself (a sum, a flag, weights
  in host memory), bounded by :attr:`Ranks.timeout_s`; on the CPU (gloo) the
  host is the stream, so every wait is such a host wait.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nvoffload.core.future import Future
from nvoffload.device import CudaEvent

DEFAULT_TIMEOUT_S = 600.0


class RankTimeoutError(RuntimeError):
    """A collective did not complete: another rank died, hangs, or took another path through the step."""


@dataclass(frozen=True)
class Ranks:
    """One process group as nvoffload uses it.

    Attributes:
        group: the process group (None: the default group).
        rank, world_size: this process's rank in ``group`` and the group's size.
        device: where collectives take their tensors (the current CUDA device with NCCL, else the CPU).
        timeout_s: the longest wait of one collective, seconds.
    """

    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    device: torch.device
    timeout_s: float = DEFAULT_TIMEOUT_S

    @staticmethod
    def resolve(process_group: dist.ProcessGroup | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Ranks | None:
        """The ranks of ``process_group`` (default: the default group when one is initialized), or None
        when there is no group or it has one rank (then nothing is communicated)."""
        if process_group is None and not (dist.is_available() and dist.is_initialized()):
            return None
        world = dist.get_world_size(process_group)
        if world == 1:
            return None
        backend = str(dist.get_backend(process_group)).lower()
        if "nccl" in backend:
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        return Ranks(process_group, dist.get_rank(process_group), world, device, float(timeout_s))

    # ------------------------------------------------------------------ collectives
    def order(self, work: dist.Work, what: str) -> None:
        """Order what the current stream does next after the async collective ``work`` (``what`` it is).

        On a GPU without a host wait: NCCL's ``work.wait()`` without a timeout only makes the current stream
        wait (with a timeout it would block the host until the collective ends). On the CPU the host is the
        stream: it waits, at most ``timeout_s``, then raises :class:`RankTimeoutError`.
        """
        if self.device.type == "cuda":
            work.wait()
            return
        try:
            done = work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise RankTimeoutError(self.failure(what, str(exc))) from exc
        if done is False:
            raise RankTimeoutError(self.failure(what, f"no answer within {self.timeout_s:g} s"))

    def wait(self, work: dist.Work, what: str) -> None:
        """Wait on the host for the async collective ``work``, for a host read of its result: at most
        ``timeout_s``, then :class:`RankTimeoutError`. On a GPU the current stream is ordered after it
        (:meth:`order`) and the host waits for an event recorded there (not the whole device)."""
        self.order(work, what)
        self.settle(what)

    def settle(self, what: str) -> None:
        """On a GPU: wait on the host for the current stream's work so far (a collective it was ordered after,
        ``what``), at most ``timeout_s``, then :class:`RankTimeoutError`; on the CPU there is nothing queued."""
        if self.device.type == "cuda" and not CudaEvent(torch.cuda.current_stream(self.device)).synchronize(self.timeout_s):
            raise RankTimeoutError(self.failure(what, f"not done on the device within {self.timeout_s:g} s"))

    def future(self, works: list[dist.Work], what: str) -> Future:
        """The collectives ``works`` as a :class:`~nvoffload.transfer.Future`: its ``result()`` orders the
        current stream after them (:meth:`order`: no host wait on a GPU), once; a failure is the
        :class:`RankTimeoutError` naming ``what``."""
        return Future([_Collectives(self, works, what)], what=what)

    def all_reduce(self, tensor: torch.Tensor, what: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """``tensor`` reduced in place over the ranks (on :attr:`device`), waited for."""
        self.wait(dist.all_reduce(tensor, op=op, group=self.group, async_op=True), what)
        return tensor

    def all_reduce_async(self, tensor: torch.Tensor) -> dist.Work:
        return dist.all_reduce(tensor, group=self.group, async_op=True)

    def reduce_async(self, tensor: torch.Tensor, dst: int) -> dist.Work:
        """Start summing ``tensor`` over the ranks into rank ``dst``'s (the others' is left undefined)."""
        return dist.reduce(tensor, dst=self._global(dst), group=self.group, async_op=True)

    def broadcast_async(self, tensor: torch.Tensor, src: int) -> dist.Work:
        """Start broadcasting ``tensor`` from rank ``src`` of the group."""
        return dist.broadcast(tensor, src=self._global(src), group=self.group, async_op=True)

    def sum(self, value: float, what: str) -> float:
        """``value`` summed over the ranks (fp64)."""
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        return float(self.all_reduce(t, what)[0])

    def min(self, value: int, what: str) -> int:
        """The smallest of ``value`` (an int) over the ranks."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        return int(self.all_reduce(t, what, op=dist.ReduceOp.MIN)[0])

    def any(self, flag: bool, what: str) -> bool:
        """Whether ``flag`` is true on any rank."""
        t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float32, device=self.device)
        return bool(self.all_reduce(t, what, op=dist.ReduceOp.MAX)[0] > 0)

    def agree(self, error: BaseException | None, what: str) -> None:
        """Raise on every rank when ``error`` happened on any: the rank's own error where it happened, a
        RuntimeError naming the failed ranks and their errors on the others."""
        mine = None if error is None else f"{type(error).__name__}: {error}"
        messages = self.gather_objects(mine, what)
        failed = {r: m for r, m in enumerate(messages) if m is not None}
        if error is not None:
            raise error
        if failed:
            listed = "; ".join(f"rank {r}: {m}" for r, m in failed.items())
            raise RuntimeError(f"nvoffload: {what} failed on another rank ({listed})")

    def gather_objects(self, value, what: str) -> list:
        """Every rank's ``value`` (picklable), in rank order, on every rank."""
        values: list = [None] * self.world_size
        self._object_collective(lambda: dist.all_gather_object(values, value, group=self.group), what)
        return values

    def broadcast_object(self, value, what: str):
        """Rank 0's ``value`` (picklable) on every rank."""
        box = [value]
        self._object_collective(lambda: dist.broadcast_object_list(box, src=self._global(0), group=self.group), what)
        return box[0]

    def same(self, value, what: str) -> None:
        """Raise ValueError unless every rank passes an equal ``value`` (a picklable summary)."""
        values = self.gather_objects(value, what)
        if any(v != values[0] for v in values):
            raise ValueError(f"nvoffload: {what} differs between the ranks: {values}")

    def _object_collective(self, run, what: str) -> None:
        try:
            run()
        except RuntimeError as exc:
            raise RankTimeoutError(self.failure(what, str(exc))) from exc

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def failure(self, what: str, why: str) -> str:
        """The message of a wait for ``what`` that ended without it (``why``)."""
        return (
            f"nvoffload: rank {self.rank} of {self.world_size} waited in vain for {what} ({why}); another rank"
            " died, hangs, or left the step on another path (an error there, or gradients for other parameters)"
        )


class _Collectives:
    """Collectives as the part of a :class:`~nvoffload.transfer.Future` (see :meth:`Ranks.future`). Their own
    bound is :attr:`Ranks.timeout_s`, whatever the future's wait allows."""

    __slots__ = ("_error", "_ranks", "_what", "_works")

    def __init__(self, ranks: Ranks, works: list[dist.Work], what: str):
        self._ranks, self._works, self._what = ranks, works, what
        self._error: RankTimeoutError | None = None

    def done(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def wait(self, timeout_s: float) -> bool:
        try:
            for work in self._works:
                self._ranks.order(work, self._what)
        except RankTimeoutError as exc:
            self._error = exc
        return True

    def error(self, what: str | None) -> BaseException | None:
        return self._error
