"""Models built from configurations shipped in the package (no downloads)."""

from nvoffload.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
