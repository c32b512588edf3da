"""finetune's checkpoints: each written in the background while the next steps run (the last one, and any
optimizer :func:`~nvoffload.start_training_checkpoint` does not take, written with training stopped); when
each starts and ends is said, with what it cost the steps beside it."""

from __future__ import annotations

import time
from collections.abc import Callable

from nvoffload.optim import OffloadOptimizer
from nvoffload.training_checkpoint import BackgroundCheckpoint, save_training_checkpoint, start_training_checkpoint

__all__ = ["Checkpoints"]


class Checkpoints:
    """Saves the run's checkpoints into ``directory`` (``state``: the model, optimizer, scheduler and scaler, as
    :func:`~nvoffload.save_training_checkpoint` takes them) and says what happened (``say``). Call
    :meth:`after_step` after every step (it times them), :meth:`save` where a checkpoint is due and
    :meth:`close` before the optimizer closes."""

    def __init__(self, directory: str, keep_last: int | None, say: Callable[[str], None], state: dict):
        self._directory, self._keep_last, self._say, self._state = directory, keep_last, say, state
        self._background = isinstance(state["optimizer"], OffloadOptimizer) and state["optimizer"].ranks is None
        self._last_s = time.perf_counter()
        self._alone: list[float] = []  # seconds of the steps run without a checkpoint in flight
        self._beside: list[float] = []  # seconds of the steps the checkpoint in flight ran beside
        self._writing: BackgroundCheckpoint | None = None

    def after_step(self) -> None:
        now = time.perf_counter()
        (self._beside if self._writing is not None else self._alone).append(now - self._last_s)
        self._last_s = now
        if self._writing is not None and self._writing.done():
            self._end()

    def save(self, step: int, extra: dict, *, last: bool) -> None:
        """Checkpoint ``step``: in the background, unless it is the ``last`` (then the run waits for it)."""
        if self._writing is not None:
            self._end()
        if not self._background:
            saved = save_training_checkpoint(self._directory, step=step, extra=extra, keep_last=self._keep_last, **self._state)
            self._say(f"checkpoint of step {step} written: {saved.path}")
            return
        started = time.perf_counter()
        job = start_training_checkpoint(self._directory, step=step, extra=extra, keep_last=self._keep_last, **self._state)
        waited = time.perf_counter() - started
        self._last_s += waited  # the steps are timed without it: the weights and the state held
        self._say(
            f"checkpoint of step {step} started: the weights and the optimizer state held in {waited:.2f} s"
            f" (training waited), {job.nbytes / 1e9:.2f} GB of it written "
            + ("now (the run's last step)" if last else "beside the next steps")
        )
        self._writing, self._beside = job, []
        if last:
            self._end()

    def close(self) -> None:
        """Wait for the checkpoint in flight, and say how it ended."""
        if self._writing is not None:
            self._end()

    def _end(self) -> None:
        job, self._writing = self._writing, None
        saved = job.wait()
        rate = job.nbytes / job.seconds / 1e9 if job.seconds else float("inf")
        cost = ""
        if self._beside and self._alone:
            beside, alone = sum(self._beside) / len(self._beside), sum(self._alone[-8:]) / len(self._alone[-8:])
            cost = (
                f"; the {len(self._beside)} step(s) beside it took {beside:.2f} s each against {alone:.2f} s without"
                f": {alone / beside:.2f}x the rate"
            )
        self._say(f"checkpoint of step {job.step} written: {saved.path} (in {job.seconds:.1f} s, {rate:.2f} GB/s{cost})")
