"""Hugging Face model directories written one tensor at a time, atomically.

:func:`save_pretrained` writes what ``transformers``' ``save_pretrained`` writes
for a causal LM: ``model.safetensors`` (or shards ``model-00001-of-0000N.safetensors``
and ``model.safetensors.index.json``), each file with the metadata
``{"format": "pt"}`` and its data at 4 KiB (the header padded with spaces, as
the format allows: a background checkpoint writes the same files with
O_DIRECT, :class:`ModelFiles`), ``config.json`` (its ``dtype`` and ``architectures`` set
as Hugging Face sets them) and ``generation_config.json`` when the model can
generate; ``AutoModelForCausalLM.from_pretrained`` opens the result. Unlike
``transformers``, it holds one tensor in memory at a time (a streamed model's
weights are read from the streamer's host cache, block by block:
``optimizer.session.save_pretrained(...)``), and it is atomic: everything is
written into a temporary sibling directory, fsynced, and only then put in
place of the target, so an error or a crash leaves the previous directory
intact and no partial one.

It needs no ``transformers`` import itself: the configuration is whatever the
model's ``config`` attribute saves. The other way, :func:`build_meta_model`
builds a ``transformers`` causal LM on the meta device,
for :func:`nvoffload.initialize` to fill from a model directory one block at a
time.

Example::

    from nvoffload.pretrained import save_pretrained

    save_pretrained(model, "out/tuned", max_shard_bytes=2 * 10**9)   # any nn.Module
    # a model streamed by nvoffload.initialize:
    optimizer.session.save_pretrained("out/tuned")

    # streaming a Hugging Face model directory (config.json + safetensors):
    model = build_meta_model(AutoConfig.from_pretrained("gpt2-dir"), dtype=torch.bfloat16)
    with open_checkpoint("gpt2-dir") as ckpt:
        model, optimizer = nvoffload.initialize(model, torch.optim.AdamW(model.parameters()), config, checkpoint=ckpt)
"""

from __future__ import annotations

import contextlib
import copy
import errno
import functools
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import NamedTuple

import torch
from torch import nn

from nvoffload.checkpoint import SafetensorsWriter
from nvoffload.core.atomic import fsync_path, new_sibling, put_in_place
from nvoffload.core.buffers import ALIGNMENT_BYTES
from nvoffload.streaming import Index, PeftView, state_tensors, stored_layout

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES", "ModelFiles", "SavedTensor", "build_meta_model", "check_save_directory", "save_pretrained",
    "saved_tensors",
]  # fmt: skip

DEFAULT_MAX_SHARD_BYTES = 50 * 10**9  # transformers' default max_shard_size ("50GB")
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"  # PEFT's adapter directory
ADAPTER_CONFIG_NAME = "adapter_config.json"
_MARKERS = ("config.json", WEIGHTS_NAME, INDEX_NAME, ADAPTER_CONFIG_NAME)  # a directory holding one may be replaced
_METADATA = {"format": "pt"}


def check_save_directory(path: str | os.PathLike) -> str:
    """Check that :func:`save_pretrained` can write ``path``, without writing it; returns its absolute path.

    ``path``'s parent must be an existing directory in which this process can
    create (and rename) directories; ``path`` itself must not exist, be an
    empty directory, or be a directory that already holds a saved model (a
    ``config.json``, ``model.safetensors`` or ``model.safetensors.index.json``),
    which will be replaced as a whole.

    Raises:
        FileNotFoundError: the parent directory does not exist.
        NotADirectoryError: ``path`` or its parent is not a directory.
        FileExistsError: ``path`` is a directory holding something other than a saved model.
        PermissionError (or another OSError): a directory cannot be created beside ``path``.
    """
    target = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(target)
    if not os.path.exists(parent):
        raise FileNotFoundError(errno.ENOENT, f"cannot save a model to {target}: the directory {parent} does not exist")
    if not os.path.isdir(parent):
        raise NotADirectoryError(errno.ENOTDIR, f"cannot save a model to {target}: {parent} is not a directory")
    if os.path.lexists(target):
        if not os.path.isdir(target) or os.path.islink(target):
            raise NotADirectoryError(
                errno.ENOTDIR, f"cannot save a model to {target}: it exists and is not a directory"
            )
        entries = os.listdir(target)
        if entries and not any(name in entries for name in _MARKERS):
            raise FileExistsError(
                errno.EEXIST,
                f"refusing to replace {target}: it is a non-empty directory that holds no saved model"
                f" (none of {', '.join(_MARKERS)})",
            )
    try:  # the real test: what save_pretrained does first
        os.rmdir(new_sibling(target, "probe"))
    except OSError as exc:
        raise type(exc)(
            exc.errno, f"cannot save a model to {target}: cannot create a directory in {parent} ({exc.strerror})"
        ) from None
    return target


