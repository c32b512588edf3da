"""A GPT-style causal language model built from a configuration (no download).

Used by ``nvoffload finetune``, the tests and the benchmarks. Its transformer
blocks sit in ``model.blocks`` (a ``ModuleList``) so that engines working block
by block (parameter streaming, activation offload) find them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT"]


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
        """A named size: ``tiny``, ``small``, ``gpt2-350m`` or ``gpt2-1.3b``."""
        try:
            return cls(**PRESETS[name])
        except KeyError:
            raise ValueError(f"unknown GPT preset {name!r}; choose one of {sorted(PRESETS)}") from None


PRESETS = {
    "tiny": dict(seq_len=64, n_layer=2, n_head=2, d_model=64),
    "small": dict(seq_len=128, n_layer=4, n_head=4, d_model=256),
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
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

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits of shape ``(batch, seq, vocab)``; with ``targets``, the mean cross-entropy loss."""
        t = idx.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len {self.config.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.tok_emb.weight)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
