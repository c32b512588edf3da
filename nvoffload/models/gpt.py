"""A GPT-style causal language model built from a configuration (no download).

Used by ``nvoffload finetune``, the tests and the benchmarks. Its transformer
blocks sit in ``model.blocks`` (a ``ModuleList``) so that engines working block
by block (parameter streaming, activation offload) find them.

With targets, the loss over a large vocabulary is computed a few hundred rows
of logits at a time (:func:`lm_head_loss`), so the ``(batch * seq, vocab)``
logits, their log-softmax and their gradients are never in memory whole: for
GPT-2 124M at 1024 tokens that is 4 x 206 MB fp32 less at the peak.

Packed sequences (several examples in one row, :mod:`nvoffload.data.sft`) keep
to themselves when ``position_ids`` restart at 0 at each example: positions
are embedded per example and attention is causal within each (a
block-diagonal mask), as ``transformers`` does for packed rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT", "lm_head_loss"]

# Logits elements per chunk of the fused LM-head loss (16 MiB of fp32); a loss
# whose logits fit in one chunk is computed by F.linear and F.cross_entropy as is.
LOSS_CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT model. ``vocab_size=256`` fits the byte-level tokenizer."""

    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    mlp_ratio: int = 4

    def __post_init__(self):
        for field in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "mlp_ratio"):
            if getattr(self, field) < 1:
                raise ValueError(f"GPTConfig.{field} must be >= 1, got {getattr(self, field)}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")

    @property
    def num_parameters(self) -> int:
        """Parameter count of :class:`GPT` with this configuration (tied embeddings)."""
        d, f = self.d_model, self.d_model * self.mlp_ratio
        per_block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
        return self.vocab_size * d + self.seq_len * d + self.n_layer * per_block + 2 * d

    @classmethod
    def preset(cls, name: str) -> GPTConfig:
        """A named size: ``tiny``, ``small``, ``gpt2-124m``, ``gpt2-350m`` or ``gpt2-1.3b``."""
        try:
            return cls(**PRESETS[name])
        except KeyError:
            raise ValueError(f"unknown GPT preset {name!r}; choose one of {sorted(PRESETS)}") from None


PRESETS = {
    "tiny": dict(seq_len=64, n_layer=2, n_head=2, d_model=64),
    "small": dict(seq_len=128, n_layer=4, n_head=4, d_model=256),
    "gpt2-124m": dict(vocab_size=50257, seq_len=1024, n_layer=12, n_head=12, d_model=768),
    "gpt2-350m": dict(vocab_size=50304, seq_len=1024, n_layer=24, n_head=16, d_model=1024),
    "gpt2-1.3b": dict(vocab_size=50304, seq_len=1024, n_layer=24, n_head=32, d_model=2048),
}


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        d = config.d_model
        self.n_head = config.n_head
        self.ln_1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, config.mlp_ratio * d)
        self.fc_out = nn.Linear(config.mlp_ratio * d, d)
        for residual_out in (self.proj, self.fc_out):
            residual_out.residual_out = True  # initialized with a depth-scaled std

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: ``(batch, 1, seq, seq)`` bool, True where a position may attend (None: causal)."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    """Token and position embeddings, ``n_layer`` blocks, a tied LM head."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.apply(self.init_weights)

    def init_weights(self, module: nn.Module) -> None:
        """Initialize ``module``'s own parameters as the constructor does (also for a model built on the meta device)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02 / math.sqrt(2 * self.config.n_layer) if getattr(module, "residual_out", False) else 0.02
            nn.init.normal_(module.weight, std=std)
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, position_ids: torch.Tensor | None = None,
        num_items_in_batch: int | float | torch.Tensor | None = None,
    ):  # fmt: skip
        """Logits of shape ``(batch, seq, vocab)``; with ``targets`` (-100: no loss), the cross-entropy loss.

        ``position_ids`` (``(batch, seq)``, restarting at 0 at each packed
        example; None: ``0..seq-1``): each example's positions and attention
        are its own. ``num_items_in_batch``: the loss is the sum over the
        targets divided by this (the targets of a whole step of micro-batches,
        as ``transformers`` takes it) instead of their mean.
        """
        h = self.hidden_states(idx, position_ids=position_ids)
        if targets is None:
            return F.linear(h, self.tok_emb.weight)
        return self.head_loss(h, targets, num_items=num_items_in_batch)


    def head_loss(
        self, h: torch.Tensor, targets: torch.Tensor, *, num_items: int | float | torch.Tensor | None = None
    ) -> torch.Tensor:  # fmt: skip
        """The loss :meth:`forward` gives with ``targets``, from the hidden states ``h`` (:meth:`hidden_states`):
        the tied head's cross-entropy, a chunk of rows at a time (:func:`lm_head_loss`)."""
        return lm_head_loss(h, self.tok_emb.weight, targets, num_items=num_items)

    def hidden_states(self, idx: torch.Tensor, *, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm's output ``(batch, seq, d_model)``, before the LM head (``position_ids`` as in
        :meth:`forward`); the head is ``F.linear(h, self.tok_emb.weight)``."""
        t = idx.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len {self.config.seq_len}")
        mask = None
        if position_ids is None:
            pos = torch.arange(t, device=idx.device)
        else:
            pos, mask = position_ids, document_mask(position_ids)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x) if mask is None else block(x, mask)
        return self.ln_f(x)


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """The ``(batch, 1, seq, seq)`` attention mask of packed rows: causal within each example, an example
    starting wherever the position is not the previous one's plus one (built on the device, no host wait)."""
    starts = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1
    doc = starts.cumsum(-1)
    t = position_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
    return ((doc.unsqueeze(2) == doc.unsqueeze(1)) & causal).unsqueeze(1)


