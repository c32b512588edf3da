"""The speculate/commit protocol: updates during backward that ``step()`` keeps, redoes or undoes.

Each parameter's post-accumulate-grad hook (on the micro-batch learned to be
the last before ``step()``) records a :class:`Spec` -- the gradient it saw,
that gradient's version, the hyperparameters -- and, while speculating, queues
the parameter's chunk updates at once. Every update writes a new generation of
its chunk (``Chunk.pending_gen``) and leaves the committed one (``Chunk.gen``)
in the store, so ``step()`` can:

* keep an update whose gradient and hyperparameters are still the ones the
  hook saw, and commit it (the old generation is deleted);
* redo it from the committed generation when they changed (clipping, a
  ``GradScaler``'s scale, a new learning rate), and stop speculating until a
  step shows that they no longer change;
* undo it (:meth:`StepProtocol.restore`: read the committed master weights
  back into the model, drop the new generation) on an overflow, an error, or
  more micro-batches than learned.

With released gradients (``release_grads``: parameter streaming, where device
memory holds no gradient after its hook) the number of micro-batches per step
is given (``accumulation_steps``), not learned. On each micro-batch before the
last, the hook adds the gradient to an fp32 copy kept in the store (its
``kept_name``); on the last, it queues the update with the sum, unscaled by the
loss scale, and frees the gradient. The worker measures every summed
gradient's norm, so ``step()`` knows the global norm without any gradient in
memory and then either keeps the updates (the common case: no clipping
needed, no overflow), redoes them all from the committed generation and the
kept gradients scaled by the clipping coefficient (with ``max_grad_norm``,
every last micro-batch keeps its gradient too), or, on an fp16 overflow,
undoes them and skips the step. A parameter whose gradient came in fewer
micro-batches (unused in the last one, or ``step()`` called early) is updated
in ``step()`` from its kept gradient.

Or released gradients defer (``defer``): the hooks keep every gradient (the
sum, measured) and queue no update; ``step()`` knows the norm before any
update runs, so nothing is redone and an overflow undoes nothing. It queues
the updates with the clipping coefficient and the loss scale applied: those
of the parameters outside the weight home (on the device) first, waited for,
then the streamed ones in forward order (the reverse of their gradients'),
each with a :meth:`~nvoffload.optim._pipeline.Pipeline.mark` given to the
weight home, and returns. The next forward copies each streamed block to the
device only once its updates wrote its weights, so the optimizer and its NVMe
traffic overlap that forward; the first hook of the next backward (or the
next ``step()``, ``synchronize()``, a state dict, ``close()``) lands them: commits
their generation. The weights a step trains on are exactly AdamW's. A
deferred step costs the kept gradient's bytes (4 a parameter written and read
again, where speculation without clipping writes them only with
``max_grad_norm``) and runs its updates beside the next forward, not the
backward; a speculative step that clips runs every update twice, the second
time in ``step()`` (12 + 4 bytes a parameter more read and 12 more written).
``defer=None`` takes the better by a rule: speculate, and defer the step after
one whose clipping bit, until a step does not clip. Both keep the committed
generation until the step lands (two generations on NVMe at the end of a
step), so an error restores every parameter to the step before.

Over several ranks (a :class:`~nvoffload.distributed.Sharding`), each rank's
records hold the chunks of its share of the elements only. Held gradients are
averaged over the ranks in buckets during the last micro-batch's backward
(:class:`~nvoffload.distributed.BackwardAverage`; in ``step()`` for what
backward could not), and the hooks' speculation starts from each averaged
bucket; released gradients are reduced to their owners in buckets during
backward, and the norm for clipping is summed over the ranks. The ranks agree on every
error before committing, and after the commit every rank receives the owners'
new weights.

Delayed updates (``delayed``: PipeDream-2BW's and ZeRO-Offload's one-step-late
update): nothing is speculative. The hooks only
observe; ``step()`` first lands the updates the previous ``step()`` queued
(:meth:`StepProtocol.land`: waits for them, commits them, copies their staged
weights into the parameters), then clips, unscales or skips this step's
gradients exactly as without delay (every gradient is final and known there,
so no update is ever redone) and queues their updates without waiting. They
run during the next forward and backward, which still see the weights from
before them, and write the new weights to a staged copy; the next ``step()``
(or ``synchronize()``, a state dict, a checkpoint, ``close()``) lands them. So
the weights of step ``t + 1`` are those of torch's AdamW applied with the
gradients up to step ``t - 1``: each update lands one step late. With released
gradients the hooks keep every gradient, as when deferring, and ``step()``
queues the updates from them (clipped and unscaled with the norm known); a
streamed parameter's new weights go to its block's twin in the weight home
(``acquire(staged=True)``), which the next forward and backward do not read,
and landing makes the twins the blocks (``install_staged``). The steps
alternate between each chunk's two kept gradients (``Chunk.kept_name``): the
updates read one step's while the next backward writes the other, and the
worker takes those gradients ahead of the updates queued (their device memory
is what backward waits for). An error drops the updates (``drop_staged``) and
the gradients kept since: the next ``step()`` raises it.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

import torch

from nvoffload.optim._chunk_io import ChunkIO
from nvoffload.optim._chunk_state import Chunk
from nvoffload.optim._layout import Record
from nvoffload.optim._pipeline import Pipeline
from nvoffload.optim._updates import Request
from nvoffload.optim.loss_scale import DynamicLossScale
from nvoffload.transfer import Future

if TYPE_CHECKING:
    from nvoffload.distributed import Sharding


class OffloadIOError(RuntimeError):
    """An I/O error during :meth:`OffloadOptimizer.step`; the parameters were restored to their values before the step."""


_RELEASED = object()  # Spec.grad_ref: the hook queued the update and freed the gradient (release_grads)


class Spec(NamedTuple):
    """What a parameter's hook saw on the learned fire."""

    grad_ref: object  # weakref to the gradient, or _RELEASED
    grad_version: int | None  # the gradient's ``_version`` then
    hparams: dict  # the group's hyperparameters then
    applied: bool  # the update was queued then (else only observed, to re-learn overlap)


