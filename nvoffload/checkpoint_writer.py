"""Checkpoint files written by the I/O engine's native threads, and the thread that writes a checkpoint while
training goes on.

:class:`EngineWriter` moves the bytes of :class:`~nvoffload.checkpoint.SafetensorsWriter` files' tensors
through an :class:`~nvoffload.io.IOEngine`: each part's 4 KiB-aligned middle by the native threads with
O_DIRECT, its CRC-32C computed by them as the blocks go out; the unaligned edges (under 4 KiB at each end)
by a buffered ``pwrite`` on the calling thread. :class:`BackgroundCheckpoint` is a checkpoint being written by a
thread of its own (:func:`nvoffload.start_training_checkpoint`).

Testing hooks name the phases of a background checkpoint (:data:`PHASES`): :func:`hold_at` holds the writer
there until released, and ``NVOFFLOAD_CHECKPOINT_STOP_AT=<phase>:<marker file>`` makes the process create the
marker and stop itself (SIGSTOP) there, for a test to kill it at that exact point.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import torch

from nvoffload.checkpoint import SafetensorsWriter
from nvoffload.core.atomic import naming
from nvoffload.core.buffers import ALIGNMENT_BYTES, byte_view, round_up
from nvoffload.core.future import WAIT_LIMIT_S, Future
from nvoffload.core.workers import Worker
from nvoffload.io.checksum import crc32c, crc32c_combine
from nvoffload.io.config import IOConfig
from nvoffload.io.engine import IOEngine, OpenFile

__all__ = ["PHASES", "BackgroundCheckpoint", "EngineWriter", "hold_at", "reached"]

PHASES = ("copy", "state", "manifest")
"""Where a background checkpoint can be held: ``copy``, on its thread before the optimizer state is read;
``state``, half of it written; ``manifest``, every file but the manifest written (the directory not yet renamed
into place)."""

_held: dict[str, threading.Event] = {}


class EngineWriter:
    """Writes parts of the tensors of safetensors files (made by :class:`SafetensorsWriter`, which wrote their
    header and checks that every tensor is written) through the native I/O threads; ``written_bytes`` counts."""

    def __init__(self, config: IOConfig | None = None):
        self._engine = IOEngine(config)
        self._files: dict[str, tuple[OpenFile, int]] = {}  # partial path -> (the engine's file, a buffered fd)
        self.written_bytes = 0

    def write(self, writer: SafetensorsWriter, name: str, start: int, values: torch.Tensor) -> Future:
        """Write ``values`` (the tensor's dtype, contiguous, host memory, alive until the future is done) as its
        flat elements ``[start, ...)``; the future's completion counts them in ``writer`` with their CRC-32C
        (``writer.placed``): complete the futures of one tensor in order."""
        data = byte_view(values.contiguous())
        path = writer.partial_path
        if path not in self._files:  # its blocks allocated at once: O_DIRECT writes into holes convert extents
            self._files[path] = (self._engine.open(path), os.open(path, os.O_WRONLY))
            self._engine.allocate(self._files[path][0], 0, os.path.getsize(path))
        file, fd = self._files[path]
        offset = writer.data_offset(name) + start * values.element_size()
        lo = round_up(offset) - offset
        hi = max(lo, (offset + data.numel()) // ALIGNMENT_BYTES * ALIGNMENT_BYTES - offset)
        head, middle, tail = data[:lo], data[lo:hi], data[hi:]
        with naming(path):
            _pwrite(fd, head, offset)
            _pwrite(fd, tail, offset + hi)
        crcs = crc32c(head), crc32c(tail)
        part = self._engine.submit(file, middle, offset + lo, write=True, checksum=True) if middle.numel() else None
        self.written_bytes += data.numel()

        def finish(error: BaseException | None) -> None:
            if error is not None:
                raise error
            crc = crc32c_combine(crcs[0], part.crc(), middle.numel()) if part is not None else crcs[0]
            writer.placed(name, start, values.numel(), crc32c_combine(crc, crcs[1], tail.numel()))

        return Future([part] if part is not None else [], finish, what=f"{name} of {path}", keepalive=values)

    def close(self) -> None:
        """Close the files it opened and stop its threads (after the writes queued). Idempotent."""
        for file, fd in self._files.values():
            self._engine.close_file(file)
            os.close(fd)
        self._files.clear()
        self._engine.close()


def _pwrite(fd: int, data: torch.Tensor, offset: int) -> None:
    view = memoryview(data.numpy()) if data.numel() else memoryview(b"")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


class BackgroundCheckpoint:
    """A checkpoint written by a thread of its own while training goes on: :meth:`wait` for it (its errors raise
    there), :meth:`done` to look. ``nbytes``: the bytes of the files it writes behind (the optimizer state's);
    ``started_s`` and ``ended_s`` (``time.monotonic``): when the thread got them and when it was done."""

    def __init__(self, step: int, write: Callable[[], object], nbytes: int):
        self.step, self.nbytes = step, nbytes
        self.started_s, self.ended_s = time.monotonic(), None
        self._result: Future | None = None
        self._done = threading.Event()
        self._worker = Worker(f"nvoffload-checkpoint-{step}", lambda _: self._run(write))
        self._worker.submit(None)
        self._worker.stop()

    def _run(self, write: Callable[[], object]) -> None:
        try:
            self._result = Future.completed(write())
        except BaseException as exc:  # raised from wait()
            self._result = Future.failed(exc)
        finally:
            self.ended_s = time.monotonic()
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None):
        """The checkpoint (a :class:`~nvoffload.TrainingCheckpoint`) once written; raises what failed it, or
        TimeoutError after ``timeout_s`` (default ``NVOFFLOAD_WAIT_LIMIT_S``) naming the step."""
        limit = WAIT_LIMIT_S if timeout_s is None else timeout_s
        if not self._done.wait(limit):
            raise TimeoutError(f"the background checkpoint of step {self.step} is still being written after {limit:g} s")
        return self._result.result()

    def exception(self, timeout_s: float | None = None) -> BaseException | None:
        """Wait as :meth:`wait`; return what failed it (None: it was written)."""
        try:
            self.wait(timeout_s)
        except TimeoutError:
            if not self.done():
                raise
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            return exc
        return None

    @property
    def seconds(self) -> float | None:
        """How long it took to write (None while it is written)."""
        return None if self.ended_s is None else self.ended_s - self.started_s


def reached(phase: str) -> None:
    """The background writer is at ``phase`` (:data:`PHASES`): hold or stop here when a test asked to."""
    event = _held.get(phase)
    if event is not None and not event.wait(WAIT_LIMIT_S):
        raise TimeoutError(f"a background checkpoint was held at {phase!r} for {WAIT_LIMIT_S:g} s")
    stop_at = os.environ.get("NVOFFLOAD_CHECKPOINT_STOP_AT", "")
    if stop_at.partition(":")[0] == phase:
        with open(stop_at.partition(":")[2], "w") as marker:
            marker.write(f"{os.getpid()}\n")
        os.kill(os.getpid(), signal.SIGSTOP)


@contextlib.contextmanager
def hold_at(phase: str) -> Iterator[threading.Event]:
    """Testing hook: background checkpoints wait at ``phase`` (:data:`PHASES`) until the event yielded is set
    (set on exit too)."""
    if phase not in PHASES:
        raise ValueError(f"no phase {phase!r}; the phases are {', '.join(PHASES)}")
    event = _held[phase] = threading.Event()
    try:
        yield event
    finally:
        event.set()
        del _held[phase]