def lm_head_loss(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
    chunk_elements: int = LOSS_CHUNK_ELEMENTS, num_items: int | float | torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``F.cross_entropy(F.linear(h, weight).view(-1, vocab), targets.reshape(-1), ignore_index=ignore_index)``
    without the whole logits in memory.

    With ``num_items`` the loss is the sum over the targets (``reduction="sum"``)
    divided by ``num_items``: 0, with zero gradients, when every target is ignored.

    When the logits fit in ``chunk_elements`` this is exactly that expression.
    Otherwise the rows are taken ``chunk_elements // vocab`` at a time: each
    chunk's logits give its share of the loss and, when a gradient is wanted,
    its share of the gradients of ``h`` and ``weight`` at once (softmax minus
    one-hot, times ``weight`` and times ``h``), so forward does the head's
    three matrix products and backward only scales the result. The gradients
    are those of the expression above up to float rounding (the summation order
    differs). A second backward through a retained graph recomputes them;
    double backward is not supported.
    """
    vocab = weight.shape[0]
    h2 = h.reshape(-1, h.shape[-1])
    t = targets.reshape(-1)
    rows = max(1, chunk_elements // vocab)
    if h2.shape[0] <= rows:
        logits = F.linear(h, weight).view(-1, vocab)
        if num_items is None:
            return F.cross_entropy(logits, t, ignore_index=ignore_index)
        return F.cross_entropy(logits, t, ignore_index=ignore_index, reduction="sum") / num_items
    if torch.is_grad_enabled() and (h2.requires_grad or weight.requires_grad):
        return _ChunkedLMHeadLoss.apply(h2, weight, t, ignore_index, rows, num_items)
    return _chunked_loss(h2, weight, t, ignore_index, rows, num_items, grads=False)[0]


def _chunked_loss(h, weight, t, ignore_index, rows, num_items, *, grads):
    """The cross-entropy (mean, or sum over ``num_items``) and, with ``grads``, its gradients w.r.t. ``h`` and
    ``weight``."""
    acc = torch.promote_types(h.dtype, torch.float32)  # softmax and sums in fp32 at least
    valid = t != ignore_index
    count = valid.sum().to(acc) if num_items is None else torch.as_tensor(num_items, dtype=acc, device=h.device)
    total = torch.zeros((), dtype=acc, device=h.device)
    grad_h = torch.empty_like(h) if grads else None
    grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if grads else None
    scale = 1.0 / count.clamp(min=1)
    for start in range(0, h.shape[0], rows):
        hc, tc, vc = h[start : start + rows], t[start : start + rows], valid[start : start + rows]
        logits = F.linear(hc, weight).to(acc)
        lse = torch.logsumexp(logits, dim=1)
        picked = tc.masked_fill(~vc, 0).unsqueeze(1)
        total += ((lse - logits.gather(1, picked).squeeze(1)) * vc).sum()
        if grads:
            probs = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place of the logits
            probs.scatter_add_(1, picked, -vc.to(probs.dtype).unsqueeze(1))
            probs.mul_((vc.to(probs.dtype) * scale).unsqueeze(1))
            grad_h[start : start + rows] = probs.to(weight.dtype) @ weight
            grad_w.addmm_(probs.t(), hc.to(acc))
            del probs
        del logits
    loss = total / count  # nan when every target is ignored, as F.cross_entropy
    return loss.to(h.dtype), grad_h, grad_w


class _ChunkedLMHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, t, ignore_index, rows, num_items):
        loss, grad_h, grad_w = _chunked_loss(h, weight, t, ignore_index, rows, num_items, grads=True)
        # Kept on ctx, not saved: they are results, not activations for an offload hook to move.
        ctx.grads = (grad_h, grad_w.to(weight.dtype))
        ctx.save_for_backward(h, weight, t)
        ctx.ignore_index, ctx.rows, ctx.num_items = ignore_index, rows, num_items
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        if ctx.grads is None:  # a second backward through a retained graph
            h, weight, t = ctx.saved_tensors
            _, grad_h, grad_w = _chunked_loss(h, weight, t, ctx.ignore_index, ctx.rows, ctx.num_items, grads=True)
            grad_w = grad_w.to(weight.dtype)
        else:
            (grad_h, grad_w), ctx.grads = ctx.grads, None  # the graph holds them no longer
        g = grad_loss.to(grad_h.dtype)
        return grad_h.mul_(g), grad_w.mul_(g), None, None, None, None
