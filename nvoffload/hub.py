"""Models named as on the Hugging Face Hub (``org/name``), found in the local Hugging Face cache; never downloaded.

``nvoffload finetune --model`` and ``nvoffload plan --model`` take a model directory or a Hub name, as
``from_pretrained`` does offline: an existing path is that directory; any other name that is a valid Hub
repository id is looked up in the cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
``~/.cache/huggingface/hub``) by ``huggingface_hub.snapshot_download(local_files_only=True)``, which gives the
snapshot ``refs/main`` points at. A name that is not there is refused, naming it and the way to get it
(``hf download org/name``, which is the user's own choice to download).
"""

from __future__ import annotations

import os

__all__ = ["hub_cache_dir", "resolve_model"]


def hub_cache_dir() -> str:
    """The Hugging Face Hub cache as ``huggingface_hub`` finds it, read from the environment now (not at import)."""
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return os.path.expanduser(cache)
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def resolve_model(name: str) -> str:
    """The model directory ``name`` stands for: ``name`` itself when that path exists, else the cached snapshot of
    the Hub repository ``name``. ValueError, one line naming ``name``, when it is neither."""
    if os.path.exists(name):
        return name
    cache = hub_cache_dir()
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:
        raise ValueError(f"model_dir: {name} is not a directory (a Hub name needs huggingface_hub: pip install 'nvoffload[hf]')") from None
    try:
        return snapshot_download(name, cache_dir=cache, local_files_only=True)
    except HFValidationError:
        raise ValueError(f"model_dir: {name} is not a directory, nor a Hugging Face Hub name (org/name)") from None
    except LocalEntryNotFoundError:
        raise ValueError(
            f"model_dir: {name} is not a directory, and not in the Hugging Face cache {cache} (nothing is downloaded:"
            f" 'hf download {name}' fetches it, or give a model directory)"
        ) from None