class SavedTensor(NamedTuple):
    """A tensor :func:`save_pretrained` writes: the model's parameter or buffer ``tensor``, whole, or the part of it
    ``index`` selects (one expert's projection of a fused parameter, in the hub's layout)."""

    tensor: torch.Tensor
    index: Index = ()

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def shape(self) -> torch.Size:
        return torch.empty(self.tensor.shape, device="meta")[self.index].shape

    def of(self, weights: torch.Tensor) -> torch.Tensor:
        """This tensor's part of ``weights`` (the current weights of :attr:`tensor`), a view."""
        return weights[self.index]


def saved_tensors(model: nn.Module) -> dict[str, SavedTensor]:
    """The tensors :func:`save_pretrained` writes, by name, in order, without reading them.

    ``state_dict()``'s entries (parameters and persistent buffers) less the
    model's ``_keys_to_ignore_on_save`` and, of each tied parameter, every name
    but one, chosen as ``transformers`` chooses: the names matching the
    ``_tied_weights_keys`` of the model's modules (e.g. ``lm_head.weight``) are
    dropped while another name remains; a model without them keeps the first name.
    Under ``transformers`` 5, a model whose weights it converts on load is
    written back as it saves it (:func:`~nvoffload.streaming._hf_models.stored_layout`):
    a fused expert parameter (Qwen2-MoE's, Mixtral's ``experts.gate_up_proj``)
    as one tensor per expert and projection (``experts.N.gate_proj.weight``, ...).

    Raises:
        ValueError: ``transformers`` converts the model's weights in another
            way, which cannot be written back one tensor at a time.
    """
    tensors = state_tensors(model)
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        tensors.pop(key, None)
    names_of: dict[torch.Tensor, list[str]] = {}
    for name, t in tensors.items():
        names_of.setdefault(t, []).append(name)
    patterns = _tied_weight_patterns(model)
    dropped: set[str] = set()
    for names in names_of.values():
        if len(names) < 2:
            continue
        keep = [n for n in names if not any(re.search(p, n) for p in patterns)] or [max(names)]
        dropped.update(n for n in names if n != keep[0])
    kept = {name: t for name, t in tensors.items() if name not in dropped}
    layout = stored_layout(model, {name: t.shape for name, t in kept.items()})
    return {stored: SavedTensor(kept[name], index) for stored, (name, index) in layout.items()}


def _write_index(tmp: str, model: nn.Module, peft: PeftView | None, tensors: dict, shards: dict[str, list[str]]) -> None:
    """The index of a sharded model (``model.safetensors.index.json``): its parameters counted (the adapter's left
    out), its bytes, and each tensor's shard."""
    index = {
        "metadata": {
            "total_parameters": sum(p.numel() for p in model.parameters() if peft is None or p not in peft.adapters),
            "total_size": sum(_nbytes(t) for t in tensors.values()),
        },
        "weight_map": {name: filename for filename, names in shards.items() for name in names},
    }
    with open(os.path.join(tmp, INDEX_NAME), "w", encoding="utf-8") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


