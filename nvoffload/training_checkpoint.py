"""Training checkpoints: everything a run needs to go on, saved together and atomically, resumed bit for bit.

>>> nvoffload.save_training_checkpoint("ckpt", step=step, model=model, optimizer=optimizer,
...     scheduler=scheduler, extra={"data": loader_state})                          # doctest: +SKIP
>>> done = nvoffload.load_training_checkpoint("ckpt", model=model, optimizer=optimizer,
...     scheduler=scheduler)   # the latest complete one                            # doctest: +SKIP

One checkpoint is a directory ``<directory>/checkpoint-<step>/`` holding:

- ``model/``: the weights as a Hugging Face model directory
  (:func:`nvoffload.pretrained.save_pretrained`: safetensors shards, and
  ``config.json`` for a ``transformers`` model; the same files, their data at
  4 KiB); with an :class:`~nvoffload.optim.OffloadOptimizer` in one process
  written by the native I/O threads (O_DIRECT, each block's CRC-32C computed
  as it goes out; a streamed model's blocks from the streamer's host cache or
  store), else one tensor at a time;
- ``optimizer.safetensors`` (or ``optimizer-00001-of-0000N.safetensors``):
  the optimizer's per-element state in fp32, named ``<parameter index>.<key>``
  (``exp_avg``, ``exp_avg_sq``, ``master_param`` of 16-bit parameters, ...),
  streamed from the NVMe store one chunk at a time (an
  :class:`~nvoffload.optim.OffloadOptimizer`'s: in one process, read from every
  swap directory and written by the native I/O threads, O_DIRECT, each block's
  CRC-32C computed as it goes out) or taken from its ``state_dict()`` (any
  other torch optimizer);
- ``trainer_state.pt``: the small rest: the optimizer's hyperparameters and
  scalar state (and its loss scale; a compact state's ``state_precision``, so that
  it loads only into an optimizer of the same precision), the LR scheduler's and ``GradScaler``'s
  state dicts, the RNG states (torch's CPU and CUDA generators, Python's
  ``random``, numpy's when imported) and the caller's ``extra`` (e.g. the
  position in the data);
- ``checkpoint.json``, the manifest, written last: the step, every file's
  size, and the CRC-32C of every tensor and of ``trainer_state.pt``, verified
  as the checkpoint is loaded.

Atomic as a whole: everything is written into a hidden sibling directory,
fsynced, and renamed to ``checkpoint-<step>`` only when complete, so a crash
(or ``kill -9``) at any moment leaves the previous checkpoints intact and at
most a hidden partial directory, which the next run on the directory removes. Only the last
``keep_last`` complete checkpoints are kept.

:func:`start_training_checkpoint` writes one while training goes on: the call holds the step's weights (a
streamed model's blocks in the streamer's host cache or store, the rest copied) and optimizer state (its generation
pinned in the store), a thread of its own writes them through the I/O engine and renames the directory; the checkpoint is the state of that step exactly (:func:`save_training_checkpoint` of such an
optimizer is that, waited for).

One run writes to a directory at a time: a save holds the directory's lock (the swap directories' lock,
:mod:`nvoffload.io.ownership`) while it writes, and :func:`claim_checkpoint_directory` holds it for a whole
run; a directory another live run holds is refused. A write error (a full disk) names its file. Loading a
directory of checkpoints takes the newest one that loads, warning about the damaged ones it skipped.

Nothing is gathered in memory beyond one tensor of the model (on its device)
and one chunk of the optimizer state (in the optimizer's own host buffers).
Resuming gives bit-identical training to a run that was never interrupted,
also with another ``cpu_memory_bytes``, as long as the optimizer's chunks
keep their size (``max_grad_norm`` sums per-chunk norms; chunks are whole
parameters up to 16 MiB of fp32 unless the budget cuts them smaller).
"""

from __future__ import annotations

import errno
import functools
import io
import json
import math
import os
import random
import re
import shutil
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import BinaryIO

import torch
from torch import nn

from nvoffload.checkpoint import (
    CheckpointError,
    CheckpointReader,
    SafetensorsWriter,
    open_checkpoint,
)
from nvoffload.checkpoint_writer import BackgroundCheckpoint, EngineWriter, reached
from nvoffload.core.atomic import fsync_path, naming, new_sibling, put_in_place
from nvoffload.core.buffers import ALIGNMENT_BYTES, aligned_empty
from nvoffload.core.future import Future
from nvoffload.distributed import Ranks, RankTimeoutError
from nvoffload.io.checksum import crc32c
from nvoffload.io.ownership import claim
from nvoffload.optim.offload import OffloadOptimizer
from nvoffload.pretrained import ModelFiles, save_pretrained, saved_tensors, shard_files

__all__ = [
    "DEFAULT_BYTES_IN_FLIGHT",
    "DEFAULT_MAX_SHARD_BYTES",
    "BackgroundCheckpoint",
    "TrainingCheckpoint",
    "check_checkpoint_directory",
    "claim_checkpoint_directory",
    "latest_training_checkpoint",
    "load_training_checkpoint",
    "save_training_checkpoint",
    "start_training_checkpoint",
    "verify_training_checkpoint",
]

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # per optimizer state file (the model's shards: save_pretrained's 50 GB)
DEFAULT_BYTES_IN_FLIGHT = 256 << 20  # a background checkpoint's host buffers (chunks read ahead, written behind)
MANIFEST = "checkpoint.json"
STATE_FILE = "trainer_state.pt"
_FORMAT = "nvoffload-training-checkpoint"
_VERSION = 1
_NAME = re.compile(r"checkpoint-(\d+)")
_TENSOR = "__safetensors__"  # in trainer_state.pt, {_TENSOR: name} stands for a tensor of the optimizer files
_PIECES = "__pieces__"  # {_PIECES: [[name, lo, hi], ...], "shape": s}: a tensor saved in flat pieces by the ranks


