"""Released gradients (``release_grads``, parameter streaming): device memory holds no gradient after its hook.

The number of micro-batches per step is given (``accumulation_steps``), not learned. On each micro-batch before
the last, the hook adds the gradient to an fp32 copy kept in the store (the chunk's ``kept_name``); the worker
measures every summed gradient's norm, so ``step()`` knows the global norm without any gradient in memory
(:class:`~nvoffload.optim._scaling.GradScaling`). A step's schedule is one of three types:

* :class:`ReleasedSpeculative`: on the last micro-batch the hook queues the update with the sum, unscaled by
  the loss scale, and frees the gradient. ``step()`` then keeps the updates (the common case: no clipping
  needed, no overflow), redoes them all from the committed generation and the kept gradients scaled by the
  clipping coefficient (with ``max_grad_norm`` every last micro-batch keeps its gradient too), or, on an fp16
  overflow, undoes them and skips the step. A parameter whose gradient came in fewer micro-batches (unused in
  the last one, or ``step()`` called early) is updated in ``step()`` from its kept gradient.
* :class:`Deferred` (``defer_updates``): the hooks keep every gradient and queue no update; ``step()`` knows the
  norm before any update runs, so nothing is redone and an overflow undoes nothing. It queues the updates with
  the clipping coefficient and the loss scale applied: the parameters outside the weight home first, waited
  for, then the streamed ones in forward order, each with a pipeline mark the weight home waits for before the
  block's next copy to the device; the first hook of the next backward lands them
  (:class:`~nvoffload.optim._in_flight.DeferredUpdates`). It costs the kept gradient's bytes (4 a parameter
  written and read again) and runs the updates beside the next forward; a speculative step that clips runs
  every update twice (12 + 4 bytes a parameter more read and 12 more written).
* :class:`ReleasedDelayed` (``delayed_update``): the hooks keep, as deferring; ``step()`` queues the updates
  into each streamed block's twin in the weight home (``acquire(staged=True)``) and a staged copy of each
  device parameter, which the next forward and backward do not read; the next ``step()`` lands them
  (:class:`~nvoffload.optim._in_flight.DelayedUpdates`). The steps alternate between each chunk's two kept
  gradients: the updates read one step's while the next backward writes the other.

:class:`Released`'s rule, chosen once, picks each step's: ``defer_updates=False`` speculates, ``True`` defers,
``None`` speculates and defers the step after one whose clipping bit, until a step does not clip; with
``delayed_update``, every step after the first ``delayed_update_after`` is delayed.
"""

from __future__ import annotations

import contextlib

from nvoffload.optim._generations import RELEASED, Generations, Spec, checked_grad, hparams
from nvoffload.optim._in_flight import DeferredUpdates, DelayedUpdates, InFlight, explained
from nvoffload.optim._layout import Record
from nvoffload.optim._scaling import GradScaling
from nvoffload.optim._schedule import Schedule, StepProtocol


