"""Held gradients: each waits in ``.grad`` for ``step()``, which may change it (the user's clipping, a
``GradScaler``'s scale) before it is used.

The hook sees a gradient on the micro-batch learned to be the last before ``step()`` and records a
:class:`~nvoffload.optim._generations.Spec` (the gradient, its version, the hyperparameters). The step's
schedule is one of three types:

* :class:`HeldSpeculative`: the hook also queues the parameter's chunk updates at once. ``step()`` keeps an
  update whose gradient and hyperparameters are still the ones the hook saw, redoes it from the committed
  generation when they changed (and the next steps update in ``step()`` until one shows that they no longer
  change), restores the weights on an overflow, an error, or more micro-batches than learned.
* :class:`HeldInStep`: the hook only observes; ``step()`` runs every update (``overlap=False``,
  ``max_grad_norm``, or the step after one whose gradients changed).
* :class:`HeldDelayed` (``delayed_update``): the hook only observes; ``step()`` clips and unscales as in step,
  then queues the updates into staged device copies without waiting; the next ``step()`` lands them
  (:class:`~nvoffload.optim._in_flight.DelayedUpdates`).

Over several ranks the gradients are averaged in buckets as their hooks fire (:mod:`nvoffload.optim._sharing`).
"""

from __future__ import annotations

import torch

from nvoffload.optim._generations import Generations, Spec, checked_grad, hparams
from nvoffload.optim._in_flight import DelayedUpdates
from nvoffload.optim._layout import Record
from nvoffload.optim._schedule import Schedule, StepProtocol


class HeldInStep(Schedule):
    """Held gradients updated in ``step()``: the hooks observe (see the module docs)."""

    applies = False  # the hook queues the update it saw

    def __init__(self, gens: Generations, held: Held):
        super().__init__(gens)
        self.held = held

    def take(self, rec: Record) -> None:
        self.held.gradients.fired(rec)

    def observe(self, rec: Record) -> None:
        """Record what ``rec``'s final gradient of the step is (and queue its update when speculating)."""
        grad = checked_grad(rec)
        if grad is None:
            return
        hp = hparams(rec.group)
        rec.spec = Spec.of(grad, hp, self.applies)
        if self.applies:
            self.gens.submit(rec, grad, hp, 1.0)

    def finish(self, records: list[Record], found_inf, grad_scale) -> None:
        unscale = self.held.clip_and_unscale(records, found_inf, grad_scale)
        if unscale is None:
            return None
        gens = self.gens
        clean = self.held.redo_changed(records, unscale)
        gens.pipeline.wait_idle()
        gens.raise_error(records)
        # Gradients or hyperparameters edited between backward and step(): update in step() until a step
        # shows that they no longer are (the hooks still observe them).
        self.held.schedule = self.held.speculative if self.held.can_speculate and clean else self.held.in_step
        gens.commit(records, gens.stepped)
        gens.sharing.gather_weights(gens.records, gens.io)
        return None


class HeldSpeculative(HeldInStep):
    """Held gradients updated as each hook sees its final one; ``step()`` keeps, redoes or undoes them."""

    applies = True


class HeldDelayed(HeldInStep):
    """Held gradients whose updates ``step()`` queues into staged device copies; the next ``step()`` lands them."""

    def finish(self, records: list[Record], found_inf, grad_scale) -> DelayedUpdates | None:
        unscale = self.held.clip_and_unscale(records, found_inf, grad_scale)
        if unscale is None:
            return None
        gens = self.gens
        gens.io.stage([r for r in records if r.param.grad is not None])
        try:
            self.held.redo_changed(records, unscale)
        except BaseException:  # e.g. a sparse gradient: none of this step's updates lands
            gens.pipeline.wait_idle()
            gens.restore_all(records)
            raise
        queued = [r for r in records if r in gens.stepped]
        return DelayedUpdates(gens, queued, None) if queued else None


