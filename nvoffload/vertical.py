"""The vertical schedule of a streamed step (issue 33): every micro-batch of a block before the next block.

With ``gradient_accumulation_steps=G`` and the ordinary loop, every micro-batch
streams every block to the device twice and sums its gradients in an fp32 copy
in the store. :func:`vertical_step` runs the G micro-batches of a step as one
forward and one backward of the model's own code instead:

* the micro-batches go through the model as one batch (concatenated along the
  first dimension); each streamed block is called once per micro-batch under
  non-reentrant ``torch.utils.checkpoint``, while the block stays on the device
  (:meth:`~nvoffload.streaming.ParameterStreamer.kept`): its weights are copied
  once for all G calls, and only its input is kept per micro-batch;
* the head and the loss run per micro-batch on the hidden states, each on its
  own graph, differentiated at once (``torch.autograd.grad``): the logits of
  the G micro-batches are never alive together;
* one backward from the hidden states (and the head's parameters, with the
  gradients summed over the micro-batches) runs the blocks in reverse: a block's
  input gradient needs every micro-batch's call, so autograd finishes each block
  over all G micro-batches before the block below (recomputing one micro-batch at
  a time), and sums each parameter's G contributions before its
  post-accumulate-grad hook fires, once a step: the optimizer updates each block
  once, while backward goes on below, and no gradient is written to be accumulated.

What a step keeps for backward is each block's input for each micro-batch (the
arguments checkpointing saves), G of them a layer: on the device, bounding G by
device memory, unless the session has a stash (``OffloadConfig.stash_host_bytes``,
:attr:`~nvoffload.training.OffloadSession.stash`): each call then runs inside
it, so the input is copied off the device as it is saved, kept in host memory
(NVMe beyond) and read back ahead of backward, block by block in reverse, and G
is bound by host memory and the drives.

Clipping is the ordinary loop's speculation, unchanged: each block's update runs
as its hook fires; with ``max_grad_norm`` the hook also keeps the gradient in the
store (4 bytes a parameter, written once a step whatever G), and ``step()`` redoes
the updates from it when the norm clips. (Deferring each block's update to just
before its next forward, with no redo, is the alternative issue 33 asks to
measure.)

The ordinary loop keeps working as it is; ``state_dict()`` names never change
(the blocks are wrapped in their containers during the forward only).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from nvoffload.activations import offload_activations
from nvoffload.causal_lm import causal_lm_hidden, causal_lm_logits, has_head_loss, is_hf_causal_lm
from nvoffload.optim import OffloadOptimizer
from nvoffload.streaming import ParameterStreamer

__all__ = ["vertical_step"]

Batch = Sequence[torch.Tensor] | Mapping[str, torch.Tensor]


def vertical_step(
    optimizer: OffloadOptimizer,
    micro_batches: Sequence[Batch],
    *,
    hidden: Callable[[nn.Module, Batch], torch.Tensor] | None = None,
    loss: Callable[[nn.Module, torch.Tensor, Batch], torch.Tensor] | None = None,
    mean: bool = True,
) -> torch.Tensor:
    """One optimizer step over ``micro_batches``, each block over all of them at once; returns their losses.

    The result equals the ordinary loop's
    ``for b in micro_batches: (loss(b) / G).backward()`` (``mean=False``:
    ``loss(b).backward()``) then ``optimizer.step()``
    (up to float rounding: the sums run in another order), with
    ``G = len(micro_batches)`` whatever ``gradient_accumulation_steps`` the
    config gives; clipping (``max_grad_norm``) and fp16 loss scaling
    (``loss_scaling``: the losses are scaled here, and a step whose gradients
    overflow is skipped) are the config's, as there. With bf16 or fp16
    parameters the G gradients of a parameter are summed by autograd in its
    dtype, as torch's own loop sums them in ``.grad`` (the ordinary streamed
    loop sums them in fp32 in the store). It
    waits for the step (``optimizer.step()`` is called) and zeroes nothing else:
    ``param.grad`` is None afterwards, as after any streamed step.

    Args:
        optimizer: the optimizer :func:`nvoffload.initialize` returned (its
            session streams the model's blocks).
        micro_batches: the G micro-batches, each a tuple/list or a mapping of
            tensors whose first dimension is the batch (the sizes may differ; all
            must have the same keys or length). They are concatenated into one
            batch for ``hidden``.
        hidden: ``hidden(model, batch)`` gives the hidden states before the head,
            ``(rows, ...)`` with the rows of the micro-batches one after the other;
            it must call the streamed blocks through their containers (the
            model's own forward does). Default for a model with
            ``hidden_states`` and ``head_loss`` (:class:`~nvoffload.models.GPT`):
            ``model.hidden_states(batch[0])``;
            for a Hugging Face causal LM (micro-batches ``(input_ids, labels)``
            or mappings with those keys, ``attention_mask`` and
            ``position_ids`` optional): its base model's last hidden state
            (:func:`~nvoffload.sft.causal_lm_hidden`).
        loss: ``loss(model, h, micro_batch)`` gives the scalar loss of one
            micro-batch from its rows ``h`` of the hidden states (the head and the
            loss; it may use parameters outside the streamed blocks, never the
            blocks'). Default for a model with ``hidden_states`` and
            ``head_loss``: ``model.head_loss(h, batch[1])`` (a GPT's tied head); for a
            Hugging Face causal LM (:mod:`nvoffload.causal_lm`): its output
            embeddings and its ``loss_function`` (labels shifted, as its forward
            takes them; a model that transforms its logits after the output
            embeddings, such as Gemma 2, is refused: give ``loss``).
        mean: the step's loss is the mean of the micro-batches' losses (each
            divided by G, as with ``gradient_accumulation_steps``); False: their
            sum (each ``loss`` already its share of the step's, e.g. summed over
            its targets and divided by the step's count of targets, as
            ``transformers``' ``num_items_in_batch``).

    Returns:
        The G losses (detached, not divided by G), as one tensor.

    Raises:
        ValueError: no micro-batch, micro-batches that do not match, or no
            default for the model's type.
        RuntimeError: a step is in progress (backward ran since the last ``step()``).
    """
    session = optimizer.session
    if session is None or session.closed:
        raise ValueError("vertical_step needs the optimizer of an open nvoffload.initialize() session")
    if not micro_batches:
        raise ValueError("vertical_step needs at least one micro-batch")
    streamer = session.streamer
    model = streamer.model
    hidden, loss = _defaults(model, hidden, loss)
    sizes = [_rows(b) for b in micro_batches]
    batch = _concatenated(micro_batches)
    session.settle()
    with optimizer.backward_passes(1):
        with torch.enable_grad():
            # With activation offload, what the forward saves outside the checkpointed calls (each call's input,
            # the embeddings' and the final norm's) moves as the model's own forward would move it.
            with _per_micro_batch(streamer, sizes, session.stash), session.activation_offload or contextlib.nullcontext():
                h = hidden(model, batch)
            if h.shape[0] != sum(sizes):
                raise ValueError(f"hidden() gave {h.shape[0]} rows for micro-batches of {sum(sizes)} rows in all")
            scale = optimizer.loss_scale or 1.0  # fp16: the loss scaled as optimizer.scale_loss() scales it
            divisor = len(sizes) if mean else 1
            losses, grad_h, head = _head_per_micro_batch(model, streamer, h, sizes, micro_batches, loss, divisor, scale)
        roots = [h, *head]
        torch.autograd.backward(roots, [grad_h, *head.values()])
        optimizer.step()
    return torch.stack(losses)


def _head_per_micro_batch(model, streamer, h, sizes, micro_batches, loss, divisor, scale):
    """Each micro-batch's loss and its gradients (divided by ``divisor``, times the loss ``scale``): of its rows of
    ``h`` (concatenated) and of the parameters outside the streamed blocks that the head uses (summed, in the order
    of the micro-batches)."""
    blocks = {p for p in streamer.model.parameters() if streamer.weights.holds(p)}
    outside = [p for p in model.parameters() if p.requires_grad and p not in blocks]
    losses, grads_h = [], []
    head: dict[torch.Tensor, torch.Tensor] = {}
    for rows, micro_batch in zip(h.detach().split(sizes), micro_batches):
        rows.requires_grad_()
        value = loss(model, rows, micro_batch)
        losses.append(value.detach())
        grads = torch.autograd.grad(value / divisor * scale, [rows, *outside], allow_unused=True)
        grads_h.append(grads[0])
        for p, g in zip(outside, grads[1:]):
            if g is not None:
                head[p] = g if p not in head else head[p] + g
    return losses, torch.cat(grads_h), head


@contextlib.contextmanager
def _per_micro_batch(streamer: ParameterStreamer, sizes: list[int], stash: offload_activations | None):
    """Inside: each streamed block, in its container, is a :class:`_MicroBatched` around it."""
    swapped = []
    try:
        for block in streamer.blocks:
            parent, key = _container_of(streamer.model, block)
            parent._modules[key] = _MicroBatched(block, streamer, sizes, stash)
            swapped.append((parent, key, block))
        yield
    finally:
        for parent, key, block in swapped:
            parent._modules[key] = block


def _container_of(model: nn.Module, module: nn.Module) -> tuple[nn.Module, str]:
    for parent in model.modules():
        for key, child in parent._modules.items():
            if child is module:
                return parent, key
    raise ValueError(f"{type(module).__name__}: a streamed block that is not a child of a module of the model")


class _MicroBatched(nn.Module):
    """A streamed block called once per micro-batch, each call under non-reentrant checkpointing, the block kept
    on the device across the calls; tensors whose first dimension is the batch's are split, the others given to
    every call; the outputs are concatenated back. With the session's stash, what each call keeps for backward
    (its input: checkpointing saves its arguments outside the block's own saved-tensor hooks) goes through it."""

    def __init__(self, block: nn.Module, streamer: ParameterStreamer, sizes: list[int], stash: offload_activations | None):
        super().__init__()
        self._parts = (block, streamer, stash or contextlib.nullcontext())  # not children: the wrapper owns no parameters
        self.sizes = sizes

    def forward(self, *args, **kwargs):
        block, streamer, stash = self._parts
        rows = sum(self.sizes)
        parts = [_split(a, rows, self.sizes) for a in args]
        kwparts = {k: _split(v, rows, self.sizes) for k, v in kwargs.items()}
        outs = []
        with streamer.kept(block):
            for i in range(len(self.sizes)):
                call_args = [p[i] for p in parts]
                call_kwargs = {k: p[i] for k, p in kwparts.items()}
                with stash:
                    outs.append(checkpoint(block, *call_args, use_reentrant=False, **call_kwargs))
        if isinstance(outs[0], torch.Tensor):
            return torch.cat(outs)
        if isinstance(outs[0], tuple):
            return tuple(torch.cat(parts) if _batched(parts[0]) else parts[0] for parts in zip(*outs))
        raise TypeError(f"a streamed block returned {type(outs[0]).__name__}: vertical_step takes a tensor or a tuple")


def _batched(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _split(value, rows: int, sizes: list[int]) -> list:
    """``value`` for each micro-batch: a tensor whose first dimension is the batch's split, a tuple or list split
    element by element (rotary embeddings' ``(cos, sin)``), anything else the same for every call."""
    if _batched(value) and value.shape[0] == rows:
        return list(value.split(sizes))
    if isinstance(value, (tuple, list)) and any(_batched(v) and v.shape[0] == rows for v in value):
        return [type(value)(parts) for parts in zip(*(_split(v, rows, sizes) for v in value))]
    return [value] * len(sizes)


def _rows(micro_batch: Batch) -> int:
    tensors = list(micro_batch.values()) if isinstance(micro_batch, Mapping) else list(micro_batch)
    rows = {t.shape[0] for t in tensors if _batched(t)}
    if len(rows) != 1:
        raise ValueError(f"a micro-batch's tensors must share their first dimension (the batch), got {sorted(rows)}")
    return rows.pop()


def _concatenated(micro_batches: Sequence[Batch]) -> Batch:
    first = micro_batches[0]
    if isinstance(first, Mapping):
        keys = list(first)
        if any(list(b) != keys for b in micro_batches):
            raise ValueError("the micro-batches must have the same keys")
        return {k: torch.cat([b[k] for b in micro_batches]) for k in keys}
    if any(len(b) != len(first) for b in micro_batches):
        raise ValueError("the micro-batches must have the same number of tensors")
    return tuple(torch.cat(ts) for ts in zip(*micro_batches))


def _defaults(model: nn.Module, hidden, loss):
    if hidden is not None and loss is not None:
        return hidden, loss
    if is_hf_causal_lm(model):
        return hidden or _hf_hidden, loss or _hf_loss
    if not has_head_loss(model):
        raise ValueError(f"vertical_step has no default hidden() and loss() for {type(model).__name__}: give both")
    return hidden or _own_hidden, loss or _own_head_loss


def _own_hidden(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model.hidden_states(batch[0])


def _own_head_loss(model: nn.Module, h: torch.Tensor, micro_batch: Batch) -> torch.Tensor:
    return model.head_loss(h, micro_batch[1])


def _hf_inputs(batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor | None], torch.Tensor]:
    """``(input_ids, {attention_mask, position_ids}, labels)`` of a mapping with those keys (the two in the middle
    optional) or of a tuple ``(input_ids, labels)``."""
    if isinstance(batch, Mapping):
        extra = {k: batch.get(k) for k in ("attention_mask", "position_ids")}
        return batch["input_ids"], extra, batch["labels"]
    input_ids, labels = batch
    return input_ids, {}, labels


def _hf_hidden(model: nn.Module, batch: Batch) -> torch.Tensor:
    input_ids, extra, _ = _hf_inputs(batch)
    return causal_lm_hidden(model, input_ids, **extra)


def _hf_loss(model: nn.Module, h: torch.Tensor, micro_batch: Batch) -> torch.Tensor:
    """The causal LM's head and loss on one micro-batch's hidden states (its ``loss_function``: labels shifted)."""
    labels = _hf_inputs(micro_batch)[2]
    return model.loss_function(causal_lm_logits(model, h), labels, vocab_size=model.config.vocab_size)