@dataclass(frozen=True)
class TrainingCheckpoint:
    """A complete checkpoint: its directory, the step it was saved at and the caller's ``extra``."""

    path: str
    step: int
    extra: dict = field(default_factory=dict)


def check_checkpoint_directory(directory: str | os.PathLike) -> str:
    """Check, before any training and creating nothing, that checkpoints can be written in ``directory`` (or,
    when it does not exist yet, that it can be created: a directory can be made in its nearest existing parent);
    returns its absolute path. Raises OSError (naming the directory) when they cannot."""
    root = os.path.abspath(os.fspath(directory))
    missing = _missing(root)
    existing = os.path.dirname(missing[-1]) if missing else root
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(errno.ENOTDIR, f"{existing} is not a directory")
        os.rmdir(new_sibling(os.path.join(existing, "checkpoint"), "probe"))
    except OSError as exc:
        raise type(exc)(exc.errno, f"cannot write training checkpoints in {root}: {exc.strerror}") from None
    return root


def claim_checkpoint_directory(directory: str | os.PathLike) -> Callable[[], None]:
    """Take ``directory`` (created if needed) for this run until the release returned is called: its lock
    (:mod:`nvoffload.io.ownership`, as a swap directory's) refuses other live runs; a killed run's lock is taken
    over, and what its saves left (hidden partial checkpoints, and old ones being deleted) is removed, with a
    warning. The saves of the process that holds it go on (they take the lock again). The release removes the
    directories the claim created if nothing was saved in them (a run refused later leaves nothing).

    Raises:
        SwapDirectoryInUse: another live run holds it (``errno.EBUSY``; the message names the lock to delete
            if that run is gone).
        OSError: it cannot be written (naming it).
    """
    root = check_checkpoint_directory(directory)
    created = _missing(root)
    os.makedirs(root, exist_ok=True)
    unlock = claim(root, "checkpoint directory")

    def release() -> None:
        unlock()
        for made in created:
            try:
                os.rmdir(made)
            except OSError:  # not empty (a checkpoint was saved), or already gone
                return
    left = _remove_partial(root)
    if left:
        warnings.warn(
            f"{root}: removed {len(left)} partial checkpoint(s) left by a run killed while saving or deleting one:"
            f" {', '.join(left)}",
            stacklevel=2,
        )
    return release


def _missing(path: str) -> list[str]:
    """``path`` and those of its parents that do not exist, deepest first."""
    missing = []
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def latest_training_checkpoint(directory: str | os.PathLike) -> TrainingCheckpoint | None:
    """The complete checkpoint of ``directory`` with the highest step (None when there is none)."""
    found = _complete(os.fspath(directory))
    if not found:
        return None
    step, path = found[-1]
    return TrainingCheckpoint(path, step, {})