class ModelFiles:
    """What :func:`save_pretrained` writes for ``model``, planned before anything is written: ``tensors``, the
    tensors by name (:func:`saved_tensors`, a PEFT model's adapter, or with ``merged`` its base model's), ``shards``,
    each safetensors file's tensor names, and ``read`` (``read`` given, wrapped to merge a LoRA adapter with
    ``merged``). :meth:`open` makes a file's writer; :meth:`save_rest` writes the small files beside them. A
    background checkpoint fills the files through the I/O engine with this; :func:`save_pretrained` one tensor
    at a time.

    Raises:
        ValueError: ``max_shard_bytes`` is not a positive int, ``merged`` without a PEFT model, no tensors, or see
            :func:`saved_tensors`.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        read: Callable[[torch.Tensor], AbstractContextManager[torch.Tensor]] | None = None,
        merged: bool = False,
    ):
        if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
        self.read = read if read is not None else _as_is
        peft = PeftView.of(model)
        if merged and peft is None:
            raise ValueError(
                f"merged=True merges a PEFT model's adapter into its base model; this {type(model).__name__} has none"
            )
        self._configs = functools.partial(_save_configs, model)
        if peft is not None and not merged:  # the adapter, in the one file PEFT reads
            self.tensors = {name: SavedTensor(t) for name, t in peft.adapter_state().items()}
            self.shards, self._configs = {ADAPTER_WEIGHTS_NAME: list(self.tensors)}, peft.save_config
        else:
            if peft is not None:  # the base model's tensors under its own names, the adapter merged into them
                self.read, model = peft.merging(self.read), peft.base
                self._configs = functools.partial(_save_configs, peft.base)
                self.tensors = {
                    peft.base_name(peft.prefix + n): t for n, t in saved_tensors(model).items() if t.tensor not in peft.adapters
                }  # fmt: skip
            else:
                self.tensors = saved_tensors(model)
            self.shards = shard_files({name: _nbytes(t) for name, t in self.tensors.items()}, max_shard_bytes, "model")
        if not self.tensors:
            raise ValueError(f"{type(model).__name__} has no parameters or buffers to save")
        self._model, self._peft = model, peft

    def open(self, directory: str, filename: str) -> SafetensorsWriter:
        """The writer of ``filename`` (a key of ``shards``) in ``directory``, its header written; its data starts at
        4 KiB, so that the I/O engine can write the tensors with O_DIRECT
        (:class:`~nvoffload.checkpoint_writer.EngineWriter`)."""
        shapes = {name: (self.tensors[name].dtype, tuple(self.tensors[name].shape)) for name in self.shards[filename]}
        return SafetensorsWriter(
            os.path.join(directory, filename), shapes, _METADATA, data_alignment_bytes=ALIGNMENT_BYTES
        )  # fmt: skip

    def save_rest(self, directory: str) -> None:
        """The files beside the tensors' into ``directory``: a sharded model's index, ``config.json`` and
        ``generation_config.json`` (or a PEFT adapter's ``adapter_config.json``)."""
        if len(self.shards) > 1:
            _write_index(directory, self._model, self._peft, self.tensors, self.shards)
        self._configs(directory)


def save_pretrained(
    model: nn.Module,
    save_directory: str | os.PathLike,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    read: Callable[[torch.Tensor], AbstractContextManager[torch.Tensor]] | None = None,
    extra: Callable[[str], object] | None = None,
    checksums: dict[str, dict[str, int]] | None = None,
    merged: bool = False,
) -> list[str]:
    """Write ``model`` as a Hugging Face model directory, one tensor in memory at a time, atomically.

    A PEFT model (``peft.get_peft_model``) is written as PEFT writes its active adapter
    (``adapter_model.safetensors`` and ``adapter_config.json``, which ``PeftModel.from_pretrained``
    loads over the base model), or, with ``merged``, as its base model with the LoRA adapter merged
    into the weights (what ``merge_and_unload().save_pretrained`` writes).

    Args:
        model: any ``nn.Module``; a ``transformers`` model also gets its
            ``config.json`` (``dtype`` set to its parameters' dtype,
            ``architectures`` to its class) and ``generation_config.json``.
        save_directory: the directory to write. Its parent must exist; an
            existing directory is replaced as a whole, once the new one is
            complete, and only if it is empty or holds a saved model (see
            :func:`check_save_directory`).
        max_shard_bytes: the largest shard, in bytes; tensors are put in shards
            in ``state_dict()`` order as ``transformers`` does (a larger tensor
            gets a shard of its own). One shard is ``model.safetensors``;
            several are indexed by ``model.safetensors.index.json``.
        read: gives a tensor's current weights: called with each tensor of
            :func:`saved_tensors` (the model's own parameter or buffer), it
            returns a context manager yielding the weights, on any device,
            valid until it exits. Default: the tensor itself. A streamed model
            passes its streamer's ``weights.current``
            (which :meth:`nvoffload.OffloadSession.save_pretrained` does).
        extra: called with the temporary directory before it is put in place,
            to add files (e.g. ``tokenizer.save_pretrained``).
        checksums: filled, when given, with ``{file name: {tensor name: CRC-32C of its bytes}}``.
        merged: for a PEFT model, write the base model with the adapter merged instead of the adapter.

    Returns:
        The names of the files written, sorted.

    Raises:
        OSError: the target cannot be written (see :func:`check_save_directory`),
            or an I/O error; nothing is left behind and an existing directory is
            untouched. Any error of ``read`` or ``extra`` likewise.
        ValueError: ``max_shard_bytes`` is not a positive int, or see :func:`saved_tensors`.
    """
    files = ModelFiles(model, max_shard_bytes=max_shard_bytes, read=read, merged=merged)
    target = check_save_directory(save_directory)
    tmp = new_sibling(target, "tmp")
    try:
        for filename, names in files.shards.items():
            with files.open(tmp, filename) as writer:
                for name in names:
                    with files.read(files.tensors[name].tensor) as weights:
                        writer.write(name, files.tensors[name].of(weights))
            if checksums is not None:
                checksums[filename] = dict(writer.checksums)
        files.save_rest(tmp)
        if extra is not None:
            extra(tmp)
        written = sorted(os.listdir(tmp))
        for name in written:
            fsync_path(os.path.join(tmp, name))
        fsync_path(tmp)
        put_in_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return written


def build_meta_model(config, *, dtype: torch.dtype | None = None) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config)`` built on the meta device, in training mode.

    :func:`nvoffload.initialize` with ``checkpoint=open_checkpoint(model_dir)``
    then fills its parameters block by block and rebuilds its non-persistent
    buffers (rotary frequencies, ...) on the compute device. ``dtype``: the
    parameters' (default: the configuration's).

    Raises:
        ImportError: ``transformers`` is not installed (``pip install 'nvoffload[hf]'``).
    """
    transformers = import_transformers()
    kwargs = dtype_kwargs(transformers, dtype) if dtype is not None else {}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    return model.train()


def import_transformers():
    """The ``transformers`` module, imported on first use (the ``[hf]`` extra), or a clear ImportError."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(f"Hugging Face models need transformers ({exc}): pip install 'nvoffload[hf]'") from None
    return transformers


