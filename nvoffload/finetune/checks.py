"""What a ``finetune`` run checks before it creates anything: paths it will write, the model's files, the memory
of a micro-batch and the swap space, and host allocations named by the budgets that asked for them."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn

from nvoffload.checkpoint import open_checkpoint
from nvoffload.finetune.config import _DTYPES, FinetuneConfig, _host_memory_bytes
from nvoffload.io.store import swap_directories
from nvoffload.models import GPT
from nvoffload.planner.calibrate import host_available_bytes
from nvoffload.planner.cost import ModelShape, PlanRequest, human_size, swap_bytes
from nvoffload.pretrained import (
    check_save_directory,
    saved_tensors,
)


def _rank() -> tuple[int, int]:
    """``(rank, world size)`` of the default process group; ``(0, 1)`` without one."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


@contextlib.contextmanager
def _host_budgets_named(config: FinetuneConfig):
    """An allocation the host refuses (``OSError(ENOMEM)``, no more than "Cannot allocate memory") raised again
    naming the budgets asked and the memory this machine has available."""
    try:
        yield
    except OSError as exc:
        if exc.errno != errno.ENOMEM:
            raise
        asked = [("cpu_memory_bytes", config.cpu_memory_bytes)]
        if config.offload_activations and config.activation_memory_bytes is not None:
            asked.append(("activation_memory_bytes", config.activation_memory_bytes))
        if config.activation_host_bytes:
            asked.append(("activation_host_bytes", config.activation_host_bytes))
        named = " and ".join(f"{name} {n} ({human_size(n)})" for name, n in asked)
        free = host_available_bytes()
        raise OSError(errno.ENOMEM, f"cannot allocate the host memory asked, {named}: {free} ({human_size(free)}) of this"
                      f" machine's {human_size(_host_memory_bytes())} is available") from None  # fmt: skip


@contextlib.contextmanager
def named_in_errors(field: str):
    """An OSError of the body (a directory that cannot be written) raised again led by ``field``, the option that gave
    the path."""
    try:
        yield
    except OSError as exc:
        raise type(exc)(exc.errno, f"{field}: {exc.strerror or exc}", exc.filename) from None


def _check_save_to(config: FinetuneConfig) -> None:
    """Raise (OSError) before any training when ``save_to`` cannot be written."""
    if config.save_to is None:
        return
    if config.model_dir is not None:
        with named_in_errors("save_to"):
            check_save_directory(config.save_to)
        return
    _check_writable(config.save_to, "save_to", "a safetensors file")


def _check_saveable(model: nn.Module, config: FinetuneConfig) -> None:
    """Raise ValueError, naming the field, before step 1 when the model cannot be written as ``save_to`` or
    ``checkpoint_dir`` will write it (a conversion of transformers that is not reverted one tensor at a time)."""
    field = "save_to" if config.save_to is not None else "checkpoint_dir" if config.checkpoint_dir is not None else None
    if field is not None:
        try:
            saved_tensors(model)
        except ValueError as exc:
            raise ValueError(f"{field}: {exc}") from None


