"""A Hugging Face ``Trainer`` driving an optimizer whose gradients are released: its recipe must be the optimizer's.

The ``Trainer`` clips with ``torch.nn.utils.clip_grad_norm_(model.parameters())``
between backward and ``optimizer.step()``, and counts micro-batches itself.
With released gradients (parameter streaming) ``clip_grad_norm_`` finds no
gradient and returns 0 without clipping anything, so the clipping and the
accumulation must be the optimizer's own: when a ``Trainer`` on the call stack
asks for a different ``max_grad_norm`` or ``gradient_accumulation_steps``
than the optimizer was built with, ``step()`` refuses (before anything is
committed) rather than train unclipped. With equal settings the ``Trainer``
trains exactly as the optimizer's recipe says, and logs the optimizer's gradient
norm (:func:`log_optimizer_grad_norm`) in place of the 0.0 that
``clip_grad_norm_`` found.
"""

from __future__ import annotations

import functools
import sys

__all__ = ["check_trainer_optimizer", "check_trainer_recipe", "log_optimizer_grad_norm"]


def _driving_trainer():
    """The ``transformers.Trainer`` whose training loop called us, or None."""
    transformers = sys.modules.get("transformers")
    trainer_type = getattr(transformers, "Trainer", None) if transformers is not None else None
    if trainer_type is None:
        return None
    frame = sys._getframe(2)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, trainer_type):
            return candidate
        frame = frame.f_back
    return None


def check_trainer_optimizer(optimizer) -> None:
    """ValueError when a ``Trainer`` (``trl.SFTTrainer`` too) trains the model with an optimizer of its own:
    ``optimizer`` (nvoffload's) updates the weights from hooks in backward, and the ``Trainer``'s would step
    nothing (the gradients are released, or summed where only ``optimizer`` reads them)."""
    trainer = _driving_trainer()
    theirs = getattr(trainer, "optimizer", None)
    theirs = getattr(theirs, "optimizer", theirs)  # accelerate's AcceleratedOptimizer wraps the one the Trainer has
    if theirs is not None and theirs is not optimizer:
        raise ValueError(
            f"a transformers Trainer trains a model set up by nvoffload.initialize with its own optimizer"
            f" ({type(theirs).__name__}), which would train nothing: give it nvoffload's,"
            " Trainer(..., optimizers=(optimizer, None)) (SFTTrainer takes the same argument)"
        )


def check_trainer_recipe(max_grad_norm: float | None, accumulation_steps: int):
    """The ``Trainer`` driving this step (None: none does); ValueError when it clips or accumulates otherwise
    than the optimizer."""
    trainer = _driving_trainer()
    if trainer is None:
        return None
    args = trainer.args
    wanted = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
    problems = []
    if wanted is not None and wanted != max_grad_norm:
        problems.append(
            f"TrainingArguments(max_grad_norm={wanted}) clips through torch.nn.utils.clip_grad_norm_, which finds"
            f" no gradients here and would silently skip clipping: build the optimizer with max_grad_norm={wanted}"
            " (nvoffload.OffloadConfig(max_grad_norm=...)), which clips exactly as it would"
        )
    if args.gradient_accumulation_steps != accumulation_steps:
        problems.append(
            f"TrainingArguments(gradient_accumulation_steps={args.gradient_accumulation_steps}) but the optimizer"
            f" sums {accumulation_steps} backward passes per step: give nvoffload.OffloadConfig the same"
            " gradient_accumulation_steps"
        )
    if problems:
        raise ValueError(
            "a transformers Trainer drives an optimizer that releases gradients during backward (parameter"
            " streaming): " + "; ".join(problems)
        )
    return trainer


@functools.cache
def _grad_norm_callback_type() -> type:
    """The ``TrainerCallback`` that logs the optimizer's gradient norm (made once ``transformers`` is imported)."""
    from transformers import TrainerCallback

    class OptimizerGradNorm(TrainerCallback):
        """Replaces the ``grad_norm`` the ``Trainer`` logs by :attr:`norm`, the norm the optimizer's last step
        measured, before the other callbacks (printers, reporters) see the logs."""

        def __init__(self) -> None:
            self.norm: float | None = None

        def on_log(self, args, state, control, logs=None, **kwargs) -> None:
            if logs is None or "grad_norm" not in logs or self.norm is None:
                return
            logs["grad_norm"] = self.norm
            last = state.log_history[-1] if state.log_history else None
            if last is not None and "grad_norm" in last and last.get("step") == state.global_step:
                last["grad_norm"] = self.norm  # the Trainer copied the logs into its history before the callbacks

    return OptimizerGradNorm


def log_optimizer_grad_norm(trainer, norm: float | None) -> None:
    """Have ``trainer`` log ``norm`` as this step's ``grad_norm``: its own ``clip_grad_norm_(model.parameters())``
    found the released gradients gone and measured 0.0."""
    callback_type = _grad_norm_callback_type()
    callbacks = trainer.callback_handler.callbacks
    callback = next((c for c in callbacks if isinstance(c, callback_type)), None)
    if callback is None:
        callback = callback_type()
        callbacks.insert(0, callback)
    callback.norm = norm
