"""What a model built from a config on the meta device needs to be filled: Hugging Face ``PreTrainedModel`` rules.

- :func:`rebuilt_buffers`: buffers no checkpoint holds (rotary ``inv_freq``,
  causal masks), as a twin of the model built from its ``config`` computes them;
- :func:`default_init`: the model's own ``_init_weights``, for a ``PreTrainedModel``;
- :class:`CheckpointSources`: the checkpoint tensors that fill each parameter and buffer, matched by
  :func:`checkpoint_names` and :func:`checkpoint_parts` and checked before anything is read;
- :func:`checkpoint_names`: a checkpoint's tensor names as the model names them
  (transformers' renamings, ``base_model_prefix`` added or stripped,
  ``_keys_to_ignore_on_load_unexpected``);
- :func:`checkpoint_parts` and :func:`stored_layout`: under transformers 5, a
  mixture of experts' per-expert tensors as parts of the fused parameters it
  builds on load (``experts.N.up_proj.weight`` of ``experts.gate_up_proj``),
  read and written back one tensor at a time from transformers' own mapping.

Nothing here imports transformers for a model that is not a ``PreTrainedModel``
(one exists only once transformers is imported): the library works without it.
"""

from __future__ import annotations

import contextlib
import copy
import re
import sys
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping

import torch
from torch import nn

from nvoffload.streaming._blocks import state_tensors
from nvoffload.streaming._peft import PeftView

__all__ = [
    "CheckpointSources", "Index", "checkpoint_names", "checkpoint_parts", "default_init", "rebuilt_buffers",
    "stored_layout",
]

Index = tuple[int | slice, ...]  # a part of a tensor: tensor[index]; () for the whole


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


def rebuilt_buffers(model: nn.Module, names: Iterable[str], view: PeftView | None) -> dict[str, torch.Tensor]:
    """The buffers ``names`` (by module path) as ``type(model)(model.config)`` computes them, on the CPU.

    The twin is built with its parameters on the meta device, so only its
    buffers take memory. Raises ValueError, naming the first buffer and what to
    do, for a model that has no ``config``, cannot be built from it, or whose
    twin lacks a buffer or holds it with another shape.
    """
    names = list(names)
    twin_name = view.base_name if view is not None else (lambda name: name)

    def refuse(why: str, name: str = names[0]) -> ValueError:
        return ValueError(
            f"buffer {name!r} is on the meta device and no checkpoint holds it, and {type(model).__name__} cannot be "
            f"rebuilt from its config to compute it ({why}): build the model with its buffers on the device (only "
            "its parameters on the meta device, e.g. accelerate's init_empty_weights(include_buffers=False))"
        )

    original = view.base if view is not None else model  # a PEFT model's twin is its base model's
    config = getattr(original, "config", None)
    if config is None:
        raise refuse("it has no `config` attribute")
    try:
        with torch.device("cpu"), _parameters_on_meta():
            twin = type(original)(copy.deepcopy(config))
    except Exception as e:
        raise refuse(f"{type(original).__name__}(model.config) raised {type(e).__name__}: {e}") from e
    built = dict(twin.named_buffers(remove_duplicate=False))
    mine = dict(model.named_buffers(remove_duplicate=False))
    for name in names:
        theirs = built.get(twin_name(name))
        if theirs is None or theirs.shape != mine[name].shape:
            raise refuse(f"the rebuilt model has no such buffer of shape {tuple(mine[name].shape)}", name)
    return {name: built[twin_name(name)] for name in names}


def default_init(model: nn.Module, view: PeftView | None) -> Callable[[nn.Module], None] | None:
    """For a ``PreTrainedModel``: a function initializing a module's parameters with ``_init_weights`` of the
    innermost ``PreTrainedModel`` holding it (as ``initialize_weights`` dispatches; for a PEFT model, of its base
    model: the adapters are PEFT's, see :meth:`~nvoffload.streaming._peft.PeftView.adapter_init`); None for any
    other model."""
    pretrained = _pretrained_model_class()
    if view is not None:  # the base model's init; the adapters are PEFT's (see Materializer)
        model = view.base
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