def dtype_kwargs(transformers, dtype: torch.dtype) -> dict:
    """``dtype=`` for ``from_config``/``from_pretrained`` (``torch_dtype=`` before transformers 4.56)."""
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dtype}


# -- what is written -------------------------------------------------------------


@contextlib.contextmanager
def _as_is(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    yield tensor.detach()


def _nbytes(t: torch.Tensor | SavedTensor) -> int:
    return math.prod(t.shape) * t.dtype.itemsize


def _tied_weight_patterns(model: nn.Module) -> list[str]:
    """The ``_tied_weights_keys`` of every module (a dict target -> source in transformers 5, a list before), full names."""
    patterns = []
    for prefix, module in model.named_modules():
        tied = getattr(module, "_tied_weights_keys", None) or ()
        keys = tied.keys() if isinstance(tied, Mapping) else tied
        patterns += [f"{prefix}.{k}" if prefix else k for k in keys]
    return patterns


def shard_files(nbytes: Mapping[str, int], max_shard_bytes: int, stem: str) -> dict[str, list[str]]:
    """File name -> tensor names, as ``huggingface_hub.split_torch_state_dict_into_shards`` splits: tensors (by
    name, with their sizes in bytes) in order, a new shard when the next would pass ``max_shard_bytes`` (a
    larger tensor gets a shard of its own); ``<stem>.safetensors`` when one shard holds all, else
    ``<stem>-00001-of-0000N.safetensors``, ..."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name, size in nbytes.items():
        if size > max_shard_bytes:
            shards.append([name])
            continue
        if current_bytes + size > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += size
    if current:
        shards.append(current)
    if len(shards) <= 1:
        return {f"{stem}.safetensors": shards[0] if shards else []}
    return {f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors": names for i, names in enumerate(shards, start=1)}


def _parameter_dtype(model: nn.Module) -> torch.dtype | None:
    """As ``PreTrainedModel.dtype``: the first floating-point parameter's dtype."""
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def _save_configs(model: nn.Module, directory: str) -> None:
    """``config.json`` (a copy with ``dtype`` and ``architectures`` set) and ``generation_config.json``, as transformers."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "save_pretrained", None)):
        return
    config = copy.deepcopy(config)
    dtype = _parameter_dtype(model)
    if dtype is not None:  # "torch_dtype" before transformers 4.56
        name = "torch_dtype" if "torch_dtype" in vars(config) and "dtype" not in vars(config) else "dtype"
        setattr(config, name, str(dtype).split(".")[1])
    config.architectures = [type(model).__name__]
    config.save_pretrained(directory)
    can_generate = getattr(model, "can_generate", None)
    generation = getattr(model, "generation_config", None)
    if callable(can_generate) and can_generate() and generation is not None:
        generation.save_pretrained(directory)
