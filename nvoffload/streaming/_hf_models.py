"""What a model built from a config on the meta device needs to be filled: Hugging Face ``PreTrainedModel`` rules.

- :func:`rebuilt_buffers`: buffers no checkpoint holds (rotary ``inv_freq``,
  causal masks), as a twin of the model built from its ``config`` computes them;
- :func:`default_init`: the model's own ``_init_weights``, for a ``PreTrainedModel``;
- :func:`checkpoint_names`: a checkpoint's tensor names as the model names them
  (transformers' renamings, ``base_model_prefix`` added or stripped,
  ``_keys_to_ignore_on_load_unexpected``).

Nothing here imports transformers for a model that is not a ``PreTrainedModel``
(one exists only once transformers is imported): the library works without it.
"""

from __future__ import annotations

import contextlib
import copy
import re
import sys
from collections.abc import Callable, Collection, Iterable, Iterator

import torch
from torch import nn

__all__ = ["checkpoint_names", "default_init", "rebuilt_buffers"]


def _pretrained_model_class() -> type | None:
    transformers = sys.modules.get("transformers")
    return None if transformers is None else transformers.PreTrainedModel


def _is_pretrained(model: nn.Module) -> bool:
    pretrained = _pretrained_model_class()
    return pretrained is not None and isinstance(model, pretrained)


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built in the body get their parameters on the meta device, their buffers where they are made
    (accelerate's ``init_empty_weights(include_buffers=False)``). Patches ``nn.Module`` for every thread."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def rebuilt_buffers(model: nn.Module, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The buffers ``names`` (by module path) as ``type(model)(model.config)`` computes them, on the CPU.

    The twin is built with its parameters on the meta device, so only its
    buffers take memory. Raises ValueError, naming the first buffer and what to
    do, for a model that has no ``config``, cannot be built from it, or whose
    twin lacks a buffer or holds it with another shape.
    """
    names = list(names)

    def refuse(why: str, name: str = names[0]) -> ValueError:
        return ValueError(
            f"buffer {name!r} is on the meta device and no checkpoint holds it, and {type(model).__name__} cannot be "
            f"rebuilt from its config to compute it ({why}): build the model with its buffers on the device (only "
            "its parameters on the meta device, e.g. accelerate's init_empty_weights(include_buffers=False))"
        )

    config = getattr(model, "config", None)
    if config is None:
        raise refuse("it has no `config` attribute")
    try:
        with torch.device("cpu"), _parameters_on_meta():
            twin = type(model)(copy.deepcopy(config))
    except Exception as e:
        raise refuse(f"{type(model).__name__}(model.config) raised {type(e).__name__}: {e}") from e
    built = dict(twin.named_buffers(remove_duplicate=False))
    mine = dict(model.named_buffers(remove_duplicate=False))
    for name in names:
        if name not in built or built[name].shape != mine[name].shape:
            raise refuse(f"the rebuilt model has no such buffer of shape {tuple(mine[name].shape)}", name)
    return {name: built[name] for name in names}


def default_init(model: nn.Module) -> Callable[[nn.Module], None] | None:
    """For a ``PreTrainedModel``: a function initializing a module's parameters with ``_init_weights`` of the
    innermost ``PreTrainedModel`` holding it (as ``initialize_weights`` dispatches); None for any other model."""
    pretrained = _pretrained_model_class()
    if pretrained is None or not isinstance(model, pretrained):
        return None
    owners: dict[str, nn.Module] = {}
    by_module: dict[nn.Module, nn.Module] = {}
    for name, module in model.named_modules():  # parents before children
        owner = module if isinstance(module, pretrained) else owners[name.rpartition(".")[0]]
        owners[name] = by_module[module] = owner
    return lambda module: by_module[module]._init_weights(module)


def _weight_transforms(model: nn.Module) -> tuple[list, list]:
    """transformers' renamings of the model's checkpoint names (e.g. GPT-NeoX's ``embed_out`` -> ``lm_head``, which
    ``save_pretrained`` writes back), and its conversions (which merge or reshape tensors)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # transformers < 5: checkpoints use the model's names
        return [], []
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    return renamings, [t for t in transforms if not isinstance(t, WeightRenaming)]


def checkpoint_names(model: nn.Module, names: Collection[str]) -> Callable[[str], str | None]:
    """A function giving the model's state-dict name for a checkpoint tensor's name, as transformers matches them
    for a ``PreTrainedModel`` (the identity for any other model).

    transformers' renamings of the model's family apply first (one that merges
    or reshapes tensors raises ``ValueError``: it needs more than one tensor
    at a time). Then, unless the name is among ``names``, the model's
    ``base_model_prefix`` (``transformer`` for GPT-2) is stripped (a checkpoint
    of the task model loaded into the base model) or added (a base-model
    checkpoint, as the hub's GPT-2, loaded into the task model) when that gives
    one of ``names``. Names the model ignores (its
    ``_keys_to_ignore_on_load_unexpected`` patterns, e.g. GPT-2's old
    ``attn.bias`` masks) give None; any other is returned renamed (and is unexpected).
    """
    if not _is_pretrained(model):
        return lambda key: key
    renamings, conversions = _weight_transforms(model)
    prefix = model.base_model_prefix
    patterns = model._keys_to_ignore_on_load_unexpected or ()
    ignored = re.compile("|".join(f"({p})" for p in patterns)) if patterns else None

    def model_name(key: str) -> str | None:
        name = key
        for renaming in renamings:
            name = renaming.rename_source_key(name)[0]
        for conversion in conversions:
            matched = conversion.rename_source_key(name)[1]
            if matched is not None:
                raise ValueError(
                    f"checkpoint tensor {key!r} is converted by transformers ({type(conversion).__name__} of "
                    f"{matched!r}), which checkpoint= cannot do one tensor at a time: write a checkpoint with the "
                    "model's own state-dict names (e.g. nvoffload.checkpoint.SafetensorsWriter)"
                )
        if name in names:
            return name
        if prefix:
            for prefixed in (name.removeprefix(prefix + "."), f"{prefix}.{name}"):
                if prefixed in names:
                    return prefixed
        return None if ignored is not None and ignored.search(key) else name

    return model_name