def _saved_transforms(model: nn.Module) -> list:
    """The transforms transformers reverts when it saves the model, chosen as its ``revert_weight_conversion``
    chooses: those ``from_pretrained`` used, else the family's without legacy renamings and ``PrefixChange``."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:  # transformers < 5: saved under the model's names
        return []
    used = getattr(model, "_weight_conversions", None)
    if used is not None:
        return list(used)
    return [t for t in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(t, PrefixChange)]


def _describe(conversion) -> str:
    ops = list(getattr(conversion, "operations", []))
    return f"{ops} of {conversion.source_patterns} into {conversion.target_patterns}"


class _Fusion:
    """One of transformers' conversions that stack the experts' tensors into one parameter (``MergeModulelist(dim=0)``),
    then maybe concatenate projections (``Concatenate(dim=d)``, d >= 1: the hub's ``experts.N.gate_proj.weight``
    and ``experts.N.up_proj.weight`` into ``experts.gate_up_proj``), as the part of the fused parameter each stored
    tensor is, so that it is read and written one tensor at a time. Another conversion is ``supported`` False."""

    def __init__(self, converter):
        self.converter = converter
        ops = list(getattr(converter, "operations", []))
        kinds = [type(op).__name__ for op in ops]
        self.concat_dim = ops[1].dim if kinds == ["MergeModulelist", "Concatenate"] else None
        self.supported = (
            kinds in (["MergeModulelist"], ["MergeModulelist", "Concatenate"]) and ops[0].dim == 0
            and len(converter.target_patterns) == 1 and all(p.count("*") == 1 for p in converter.source_patterns)
            and (self.concat_dim is None or (self.concat_dim >= 1 and ops[1].num_shards_attribute is None))
        )  # fmt: skip
        try:
            self.reverse = converter.reverse_transform()
        except (NotImplementedError, ValueError):  # an op without an inverse: where it applies is not known
            self.reverse = None

    def index(self, shape: torch.Size, source: int, expert: int) -> Index:
        """The part of the fused parameter (of ``shape``) that expert ``expert``'s tensor of pattern ``source`` is."""
        if self.concat_dim is None:
            return (expert,)
        size = shape[self.concat_dim] // len(self.converter.source_patterns)
        return (expert, *[slice(None)] * (self.concat_dim - 1), slice(source * size, (source + 1) * size))

    def part(self, name: str) -> tuple[str, int, int] | None:
        """The fused parameter's name, the source pattern and the expert of a stored tensor (named as after the
        renamings of loading); None when the conversion does not apply to it."""
        fused, matched = self.converter.rename_source_key(name)
        if matched is None:
            return None
        expert = re.search(re.escape(matched).replace(r"\*", r"(\d+)"), name)
        if expert is None:
            raise ValueError(f"checkpoint tensor {name!r} matches {matched!r}, but names no expert by number")
        return fused, self.converter.source_patterns.index(matched), int(expert.group(1))

    def parts(self, model: nn.Module, name: str, shape: torch.Size) -> list[tuple[str, Index]] | None:
        """The stored tensors (named as before the renamings of saving are reverted) that the parameter ``name`` of
        ``shape`` is saved as, by source pattern, then expert; None when the conversion does not apply to it."""
        matched = None if self.reverse is None else self.reverse.rename_source_key(name)[1]
        if self.reverse is None or (matched is not None and not self.supported):
            raise ValueError(
                f"transformers saves {type(model).__name__} converted ({_describe(self.converter)}), and nvoffload"
                f" cannot write it back one tensor at a time: save the state dict under the model's own names"
                f" (optimizer.session.save_checkpoint, nvoffload.checkpoint.save_file) instead"
            )
        if matched is None:
            return None
        renamed = self.reverse.rename_source_key(name)[0]
        first = self.reverse.target_patterns[0]
        return [
            (renamed.replace(first, pattern.replace("*", str(expert)), 1), self.index(shape, source, expert))
            for source, pattern in enumerate(self.reverse.target_patterns)
            for expert in range(shape[0])
        ]