def save_training_checkpoint(
    directory: str | os.PathLike,
    *,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler=None,
    grad_scaler: torch.amp.GradScaler | None = None,
    extra: dict | None = None,
    keep_last: int | None = 2,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> TrainingCheckpoint:
    """Save ``<directory>/checkpoint-<step>`` atomically (see the module docs); call it after ``optimizer.step()``.

    Args:
        directory: where checkpoints go (created if needed).
        step: the optimizer steps done (the name of the checkpoint; saving a step again replaces it).
        model: the model, streamed by :func:`nvoffload.initialize` or not.
        optimizer: an :class:`~nvoffload.optim.OffloadOptimizer` (its state streamed from NVMe) or any torch
            optimizer.
        scheduler: an LR scheduler (anything with ``state_dict``/``load_state_dict``).
        grad_scaler: a ``torch.amp.GradScaler``.
        extra: saved with the checkpoint and given back by :func:`load_training_checkpoint`: tensors,
            numbers, strings, lists, tuples and dicts (e.g. the data loader's position).
        keep_last: how many complete checkpoints to keep (the oldest are removed once this one is in
            place); None keeps all.
        max_shard_bytes: the largest optimizer state file, in bytes.

    Raises:
        RuntimeError: updates of a step are still queued (save after ``step()``, not between micro-batches).
        OSError: the directory cannot be written, or an I/O error (nothing is left behind, and the
            checkpoints already there are untouched); the optimizer's errors while reading its state.
    """
    _check_save(step, keep_last, max_shard_bytes, optimizer)
    ranks = _ranks_of(optimizer)
    if isinstance(optimizer, OffloadOptimizer) and ranks is None:  # through the I/O engine, as in the background
        return start_training_checkpoint(
            directory, step=step, model=model, optimizer=optimizer, scheduler=scheduler, grad_scaler=grad_scaler,
            extra=extra, keep_last=keep_last, max_shard_bytes=max_shard_bytes,
        ).wait()  # fmt: skip
    lead = ranks is None or ranks.rank == 0  # writes the model, the state file and the manifest
    release = None
    try:
        with _Together(ranks, "saving the training checkpoint"):
            if lead:
                release = claim_checkpoint_directory(directory)  # released at the end
                root = os.path.abspath(os.fspath(directory))
                target = os.path.join(root, f"checkpoint-{step}")
                tmp = new_sibling(target, "tmp")
        root, target, tmp = _share(ranks, (root, target, tmp) if lead else None)
        try:
            with _Together(ranks, "saving the training checkpoint"):
                tensors: dict[str, dict[str, int]] = {}  # file -> tensor -> CRC-32C
                _land(optimizer)
                if lead:
                    model_checksums: dict[str, dict[str, int]] = {}
                    save_pretrained(
                        model, os.path.join(tmp, "model"), read=_weights(optimizer, write=False), checksums=model_checksums
                    )  # fmt: skip
                    tensors.update({f"model/{name}": crcs for name, crcs in model_checksums.items()})
                skeleton, files = _save_optimizer(optimizer, tmp, max_shard_bytes, ranks)
                tensors.update(files)
            every = _gather(ranks, (tensors, skeleton, _rng_state()))
            with _Together(ranks, "saving the training checkpoint"):
                if lead:
                    tensors = {f: crcs for t, _, _ in every for f, crcs in t.items()}
                    state = _trainer_state(
                        _merge_pieces([sk for _, sk, _ in every]), scheduler, grad_scaler, [rng for _, _, rng in every],
                        extra,
                    )  # fmt: skip
                    _finish(tmp, target, step, len(every), tensors, functools.partial(torch.save, state))
        except BaseException:
            if lead:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        if lead and keep_last is not None:
            _prune(root, keep_last, target)
        return TrainingCheckpoint(target, step, extra if extra is not None else {})
    finally:
        if release is not None:
            release()


def _check_save(step, keep_last, max_shard_bytes, optimizer: torch.optim.Optimizer) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be a positive int or None, got {keep_last!r}")
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    _check_between_steps(optimizer, "save")


_writing: dict[str, BackgroundCheckpoint] = {}  # checkpoint directory -> its background checkpoint being written


def start_training_checkpoint(
    directory: str | os.PathLike,
    *,
    step: int,
    model: nn.Module,
    optimizer: OffloadOptimizer,
    scheduler=None,
    grad_scaler: torch.amp.GradScaler | None = None,
    extra: dict | None = None,
    keep_last: int | None = 2,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    max_bytes_in_flight: int = DEFAULT_BYTES_IN_FLIGHT,
) -> BackgroundCheckpoint:
    """Start saving ``<directory>/checkpoint-<step>`` (the same files as :func:`save_training_checkpoint`,
    atomic as a whole) and return while its weights and optimizer state are written: training goes on beside it,
    and the checkpoint holds the state of this step exactly. ``wait()`` on the :class:`BackgroundCheckpoint` returned
    gives the :class:`TrainingCheckpoint` (or raises what failed it); wait for it before closing the optimizer.

    Training waits here (after ``optimizer.step()``) only while the step's weights and state are held, nothing
    written: a streamed model's blocks that the streamer's store does not have yet stay in its host cache
    (:meth:`StreamedWeights.snapshot`: the next step's updates of such a block, and the cache's eviction of it,
    wait until the writer has written it, which it does first), the other blocks' store entries are pinned; the
    tensors outside the blocks (all of a model that is not streamed) are copied into host memory, outside the
    budgets until written; the store's generation of each chunk of state is pinned
    (:meth:`OffloadOptimizer.snapshot_state`; the next steps' commits leave it on NVMe, one more generation at
    most, so no step waits for the copy; the resident state's rows copied in host memory, outside the optimizer's
    budget until written). A thread of its own then writes the weights and copies the state to the checkpoint
    through the native I/O threads (O_DIRECT, CRC-32C on the I/O threads; every swap directory read at once),
    ``max_bytes_in_flight`` bytes of host buffers at most (besides the weights held), writes ``trainer_state.pt``
    (captured now) and the manifest, and renames the directory into place. A new
    checkpoint of the same directory waits for the last one first (``NVOFFLOAD_WAIT_LIMIT_S`` at most).

    An :class:`~nvoffload.optim.OffloadOptimizer` in one process only (any other: :func:`save_training_checkpoint`).

    Raises:
        ValueError: another optimizer, or the bad arguments :func:`save_training_checkpoint` refuses.
        RuntimeError, OSError: as :func:`save_training_checkpoint`, here for what is done before it returns;
            the writer's errors raise from ``wait()``, leaving nothing behind and the other checkpoints intact.
    """
    _check_save(step, keep_last, max_shard_bytes, optimizer)
    if not isinstance(optimizer, OffloadOptimizer) or optimizer.ranks is not None:
        raise ValueError("background checkpoints need an OffloadOptimizer in one process: use save_training_checkpoint")
    if isinstance(max_bytes_in_flight, bool) or not isinstance(max_bytes_in_flight, int) or max_bytes_in_flight < 1:
        raise ValueError(f"max_bytes_in_flight must be a positive int, got {max_bytes_in_flight!r}")
    root = os.path.abspath(os.fspath(directory))
    previous = _writing.pop(root, None)
    if previous is not None:  # back-pressure: one checkpoint of a directory at a time (its errors are its holder's)
        previous.exception()
    release = claim_checkpoint_directory(root)
    target = os.path.join(root, f"checkpoint-{step}")
    tmp = new_sibling(target, "tmp")
    writers: dict[str, SafetensorsWriter] = {}
    weights = snapshot = None
    try:
        _land(optimizer)
        weights = _HeldWeights(model, optimizer, os.path.join(tmp, "model"))
        layout = optimizer.state_layout()
        skeleton, tensors, name_of, _ = _named_state(optimizer, layout, None)
        writers, writer_of = _open_shards(tmp, tensors, max_shard_bytes, "optimizer")
        state = io.BytesIO()
        torch.save(_trainer_state(skeleton, scheduler, grad_scaler, [_rng_state()], extra), state)
        snapshot = optimizer.snapshot_state(layout)
    except BaseException:
        if weights is not None:
            weights.abort()
        for w in writers.values():
            w.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        release()
        raise
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    copy = _Copy(weights, snapshot, writers, writer_of, name_of, max_bytes_in_flight, nbytes)

    def write() -> TrainingCheckpoint:
        try:
            files = copy.run()
            _finish(tmp, target, step, 1, files, lambda f: f.write(state.getbuffer()))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            release()
            raise
        try:
            if keep_last is not None:
                _prune(root, keep_last, target)
        finally:
            release()
        return TrainingCheckpoint(target, step, extra if extra is not None else {})

    job = _writing[root] = BackgroundCheckpoint(step, write, weights.nbytes + nbytes)
    return job


class _HeldWeights:
    """A background checkpoint's model: the files :func:`save_pretrained` writes, opened in ``directory`` (the
    small ones written), and the weights of this step held for the checkpoint's thread to write: a streamed
    model's blocks where they are (:meth:`StreamedWeights.snapshot`: in the host cache, their writers waiting,
    or pinned in the store), the other tensors copied into host memory (the parameters outside the blocks, the
    buffers; all of a model that is not streamed)."""

    def __init__(self, model: nn.Module, optimizer: OffloadOptimizer, directory: str):
        self.files = ModelFiles(model)
        os.makedirs(directory)
        self.files.save_rest(directory)
        self.writers: dict[str, SafetensorsWriter] = {}
        self.names: dict[torch.Tensor, list[str]] = {}  # the model's tensor -> the names it is written under
        for name, saved in self.files.tensors.items():
            self.names.setdefault(saved.tensor, []).append(name)
        session = getattr(optimizer, "session", None)
        streamed = [t for t in self.names if session is not None and session.streamer.weights.holds(t)]
        self.snapshot = session.streamer.weights.snapshot(streamed) if streamed else None
        streamed = set(streamed)
        try:
            for filename in self.files.shards:
                self.writers[filename] = self.files.open(directory, filename)
            self.copies = {t: _host_copy(t) for t in self.names if t not in streamed}
        except BaseException:
            self.abort()
            raise
        self.nbytes = sum(_nbytes(saved) for saved in self.files.tensors.values())

    def write(self, engine: EngineWriter, max_bytes_in_flight: int) -> dict[str, dict[str, int]]:
        """Write every tensor through ``engine`` (``reached("weights")`` half-way) and close the files; returns
        ``{file: {tensor: CRC-32C}}`` (relative to the checkpoint). What was held is let go."""
        writer_of = {name: self.writers[f] for f, names in self.files.shards.items() for name in names}
        half = self.nbytes // 2

        def sink(tensor: torch.Tensor, weights: torch.Tensor) -> Future:
            futures = []
            for name in self.names[tensor]:
                before = engine.written_bytes
                futures.append(engine.write(writer_of[name], name, 0, self.files.tensors[name].of(weights).contiguous()))
                if before < half <= engine.written_bytes:
                    reached("weights")
            return Future.all_of(futures)

        if self.snapshot is not None:
            self.snapshot.stream(sink, max_bytes_in_flight=max_bytes_in_flight)
        Future.all_of([sink(t, copy) for t, copy in self.copies.items()]).result()
        self.copies = {}
        return {f"model/{f}": dict(w.checksums) for f, w in self.writers.items()}

    def close(self) -> None:
        """Every tensor written (the engine finished): put the files in place."""
        for w in self.writers.values():
            w.close()
        self.release()

    def abort(self) -> None:
        for w in self.writers.values():
            w.abort()
        self.release()

    def release(self) -> None:
        """Let go of the weights held. Idempotent."""
        self.copies = {}
        if self.snapshot is not None:
            self.snapshot.release()


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` in host memory of its own (4 KiB-aligned)."""
    copy = aligned_empty(tensor.numel() * tensor.element_size()).view(tensor.dtype).view(tensor.shape)
    with torch.no_grad():
        return copy.copy_(tensor.detach())


def _nbytes(saved) -> int:
    return math.prod(saved.shape) * saved.dtype.itemsize


class _Copy:
    """A background checkpoint's copy: the model's weights held into its files, then the optimizer state (the
    snapshot's chunks) into the state files, through the native I/O threads."""

    def __init__(
        self, weights: _HeldWeights, snapshot, writers: dict, writer_of: dict, name_of: dict[int, str],
        max_bytes_in_flight: int, nbytes: int,
    ):  # fmt: skip
        self._weights, self._snapshot, self._writers, self._writer_of = weights, snapshot, writers, writer_of
        self._name_of, self._max_bytes_in_flight, self._nbytes = name_of, max_bytes_in_flight, nbytes  # of the state

    def run(self) -> dict[str, dict[str, int]]:
        """Copy everything; returns ``{file: {tensor: CRC-32C}}``. The weights and the snapshot are released and
        the files closed (complete) or removed (on an error)."""
        engine = EngineWriter()
        half = self._nbytes // 2

        def sink(placeholder: torch.Tensor, elements: slice, values: torch.Tensor) -> Future:
            name = self._name_of[id(placeholder)]
            before = engine.written_bytes
            future = engine.write(self._writer_of[name], name, elements.start, values)
            if before < self._weights.nbytes + half <= engine.written_bytes:
                reached("state")
            return future

        try:
            reached("copy")
            files = self._weights.write(engine, self._max_bytes_in_flight)
            self._snapshot.stream(sink, max_bytes_in_flight=self._max_bytes_in_flight)
            engine.finish()
            self._weights.close()
            for w in self._writers.values():
                w.close()
        except BaseException:
            engine.close()
            self._weights.abort()
            for w in self._writers.values():
                w.abort()
            raise
        finally:
            self._weights.release()
            self._snapshot.release()
        return {**files, **{f: dict(w.checksums) for f, w in self._writers.items()}}


def _trainer_state(optimizer_state: dict, scheduler, grad_scaler, rng_of_ranks: list, extra: dict | None) -> dict:
    """What ``trainer_state.pt`` holds."""
    return {
        "optimizer": optimizer_state,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "grad_scaler": grad_scaler.state_dict() if grad_scaler is not None else None,
        "rng": rng_of_ranks[0],
        "rng_of_ranks": rng_of_ranks,
        "extra": extra if extra is not None else {},
    }


def _finish(
    tmp: str, target: str, step: int, world_size: int, tensors: dict, put_state: Callable[[BinaryIO], object]
) -> None:
    """Write the trainer state (``put_state(file)``) and the manifest into ``tmp`` (every other file written),
    fsync it and rename it to ``target``."""
    state_path = os.path.join(tmp, STATE_FILE)
    _write(state_path, put_state)
    manifest = {
        "format": _FORMAT,
        "version": _VERSION,
        "step": step,
        "world_size": world_size,
        "files": _sizes(tmp),
        "tensors": tensors,
        "trainer_state_crc32c": _file_crc32c(state_path),
    }
    text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    reached("manifest")
    _write(os.path.join(tmp, MANIFEST), lambda f: f.write(text.encode()))
    fsync_path(tmp)
    put_in_place(tmp, target)


def _prune(root: str, keep_last: int, keep: str) -> None:
    """Remove the complete checkpoints of ``root`` but the last ``keep_last``, and never ``keep``."""
    for _, old in _complete(root)[:-keep_last]:
        if old != keep:
            _remove(old)


def _remove(checkpoint: str) -> None:
    """Remove a checkpoint as a whole: renamed to a hidden name first (atomic), then deleted, so that a crash
    while deleting leaves a hidden directory the next save removes, never a half-deleted checkpoint."""
    hidden = new_sibling(checkpoint, "old")
    os.rename(checkpoint, hidden)  # onto the empty directory just made
    fsync_path(os.path.dirname(checkpoint))
    shutil.rmtree(hidden, ignore_errors=True)


def load_training_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler=None,
    grad_scaler: torch.amp.GradScaler | None = None,
    restore_rng: bool = True,
    keep_last: int | None = None,
) -> TrainingCheckpoint:
    """Load a checkpoint into ``model``, ``optimizer``, ``scheduler`` and ``grad_scaler`` (and the RNGs).

    ``path`` is one checkpoint (``checkpoint-<step>``) or a directory of them: the newest complete one that
    loads is loaded, with a warning naming each newer one skipped and why (a damaged file, or one that does
    not fit). The objects must be built as for the run that saved it (the same model, parameter groups and
    kinds of scheduler and scaler); the budgets may differ. Every tensor's CRC-32C is checked as it is read.
    Call it before training, or between steps.

    Args:
        keep_last: with a directory, remove its complete checkpoints but the last ``keep_last`` (never the
            one loaded) once one is loaded, as a save does: a resume that has no step left to do leaves the
            directory as its last save would have.

    Returns:
        The checkpoint loaded: its path, step and ``extra``.

    Raises:
        FileNotFoundError: no complete checkpoint at ``path``.
        CheckpointError: a file is missing, truncated or corrupt (a checksum mismatch), or the checkpoint
            does not fit the model or optimizer (with a directory: none of its checkpoints loads; the error
            names each and why). The model and optimizer may then be partly loaded: load another checkpoint
            (the one before) into them.
    """
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be a positive int or None, got {keep_last!r}")
    _check_between_steps(optimizer, "load")
    ranks = _ranks_of(optimizer)
    objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "grad_scaler": grad_scaler}
    path = os.path.abspath(os.fspath(path))
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return _load(path, objects, ranks, restore_rng)
    candidates = [ckpt_dir for _, ckpt_dir in reversed(_complete(path))]
    if not candidates:
        raise _not_found(path)
    skipped = []  # "<checkpoint>: <why>", newest first
    for ckpt_dir in candidates:
        try:
            done = _load(ckpt_dir, objects, ranks, restore_rng)
        except Exception as exc:
            if not _damaged(exc, ranks):
                raise
            skipped.append(f"{ckpt_dir}: {exc}")
            continue
        if skipped:
            warnings.warn("".join(f"skipped {why}; " for why in skipped) + f"loaded {ckpt_dir}", stacklevel=2)
        if keep_last is not None and (ranks is None or ranks.rank == 0):
            release = claim_checkpoint_directory(path)
            try:
                _prune(path, keep_last, ckpt_dir)
            finally:
                release()
        return done
    raise CheckpointError(path, f"no checkpoint in it loads: {'; '.join(skipped)}")


def _damaged(error: Exception, ranks: Ranks | None) -> bool:
    """Whether a checkpoint failed to load for what its files hold (on every rank where it failed: the ranks
    agree, so that they all go on to the one before, or all raise)."""
    mine = isinstance(error, (CheckpointError, _FailedOnAnotherRank))
    return mine if ranks is None else all(_gather(ranks, mine))


def _load(ckpt_dir: str, objects: dict, ranks: Ranks | None, restore_rng: bool) -> TrainingCheckpoint:
    """Load the checkpoint ``ckpt_dir`` into ``objects`` (see :func:`load_training_checkpoint`)."""
    model, optimizer = objects["model"], objects["optimizer"]
    _land(optimizer)  # before the model is loaded: landing writes the model's weights
    with _Together(ranks, "loading the training checkpoint"):
        ckpt_dir, manifest, state_path = _open(ckpt_dir)
        state = torch.load(state_path, weights_only=True)
    if ranks is not None:
        ranks.same(int(manifest["step"]), "the step of the training checkpoint each rank found")
    with _Together(ranks, "loading the training checkpoint"):
        checks = _Checks(ckpt_dir, manifest["tensors"])
        _load_model(model, optimizer, os.path.join(ckpt_dir, "model"), checks)
        _load_optimizer(optimizer, state["optimizer"], ckpt_dir, manifest["tensors"], checks)
        for what in ("scheduler", "grad_scaler"):
            if objects[what] is None:
                continue
            if state[what] is None:
                raise CheckpointError(ckpt_dir, f"the checkpoint has no {what} state, but a {what} was given")
            objects[what].load_state_dict(state[what])
    if restore_rng:
        of_ranks = state.get("rng_of_ranks", [])
        same_ranks = ranks is not None and len(of_ranks) == ranks.world_size
        _set_rng_state(of_ranks[ranks.rank] if same_ranks else state["rng"])
    return TrainingCheckpoint(ckpt_dir, int(manifest["step"]), state["extra"])


def verify_training_checkpoint(path: str | os.PathLike) -> TrainingCheckpoint:
    """Check a checkpoint (or the latest complete one of a directory) without loading it anywhere: the manifest,
    every file's size and every tensor's CRC-32C, one tensor in memory at a time.

    Raises:
        FileNotFoundError: no complete checkpoint at ``path``.
        CheckpointError: what is missing, truncated or corrupt.
    """
    ckpt_dir, manifest, state_path = _open(path)
    checks = _Checks(ckpt_dir, manifest["tensors"])
    for rel, crcs in manifest["tensors"].items():
        with CheckpointReader([os.path.join(ckpt_dir, rel)]) as reader:
            if set(reader.keys()) != set(crcs):
                raise CheckpointError(os.path.join(ckpt_dir, rel), "holds other tensors than the manifest names")
            for name in crcs:
                checks.verified(reader.file_of(name), name, reader.read(name))
    extra = torch.load(state_path, weights_only=True)["extra"]
    return TrainingCheckpoint(ckpt_dir, int(manifest["step"]), extra)


# -- the optimizer ---------------------------------------------------------------


def _save_optimizer(
    optimizer: torch.optim.Optimizer, tmp: str, max_shard_bytes: int, ranks: Ranks | None
) -> tuple[dict, dict[str, dict[str, int]]]:
    """Write the optimizer's per-element state to safetensors files in ``tmp``; returns its state dict with each
    such tensor replaced by ``{_TENSOR: name}`` (over several ranks: ``{_PIECES: [[name, lo, hi]], "shape": ...}``,
    this rank's piece: the flat elements ``[lo, hi)`` it owns), and ``{file: {tensor: CRC-32C}}``."""
    streamed = isinstance(optimizer, OffloadOptimizer)
    state_dict = optimizer.state_layout() if streamed else optimizer.state_dict()
    skeleton, tensors, name_of, first = _named_state(optimizer, state_dict, ranks)
    stem = "optimizer" if ranks is None else f"optimizer-rank{ranks.rank:05d}-of-{ranks.world_size:05d}"
    writers, writer_of = _open_shards(tmp, tensors, max_shard_bytes, stem)
    try:
        if streamed:

            def sink(placeholder: torch.Tensor, elements: slice, values: torch.Tensor) -> None:
                name = name_of[id(placeholder)]
                writer_of[name].write_slice(name, elements.start - first.get(id(placeholder), 0), values)

            optimizer.stream_state(state_dict, sink)
        else:
            for name, t in tensors.items():
                writer_of[name].write(name, t)
        for w in writers.values():
            w.close()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    return skeleton, {f: dict(w.checksums) for f, w in writers.items()}


def _named_state(
    optimizer: torch.optim.Optimizer, state_dict: dict, ranks: Ranks | None
) -> tuple[dict, dict[str, torch.Tensor], dict[int, str], dict[int, int]]:
    """``state_dict``'s skeleton (each per-element tensor replaced by its name, see :func:`_save_optimizer`), the
    tensors to write by name, the name of each state tensor (by id) and, over several ranks, its piece's first
    element (by id)."""
    tensors: dict[str, torch.Tensor] = {}  # name -> tensor (meta: streamed)
    name_of: dict[int, str] = {}  # id(state tensor) -> the name it is written under
    first: dict[int, int] = {}  # id(state tensor) -> its piece's first element (over several ranks)
    skeleton = {**state_dict, "state": {}}  # new dicts: a torch optimizer's state_dict shares its live state's
    for idx, st in state_dict["state"].items():
        skeleton["state"][idx] = entry = dict(st)
        for key, value in st.items():
            if not (isinstance(value, torch.Tensor) and value.numel() > 1):
                continue
            if ranks is None:
                name = f"{idx}.{key}"
                tensors[name], name_of[id(value)] = value, name
                entry[key] = {_TENSOR: name}
                continue
            lo, hi = optimizer._sharding.owned(idx, value.numel())
            name = f"{idx}.{key}@{lo}"
            if hi > lo:
                tensors[name] = torch.empty(hi - lo, dtype=value.dtype, device="meta")
                name_of[id(value)], first[id(value)] = name, lo
            entry[key] = {_PIECES: [[name, lo, hi]] if hi > lo else [], "shape": list(value.shape)}
    return skeleton, tensors, name_of, first


def _open_shards(
    tmp: str, tensors: dict[str, torch.Tensor], max_shard_bytes: int, stem: str
) -> tuple[dict[str, SafetensorsWriter], dict[str, SafetensorsWriter]]:
    """A writer for each optimizer state file of ``tensors`` in ``tmp``, headers written: by file name, and by
    tensor name."""
    shards = shard_files({n: t.numel() * t.element_size() for n, t in tensors.items()}, max_shard_bytes, stem)
    writers: dict[str, SafetensorsWriter] = {}
    try:
        for filename, names in shards.items():
            info = {n: (tensors[n].dtype, tuple(tensors[n].shape)) for n in names}
            path = os.path.join(tmp, filename)
            writers[filename] = SafetensorsWriter(path, info, data_alignment_bytes=ALIGNMENT_BYTES)  # for O_DIRECT
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    return writers, {n: writers[f] for f, names in shards.items() for n in names}


def _merge_pieces(skeletons: list[dict]) -> dict:
    """The ranks' skeletons as one: each ``{_PIECES: ...}`` entry lists the pieces of every rank."""
    merged = skeletons[0]
    for other in skeletons[1:]:
        for idx, st in merged["state"].items():
            for key, value in st.items():
                if isinstance(value, dict) and _PIECES in value:
                    value[_PIECES] += other["state"][idx][key][_PIECES]
    return merged


def _with_placeholders(skeleton: dict, tensors: Mapping[str, torch.Tensor], pieces: dict) -> dict:
    """The state dict ``skeleton`` with its ``{_TENSOR: name}`` entries back as ``tensors[name]``, and its
    ``{_PIECES: ...}`` entries as meta tensors of their shape (``pieces`` maps their ids to the pieces)."""

    def value(v):
        if isinstance(v, dict) and _TENSOR in v:
            return tensors[v[_TENSOR]]
        if isinstance(v, dict) and _PIECES in v:
            placeholder = torch.empty(v["shape"], dtype=torch.float32, device="meta")
            pieces[id(placeholder)] = sorted(v[_PIECES], key=lambda piece: piece[1])
            return placeholder
        return v

    state = {idx: {k: value(v) for k, v in st.items()} for idx, st in skeleton["state"].items()}
    return {**skeleton, "state": state}


def _load_optimizer(
    optimizer: torch.optim.Optimizer, skeleton: dict, ckpt_dir: str, files: dict, checks: _Checks
) -> None:
    shards = [os.path.join(ckpt_dir, f) for f in files if f.startswith("optimizer")]
    if not shards:
        optimizer.load_state_dict(skeleton)
        return
    with CheckpointReader(shards) as reader:
        streamed = isinstance(optimizer, OffloadOptimizer)
        tensors = {}
        for name in reader.keys():
            info = reader.info(name)
            tensors[name] = torch.empty(info.shape, dtype=info.dtype, device="meta")
        pieces: dict[int, list] = {}  # id(placeholder) -> [[name, lo, hi], ...] (saved over several ranks)
        state_dict = _with_placeholders(skeleton, tensors, pieces)
        name_of = {id(t): n for n, t in tensors.items()}

        def source(tensor: torch.Tensor, elements: slice, out: torch.Tensor) -> None:
            """Fill ``out`` with ``elements`` of a saved tensor, from its file or from the pieces it was saved in."""
            if id(tensor) in name_of:
                name = name_of[id(tensor)]
                reader.read_slice(name, elements.start, out)
                checks.add(reader.file_of(name), name, out, elements.start)
                return
            covered = 0
            for name, lo, hi in pieces[id(tensor)]:
                start, stop = max(lo, elements.start), min(hi, elements.stop)
                if start < stop:
                    part = out[start - elements.start : stop - elements.start]
                    reader.read_slice(name, start - lo, part)
                    checks.add(reader.file_of(name), name, part, start - lo)
                    covered += stop - start
            if covered != elements.stop - elements.start:
                raise CheckpointError(
                    ckpt_dir, f"elements [{elements.start}, {elements.stop}) of a state tensor of shape"
                    f" {tuple(tensor.shape)} are not all in the pieces the ranks saved: the manifest is damaged",
                )  # fmt: skip

        if not streamed:  # a torch optimizer: whole tensors
            for st in state_dict["state"].values():
                for key, value in st.items():
                    if isinstance(value, torch.Tensor) and value.is_meta:
                        whole = torch.empty(value.shape, dtype=torch.float32)
                        source(value, slice(0, value.numel()), whole.view(-1))
                        st[key] = whole
            checks.finish(reader)
            optimizer.load_state_dict(state_dict)
            return
        optimizer.load_state_dict(state_dict, source=source)
        checks.finish(reader)


# -- the model -------------------------------------------------------------------


def _weights(optimizer: torch.optim.Optimizer, *, write: bool):
    """How to reach the model's weights: through the streamer of ``optimizer``'s session, or the tensors."""
    session = getattr(optimizer, "session", None)
    if session is None:
        return None
    return session.streamer.weights.writable if write else session.streamer.weights.current


def _load_model(model: nn.Module, optimizer: torch.optim.Optimizer, model_dir: str, checks: _Checks) -> None:
    expected = saved_tensors(model)
    writable = _weights(optimizer, write=True)
    with open_checkpoint(model_dir) as reader:
        missing = sorted(set(expected) - set(reader.keys()))
        unexpected = sorted(set(reader.keys()) - set(expected))
        if missing or unexpected:
            raise CheckpointError(
                model_dir, f"does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        for name, t in expected.items():
            info = reader.info(name)
            if info.dtype != t.dtype or info.shape != tuple(t.shape):
                raise CheckpointError(
                    model_dir, f"holds {info.dtype} {info.shape}, the model {t.dtype} {tuple(t.shape)}", name
                )
            weights = checks.verified(reader.file_of(name), name, reader.read(name))
            with torch.no_grad():
                if writable is None:
                    t.of(t.tensor.detach()).copy_(weights)
                else:
                    with writable(t.tensor) as target:
                        t.of(target).copy_(weights)


# -- integrity -------------------------------------------------------------------


class _Checks:
    """CRC-32C of the tensors read against the manifest's: tensors read whole, or in parts."""

    def __init__(self, ckpt_dir: str, expected: dict[str, dict[str, int]]):
        self._dir = ckpt_dir
        self._expected = expected  # file (relative to the checkpoint) -> tensor -> CRC-32C
        # (file, tensor) -> (CRC-32C of the elements read from the start, the next element), None: read out
        # of order (a rank's share of a tensor saved by another partition: checked by reading it whole)
        self._running: dict[tuple[str, str], tuple[int, int] | None] = {}

    def verified(self, path: str, name: str, data: torch.Tensor) -> torch.Tensor:
        """``data``, all of tensor ``name`` of the file ``path``, once its checksum is found right."""
        self._check((os.path.relpath(path, self._dir), name), crc32c(data.contiguous()))
        return data

    def add(self, path: str, name: str, part: torch.Tensor, start: int) -> None:
        """Elements ``[start, start + part.numel())`` of tensor ``name`` of ``path``, checked at :meth:`finish`."""
        key = (os.path.relpath(path, self._dir), name)
        running = self._running.get(key, (0, 0))
        if running is not None:
            crc, at = running
            self._running[key] = (crc32c(part.contiguous(), crc), start + part.numel()) if start == at else None

    def finish(self, reader: CheckpointReader) -> None:
        """Check every tensor read in parts: from the parts when they covered it in order, else read whole."""
        for key, running in self._running.items():
            rel, name = key
            if running is not None and running[1] == math.prod(reader.info(name).shape):
                self._check(key, running[0])
            else:
                self.verified(os.path.join(self._dir, rel), name, reader.read(name))
        self._running.clear()

    def _check(self, key: tuple[str, str], crc: int) -> None:
        rel, name = key
        expected = self._expected.get(rel, {}).get(name)
        path = os.path.join(self._dir, rel)
        if expected is None:
            raise CheckpointError(path, "the manifest has no checksum for the tensor", name)
        if crc != expected:
            raise CheckpointError(
                path, f"checksum mismatch (crc32c {crc:#010x}, the manifest says {expected:#010x}): the file"
                " changed after it was written; load the checkpoint before this one", name,
            )  # fmt: skip


def _file_crc32c(path: str) -> int:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(16 << 20):
            crc = crc32c(torch.frombuffer(bytearray(chunk), dtype=torch.uint8), crc)
    return crc


# -- the directory ---------------------------------------------------------------


def _complete(root: str) -> list[tuple[int, str]]:
    """``(step, path)`` of the complete checkpoints in ``root`` (those with a manifest), by step."""
    try:
        entries = os.listdir(root)
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        match = _NAME.fullmatch(entry)
        if match and os.path.isfile(os.path.join(root, entry, MANIFEST)):
            found.append((int(match.group(1)), os.path.join(root, entry)))
    return sorted(found)


def _remove_partial(root: str) -> list[str]:
    """Remove what saves killed before their end left: hidden ``.checkpoint-<step>.<what>-<random>`` directories
    (a checkpoint being written, or an old one being deleted); returns their names."""
    left = sorted(e for e in os.listdir(root) if e.startswith(".checkpoint-") and os.path.isdir(os.path.join(root, e)))
    for entry in left:
        shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
    return left


def _open(path: str | os.PathLike) -> tuple[str, dict, str]:
    """The checkpoint at ``path`` (or the latest in it), its checked manifest and its verified state file."""
    ckpt_dir = _resolve(os.fspath(path))
    manifest = _read_manifest(ckpt_dir)
    state_path = os.path.join(ckpt_dir, STATE_FILE)
    if _file_crc32c(state_path) != manifest["trainer_state_crc32c"]:
        raise CheckpointError(state_path, "checksum mismatch: the file changed after it was written")
    return ckpt_dir, manifest, state_path


def _resolve(path: str) -> str:
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return os.path.abspath(path)
    latest = latest_training_checkpoint(path)
    if latest is None:
        raise _not_found(path)
    return latest.path


def _not_found(path: str) -> FileNotFoundError:
    return FileNotFoundError(f"no complete training checkpoint at {path} (no {MANIFEST} in it or in a checkpoint-<step> in it)")


def _read_manifest(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(path, f"cannot read the manifest: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        raise CheckpointError(path, f"not an nvoffload training checkpoint manifest (format {_FORMAT!r})")
    if manifest.get("version") != _VERSION:
        raise CheckpointError(path, f"version {manifest.get('version')!r}; this nvoffload reads version {_VERSION}")
    for rel, size in manifest["files"].items():
        file = os.path.join(ckpt_dir, rel)
        actual = os.path.getsize(file) if os.path.isfile(file) else None
        if actual != size:
            raise CheckpointError(file, f"{'missing' if actual is None else f'{actual} bytes'}: the manifest says {size} bytes")
    return manifest


def _sizes(directory: str) -> dict[str, int]:
    """Every file under ``directory`` (relative path -> bytes), fsynced."""
    sizes = {}
    for parent, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(parent, name)
            fsync_path(path)
            sizes[os.path.relpath(path, directory)] = os.path.getsize(path)
        fsync_path(parent)
    return dict(sorted(sizes.items()))


def _write(path: str, put: Callable[[BinaryIO], object]) -> None:
    """Create the file ``path`` with ``put(file)`` and fsync it; an OSError (a full disk) names it."""
    with naming(path), open(path, "wb") as f:
        put(f)
        f.flush()
        os.fsync(f.fileno())


# -- the ranks -------------------------------------------------------------------


def _ranks_of(optimizer: torch.optim.Optimizer) -> Ranks | None:
    """The ranks ``optimizer`` shares its state with (None: one process)."""
    return optimizer.ranks if isinstance(optimizer, OffloadOptimizer) else None


class _FailedOnAnotherRank(RuntimeError):
    """What the ranks of a :class:`_Together` stretch that did not fail raise: names the failed ranks' errors."""


class _Together:
    """A stretch of a checkpoint's save or load that fails on every rank when it fails on one (a no-op in one
    process): the failed rank raises its error, the others a :class:`_FailedOnAnotherRank` naming it."""

    def __init__(self, ranks: Ranks | None, what: str):
        self._ranks, self._what = ranks, what

    def __enter__(self) -> _Together:
        return self

    def __exit__(self, kind, error, tb) -> bool:
        if self._ranks is not None and (error is None or isinstance(error, Exception)):
            try:
                self._ranks.agree(error, self._what)
            except RuntimeError as exc:
                if exc is error or isinstance(exc, RankTimeoutError):
                    raise
                raise _FailedOnAnotherRank(*exc.args) from None
        return False


def _share(ranks: Ranks | None, value):
    """Rank 0's ``value`` on every rank."""
    return value if ranks is None else ranks.broadcast_object(value, "sharing the checkpoint's directory")


def _gather(ranks: Ranks | None, value) -> list:
    """Every rank's ``value``, in rank order."""
    return [value] if ranks is None else ranks.gather_objects(value, "gathering the checkpoint's parts")


# -- the rest of the run ---------------------------------------------------------


def _check_between_steps(optimizer: torch.optim.Optimizer, what: str) -> None:
    if isinstance(optimizer, OffloadOptimizer) and optimizer.step_in_progress:
        raise RuntimeError(
            f"cannot {what} a training checkpoint while a step's updates are queued: call it after optimizer.step()"
            " (not between backward and step(), nor between micro-batches)"
        )


def _land(optimizer: torch.optim.Optimizer) -> None:
    """Land an :class:`OffloadOptimizer`'s delayed update in flight (``delayed_update``): the model and the state
    saved, or loaded over, are then those of the same step."""
    if isinstance(optimizer, OffloadOptimizer):
        optimizer.synchronize()


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (kind, keys.tolist(), pos, has_gauss, gauss)
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np = sys.modules.get("numpy")
    if "numpy" in state and np is not None:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
