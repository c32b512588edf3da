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
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nvoffload.data.sft import IGNORE_INDEX, SFTBatch
from nvoffload.models import GPT

__all__ = ["EvalResult", "causal_lm_loss", "evaluate"]


def causal_lm_loss(model: nn.Module, batch: SFTBatch, num_items: int | float | torch.Tensor) -> torch.Tensor:
    """The cross-entropy of ``model``'s next-token predictions on ``batch``, summed over its targets and divided
    by ``num_items`` (at least 1).

    ``model`` is a :class:`~nvoffload.models.GPT` (its fused LM-head loss) or a
    Hugging Face causal LM (``model(input_ids=..., position_ids=...).logits``),
    streamed or not. The batch's ``position_ids`` (packed rows) keep each
    example's attention to itself where the model supports it (see
    :mod:`nvoffload.data.sft`).
    """
    num_items = max(num_items, 1) if not isinstance(num_items, torch.Tensor) else num_items.clamp(min=1)
    if isinstance(model, GPT):
        return model(batch.input_ids, batch.labels, position_ids=batch.position_ids, num_items_in_batch=num_items)
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
    summed = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), batch.labels.reshape(-1), ignore_index=IGNORE_INDEX,
        reduction="sum",
    )  # fmt: skip
    return summed / num_items


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
