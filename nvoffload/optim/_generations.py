"""What every update schedule shares: the records' two generations, the requests that fill the new one, commit
and restore.

Every update writes a new generation of its chunk (``Chunk.pending_gen``) and leaves the committed one
(``Chunk.gen``) in the store. A schedule (:mod:`nvoffload.optim._schedule`) decides when the updates run;
:class:`Generations` queues them (:meth:`~Generations.submit` from a device gradient,
:meth:`~Generations.submit_kept` from the gradient kept in the store), makes the new generation the committed
one (:meth:`~Generations.commit`) or puts the committed weights back and drops it
(:meth:`~Generations.restore`), and raises an update's error after restoring (:meth:`~Generations.raise_error`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

import torch

from nvoffload.optim._chunk_io import ChunkIO
from nvoffload.optim._chunk_state import Chunk
from nvoffload.optim._layout import Record
from nvoffload.optim._pipeline import Pipeline
from nvoffload.optim._updates import Request

if TYPE_CHECKING:
    from nvoffload.optim._sharing import OneProcess


class OffloadIOError(RuntimeError):
    """An I/O error during :meth:`OffloadOptimizer.step`; the parameters were restored to their values before the step."""


RELEASED = object()  # Spec.grad_ref: the hook queued the update and freed the gradient (release_grads)


class Spec(NamedTuple):
    """What a parameter's hook saw on the step's last backward pass."""

    grad_ref: object  # weakref to the gradient, or RELEASED
    grad_version: int | None  # the gradient's ``_version`` then
    hparams: dict  # the group's hyperparameters then
    applied: bool  # the update was queued then (else only observed, to re-learn overlap)

    @classmethod
    def of(cls, grad: torch.Tensor, hparams: dict, applied: bool) -> Spec:
        """What the hook saw of the held gradient ``grad``."""
        return cls(weakref.ref(grad), grad._version, hparams, applied)


def hparams(group: dict) -> dict:
    """The group's hyperparameters as plain values (a tensor learning rate as its float)."""
    return {k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in group.items() if k != "params"}


def checked_grad(rec: Record) -> torch.Tensor | None:
    """``rec``'s gradient (None: it has none); raises ValueError for one the optimizer cannot take."""
    g = rec.param.grad
    if g is None:
        return None
    if g.is_sparse or g.layout != torch.strided:
        raise ValueError(f"{rec.name} has a sparse gradient; OffloadOptimizer supports dense gradients only")
    if g.device != rec.param.device:
        raise ValueError(f"{rec.name} is on {rec.param.device} but its gradient is on {g.device}")
    if g.shape != rec.param.shape:
        raise ValueError(f"{rec.name} has a gradient of shape {tuple(g.shape)}")
    return g


