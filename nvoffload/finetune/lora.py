"""LoRA in ``finetune`` (``lora_rank``, ``lora_targets``): the model wrapped by PEFT, its adapters drawn from the seed
alone, whether the base is loaded or streamed, and the adapter described as ``AutoPeftModelForCausalLM`` opens it."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from nvoffload.finetune.config import FinetuneConfig

__all__ = ["adapters_seeded", "with_lora"]


@contextlib.contextmanager
def adapters_seeded(seed: int) -> Iterator[None]:
    """The body draws from the CPU generator seeded with ``seed``, and leaves the run's own random state as it was:
    the adapters' initial weights depend on the seed alone, not on what the run drew before (loading a model,
    building one on the meta device) nor on where they are drawn (PEFT's ``get_peft_model`` over a loaded base
    draws them on the CPU, then moves them to the base's device; the streamer's init over a base built on the meta
    device draws them in the same order, on the CPU too, whatever its device)."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        yield


def with_lora(model: nn.Module, config: FinetuneConfig) -> nn.Module:
    """``model`` wrapped by PEFT with LoRA adapters of ``lora_rank`` on ``lora_targets``, the rest frozen, its
    adapters drawn from ``config.seed`` (:func:`adapters_seeded`). The adapter is a causal LM's (``task_type``
    ``CAUSAL_LM``) over ``model_dir`` by its absolute path, so the directory ``save_to`` writes opens with
    ``AutoPeftModelForCausalLM.from_pretrained`` from any working directory.

    Raises:
        ImportError: peft is not installed.
        ValueError: naming ``lora_targets``: a target adapts no module of the model, or none is given and PEFT knows
            no default for the model's family.
    """
    try:
        import peft
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError as exc:
        raise ImportError(f"lora_rank needs peft ({exc}): pip install peft") from None
    targets = list(config.lora_targets) if config.lora_targets is not None else None
    linears = ", ".join(dict.fromkeys(n.rpartition(".")[2] for n, m in model.named_modules() if _linear(m)))
    lora = peft.LoraConfig(r=config.lora_rank, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM")
    try:
        with warnings.catch_warnings(), adapters_seeded(config.seed):
            # transformers 5 deprecates a question peft asks: nothing for the user to do
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
            wrapped = peft.get_peft_model(model, lora)
    except ValueError:  # PEFT's: no target matched, or no default targets for the family
        wrapped = None
    adapted = [] if wrapped is None else [n for n, m in wrapped.named_modules() if isinstance(m, BaseTunerLayer)]
    unmatched = [t for t in targets or () if not any(n == t or n.endswith("." + t) for n in adapted)]
    if wrapped is None or unmatched:
        family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        if targets is None:
            raise ValueError(f"lora_targets: PEFT has no default modules to adapt in a {family} model: name them (its linear layers: {linears})")
        raise ValueError(f"lora_targets {' '.join(unmatched or targets)} name no linear layer of the {family} model ({linears})")
    wrapped.peft_config[wrapped.active_adapter].base_model_name_or_path = os.path.abspath(config.model_dir)
    return wrapped


def _linear(module: nn.Module) -> bool:
    """A linear layer LoRA adapts: ``nn.Linear``, or GPT-2's (transformers' ``Conv1D``)."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"
