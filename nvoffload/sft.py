"""The loss and the evaluation of supervised fine-tuning, for ``nvoffload finetune`` and for a script's own loop.

:func:`causal_lm_loss` is the next-token cross-entropy of a batch
(:class:`~nvoffload.data.sft.SFTBatch`) summed over its targets (labels other
than -100) and divided by ``num_items``: pass the number of targets of the
whole optimizer step, every micro-batch (and rank) together, and the gradients
that accumulate over the micro-batches are those of the mean over all of the
step's targets, whatever each micro-batch holds (``transformers``'
``num_items_in_batch``; ``SFTTrainer`` does the same). Dividing each
micro-batch's mean by the number of micro-batches would weigh a target of a
micro-batch with few of them more.

Example (gradient accumulation over ``G`` micro-batches)::

    from nvoffload.data.sft import SFTDataset
    from nvoffload.sft import causal_lm_loss, evaluate

    batches = [data.batch(8) for _ in range(G)]
    n = sum(b.num_items for b in batches)
    for b in batches:
        causal_lm_loss(model, b.to(device), n).backward()
    optimizer.step(); optimizer.zero_grad()
    print(evaluate(model, eval_data.batches(8), device))   # EvalResult(loss=..., perplexity=..., tokens=...)

With a streamed model, :func:`causal_lm_vertical_step` takes
the ``G`` micro-batches of the step at once and runs each block over all of them
while it is on the device: the same gradients, without streaming every block
``G`` times.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nvoffload.causal_lm import causal_lm_hidden, causal_lm_logits
from nvoffload.data.sft import IGNORE_INDEX, SFTBatch
from nvoffload.models import GPT
from nvoffload.optim import OffloadOptimizer
from nvoffload.vertical import vertical_step

__all__ = [
    "EvalResult", "causal_lm_head_loss", "causal_lm_hidden", "causal_lm_logits", "causal_lm_loss",
    "causal_lm_vertical_step", "evaluate",
]  # causal_lm_hidden and causal_lm_logits: nvoffload.causal_lm's, the parts these losses are made of


def causal_lm_loss(model: nn.Module, batch: SFTBatch, num_items: int | float | torch.Tensor) -> torch.Tensor:
    """The cross-entropy of ``model``'s next-token predictions on ``batch``, summed over its targets and divided
    by ``num_items`` (at least 1).

    ``model`` is a :class:`~nvoffload.models.GPT` (its fused LM-head loss) or a
    Hugging Face causal LM (``model(input_ids=..., position_ids=...).logits``),
    streamed or not. The batch's ``position_ids`` (packed rows) keep each
    example's attention to itself where the model supports it (see
    :mod:`nvoffload.data.sft`).
    """
    if isinstance(model, GPT):
        num_items = _at_least_one(num_items)
        return model(batch.input_ids, batch.labels, position_ids=batch.position_ids, num_items_in_batch=num_items)
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
    return _summed_over(logits, batch.labels, num_items)


def causal_lm_head_loss(
    model: nn.Module, h: torch.Tensor, labels: torch.Tensor, num_items: int | float | torch.Tensor
) -> torch.Tensor:  # fmt: skip
    """:func:`causal_lm_loss` from the hidden states ``h`` (:func:`causal_lm_hidden`): the head's cross-entropy
    against ``labels``, summed over the targets and divided by ``num_items`` (at least 1)."""
    if isinstance(model, GPT):
        return model.head_loss(h, labels, num_items=_at_least_one(num_items))
    return _summed_over(causal_lm_logits(model, h), labels, num_items)


def causal_lm_vertical_step(optimizer: OffloadOptimizer, batches: Sequence[SFTBatch], num_items: float) -> torch.Tensor:
    """One optimizer step of a streamed model over the micro-batches ``batches`` by the vertical schedule; returns
    each micro-batch's loss (its targets' sum over ``num_items``: their sum is the step's loss).

    The same step as ``nvoffload.sft.causal_lm_loss(model, b, num_items).backward()``
    for each ``b`` then ``optimizer.step()`` (up to float rounding), as
    ``nvoffload finetune --stream --grad-accum G`` takes it.
    """

    def hidden(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return causal_lm_hidden(model, batch["input_ids"], position_ids=batch.get("position_ids"))

    def loss(model: nn.Module, h: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return causal_lm_head_loss(model, h, batch["labels"], num_items)

    micro_batches = [
        {"input_ids": b.input_ids, "labels": b.labels}
        | ({} if b.position_ids is None else {"position_ids": b.position_ids})
        for b in batches
    ]
    return vertical_step(optimizer, micro_batches, hidden=hidden, loss=loss, mean=False)


def _at_least_one(num_items: int | float | torch.Tensor) -> int | float | torch.Tensor:
    return max(num_items, 1) if not isinstance(num_items, torch.Tensor) else num_items.clamp(min=1)


def _summed_over(logits: torch.Tensor, labels: torch.Tensor, num_items: int | float | torch.Tensor) -> torch.Tensor:
    """The cross-entropy of ``logits`` (in fp32) against ``labels``, summed over the targets, over ``num_items``."""
    summed = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum",
    )  # fmt: skip
    return summed / _at_least_one(num_items)


@dataclass(frozen=True)
class EvalResult:
    """The mean cross-entropy over every target of the evaluation data, its exponential, and the targets counted."""

    loss: float
    perplexity: float
    tokens: int


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[SFTBatch], device: torch.device | str) -> EvalResult:
    """``model``'s loss on ``batches`` (e.g. :meth:`~nvoffload.data.sft.SFTDataset.batches`), in eval mode,
    without gradients.

    A streamed model runs forward block by block through its streamer, with the
    weights where they live; nothing reaches the optimizer (no gradient, no
    update, no optimizer state read). The model's training mode is put back.

    Raises:
        ValueError: the batches hold no target.
    """
    training = model.training
    model.eval()
    total, tokens = 0.0, 0
    try:
        for batch in batches:
            n = batch.num_items
            if n:
                total += float(causal_lm_loss(model, batch.to(device), 1))
                tokens += n
    finally:
        model.train(training)
    if not tokens:
        raise ValueError(
            "the evaluation data has no token to take the loss on (examples longer than the rows are cut: their"
            " completions may be lost)"
        )
    loss = total / tokens
    return EvalResult(loss, math.exp(min(loss, 700.0)), tokens)
