"""The frame every update schedule runs in: the hooks, ``step()``'s commit, landing, undoing a step.

An optimizer holds one :class:`StepProtocol`, chosen once at construction by where its gradients wait
(:class:`~nvoffload.optim._held.Held` in ``.grad``, :class:`~nvoffload.optim._released.Released` in the store);
each step runs one :class:`Schedule` of that protocol's (a type: speculative, in ``step()``, deferred,
delayed), which the protocol's rule picks for the next step when one ends. The updates a step queued to land
after it are an :class:`~nvoffload.optim._in_flight.InFlight`. See :mod:`nvoffload.optim._protocol`.
"""

from __future__ import annotations

from collections.abc import Callable

from nvoffload.optim._generations import Generations
from nvoffload.optim._in_flight import InFlight
from nvoffload.optim._chunk_state import Chunk
from nvoffload.optim._layout import Record


class Schedule:
    """One step's path: what the hooks do with a final gradient and what ``step()`` does (see the subclasses).

    ``keeps``: the hooks keep every gradient and queue no update; ``step()`` queues them (the next step's reads
    ahead then come in that order: the parameters on the device first, the streamed ones in forward order)."""

    keeps = False

    def __init__(self, gens: Generations):
        self.gens = gens

    def take(self, rec: Record) -> None:
        """``rec``'s hook fired (counted): its gradient is final for this backward pass."""
        raise NotImplementedError

    def finish(self, records: list[Record], found_inf, grad_scale) -> InFlight | None:
        """``step()``: keep, redo or run the updates of ``records`` (in their gradients' order) and commit them, or
        queue them; returns the updates queued to land later (None: the step is committed or undone)."""
        raise NotImplementedError


class StepProtocol:
    """The hooks' and ``step()``'s side of the optimizer over ``gens`` (see the module docs); the subclass says
    where the gradients wait and which schedule each step takes."""

    loss_scale = None  # the dynamic fp16 loss scale (released gradients only)

    def __init__(self, gens: Generations, schedule: Schedule):
        self.gens = gens
        self.schedule = schedule  # this step's
        self.in_flight: InFlight | None = None  # the updates the last step() queued, until they land

    # ------------------------------------------------------------------ the hooks
    def hook(self, rec: Record, weakly: Callable[[Record, Callable], Callable]) -> None:
        """Give ``rec``'s parameter, when it requires grad and has none yet, its post-accumulate-grad hook
        (``weakly(rec, StepProtocol.on_grad)``: a hook that holds the optimizer weakly); a frozen one has none
        (no gradient, no state)."""
        if not rec.hooks and rec.param.requires_grad:
            rec.hooks = (rec.param.register_post_accumulate_grad_hook(weakly(rec, StepProtocol.on_grad)),)
            self.learn(rec)  # nothing learned yet (held), or the one hook call of a micro-batch (released)

    def on_grad(self, rec: Record) -> None:
        """``rec``'s gradient is final for this backward pass (its post-accumulate-grad hook)."""
        self.gens.count(rec)
        flight = self.in_flight
        if flight is not None and flight.lands_in_backward:  # their weights are written (the forward waited)
            try:
                self.land()
            except BaseException:
                self.abandon()  # this backward pass is void: its gradients are forgotten
                raise
        self.schedule.take(rec)

    def before_zero_grad(self, set_to_none: bool) -> None:
        """``zero_grad`` is about to change the gradients: wait for the updates still reading them."""

    @property
    def updates_queued(self) -> bool:
        """Whether a hook queued an update since the last ``finish``."""
        return any(rec.spec is not None and rec.spec.applied for rec in self.gens.records)

    @property
    def step_in_progress(self) -> bool:
        """Whether a backward pass ran since the last ``finish`` (updates queued, or gradients kept)."""
        return any(rec.fires for rec in self.gens.records)

    @property
    def defer(self) -> bool:
        """Whether this step's updates wait for ``step()`` (the hooks keep the gradients)."""
        return self.schedule.keeps

    # ------------------------------------------------------------------ step()
    def finish(self, *, found_inf, grad_scale) -> None:
        """Wait for the updates queued during backward, redo those whose gradient or hyperparameters
        changed, run the rest, and commit (or queue them to land later); undo everything and raise on an error."""
        gens = self.gens
        gens.sharing.flush()
        gens.pipeline.wait_idle()
        records = gens.step_order()
        try:
            self.land()
            self.refuse_unsound(records, found_inf, grad_scale)
            self.in_flight = self.finishing().finish(records, found_inf, grad_scale)
        finally:
            self._end_step()
        gens.learned()
        self.schedule = self.next_schedule()
        gens.pipeline.set_plan(self.plan())

    def _end_step(self) -> None:
        """Forget the step's hooks (also after an error): the next backward starts a step."""
        gens = self.gens
        for rec in gens.records:
            rec.spec = None
            self.learn(rec)
            rec.fires = 0
        if self.in_flight is None:  # else the worker runs them now: their errors are the next land()'s
            gens.pipeline.take_error()
        gens.stepped.clear()
        self.next_step()

    def land(self) -> None:
        """Wait for the updates the last ``step()`` queued, commit them and (delayed) make their new weights the
        parameters'. On an error they are dropped and it is raised: the parameters and the committed state stay
        those from before them."""
        flight = self.in_flight
        if flight is None:
            return
        try:
            flight.wait()
        except BaseException:
            self.in_flight = None
            raise
        flight.install()  # refused while a block is in use: the updates stay in flight, uncommitted
        self.in_flight = None
        flight.commit()
        self.landed()

    def abandon(self) -> None:
        """Undo the updates queued since the last ``step()`` and forget their gradients (a refused step); the
        delayed updates of the step before land first."""
        gens = self.gens
        self.land()
        gens.pipeline.wait_idle()
        gens.restore_all(gens.step_order())
        gens.pipeline.take_error()
        gens.stepped.clear()
        for rec in gens.records:
            rec.spec, rec.fires = None, 0
        self.next_step()

    def plan(self) -> list[Chunk]:
        """The chunks to read ahead for the next step, in the order their updates come: their gradients' (when
        the hooks keep them: the parameters on the device first, then the streamed ones in forward order)."""
        order = self.gens.step_order()
        home = self.gens.io.weight_home
        if self.schedule.keeps and home is not None:
            order = [r for r in order if not home.holds(r.param)] + [r for r in reversed(order) if home.holds(r.param)]
        return [c for r in order for c in r.chunks if r.param.requires_grad]

    # ------------------------------------------------------------------ what a subclass says
    def learn(self, rec: Record) -> None:
        """At the end of a step: how many hook calls the next step's last backward pass is."""
        raise NotImplementedError

    def refuse_unsound(self, records: list[Record], found_inf, grad_scale) -> None:
        """Undo the step and raise where its updates cannot be kept or redone."""

    def finishing(self) -> Schedule:
        """The schedule that finishes this step (the one its hooks ran, or one whose hooks are the same)."""
        return self.schedule

    def next_schedule(self) -> Schedule:
        """The schedule of the next step, after this one finished."""
        return self.schedule

    def grad_norm(self) -> float | None:
        """The global L2 norm of the gradients (see ``OffloadOptimizer.grad_norm``)."""
        raise NotImplementedError

    def next_step(self) -> None:
        """A step ended (or was abandoned), the hooks' records reset."""

    def landed(self) -> None:
        """The updates in flight landed."""

    def after_load(self) -> None:
        """A state dict was loaded (the parameters' ``step`` may have changed)."""