class Held(StepProtocol):
    """The step protocol of held gradients (see the module docs).

    Args:
        gens: the records and their generations.
        max_grad_norm: clip the global norm (as ``clip_grad_norm_``) in ``step()``.
        speculate: the hooks may queue updates (``overlap``, no clipping, not delayed).
        delayed_after: with ``delayed_update``, the optimizer steps (the parameters' ``step`` count) that update in
            ``step()`` before the updates are delayed; None: never delayed.
    """

    def __init__(self, gens: Generations, *, max_grad_norm: float | None, speculate: bool, delayed_after: int | None):
        self.in_step = HeldInStep(gens, self)
        self.speculative = HeldSpeculative(gens, self)
        self.delayed = HeldDelayed(gens, self) if delayed_after is not None else None
        super().__init__(gens, self.speculative if speculate else self.in_step)
        self.can_speculate = speculate
        self._max_grad_norm = max_grad_norm
        self._delayed_after = delayed_after
        self.gradients = gens.sharing.held(gens.records, gens.pipeline, self._observe)

    def _observe(self, rec: Record) -> None:
        self.schedule.observe(rec)

    @property
    def speculate(self) -> bool:
        """Whether the hooks queue updates this step (else they only observe)."""
        return self.schedule is self.speculative

    def hook(self, rec: Record, weakly) -> None:
        """With delayed updates also a hook on the gradient before it is accumulated (``before_accumulate``)."""
        hooked = bool(rec.hooks)
        super().hook(rec, weakly)
        if not hooked and rec.hooks and self.delayed is not None:
            rec.hooks += (rec.param.register_hook(weakly(rec, Held.before_accumulate)),)

    def before_accumulate(self, rec: Record) -> None:
        """Delayed updates: backward is about to add into ``rec``'s gradient (see ``DelayedUpdates``)."""
        if self.in_flight is not None:
            self.in_flight.before_accumulate(rec)

    def before_zero_grad(self, set_to_none: bool) -> None:
        if not (self.delayed is not None and set_to_none):  # the queued updates hold the gradients they read
            self.gens.pipeline.wait_idle()

    def grad_norm(self) -> float | None:
        """The norm of the ``.grad`` tensors now (over several ranks, once they are averaged)."""
        self.average_grads()
        grads = [r.param.grad for r in self.gens.records if r.param.grad is not None]
        if not grads:
            return None
        # Reduced on the device; one host read (a read per gradient would wait for the device each time).
        norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
        return float(torch.linalg.vector_norm(torch.stack(norms)))

    def learn(self, rec: Record) -> None:
        rec.learned_fires = rec.fires

    def next_step(self) -> None:
        self.gradients.next_step(self.gens.records)

    def finishing(self) -> HeldInStep:
        if self.delayed is not None and self.gens.max_step() >= self._delayed_after:
            return self.delayed  # its hooks observed, as in step()'s
        return self.schedule

    def average_grads(self) -> None:
        """Over several ranks: make every ``.grad`` the mean over the ranks (once per step)."""
        self.gradients.complete(self.gens.step_order())

    def refuse_unsound(self, records: list[Record], found_inf, grad_scale) -> None:
        """Undo the step and raise where backward ran more times than learned after the hooks updated."""
        extra = next((r for r in records if r.spec is not None and r.spec.applied and r.fires > r.learned_fires), None)
        if extra is None:
            return
        self.gens.restore_all(records)
        raise RuntimeError(
            f"backward ran {extra.fires} times for {extra.name} before step(), but the optimizer had learned"
            f" {extra.learned_fires} per step and updated the parameters during backward pass"
            f" {extra.learned_fires}: the forward passes after it saw the updated weights, so these gradients"
            " are not the ones of the step's weights. The parameters were restored and the step skipped;"
            f" zero the gradients and run the step again (the optimizer now expects {extra.fires} backward"
            " passes per step), keep the number of micro-batches per step constant, or construct the"
            " optimizer with overlap=False"
        )

    def clip_and_unscale(self, records: list[Record], found_inf, grad_scale) -> float | None:
        """Average over the ranks; on an overflow restore and return None (the step is skipped); else clip the
        gradients in place (as ``GradScaler.unscale_`` then ``clip_grad_norm_``) and return what the updates still
        multiply them by."""
        self.average_grads()
        if self.gradients.overflow(found_inf):
            self.gens.restore_all(records)  # an overflow skips the step
            return None
        unscale = 1.0 if grad_scale is None else 1.0 / float(grad_scale)
        if self._max_grad_norm is not None:
            with_grad = [r.param for r in self.gens.records if r.param.grad is not None]  # in group order
            if with_grad and unscale != 1.0:
                torch._foreach_mul_([p.grad for p in with_grad], unscale)
                unscale = 1.0
            if with_grad:
                torch.nn.utils.clip_grad_norm_(with_grad, self._max_grad_norm)
        return unscale

    def redo_changed(self, records: list[Record], scale: float) -> bool:
        """Queue the update of every parameter whose early update is missing or stale; returns whether every
        gradient and hyperparameter is the one its hook saw."""
        gens, clean = self.gens, True
        for rec in records:
            grad = checked_grad(rec)
            spec, rec.spec = rec.spec, None
            hp = hparams(rec.group)
            if grad is None:
                gens.restore(rec.chunks)
                continue
            if spec is not None:
                unchanged = (
                    spec.grad_ref() is grad and grad._version == spec.grad_version and spec.hparams == hp and scale == 1.0
                )
                clean = clean and unchanged
                if spec.applied and unchanged and not gens.pipeline.failed:
                    continue
                for c in rec.chunks:  # recompute from the committed generation
                    if c.pending_gen is not None and c.pending_gen != c.gen:
                        c.pending_gen = None
            gens.submit(rec, grad, hp, scale)
        return clean