def stored_layout(model: nn.Module, shapes: Mapping[str, torch.Size]) -> dict[str, tuple[str, Index]]:
    """The names transformers saves a model's tensors (``shapes``: by state-dict name) under, each with the name of
    the tensor it is (a part of) and the index of that part, in order (a fused parameter's parts in its place): its
    conversions reverted (a fused expert parameter as one tensor per expert and projection, ``experts.gate_up_proj`` ->
    ``experts.N.gate_proj.weight``, ``experts.N.up_proj.weight``), then its renamings (Mixtral's ``mlp`` ->
    ``block_sparse_moe``). The identity (in order) for other models and under transformers 4.

    Raises:
        ValueError: transformers converts one of the tensors otherwise.
    """
    transforms = _saved_transforms(model) if _is_pretrained(model) else []
    if not transforms:
        return {name: (name, ()) for name in shapes}
    from transformers.core_model_loading import WeightRenaming

    transforms = transforms[::-1]  # reverted in the opposite order
    renamings = [t.reverse_transform() for t in transforms if isinstance(t, WeightRenaming)]
    fusions = [_Fusion(t) for t in transforms if not isinstance(t, WeightRenaming)]
    layout = {}
    for name in shapes:
        parts = next((p for p in (f.parts(model, name, shapes[name]) for f in fusions) if p is not None), [(name, ())])
        layout.update((_renamed(stored, renamings), (name, index)) for stored, index in parts)
    return layout


def _renamed(name: str, renamings: list) -> str:
    for renaming in renamings:
        name = renaming.rename_source_key(name)[0]
    return name


def _with_prefix(name: str, names: Collection[str], prefix: str) -> str | None:
    """``name``, or it with the ``base_model_prefix`` stripped or added, whichever is among ``names``; else None."""
    if name in names:
        return name
    if prefix:
        for prefixed in (name.removeprefix(prefix + "."), f"{prefix}.{name}"):
            if prefixed in names:
                return prefixed
    return None


def checkpoint_parts(
    model: nn.Module, tensors: Mapping[str, torch.Tensor], view: PeftView | None
) -> Callable[[str], tuple[str, Index] | None]:
    """A function giving, for a checkpoint tensor that transformers fuses into one of the model's parameters on load
    (an expert's projection: ``experts.3.up_proj.weight`` of ``experts.gate_up_proj``), that parameter's state-dict
    name (among ``tensors``, by name) and the index of its part; None for any other tensor (see
    :func:`checkpoint_names`). A PEFT model's (``view``) fused parameters are its base model's, matched through its
    wrapping."""
    if view is not None:
        to_model = {view.base_name(name): name for name in tensors}
        to_model.pop(None, None)
        base_part = _hf_parts(view.base, {base: tensors[name] for base, name in to_model.items()})

        def peft_part(key: str) -> tuple[str, Index] | None:
            found = base_part(key)
            return None if found is None else (to_model.get(found[0], found[0]), found[1])

        return peft_part
    return _hf_parts(model, tensors)