def _check_writable(path: str, field: str, kind: str) -> None:
    """Raise OSError, naming ``field``, when the file ``path`` (``kind``) cannot be written: a directory is there, or
    its directory takes no new file (probed with a temporary file, removed)."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"{field}: {path} is a directory, not {kind}")
    directory = os.path.dirname(os.path.abspath(path))
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".nvoffload-probe-"):
            pass
    except OSError as exc:
        raise type(exc)(exc.errno, f"{field}: cannot write {path}: {exc.strerror} in {directory}") from None


def _check_init_from(config: FinetuneConfig) -> None:
    """Raise ValueError when ``init_from`` is damaged (:class:`~nvoffload.checkpoint.CheckpointError`) or holds
    tensors the preset's model lacks or shapes it differs in, before anything is built (what it lacks is named
    when it is loaded)."""
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in GPT(config.model_config).state_dict().items()}
    with open_checkpoint(config.init_from) as ckpt:
        found = {name: tuple(ckpt.info(name).shape) for name in ckpt.keys()}
    wrong = [f"{n} has shape {s} (the model's {shapes[n]})" for n, s in found.items() if shapes.get(n, s) != s]
    wrong += [f"{n} is not in the model" for n in found if n not in shapes]
    if wrong:
        more = f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""
        what = f"init_from: {config.init_from} does not fit the {config.preset!r} model"
        raise ValueError(f"{what}: {'; '.join(wrong[:3])}{more}")


def _model_shape(config: FinetuneConfig) -> ModelShape | None:
    """The model's sizes as the planner sees them; None for a Hugging Face configuration the planner does not know
    (its checks below are then skipped rather than guessed)."""
    if config.model_dir is None:
        return ModelShape.from_preset(config.preset)
    try:
        return ModelShape.from_hf_config(config.model_dir)
    except (ValueError, TypeError):
        return None


def _check_batch_memory(config: FinetuneConfig, shape: ModelShape, rows: int, seq_len: int, dev: torch.device) -> None:
    """Raise ValueError when one micro-batch (this rank's ``rows`` sequences) saves more for backward than ``dev``
    has free: half the planner's measure of what autograd saves in nvoffload's GPT blocks (a model that saves less
    is not refused), or with ``offload_activations`` twice the largest saved tensor. Logits, gradients and the rest
    come on top: a run it passes may still run out of memory; it refuses only what is far out of reach."""
    dtype_bytes = _DTYPES[config.dtype].itemsize
    if config.offload_activations:
        need = 2 * rows * seq_len * max(shape.ffn, shape.d_model) * dtype_bytes
    else:
        need = shape.activation_bytes(rows, seq_len, dtype_bytes) // 2
    free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else host_available_bytes()
    if need > free:
        raise ValueError(
            f"batch_size {config.batch_size}: a micro-batch of {rows} x {seq_len} tokens saves at least {need} bytes"
            f" ({human_size(need)}) for backward, more than the {free} ({human_size(free)}) free on {dev}: lower batch_size or"
            f" seq_len{'' if config.offload_activations else ', or set offload_activations'}"
        )


def _check_swap_space(config: FinetuneConfig, shape: ModelShape | None, seq_len: int, swap_dir: str) -> None:
    """Raise OSError before anything is written when ``swap_dir`` is missing, not a writable directory, or has too
    little free space for what this rank keeps there: :func:`~nvoffload.planner.cost.swap_bytes`, the planner's
    count (the optimizer state in its ``state_precision``, two generations of it; streamed, the weights, and with
    the delayed update their twins and the kept gradients; with ``offload_activations`` a micro-batch's
    activations; with a stash, the block inputs beyond its host memory), with no state counted as resident in host
    memory: the most the store can hold."""
    if shape is None:
        swap_directories([swap_dir])
        return
    space = swap_bytes(_swap_request(config, shape, seq_len), stream=config.stream, offload=config.offload_activations,
                       stash_host_bytes=config.stash_host_bytes)  # fmt: skip
    swap_directories([swap_dir], needed_bytes=space.total, what=space.parts())


def _swap_request(config: FinetuneConfig, shape: ModelShape, seq_len: int) -> PlanRequest:
    """The planner's request for this run's step (on this many ranks). LoRA targets the planner cannot place (a
    family whose module names it does not know) count as full training: every parameter's state, more than
    the adapters'."""
    fields = dict(
        batch_size=config.batch_size, seq_len=seq_len, grad_accum_steps=config.grad_accum_steps, dtype=config.dtype,
        cpu_memory_bytes=config.cpu_memory_bytes, device_memory_bytes=config.device_memory_bytes, stream=config.stream,
        activations="offload" if config.offload_activations else "keep", max_grad_norm=config.max_grad_norm is not None,
        ranks=_rank()[1], vertical=config.vertical, state_precision=config.state_precision,
        delayed_update=config.delayed_update,
    )  # fmt: skip
    try:
        return PlanRequest(shape, **fields, lora_rank=config.lora_rank, lora_targets=config.lora_targets)
    except ValueError:
        if config.lora_rank is None:
            raise
        return PlanRequest(shape, **fields)