def _hparams(group: dict) -> dict:
    return {k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in group.items() if k != "params"}


def _checked_grad(rec: Record) -> torch.Tensor | None:
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


def _explained(mark: Future, name: str) -> Future:
    """``mark``, failing with an error that says what failed and how training goes on."""

    def explain(error: BaseException | None) -> None:
        if error is not None:
            kind = OffloadIOError if isinstance(error, OSError) else RuntimeError
            raise kind(
                f"nvoffload: the update of {name} that the last step() deferred failed: {error}. Call"
                " optimizer.synchronize() (or step()): it raises the error again and restores the weights of"
                " before that step, and training goes on from there"
            ) from error

    return Future.all_of([mark], what=mark.what, finish=explain)


class StepProtocol:
    """The hooks' speculation and ``step()``'s commit over ``records`` (the optimizer's list, shared).

    Args:
        records: one per parameter, in group order.
        io, pipeline: the chunk I/O and the worker that runs the updates.
        overlap, max_grad_norm, release_grads: as in :class:`OffloadOptimizerConfig`.
        accumulation_steps: with ``release_grads``, backward passes per ``step()``.
        loss_scale: with ``release_grads``, the dynamic fp16 loss scale (None: no scaling).
        sharding: this rank's share and the collectives, over several ranks (None: one process).
        delayed: land each step's updates at the next ``step()`` (see the module docs; one process).
        delayed_after: with ``delayed``, the optimizer steps (the parameters' ``step`` count, which state dicts
            keep) that update in ``step()`` first, before the updates are delayed.
        defer: with released gradients on one process, queue each step's updates in ``step()`` and land them
            during the next forward (see the module docs): True always, False never (speculate), None by the
            rule (the step after one whose clipping bit).
    """

    def __init__(self, records: list[Record], io: ChunkIO, pipeline: Pipeline, *, overlap: bool,
                 max_grad_norm: float | None, release_grads: bool, accumulation_steps: int = 1,
                 loss_scale: DynamicLossScale | None = None, sharding: Sharding | None = None,
                 delayed: bool = False, delayed_after: int = 0, defer: bool | None = False):  # fmt: skip
        self._records = records
        self._io = io
        self._pipeline = pipeline
        self._max_grad_norm = max_grad_norm
        self._release_grads = release_grads
        self._accumulation_steps = accumulation_steps
        self.loss_scale = loss_scale
        self.sharding = sharding
        self._averaged = False  # held gradients over several ranks: averaged since the last step()
        # Held gradients over several ranks: averaged in buckets as their hooks fire.
        self._averaging = None if sharding is None or release_grads else sharding.backward_average(self._on_averaged)
        self._stepped: set[Record] = set()  # records updated this step (those without chunks of this rank too)
        self.last_grad_norm: float | None = None  # released gradients: the global norm the last step() used
        self._order: list[Record] = []  # first iteration's gradient order
        self._order_learned = False
        self._delayed = delayed
        self._delayed_after = delayed_after
        self._in_flight: dict[Record, None] = {}  # delayed or deferred: the records whose updates step() queued, in order
        self._late = False  # the updates in flight are delayed ones (they land at the next step(), not in backward)
        self._kept = 0  # which of each chunk's two kept gradients this step's hooks write (delayed updates alternate)
        self._defer_rule = defer if release_grads and sharding is None else False
        # this step's updates wait for step() (the hooks keep the gradients): deferred, or delayed
        self.defer = bool(self._defer_rule) or (release_grads and self._delays())
        self.clipped = False  # released gradients: the last step's clipping coefficient was below 1
        self._can_speculate = overlap and not delayed and (max_grad_norm is None or release_grads)
        self.speculate = self._can_speculate  # the hooks queue updates (else they only observe)

    # ------------------------------------------------------------------ the hook
    def on_grad(self, rec: Record) -> None:
        """``rec``'s gradient is final for this backward pass."""
        rec.fires += 1
        if not self._order_learned and rec.fires == 1:
            self._order.append(rec)
        if self._release_grads:
            self._on_released_grad(rec)
            return
        if self._averaging is not None:  # over several ranks: final once its bucket is averaged
            self._averaging.fired(rec.index, last=rec.learned_fires > 0 and rec.fires == rec.learned_fires)
            return
        if not (rec.learned_fires and rec.fires == rec.learned_fires):
            return  # more backward passes than learned: step() finds them (fires > learned_fires)
        self._observe(rec)

    def _observe(self, rec: Record) -> None:
        """Record what ``rec``'s final gradient of the step is, and queue its update when speculating."""
        grad = _checked_grad(rec)
        if grad is None:
            return
        hp = _hparams(rec.group)
        rec.spec = Spec(weakref.ref(grad), grad._version, hp, self.speculate)
        if self.speculate:
            self._submit(rec, grad, hp, 1.0)

    def _on_averaged(self, indices: list[int]) -> None:
        """Over several ranks: the gradients of parameters ``indices`` are their means, during backward."""
        for rec in (self._records[i] for i in indices):
            if rec.learned_fires and rec.fires == rec.learned_fires:
                self._observe(rec)

    def _on_released_grad(self, rec: Record) -> None:
        """Keep the gradient of a micro-batch before the step's last; queue the update on the last (when
        deferring, keep that one too)."""
        if self._in_flight and not self._late:  # the last step's deferred updates wrote their weights (the forward waited): land them
            try:
                self.land()
            except BaseException:
                self.abandon()  # this backward pass is void: its gradients are forgotten
                raise
        steps = self._accumulation_steps
        if rec.fires > steps:
            fires = rec.fires
            self.abandon()
            raise RuntimeError(
                f"backward ran {fires} times for {rec.name} before step(), but gradient_accumulation_steps"
                f" is {steps}: its update already ran in backward pass {steps} (gradients are released during"
                f" backward). The step was undone (the weights are those of the last step()); call step() after"
                f" every {steps} backward passes"
            )
        grad = _checked_grad(rec)
        if grad is None:
            return
        last = rec.fires == steps
        hp = _hparams(rec.group)
        if last:
            rec.spec = Spec(_RELEASED, None, hp, not self.defer)
        keep = not last or self._max_grad_norm is not None or self.defer
        kinds = {"add_kept": rec.fires > 1, "keep": keep, "update": last and not self.defer}
        if self.sharding is None:
            self._submit(rec, grad, hp, self._unscale, **kinds)
        else:  # the worker reads the sum over the ranks once the bucket's reduction is done

            def deliver(reduced: torch.Tensor, pending) -> None:
                self._submit(rec, reduced, hp, self._unscale, comm=pending, **kinds)

            self.sharding.gradients.add(rec.index, grad, deliver)
        rec.param.grad = None  # the queued request (or the bucket) holds it until the worker is done

    @contextlib.contextmanager
    def backward_passes(self, count: int):
        """With released gradients: ``count`` backward passes make the steps finished inside the context, whatever
        ``accumulation_steps`` says (a vertical step's one backward sums its micro-batches in autograd)."""
        if self.step_in_progress:
            raise RuntimeError("a step is in progress (backward ran since the last step()): call step() first")
        saved, self._accumulation_steps = self._accumulation_steps, count
        try:
            yield
        finally:
            self._accumulation_steps = saved

    @property
    def updates_queued(self) -> bool:
        """Whether a hook queued an update since the last ``finish``."""
        return any(rec.spec is not None and rec.spec.applied for rec in self._records)

    @property
    def step_in_progress(self) -> bool:
        """Whether a backward pass ran since the last ``finish`` (updates queued, or gradients kept)."""
        return any(rec.fires for rec in self._records)

    @property
    def _unscale(self) -> float:
        """What the gradients measured and used are multiplied by: the loss scale undone, and with released
        gradients over several ranks, their sum turned into the mean."""
        unscale = 1.0 if self.loss_scale is None else 1.0 / self.loss_scale.scale
        if self.sharding is not None and self._release_grads:
            unscale *= self.sharding.mean
        return unscale

    def _submit(self, rec: Record, grad: torch.Tensor, hp: dict, grad_scale: float, **kinds) -> None:
        if kinds.get("update", True):
            self._stepped.add(rec)
        flat = grad.reshape(-1) if grad.is_contiguous() else grad.contiguous().view(-1)
        ready = self._io.transfer.record()  # the gradient is final here, and backward no longer reads the weights
        for chunk in rec.chunks:
            if kinds.get("comm") is not None:
                kinds["comm"].hold()  # the worker releases it once it copied the gradient out
            self._pipeline.submit(
                Request(chunk, flat[chunk.elements], hp, rec.step + 1, grad_scale, ready, kept=self._kept, **kinds)
            )

    def _submit_kept(self, rec: Record, grad_scale: float) -> None:
        """Queue ``rec``'s update from its kept gradient, from the committed generation."""
        hp = _hparams(rec.group)
        self._stepped.add(rec)
        ready = self._io.transfer.record()  # the worker's copies of the weights wait for compute queued so far
        for chunk in rec.chunks:
            if chunk.pending_gen is not None and chunk.pending_gen != chunk.gen:
                self._io.chunks.delete(chunk, chunk.pending_gen)
            chunk.pending_gen = None
            self._pipeline.submit(Request(chunk, None, hp, rec.step + 1, grad_scale, ready, kept=self._kept))

    # ------------------------------------------------------------------ step()
    def finish(self, *, found_inf: torch.Tensor | None, grad_scale: torch.Tensor | None) -> None:
        """Wait for the updates queued during backward, redo those whose gradient or hyperparameters
        changed, run the rest, and commit; undo everything and raise on an error."""
        pipe = self._pipeline
        if self.sharding is not None:
            self.sharding.gradients.flush()  # normally the end of backward did
        pipe.wait_idle()
        records = self._step_order()
        try:
            self.land()
            self._refuse_unsound(records, found_inf, grad_scale)
            if self._release_grads and self.defer:
                self._finish_deferred(records, late=self._delays())
            elif self._release_grads:
                self._finish_released(records)
            else:
                self._finish_held(records, found_inf, grad_scale)
        finally:
            for rec in self._records:
                rec.spec = None
                rec.learned_fires = 1 if self._release_grads else rec.fires
                rec.fires = 0
            if not self._in_flight:  # else the worker runs them now: their errors are the next land()'s
                pipe.take_error()
            self._stepped.clear()
            self._averaged = False
            if self._averaging is not None:
                self._averaging.expect([r.index for r in self._records if r.learned_fires])
        self._order_learned = True
        if self._release_grads:  # the next step's mode
            self.defer = self._delays() or (self.clipped if self._defer_rule is None else self._defer_rule)
        pipe.set_plan(self.plan())

    def _finish_held(self, records: list[Record], found_inf, grad_scale) -> None:
        """``finish`` with the gradients in ``.grad``: skip on an overflow, else clip, redo what changed, commit."""
        overflow = found_inf is not None and float(found_inf) > 0
        if self.sharding is not None:
            self.average_grads()
            overflow = self.sharding.ranks.any(overflow, "the overflow check") if found_inf is not None else False
        if overflow:
            self._restore_all(records)  # an overflow skips the step
            return
        unscale = 1.0 if grad_scale is None else 1.0 / float(grad_scale)
        if self._max_grad_norm is not None:
            # Exactly GradScaler.unscale_ then torch.nn.utils.clip_grad_norm_ (gradients changed in place).
            with_grad = [r.param for r in self._records if r.param.grad is not None]  # in group order
            if with_grad and unscale != 1.0:
                torch._foreach_mul_([p.grad for p in with_grad], unscale)
                unscale = 1.0
            if with_grad:
                torch.nn.utils.clip_grad_norm_(with_grad, self._max_grad_norm)
        if self._delays():  # they run during the next forward and backward; the next step() lands them
            self._io.stage([r for r in records if r.param.grad is not None])
            try:
                self._redo_changed(records, unscale)
            except BaseException:  # e.g. a sparse gradient: none of this step's updates lands
                self._pipeline.wait_idle()
                self._restore_all(records)
                raise
            self._in_flight, self._late = dict.fromkeys(r for r in records if r in self._stepped), True
            return
        clean = self._redo_changed(records, unscale)
        self._pipeline.wait_idle()
        self._raise_error(records)
        # Gradients or hyperparameters edited between backward and step(): update in step() until a step
        # shows that they no longer are (the hooks still observe them).
        self.speculate = self._can_speculate and clean
        self._commit(records, self._stepped)
        self._gather_weights()

    def average_grads(self) -> None:
        """Over several ranks, held gradients: make every ``.grad`` the mean over the ranks (once per step;
        what backward did not average, and all of it again when a gradient changed after its bucket left)."""
        if self._averaged:
            return
        self._pipeline.wait_idle()  # the updates queued during backward no longer read the gradients
        averaging, ranks = self._averaging, self.sharding.ranks
        if not averaging.arranged:  # the first step: the buckets follow rank 0's gradient order
            order = ranks.broadcast_object([r.index for r in self._step_order()], "the gradients' order")
            averaging.arrange([(i, self._records[i].param) for i in order])
        averaging.complete()
        if ranks.any(averaging.stray, "whether a gradient changed after its bucket was averaged"):
            averaging.expect(())  # every bucket again
            averaging.complete()
        self._averaged = True

    def _gather_weights(self) -> None:
        """Over several ranks: every rank receives the new weights of the elements the others own."""
        if self.sharding is None:
            return
        trained = [r for r in self._records if r.param.requires_grad]
        record_of = {id(r.param): r for r in trained}

        @contextlib.contextmanager
        def weights(param: torch.Tensor, modify: bool):
            with self._io.model_weights(record_of[id(param)], modify=modify) as w:
                yield w.flat

        self.sharding.gather_weights([(r.index, r.param) for r in trained], weights)

    def _delays(self) -> bool:
        """Whether this step's updates are delayed (``delayed``, after the ``delayed_after`` exact steps)."""
        return self._delayed and max((r.step for r in self._records), default=0) >= self._delayed_after

    def land(self) -> None:
        """Delayed or deferred updates: wait for the updates the last ``step()`` queued, commit them and (delayed)
        make their new weights the parameters'. On an error they are dropped and it is raised: the parameters
        and the committed state stay those from before them."""
        flight = list(self._in_flight)
        if not flight:
            return
        self._pipeline.wait_idle()
        home = self._io.weight_home if self._release_grads else None
        try:
            self._raise_error(flight)
        except BaseException:
            self._in_flight = {}
            if home is not None and self._late:
                home.drop_staged()
            raise
        finally:
            if home is not None:
                home.settled()  # landed, or restored by the error
        if self._late and home is not None:
            home.install_staged()  # first: a block in use refuses it, and the updates stay in flight, uncommitted
        self._in_flight = {}
        self._commit(flight, set(flight))
        if self._late:
            self._io.install_staged([r for r in flight if r.chunks and (home is None or not home.holds(r.param))])
        if self._release_grads:
            self._pipeline.set_plan(self.plan())  # its chunks' state is committed: read on ahead for the next step

    def after_load(self) -> None:
        """A state dict was loaded (the parameters' ``step`` may have changed): whether the next step is delayed."""
        if self._release_grads and not self.step_in_progress:
            self.defer = self._delays() or (self.clipped if self._defer_rule is None else bool(self._defer_rule))

    def before_accumulate(self, rec: Record) -> None:
        """Delayed updates: backward is about to add into ``rec``'s gradient (not zeroed to None since the last
        ``step()``), which an update in flight may not have copied yet: wait for the updates in flight first."""
        if self._in_flight and rec.param.grad is not None and rec in self._in_flight:
            self._pipeline.wait_idle()

    def abandon(self) -> None:
        """Undo the updates queued since the last ``step()`` and forget their gradients (a refused step); the
        delayed updates of the step before land first."""
        self.land()
        self._pipeline.wait_idle()
        self._restore_all(self._step_order())
        self._pipeline.take_error()
        self._stepped.clear()
        self._averaged = False
        for rec in self._records:
            rec.spec, rec.fires = None, 0
        if self._averaging is not None:
            self._averaging.expect([r.index for r in self._records if r.learned_fires])

    def _finish_deferred(self, records: list[Record], *, late: bool) -> None:
        """``finish`` of a deferred step (``late``: a delayed one): every gradient is kept and measured; queue the
        updates with the norm and the loss scale known (see the module docs)."""
        pipe = self._pipeline
        self._raise_error(records)  # a kept gradient's write failed: nothing was updated
        coef = self._clipping_coefficient()
        if coef is None:
            return
        scale = coef * self._unscale
        if self.loss_scale is not None:
            self.loss_scale.update(found_inf=False)
        home = self._io.weight_home
        updated = [r for r in records if r.fires]
        streamed = [r for r in reversed(updated) if home is not None and home.holds(r.param)]  # in forward order
        resident = [r for r in updated if home is None or not home.holds(r.param)]
        if late:  # the device's weights too: into a staged copy, the next step() installs it
            self._io.stage(resident)
        for rec in resident:  # deferred: the device's weights in step()
            self._submit_kept(rec, scale)
        if not late:
            pipe.wait_idle()
            self._raise_error(resident)
        for rec in streamed:
            if late:
                home.staging(rec.param)
            self._submit_kept(rec, scale)
            if not late:  # the next forward waits for the block's update; a delayed one reads the old weights
                home.updating(rec.param, _explained(pipe.mark(f"the deferred update of {rec.name}"), rec.name))
        self._in_flight, self._late = dict.fromkeys(resident + streamed), late
        if late:  # the next step's gradients go to the other kept entries while these updates read theirs
            self._kept ^= 1

    def _clipping_coefficient(self) -> float | None:
        """The released gradients' norm measured, what clipping multiplies them by (1.0 without clipping, and
        ``clipped`` says whether it bit); None after an fp16 overflow (the loss scale backs off: skip the step)."""
        norm = self._global_norm()
        self.last_grad_norm = float(norm)
        if self.loss_scale is not None and not math.isfinite(self.last_grad_norm):
            self.loss_scale.update(found_inf=True)
            return None
        coef = 1.0
        if self._max_grad_norm is not None:
            coef = float(torch.clamp(self._max_grad_norm / (norm + 1e-6), max=1.0))  # as clip_grad_norm_, in fp32
        self.clipped = coef < 1.0
        return coef

    def _finish_released(self, records: list[Record]) -> None:
        """``finish`` with released gradients: run the updates still to do, then keep, redo or undo them."""
        pipe = self._pipeline
        for rec in records:
            if rec.spec is None and rec.fires:  # its gradient came in fewer backward passes than accumulated
                rec.spec = Spec(_RELEASED, None, _hparams(rec.group), True)
                self._submit_kept(rec, self._unscale)
        pipe.wait_idle()
        self._raise_error(records)
        updated = [r for r in records if r.spec is not None]
        for rec in updated:
            if rec.spec.hparams != _hparams(rec.group):
                self._restore_all(records)
                raise RuntimeError(
                    f"the hyperparameters of {rec.name} changed between backward and step(); with"
                    " release_grads the update already ran in backward: change them before backward"
                )
        coef = self._clipping_coefficient()
        if coef is None:
            self._restore_all(records)  # an fp16 overflow skips the step, as GradScaler does
            return
        if coef < 1.0:
            for rec in updated:
                self._submit_kept(rec, coef * self._unscale)
            pipe.wait_idle()
            self._raise_error(records)
        if self.loss_scale is not None:
            self.loss_scale.update(found_inf=False)
        self._commit(records, self._stepped)
        self._gather_weights()

    def _raise_error(self, records: list[Record]) -> None:
        """After an update failed (over several ranks: on any rank): restore every parameter and raise its error."""
        error = self._pipeline.take_error()
        if self.sharding is not None and self.sharding.ranks.any(error is not None, "the ranks' update results"):
            if error is None:
                self._restore_all(records)
                raise RuntimeError(
                    "nvoffload: the optimizer step failed on another rank; the parameters were restored to"
                    " their values before this step() on every rank (that rank raised the error)"
                )
        if error is None:
            return
        self._restore_all(records)
        if isinstance(error, OSError):
            raise OffloadIOError(f"optimizer step failed, parameters restored: {error}") from error
        error.add_note("nvoffload: the parameters were restored to their values before this step()")
        raise error

    def _refuse_unsound(self, records: list[Record], found_inf, grad_scale) -> None:
        """Undo the step and raise where the early updates cannot be kept or redone."""
        if self._release_grads:
            if found_inf is not None or grad_scale is not None:
                self._restore_all(records)
                raise ValueError(
                    "release_grads (parameter streaming) frees gradients during backward, so GradScaler cannot"
                    " check them for overflow: give the optimizer loss_scaling (OffloadConfig(loss_scaling=...))"
                    " and scale the loss with optimizer.scale_loss(loss) instead"
                )
            return
        extra = next((r for r in records if r.spec is not None and r.spec.applied and r.fires > r.learned_fires), None)
        if extra is not None:
            self._restore_all(records)
            raise RuntimeError(
                f"backward ran {extra.fires} times for {extra.name} before step(), but the optimizer had learned"
                f" {extra.learned_fires} per step and updated the parameters during backward pass"
                f" {extra.learned_fires}: the forward passes after it saw the updated weights, so these gradients"
                " are not the ones of the step's weights. The parameters were restored and the step skipped;"
                f" zero the gradients and run the step again (the optimizer now expects {extra.fires} backward"
                " passes per step), keep the number of micro-batches per step constant, or construct the"
                " optimizer with overlap=False"
            )

    def _redo_changed(self, records: list[Record], scale: float) -> bool:
        """Queue the update of every parameter whose early update is missing or stale; returns whether every
        gradient and hyperparameter is the one its hook saw."""
        clean = True
        for rec in records:
            grad = _checked_grad(rec)
            spec, rec.spec = rec.spec, None
            hp = _hparams(rec.group)
            if grad is None:
                self.restore(rec.chunks)
                continue
            if spec is not None:
                unchanged = (
                    spec.grad_ref() is grad and grad._version == spec.grad_version and spec.hparams == hp and scale == 1.0
                )
                clean = clean and unchanged
                if spec.applied and unchanged and not self._pipeline.failed:
                    continue
                for c in rec.chunks:  # recompute from the committed generation
                    if c.pending_gen is not None and c.pending_gen != c.gen:
                        c.pending_gen = None
            self._submit(rec, grad, hp, scale)
        return clean

    def _commit(self, records: list[Record], stepped: set[Record]) -> None:
        """Make the new generation of ``records``' chunks the committed one; count a step for each updated
        record (and for those of ``stepped`` without chunks of this rank)."""
        for rec in records:
            updated = False
            for c in rec.chunks:
                if c.pending_gen is None:
                    continue
                updated = True
                if c.gen is not None and c.gen != c.pending_gen:
                    self._io.chunks.delete(c, c.gen)
                c.gen, c.pending_gen, c.applied = c.pending_gen, None, False
                c.scalars, c.pending_scalars = c.pending_scalars, {}  # a generic optimizer's (Adam has none)
            if updated or (not rec.chunks and rec in stepped):  # not rec.chunks: other ranks own it
                rec.step += 1

    def _step_order(self) -> list[Record]:
        seen = set(self._order)
        return list(self._order) + [r for r in self._records if r not in seen]

    def plan(self) -> list[Chunk]:
        """The chunks to read ahead for the next step, in the order their updates come: their gradients' (when
        deferring: the parameters on the device first, then the streamed ones in forward order)."""
        order = self._step_order()
        home = self._io.weight_home
        if self.defer and home is not None:
            order = [r for r in order if not home.holds(r.param)] + [r for r in reversed(order) if home.holds(r.param)]
        return [c for r in order for c in r.chunks if r.param.requires_grad]

    # ------------------------------------------------------------------ undo
    def _restore_all(self, records: list[Record]) -> None:
        self.restore(c for r in records for c in r.chunks)

    def restore(self, chunks: Iterable[Chunk]) -> None:
        """Put back the committed weights of chunks whose update reached the model; drop their new generation."""
        to_read = []
        for chunk in chunks:
            if chunk.pending_gen is not None and chunk.pending_gen != chunk.gen:
                self._io.chunks.delete(chunk, chunk.pending_gen)
            chunk.pending_gen = None
            chunk.pending_scalars = {}
            if chunk.applied and chunk.gen is not None:
                to_read.append(chunk)
            chunk.applied = False
        if not to_read:
            return
        failures = []
        with self._pipeline.lend() as slot:
            for chunk in to_read:
                rec = chunk.record
                try:
                    self._io.chunks.read(chunk, chunk.gen, slot, state=False).result()
                    committed = self._io.chunks.layout.views(chunk, slot).weights
                    with self._io.model_weights(rec, modify=True) as weights:
                        weights.write(chunk.elements, committed, slot).result()
                except Exception as exc:  # noqa: BLE001 - every chunk is tried; a Ctrl-C is not an I/O failure
                    failures.append(f"{rec.name} elements [{chunk.start}, {chunk.start + chunk.numel}): {exc}")
        if failures:
            more = f" (and {len(failures) - 3} more chunks)" if len(failures) > 3 else ""
            raise OffloadIOError("could not restore the weights of " + "; ".join(failures[:3]) + more)

    def grad_norm(self) -> float | None:
        """With released gradients: the global L2 norm of the gradients since the last ``step()`` (summed
        over its micro-batches, unscaled), or of the last step's when none came since (None before any).
        Call after the update requests were drained (``wait_idle``)."""
        if not any(r.fires for r in self._records):
            return self.last_grad_norm
        return float(self._global_norm())

    def _global_norm(self) -> torch.Tensor:
        """The norm of the measured gradients, computed as ``clip_grad_norm_`` does (fp32: the norm of the
        parameters' norms, in group order), unscaled."""
        norms = []
        for rec in self._records:
            if rec.fires and rec.chunks:
                chunks = [c.grad_norm for c in rec.chunks]
                norms.append(chunks[0] if len(chunks) == 1 else math.sqrt(math.fsum(n * n for n in chunks)))
        if self.sharding is not None:  # each rank measured its own elements
            squares = self.sharding.ranks.sum(math.fsum(n * n for n in norms), "the gradients' norm")
            return torch.tensor(math.sqrt(squares), dtype=torch.float32) * self._unscale
        return torch.linalg.vector_norm(torch.tensor(norms, dtype=torch.float32)) * self._unscale