class ReleasedSpeculative(Schedule):
    """Released gradients updated on each parameter's last micro-batch; ``step()`` keeps, redoes or undoes them."""

    def __init__(self, gens: Generations, released: Released):
        super().__init__(gens)
        self.released = released
        self.scaling = released.scaling

    def take(self, rec: Record) -> None:
        """Keep the gradient of a micro-batch before the step's last; queue the update on the last (when the
        schedule keeps, keep that one too)."""
        steps = self.released.accumulation_steps
        if rec.fires > steps:
            fires = rec.fires
            self.released.abandon()
            raise RuntimeError(
                f"backward ran {fires} times for {rec.name} before step(), but gradient_accumulation_steps"
                f" is {steps}: its update already ran in backward pass {steps} (gradients are released during"
                f" backward). The step was undone (the weights are those of the last step()); call step() after"
                f" every {steps} backward passes"
            )
        grad = checked_grad(rec)
        if grad is None:
            return
        last = rec.fires == steps
        hp = hparams(rec.group)
        if last:
            rec.spec = Spec(RELEASED, None, hp, not self.keeps)
        keep = not last or self.scaling.max_grad_norm is not None or self.keeps
        kinds = {"add_kept": rec.fires > 1, "keep": keep, "update": last and not self.keeps}

        def submit(reduced, comm) -> None:
            self.gens.submit(rec, reduced, hp, self.scaling.unscale, comm=comm, **kinds)

        self.gens.sharing.deliver(rec, grad, submit)
        rec.param.grad = None  # the queued request (or the bucket) holds it until the worker is done

    def finish(self, records: list[Record], found_inf, grad_scale) -> None:
        """Run the updates still to do, then keep, redo or undo them."""
        gens, scaling = self.gens, self.scaling
        for rec in records:
            if rec.spec is None and rec.fires:  # its gradient came in fewer backward passes than accumulated
                rec.spec = Spec(RELEASED, None, hparams(rec.group), True)
                gens.submit_kept(rec, scaling.unscale)
        gens.pipeline.wait_idle()
        gens.raise_error(records)
        updated = [r for r in records if r.spec is not None]
        for rec in updated:
            if rec.spec.hparams != hparams(rec.group):
                gens.restore_all(records)
                raise RuntimeError(
                    f"the hyperparameters of {rec.name} changed between backward and step(); with"
                    " release_grads the update already ran in backward: change them before backward"
                )
        coef = scaling.clipping_coefficient()
        if coef is None:
            gens.restore_all(records)  # an fp16 overflow skips the step, as GradScaler does
            return None
        if coef < 1.0:
            for rec in updated:
                gens.submit_kept(rec, coef * scaling.unscale)
            gens.pipeline.wait_idle()
            gens.raise_error(records)
        scaling.stepped()
        gens.commit(records, gens.stepped)
        gens.sharing.gather_weights(gens.records, gens.io)
        return None


class Deferred(ReleasedSpeculative):
    """Released gradients kept by the hooks; ``step()`` queues the updates, the first hook of the next backward
    lands them (see the module docs)."""

    keeps = True

    def finish(self, records: list[Record], found_inf, grad_scale) -> InFlight | None:
        """Every gradient is kept and measured: queue the updates with the norm and the loss scale known."""
        gens, scaling = self.gens, self.scaling
        gens.raise_error(records)  # a kept gradient's write failed: nothing was updated
        coef = scaling.clipping_coefficient()
        if coef is None:
            return None
        scale = coef * scaling.unscale
        scaling.stepped()
        home = gens.io.weight_home
        updated = [r for r in records if r.fires]
        streamed = [r for r in reversed(updated) if home is not None and home.holds(r.param)]  # in forward order
        resident = [r for r in updated if home is None or not home.holds(r.param)]
        self._queue_resident(resident, scale)
        for rec in streamed:
            self._queue_streamed(rec, scale)
        return self._in_flight(resident + streamed)

    def _queue_resident(self, resident: list[Record], scale: float) -> None:
        """The device's weights, in ``step()``: waited for."""
        for rec in resident:
            self.gens.submit_kept(rec, scale)
        self.gens.pipeline.wait_idle()
        self.gens.raise_error(resident)

    def _queue_streamed(self, rec: Record, scale: float) -> None:
        """A streamed parameter's update: the next forward waits for the block's."""
        gens = self.gens
        gens.submit_kept(rec, scale)
        gens.io.weight_home.updating(rec.param, explained(gens.pipeline.mark(f"the deferred update of {rec.name}"), rec.name))

    def _in_flight(self, records: list[Record]) -> InFlight | None:
        return DeferredUpdates(self.gens, records, self.gens.io.weight_home) if records else None


class ReleasedDelayed(Deferred):
    """Released gradients kept by the hooks; ``step()`` queues the updates into staged weights, the next
    ``step()`` lands them (see the module docs)."""

    def _queue_resident(self, resident: list[Record], scale: float) -> None:
        """The device's weights too: into a staged copy, the next ``step()`` installs it."""
        self.gens.io.stage(resident)
        for rec in resident:
            self.gens.submit_kept(rec, scale)

    def _queue_streamed(self, rec: Record, scale: float) -> None:
        """A delayed update reads the old weights and writes the block's twin."""
        self.gens.io.weight_home.staging(rec.param)
        self.gens.submit_kept(rec, scale)

    def _in_flight(self, records: list[Record]) -> InFlight | None:
        self.gens.kept ^= 1  # the next step's gradients go to the other kept entries while these updates read theirs
        return DelayedUpdates(self.gens, records, self.gens.io.weight_home) if records else None