def _hf_parts(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> Callable[[str], tuple[str, Index] | None]:
    """:func:`checkpoint_parts` of a model that is not a PEFT model."""
    if not _is_pretrained(model):
        return lambda key: None
    renamings, conversions = _weight_transforms(model)
    fusions = [f for f in map(_Fusion, conversions) if f.supported]
    prefix = model.base_model_prefix

    def part(key: str) -> tuple[str, Index] | None:
        name = _renamed(key, renamings)
        for fusion in fusions:
            found = fusion.part(name)
            if found is None:
                continue
            fused, source, expert = found
            fused = _with_prefix(fused, tensors, prefix)
            if fused is None or expert >= tensors[fused].shape[0]:
                return key, ()  # unexpected
            return fused, fusion.index(tensors[fused].shape, source, expert)
        return None

    return part


def checkpoint_names(model: nn.Module, names: Collection[str], view: PeftView | None) -> Callable[[str], str | None]:
    """A function giving the model's state-dict name for a checkpoint tensor's name: see :func:`_hf_names`. A PEFT
    model (``view``) is matched through its wrapping: its base model's checkpoint (``X.weight``) fills
    ``base_model.model.X.base_layer.weight``, and its adapter's (``adapter_model.safetensors``, names without
    the adapter's: ``...lora_A.weight``) the active adapter (``...lora_A.default.weight``)."""
    if view is None:
        return _hf_names(model, names)
    adapter = view.adapter_names()
    to_model = {view.base_name(name): name for name in names}
    to_model.pop(None, None)
    base_names = _hf_names(view.base, to_model.keys())

    def model_name(key: str) -> str | None:
        if key in adapter:
            return adapter[key]
        name = base_names(key)
        return None if name is None else to_model.get(name, name)

    return model_name


def _hf_names(model: nn.Module, names: Collection[str]) -> Callable[[str], str | None]:
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
        name = _renamed(key, renamings)
        for conversion in conversions:
            if conversion.rename_source_key(name)[1] is not None:
                raise ValueError(
                    f"checkpoint tensor {key!r} is converted by transformers ({_describe(conversion)}), which "
                    "checkpoint= cannot do one tensor at a time: write a checkpoint with the model's own state-dict"
                    " names (e.g. nvoffload.checkpoint.SafetensorsWriter)"
                )
        found = _with_prefix(name, names, prefix)
        if found is not None:
            return found
        return None if ignored is not None and ignored.search(key) else name

    return model_name


class _Checkpoints:
    """Several checkpoints read as one (a base model's and a PEFT adapter's): each name from the one that holds it."""

    def __init__(self, readers):
        self._where = {}
        for reader in readers:
            for name in reader.keys():
                if self._where.setdefault(name, reader) is not reader:
                    raise ValueError(f"checkpoint tensor {name!r} is in two of the checkpoints given: give it once")

    def keys(self):
        return self._where.keys()

    def info(self, name: str):
        return self._where[name].info(name)

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._where[name].read(name, out)


class CheckpointSources:
    """The checkpoint tensors that fill each parameter and buffer of a model built on the meta device, its names
    matched as transformers matches them (:func:`checkpoint_names`): one tensor whole, or a fused expert
    parameter's parts (:func:`checkpoint_parts`). Checked when made, before anything is read: a missing or
    unexpected tensor raises ``KeyError``, a shape mismatch ``ValueError``.

    Attributes:
        reader: the checkpoint; a list of them (a base model's and a PEFT adapter's) read as one, each name from
            the one that holds it.
        of: each tensor's parts to read, ``(checkpoint name, index)``, by tensor (a parameter replaced by a new
            object is found under the new one once the filler moves its entry).
    """

    def __init__(self, model: nn.Module, checkpoint, view: PeftView | None):
        self.reader = _Checkpoints(checkpoint) if isinstance(checkpoint, (list, tuple)) else checkpoint
        self.of = _match(model, self.reader, view)


def _match(model: nn.Module, ckpt, view: PeftView | None) -> dict[torch.Tensor, list[tuple[str, Index]]]:
    """:attr:`CheckpointSources.of`, checked."""
    tensors = state_tensors(model)
    first_names: dict[torch.Tensor, str] = {}
    for name, t in tensors.items():
        if isinstance(t, nn.Parameter) and not t.is_meta:
            raise ValueError(
                f"checkpoint= fills a model built on the meta device, but {name} is on {t.device}: "
                "build the model under `with torch.device('meta'):` or call load_state_dict() instead"
            )
        first_names.setdefault(t, name)
    model_name = checkpoint_names(model, tensors.keys(), view)
    part_of = checkpoint_parts(model, tensors, view)
    sources: dict[torch.Tensor, list[tuple[str, Index]]] = {}
    unexpected = []
    for key in ckpt.keys():
        name, index = part_of(key) or (model_name(key), ())
        if name is None:  # a tensor the model ignores
            continue
        t = tensors.get(name)
        if t is None:
            unexpected.append(key)
            continue
        if not t.is_meta or repr(index) in map(repr, (i for _, i in sources.get(t, ()))):
            continue  # a buffer the model computed itself, or a tie (or part) read already
        shape, part = tuple(ckpt.info(key).shape), tuple(t[index].shape)
        if shape != part:
            raise ValueError(
                f"checkpoint tensor {key!r} has shape {shape}, the model's {name}{list(index) if index else ''}"
                f" has {part}"
            )
        sources.setdefault(t, []).append((key, index))
    adapters = view.adapters if view is not None else set()  # PEFT initializes them
    missing = [
        name if t not in sources else f"{name} (parts of it)"
        for t, name in first_names.items()
        if t.is_meta and t not in adapters
        and (t not in sources or sum(t[i].numel() for _, i in sources[t]) < t.numel())
    ]
    if missing or unexpected:
        peft = (
            f" (matched through PEFT's wrapping: the base model's {view.base_name(missing[0])!r} fills "
            f"{missing[0]!r}; give the base model's checkpoint)" if view is not None and missing else ""
        )  # fmt: skip
        raise KeyError(
            "the checkpoint does not match the model: "
            + "; ".join(
                f"{what} {', '.join(names[:5])}{', ...' if len(names) > 5 else ''}"
                for what, names in (("missing", missing), ("unexpected", unexpected))
                if names
            )
            + peft
        )
    return sources
