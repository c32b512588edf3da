"""How a schedule's gradients, norm and results are shared: one process (:class:`OneProcess`), or several
ranks, each with its share of the elements (:class:`Sharded`, around any schedule that trains over ranks).

Over several ranks (a :class:`~nvoffload.distributed.Sharding`), each rank's records hold the chunks of its
share of the elements only. Held gradients are averaged over the ranks in buckets during the last micro-batch's
backward (:class:`~nvoffload.distributed.BackwardAverage`; in ``step()`` for what backward could not), and the
hooks' speculation starts from each averaged bucket; released gradients are reduced to their owners in buckets
during backward, and the norm for clipping is summed over the ranks. The ranks agree on every error before
committing, and after the commit every rank receives the owners' new weights.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch

from nvoffload.distributed import Sharding
from nvoffload.optim._chunk_io import ChunkIO
from nvoffload.optim._layout import Record
from nvoffload.optim._pipeline import Pipeline

Observe = Callable[[Record], None]  # a held schedule's look at a gradient final for the step


def _last_fire(rec: Record) -> bool:
    """Whether ``rec``'s hook just fired for the step's last backward pass, as learned."""
    return bool(rec.learned_fires) and rec.fires == rec.learned_fires


class OneProcess:
    """Nothing is shared: the gradients are this process's, and so are the norm and the errors."""

    mean = 1.0  # what a sum over the ranks is multiplied by to be their mean

    def flush(self) -> None:
        """Start whatever reductions of released gradients backward left (none)."""

    def failed_elsewhere(self, error: BaseException | None) -> bool:
        """Whether another rank's update failed while this one's did not (``error``: this rank's)."""
        return False

    def norm(self, norms: list[float], unscale: float) -> torch.Tensor:
        """The global norm of the parameters' gradient ``norms`` (fp32, as ``clip_grad_norm_``), times ``unscale``."""
        return torch.linalg.vector_norm(torch.tensor(norms, dtype=torch.float32)) * unscale

    def deliver(self, rec: Record, grad: torch.Tensor, submit: Callable[[torch.Tensor, object], None]) -> None:
        """Give the worker ``rec``'s released gradient: ``submit(grad, comm)`` (``comm``: a reduction to wait for)."""
        submit(grad, None)

    def gather_weights(self, records: list[Record], io: ChunkIO) -> None:
        """Give every rank the new weights the others own (one process owns them all)."""

    def held(self, records: list[Record], pipeline: Pipeline, observe: Observe) -> HeldGradients:
        """How the held gradients of ``records`` reach ``observe``: as each hook fires for the last time."""
        return HeldGradients(observe)


class HeldGradients:
    """Held gradients on one process: each is final when its hook fires for the step's last backward pass."""

    def __init__(self, observe: Observe):
        self._observe = observe

    def fired(self, rec: Record) -> None:
        if _last_fire(rec):
            self._observe(rec)

    def complete(self, order: list[Record]) -> None:
        """Before ``step()`` reads the gradients: make each the one to update with (it already is)."""

    def overflow(self, found_inf: torch.Tensor | None) -> bool:
        """Whether ``GradScaler`` found an overflow (over several ranks: on any rank)."""
        return found_inf is not None and float(found_inf) > 0

    def next_step(self, records: list[Record]) -> None:
        """The step ended (or was abandoned): the next one starts."""


class Sharded(OneProcess):
    """Several ranks, each updating its share of the elements (see the module docs)."""

    def __init__(self, sharding: Sharding):
        self.sharding = sharding
        self.ranks = sharding.ranks

    @property
    def mean(self) -> float:
        return self.sharding.mean

    def flush(self) -> None:
        self.sharding.gradients.flush()  # normally the end of backward did

    def failed_elsewhere(self, error: BaseException | None) -> bool:
        return self.ranks.any(error is not None, "the ranks' update results") and error is None

    def norm(self, norms: list[float], unscale: float) -> torch.Tensor:
        squares = self.ranks.sum(math.fsum(n * n for n in norms), "the gradients' norm")  # each rank's elements
        return torch.tensor(math.sqrt(squares), dtype=torch.float32) * unscale

    def deliver(self, rec: Record, grad: torch.Tensor, submit: Callable[[torch.Tensor, object], None]) -> None:
        # the worker reads the sum over the ranks once the bucket's reduction is done
        self.sharding.gradients.add(rec.index, grad, submit)

    def gather_weights(self, records: list[Record], io: ChunkIO) -> None:
        trained = [r for r in records if r.param.requires_grad]
        record_of = {id(r.param): r for r in trained}

        @contextlib.contextmanager
        def weights(param: torch.Tensor, modify: bool):
            with io.model_weights(record_of[id(param)], modify=modify) as w:
                yield w.flat

        self.sharding.gather_weights([(r.index, r.param) for r in trained], weights)

    def held(self, records: list[Record], pipeline: Pipeline, observe: Observe) -> AveragedGradients:
        return AveragedGradients(self, records, pipeline, observe)


class AveragedGradients(HeldGradients):
    """Held gradients over several ranks: each is final once its bucket is averaged, during the last
    micro-batch's backward or in :meth:`complete`."""

    def __init__(self, sharded: Sharded, records: list[Record], pipeline: Pipeline, observe: Observe):
        super().__init__(observe)
        self._ranks = sharded.ranks
        self._records = records
        self._pipeline = pipeline
        self._averaging = sharded.sharding.backward_average(self._on_averaged)
        self._complete = False  # every gradient is the mean over the ranks (averaged since the last step())

    def fired(self, rec: Record) -> None:
        self._averaging.fired(rec.index, last=_last_fire(rec))

    def _on_averaged(self, indices: list[int]) -> None:
        """The gradients of parameters ``indices`` are their means, during backward."""
        for rec in (self._records[i] for i in indices):
            if _last_fire(rec):
                self._observe(rec)

    def complete(self, order: list[Record]) -> None:
        """Make every ``.grad`` the mean over the ranks (once per step; what backward did not average, and all of
        it again when a gradient changed after its bucket left)."""
        if self._complete:
            return
        self._pipeline.wait_idle()  # the updates queued during backward no longer read the gradients
        averaging = self._averaging
        if not averaging.arranged:  # the first step: the buckets follow rank 0's gradient order
            indices = self._ranks.broadcast_object([r.index for r in order], "the gradients' order")
            averaging.arrange([(i, self._records[i].param) for i in indices])
        averaging.complete()
        if self._ranks.any(averaging.stray, "whether a gradient changed after its bucket was averaged"):
            averaging.expect(())  # every bucket again
            averaging.complete()
        self._complete = True

    def overflow(self, found_inf: torch.Tensor | None) -> bool:
        if found_inf is None:
            return False
        return self._ranks.any(super().overflow(found_inf), "the overflow check")

    def next_step(self, records: list[Record]) -> None:
        self._complete = False
        self._averaging.expect([r.index for r in records if r.learned_fires])
