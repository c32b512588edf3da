"""Training text for ``nvoffload finetune``: a shipped corpus and a byte-level tokenizer.

The corpus (``corpus.txt``, ~300 KB of Python standard-library docstrings, PSF
license; see ``README.md`` beside it) needs no download. Tokens are bytes
(vocabulary of 256), which matches :class:`nvoffload.models.GPTConfig`'s default
``vocab_size``.

Example::

    from nvoffload.data import ByteTokenizer, TokenDataset, load_text

    tokens = ByteTokenizer().encode(load_text())
    data = TokenDataset(tokens, seq_len=128, seed=0)
    x, y = data.batch(8)   # (8, 128) inputs and next-byte targets
"""

from __future__ import annotations

import os
import stat
from importlib import resources

import torch

__all__ = ["ByteTokenizer", "TokenDataset", "load_text", "CORPUS_NAME"]

CORPUS_NAME = "corpus.txt"


def load_text(path: str | os.PathLike | None = None, *, encoding: str = "utf-8", max_bytes: int | None = None) -> str:
    """The text of ``path`` (decoded as ``encoding``), or of the shipped corpus when ``path`` is None.

    ``max_bytes`` bounds what is read: a larger file is refused before it is read.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not a regular file (a directory, a device such as ``/dev/zero``, a pipe), is
            larger than ``max_bytes``, holds a byte that is not valid in ``encoding`` (naming its offset), or
            the text is empty.
    """
    if path is None:
        text = resources.files(__name__).joinpath(CORPUS_NAME).read_text(encoding="utf-8")
        source = f"the shipped {CORPUS_NAME}"
    else:
        source = os.fspath(path)
        with open(path, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise ValueError(f"{source} is not a regular file: give a text file")
            if max_bytes is not None and info.st_size > max_bytes:
                raise ValueError(f"{source} is {info.st_size} bytes, more than the {max_bytes} a text may have here")
            data = f.read(info.st_size)  # the size it had when opened, however it grows
        try:
            text = data.decode(encoding)
        except UnicodeDecodeError as exc:
            bad = data[exc.start : exc.start + 1].hex()
            raise ValueError(
                f"{source} is not valid {encoding}: byte 0x{bad} at offset {exc.start} ({exc.reason}); give the"
                " file's encoding (finetune --text-encoding)"
            ) from None
    if not text:
        raise ValueError(f"{source} is empty: nothing to train on")
    return text


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255, lossless for any text."""

    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        """The UTF-8 bytes of ``text`` as an int64 tensor of token ids."""
        data = bytearray(text.encode("utf-8"))
        return torch.frombuffer(data, dtype=torch.uint8).to(torch.int64) if data else torch.empty(0, dtype=torch.int64)

    def decode(self, tokens: torch.Tensor | list[int]) -> str:
        """The text of ``tokens`` (invalid UTF-8 sequences become U+FFFD)."""
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        if any(not 0 <= t < 256 for t in ids):
            raise ValueError("byte tokens must be in [0, 256)")
        return bytes(ids).decode("utf-8", errors="replace")


class TokenDataset:
    """Random windows of a token stream for causal language modelling.

    ``batch(n)`` draws ``n`` windows of ``seq_len + 1`` tokens at random offsets
    (from a seeded generator, so runs repeat) and returns inputs and targets
    shifted by one.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, *, seed: int = 0):
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if tokens.numel() < seq_len + 1:
            raise ValueError(f"need at least seq_len + 1 = {seq_len + 1} tokens, got {tokens.numel()}")
        self.tokens = tokens.to(torch.int64)
        self.seq_len = seq_len
        self._generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        """Number of distinct window offsets."""
        return self.tokens.numel() - self.seq_len

    def state_dict(self) -> dict:
        """The position in the data: the state of the generator drawing the windows."""
        return {"generator": self._generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        """Go on drawing from where :meth:`state_dict` was taken."""
        self._generator.set_state(state["generator"])

    def batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, each ``(batch_size, seq_len)`` int64; targets are inputs shifted by one."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        starts = torch.randint(0, len(self), (batch_size,), generator=self._generator)
        windows = torch.stack([self.tokens[s : s + self.seq_len + 1] for s in starts.tolist()])
        return windows[:, :-1], windows[:, 1:]
