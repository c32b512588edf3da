"""The update schedules: when one parameter's update runs, chosen once at construction.

A parameter's post-accumulate-grad hook fires when its gradient is final for a backward pass; ``step()`` then
finishes the step. Between the two, an update can take one of these paths, each a type that owns its hooks,
its waits and its rows of ARCHITECTURE.md's "who waits for what":

==========================  ======================  ==================================================
schedule                    the hook                ``step()``
==========================  ======================  ==================================================
``HeldSpeculative``         queues the update       keeps it, or redoes / undoes it (``_held``)
``HeldInStep``              observes                runs every update
``HeldDelayed``             observes                queues them into staged copies; the next
                                                    ``step()`` lands them
``ReleasedSpeculative``     keeps or queues         keeps, redoes from the kept gradients, or undoes
                                                    (``_released``)
``Deferred``                keeps                   queues them; the next backward lands them
``ReleasedDelayed``         keeps                   queues them into twins; the next ``step()`` lands
==========================  ======================  ==================================================

Where the gradients wait decides the protocol, once: :class:`~nvoffload.optim._held.Held` (in ``.grad``) or
:class:`~nvoffload.optim._released.Released` (``release_grads``: in the store); its rule, also fixed at
construction, picks each step's schedule (a held step speculates after one in which nothing changed between
backward and ``step()``; a released one defers after one whose clipping bit, with ``defer_updates=None``; with
``delayed_update`` the steps after the first ``delayed_update_after`` are delayed). What every schedule
shares is in :mod:`~nvoffload.optim._generations` (the two generations: commit, restore), in
:mod:`~nvoffload.optim._scaling` (the norm of released gradients, clipping, the loss scale) and in
:mod:`~nvoffload.optim._sharing` (one process, or the ranks each updating its share: around any schedule that
trains over ranks); the frame they run in (hooks, ``step()``, landing, undoing) is
:class:`~nvoffload.optim._schedule.StepProtocol`, and the updates a step queued to land after it are an
:class:`~nvoffload.optim._in_flight.InFlight`.

Every update writes a new generation of its chunk and leaves the committed one in the store until the step
commits, so an error, an overflow or a refused step restores every parameter to the step before.
"""

from __future__ import annotations

from nvoffload.distributed import Sharding
from nvoffload.optim._chunk_io import ChunkIO
from nvoffload.optim._generations import Generations
from nvoffload.optim._held import Held
from nvoffload.optim._layout import Record
from nvoffload.optim._pipeline import Pipeline
from nvoffload.optim._released import Released
from nvoffload.optim._scaling import GradScaling
from nvoffload.optim._schedule import StepProtocol
from nvoffload.optim._sharing import OneProcess, Sharded
from nvoffload.optim.loss_scale import DynamicLossScale

__all__ = ["step_protocol"]


def step_protocol(records: list[Record], io: ChunkIO, pipeline: Pipeline, config, sharding: Sharding | None) -> StepProtocol:
    """The step protocol for ``config`` (an ``OffloadOptimizerConfig``) over ``records`` (the optimizer's list,
    shared); ``sharding``: this rank's share and the collectives (None: one process)."""
    sharing = OneProcess() if sharding is None else Sharded(sharding)
    gens = Generations(records, io, pipeline, sharing)
    delayed_after = config.delayed_update_after if config.delayed_update else None
    if not config.release_grads:
        speculate = config.overlap and not config.delayed_update and config.max_grad_norm is None
        return Held(gens, max_grad_norm=config.max_grad_norm, speculate=speculate, delayed_after=delayed_after)
    loss_scale = DynamicLossScale(config.loss_scaling) if config.loss_scaling is not None else None
    scaling = GradScaling(records, config.max_grad_norm, loss_scale, sharing)
    defer = config.defer_updates if sharding is None else False  # over several ranks it speculates
    return Released(
        gens, scaling, accumulation_steps=config.gradient_accumulation_steps, defer=defer, delayed_after=delayed_after
    )