class Released(StepProtocol):
    """The step protocol of released gradients (see the module docs).

    Args:
        gens: the records and their generations.
        scaling: the loss scale, the norm and clipping.
        accumulation_steps: backward passes per ``step()``.
        defer: deferring's rule: True always, False never, None the step after one whose clipping bit.
        delayed_after: with ``delayed_update``, the optimizer steps (the parameters' ``step`` count, which state
            dicts keep) that are not delayed; None: never delayed.
    """

    def __init__(self, gens: Generations, scaling: GradScaling, *, accumulation_steps: int, defer: bool | None,
                 delayed_after: int | None):  # fmt: skip
        self.scaling = scaling
        self.loss_scale = scaling.loss_scale
        self.accumulation_steps = accumulation_steps
        self._defer_rule = defer
        self._delayed_after = delayed_after
        self.speculative = ReleasedSpeculative(gens, self)
        self.deferred = Deferred(gens, self)
        self.delayed = ReleasedDelayed(gens, self)
        super().__init__(gens, self.speculative)
        self.schedule = self._rule(defer_rule=bool(defer))

    @property
    def speculate(self) -> bool:
        """Whether the updates run during backward unless a step defers them (they do, unless delayed)."""
        return self._delayed_after is None

    def _delays(self) -> bool:
        return self._delayed_after is not None and self.gens.max_step() >= self._delayed_after

    def _rule(self, defer_rule: bool) -> Schedule:
        """The next step's schedule: delayed once the exact steps are done, else by the deferring rule."""
        if self._delays():
            return self.delayed
        return self.deferred if defer_rule else self.speculative

    def _defers(self) -> bool:
        return self.scaling.clipped if self._defer_rule is None else self._defer_rule

    def next_schedule(self) -> Schedule:
        return self._rule(self._defers())

    def finishing(self) -> Schedule:
        if self.schedule.keeps:  # the hooks kept, deferring or delayed: which of the two lands is decided now
            return self.delayed if self._delays() else self.deferred
        return self.schedule

    def after_load(self) -> None:
        """The parameters' ``step`` may have changed: whether the next step is delayed."""
        if not self.step_in_progress:
            self.schedule = self._rule(bool(self._defers()))

    def learn(self, rec: Record) -> None:
        rec.learned_fires = 1

    def landed(self) -> None:
        self.gens.pipeline.set_plan(self.plan())  # their chunks' state is committed: read on ahead for the next step

    def grad_norm(self) -> float | None:
        """The global L2 norm of the gradients since the last ``step()`` (see :class:`GradScaling`)."""
        if self.step_in_progress:  # measured by the worker as it takes the gradients
            self.gens.pipeline.wait_idle()
        return self.scaling.grad_norm()  # after step(): known, without waiting for updates deferred

    def refuse_unsound(self, records: list[Record], found_inf, grad_scale) -> None:
        """Undo the step and raise when a ``GradScaler`` drives it: it cannot check freed gradients."""
        if found_inf is not None or grad_scale is not None:
            self.gens.restore_all(records)
            raise ValueError(
                "release_grads (parameter streaming) frees gradients during backward, so GradScaler cannot"
                " check them for overflow: give the optimizer loss_scaling (OffloadConfig(loss_scaling=...))"
                " and scale the loss with optimizer.scale_loss(loss) instead"
            )

    @contextlib.contextmanager
    def backward_passes(self, count: int):
        """``count`` backward passes make the steps finished inside the context, whatever ``accumulation_steps``
        says (a vertical step's one backward sums its micro-batches in autograd)."""
        if self.step_in_progress:
            raise RuntimeError("a step is in progress (backward ran since the last step()): call step() first")
        saved, self.accumulation_steps = self.accumulation_steps, count
        try:
            yield
        finally:
            self.accumulation_steps = saved