class Generations:
    """The records' generations (``records``: the optimizer's list, shared), the updates that write the new one,
    and the step's bookkeeping every schedule keeps: the records updated, the first step's gradient order."""

    def __init__(self, records: list[Record], io: ChunkIO, pipeline: Pipeline, sharing: OneProcess):
        self.records = records
        self.io = io
        self.pipeline = pipeline
        self.sharing = sharing
        self.stepped: set[Record] = set()  # records updated this step (those without chunks of this rank too)
        self.kept = 0  # which of each chunk's two kept gradients this step's hooks write (delayed updates alternate)
        self._order: list[Record] = []  # the first step's gradient order
        self._order_learned = False

    # ------------------------------------------------------------------ the step's order
    def count(self, rec: Record) -> None:
        """A hook of ``rec`` fired: count it, and learn the gradients' order on the first step."""
        rec.fires += 1
        if not self._order_learned and rec.fires == 1:
            self._order.append(rec)

    def learned(self) -> None:
        """The first step ended: its gradients' order is the order of every step's updates."""
        self._order_learned = True

    def step_order(self) -> list[Record]:
        """The records in the order their gradients come (those that had none last, in group order)."""
        seen = set(self._order)
        return list(self._order) + [r for r in self.records if r not in seen]

    def max_step(self) -> int:
        """The most updates any parameter has had (torch's ``state["step"]``)."""
        return max((r.step for r in self.records), default=0)

    # ------------------------------------------------------------------ updates
    def submit(self, rec: Record, grad: torch.Tensor, hp: dict, grad_scale: float, **kinds) -> None:
        """Queue ``rec``'s chunks' requests for the device gradient ``grad`` (``kinds``: :class:`Request`'s)."""
        if kinds.get("update", True):
            self.stepped.add(rec)
        flat = grad.reshape(-1) if grad.is_contiguous() else grad.contiguous().view(-1)
        ready = self.io.transfer.record()  # the gradient is final here, and backward no longer reads the weights
        for chunk in rec.chunks:
            if kinds.get("comm") is not None:
                kinds["comm"].hold()  # the worker releases it once it copied the gradient out
            self.pipeline.submit(
                Request(chunk, flat[chunk.elements], hp, rec.step + 1, grad_scale, ready, kept=self.kept, **kinds)
            )

    def submit_kept(self, rec: Record, grad_scale: float) -> None:
        """Queue ``rec``'s update from its kept gradient, from the committed generation."""
        hp = hparams(rec.group)
        self.stepped.add(rec)
        ready = self.io.transfer.record()  # the worker's copies of the weights wait for compute queued so far
        for chunk in rec.chunks:
            self.drop_pending(chunk)
            self.pipeline.submit(Request(chunk, None, hp, rec.step + 1, grad_scale, ready, kept=self.kept))

    def drop_pending(self, chunk: Chunk) -> None:
        """Forget ``chunk``'s new generation (its store entry deleted): its next update starts from the committed one."""
        if chunk.pending_gen is not None and chunk.pending_gen != chunk.gen:
            self.io.chunks.delete(chunk, chunk.pending_gen)
        chunk.pending_gen = None

    # ------------------------------------------------------------------ commit and restore
    def commit(self, records: Iterable[Record], stepped: set[Record]) -> None:
        """Make the new generation of ``records``' chunks the committed one; count a step for each updated
        record (and for those of ``stepped`` without chunks of this rank)."""
        for rec in records:
            updated = False
            for c in rec.chunks:
                if c.pending_gen is None:
                    continue
                updated = True
                if c.gen is not None and c.gen != c.pending_gen:
                    self.io.chunks.delete(c, c.gen)
                c.gen, c.pending_gen, c.applied = c.pending_gen, None, False
                c.scalars, c.pending_scalars = c.pending_scalars, {}  # a generic optimizer's (Adam has none)
            if updated or (not rec.chunks and rec in stepped):  # not rec.chunks: other ranks own it
                rec.step += 1

    def restore_all(self, records: Iterable[Record]) -> None:
        self.restore(c for r in records for c in r.chunks)

    def restore(self, chunks: Iterable[Chunk]) -> None:
        """Put back the committed weights of chunks whose update reached the model; drop their new generation."""
        to_read = []
        for chunk in chunks:
            self.drop_pending(chunk)
            chunk.pending_scalars = {}
            if chunk.applied and chunk.gen is not None:
                to_read.append(chunk)
            chunk.applied = False
        if to_read:
            self._read_back(to_read)

    def _read_back(self, chunks: list[Chunk]) -> None:
        """Write the committed weights of ``chunks`` into the model; every chunk is tried, the failures raised."""
        io, failures = self.io, []
        with self.pipeline.lend() as slot:
            for chunk in chunks:
                rec = chunk.record
                try:
                    io.chunks.read(chunk, chunk.gen, slot, state=False).result()
                    committed = io.chunks.layout.views(chunk, slot).weights
                    with io.model_weights(rec, modify=True) as weights:
                        weights.write(chunk.elements, committed, slot).result()
                except Exception as exc:  # noqa: BLE001 - every chunk is tried; a Ctrl-C is not an I/O failure
                    failures.append(f"{rec.name} elements [{chunk.start}, {chunk.start + chunk.numel}): {exc}")
        if failures:
            more = f" (and {len(failures) - 3} more chunks)" if len(failures) > 3 else ""
            raise OffloadIOError("could not restore the weights of " + "; ".join(failures[:3]) + more)

    def raise_error(self, records: list[Record]) -> None:
        """After an update failed (over several ranks: on any rank): restore every parameter and raise its error."""
        error = self.pipeline.take_error()
        if self.sharing.failed_elsewhere(error):
            self.restore_all(records)
            raise RuntimeError(
                "nvoffload: the optimizer step failed on another rank; the parameters were restored to"
                " their values before this step() on every rank (that rank raised the error)"
            )
        if error is None:
            return
        self.restore_all(records)
        if isinstance(error, OSError):
            raise OffloadIOError(f"optimizer step failed, parameters restored: {error}") from error
        error.add_note("nvoffload: the parameters were restored to their values before this step()")
        raise error
