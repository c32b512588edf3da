"""The ranks an engine trains with: a ``torch.distributed`` process group, and the few collectives nvoffload runs.

Every collective here waits at most :attr:`Ranks.timeout_s` and then raises a
:class:`RankTimeoutError` naming what it waited for, so that a rank that died
or took another path never leaves the others waiting forever (gloo also fails
at once when a peer's connection closes). Collectives run in the same order on
every rank: the callers issue them from the same points of the same step.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

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
    def wait(self, work: dist.Work, what: str) -> None:
        """Wait for the async collective ``work``; raise :class:`RankTimeoutError` after ``timeout_s``."""
        try:
            done = work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise RankTimeoutError(self.failure(what, str(exc))) from exc
        if done is False:
            raise RankTimeoutError(self.failure(what, f"no answer within {self.timeout_s:g} s"))
        if self.device.type == "cuda":  # NCCL's wait only orders the current stream: let the host see the data
            torch.cuda.current_stream(self.device).synchronize()

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
