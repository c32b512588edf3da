"""A causal LM's forward in two parts, the hidden states before its head and the head: what
:func:`~nvoffload.vertical.vertical_step` runs apart, and :mod:`nvoffload.sft`'s losses build on.

Two kinds of model, recognized by what they offer rather than by type (this module sits with the entry points,
below the model presets and the data readers):

- a model with ``hidden_states(input_ids, position_ids=...)`` and ``head_loss(h, targets, num_items=...)``
  (:class:`~nvoffload.models.GPT`);
- a Hugging Face causal LM: a base model under ``base_model_prefix``, output embeddings and a ``loss_function``.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["causal_lm_hidden", "causal_lm_logits", "has_head_loss", "is_hf_causal_lm"]

# Config fields of Hugging Face causal LMs whose forward changes the logits after the output embeddings (Gemma 2's
# soft-capping, Cohere's and Granite's scales): their head is not ``get_output_embeddings()`` alone.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def is_hf_causal_lm(model: nn.Module) -> bool:
    """A Hugging Face causal LM: a base model under ``base_model_prefix``, an output embedding and a loss function."""
    prefix = getattr(model, "base_model_prefix", None)
    return (
        isinstance(prefix, str) and isinstance(getattr(model, prefix, None), nn.Module)
        and callable(getattr(model, "get_output_embeddings", None)) and hasattr(model, "loss_function")
    )  # fmt: skip


def has_head_loss(model: nn.Module) -> bool:
    """A model that gives its hidden states and its head's loss apart (``hidden_states`` and ``head_loss``)."""
    return callable(getattr(model, "hidden_states", None)) and callable(getattr(model, "head_loss", None))


def causal_lm_hidden(
    model: nn.Module, input_ids: torch.Tensor, *, position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The hidden states before ``model``'s head, ``(rows, seq, d_model)``: its ``hidden_states`` (a
    :class:`~nvoffload.models.GPT`), or a Hugging Face causal LM's base model's last hidden state (no cache: a
    training step)."""
    if not is_hf_causal_lm(model) and has_head_loss(model):
        if attention_mask is not None:
            raise ValueError(f"a {type(model).__name__} takes position_ids, not an attention_mask")
        return model.hidden_states(input_ids, position_ids=position_ids)
    base = getattr(model, model.base_model_prefix)
    out = base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state


def causal_lm_logits(model: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """A Hugging Face causal LM's logits of the hidden states ``h`` (its output embeddings).

    Raises:
        ValueError: the model's forward transforms its logits after the output embeddings
            (soft-capping or a scale, e.g. Gemma 2): give the head yourself.
    """
    config = getattr(model, "config", None)
    transforms = [f for f in _LOGIT_TRANSFORMS if getattr(config, f, None) not in (None, 1, 1.0)]
    if transforms:
        raise ValueError(
            f"{type(model).__name__} transforms its logits after the output embeddings ({', '.join(transforms)}):"
            " the head run apart from the model's forward would differ; pass your own loss()"
        )
    return model.get_output_embeddings()(h)
