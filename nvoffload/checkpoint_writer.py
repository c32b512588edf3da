"""Checkpoint files written by the I/O engine's native threads, and the thread that writes a checkpoint while
training goes on.

:class:`EngineWriter` moves the bytes of :class:`~nvoffload.checkpoint.SafetensorsWriter` files' tensors
through an :class:`~nvoffload.io.IOEngine`: each part's 4 KiB-aligned middle by the native threads with
O_DIRECT, its CRC-32C computed by them as the blocks go out; the unaligned edges (under 4 KiB at each end)
put together in the pages they share, and written by them too. :class:`BackgroundCheckpoint` is a checkpoint
being written by a thread of its own (:func:`nvoffload.start_training_checkpoint`).

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
from nvoffload.core.buffers import ALIGNMENT_BYTES, aligned_empty, byte_view, round_up
from nvoffload.core.future import WAIT_LIMIT_S, Future
from nvoffload.core.workers import Worker
from nvoffload.io.checksum import crc32c, crc32c_combine
from nvoffload.io.config import IOConfig
from nvoffload.io.engine import IOEngine, NativePart, OpenFile

__all__ = ["PHASES", "BackgroundCheckpoint", "EngineWriter", "hold_at", "reached"]

PHASES = ("copy", "weights", "state", "manifest")
"""Where a background checkpoint can be held: ``copy``, on its thread before anything is written; ``weights``, half
of the model's weights written; ``state``, half of the optimizer state written; ``manifest``, every file but the
manifest written (the directory not yet renamed into place)."""

_held: dict[str, threading.Event] = {}


class EngineWriter:
    """Writes parts of the tensors of safetensors files through the native I/O threads, O_DIRECT only; each
    file made by :class:`SafetensorsWriter` with ``data_alignment_bytes=ALIGNMENT_BYTES`` (which wrote its
    header and checks that every tensor is written). ``written_bytes`` counts.

    A part's 4 KiB-aligned middle goes out from its own memory, its CRC-32C computed by the I/O threads; its
    unaligned edges (under 4 KiB at each end, where it meets another part) are copied into the page they share
    (:class:`_Pages`), written once every byte of it is there. No buffered write meets the O_DIRECT ones: on
    ext4 a buffered write takes the file's lock exclusively, waiting for every O_DIRECT write in flight."""

    def __init__(self, config: IOConfig | None = None):
        self._engine = IOEngine(config)
        self._files: dict[str, _Pages] = {}  # partial path -> its pages being put together (and the file)
        self.written_bytes = 0

    def write(self, writer: SafetensorsWriter, name: str, start: int, values: torch.Tensor) -> Future:
        """Write ``values`` (the tensor's dtype, contiguous, host memory, alive until the future is done) as its
        flat elements ``[start, ...)``; the future's completion counts them in ``writer`` with their CRC-32C
        (``writer.placed``): complete the futures of one tensor in order."""
        data = byte_view(values.contiguous())
        pages = self._pages(writer)
        offset = writer.data_offset(name) + start * values.element_size()
        lo = round_up(offset) - offset
        hi = max(lo, (offset + data.numel()) // ALIGNMENT_BYTES * ALIGNMENT_BYTES - offset)
        head, middle, tail = data[:lo], data[lo:hi], data[hi:]
        crcs = crc32c(head), crc32c(tail)
        parts = []
        if middle.numel():
            parts.append(self._engine.submit(pages.file, middle, offset + lo, write=True, checksum=True))
        written = pages.put(head, offset) + pages.put(tail, offset + hi)  # (the page's write, its buffer)
        self.written_bytes += data.numel()

        def finish(error: BaseException | None) -> None:
            if error is not None:
                raise error
            crc = crc32c_combine(crcs[0], parts[0].crc(), middle.numel()) if middle.numel() else crcs[0]
            writer.placed(name, start, values.numel(), crc32c_combine(crc, crcs[1], tail.numel()))

        return Future(
            parts + [part for part, _ in written], finish, what=f"{name} of {writer.partial_path}",
            keepalive=(values, [page for _, page in written]),
        )  # fmt: skip

    def _pages(self, writer: SafetensorsWriter) -> _Pages:
        path = writer.partial_path
        if path not in self._files:
            if writer.data_start % ALIGNMENT_BYTES:
                raise ValueError(
                    f"{path}: its data starts at byte {writer.data_start}; O_DIRECT writes need a multiple of"
                    f" {ALIGNMENT_BYTES} (SafetensorsWriter(..., data_alignment_bytes={ALIGNMENT_BYTES}))"
                )
            file = self._engine.open(path)
            self._files[path] = _Pages(self._engine, file, os.path.getsize(path))
            # its blocks allocated at once: O_DIRECT writes into holes convert extents
            self._engine.allocate(file, 0, os.path.getsize(path))
        return self._files[path]

    def finish(self) -> None:
        """Every part written (their futures done): wait for the writes, and leave each file whole (its last
        page, written whole, cut back to the file's size). Then :meth:`close`."""
        self._engine.close()
        for pages in self._files.values():
            pages.finish()
        self.close()

    def close(self) -> None:
        """Stop its threads (after the writes queued) and close the files it opened. Idempotent."""
        self._engine.close()
        for pages in self._files.values():
            self._engine.close_file(pages.file)
        self._files.clear()


class _Pages:
    """The 4 KiB pages of one file that parts share (a tensor's tail and the next one's head), each put together
    in host memory from the parts' edges and written by the I/O threads once every byte of it (up to the file's
    end) is there."""

    def __init__(self, engine: IOEngine, file: OpenFile, end: int):
        self._engine, self.file, self._end = engine, file, end
        self._filling: dict[int, list] = {}  # page offset -> [its 4 KiB buffer, bytes not there yet]
        self._past_end = False  # the last page went out whole, past the file's end

    def put(self, data: torch.Tensor, offset: int) -> list[tuple[NativePart, torch.Tensor]]:
        """Place ``data`` (bytes, within one page) at ``offset``; the page's write (and its buffer, alive until
        it is done) when this completed it."""
        if not data.numel():
            return []
        page = offset // ALIGNMENT_BYTES * ALIGNMENT_BYTES
        if page not in self._filling:
            self._filling[page] = [aligned_empty(ALIGNMENT_BYTES).zero_(), min(ALIGNMENT_BYTES, self._end - page)]
        entry = self._filling[page]
        entry[0][offset - page : offset - page + data.numel()].copy_(data)
        entry[1] -= data.numel()
        if entry[1]:
            return []
        del self._filling[page]
        self._past_end |= page + ALIGNMENT_BYTES > self._end
        return [(self._engine.submit(self.file, entry[0], page, write=True), entry[0])]

    def finish(self) -> None:
        """The writes done: check every page went out, and cut the file back to its size."""
        if self._filling:
            raise RuntimeError(f"{self.file.path}: the pages at {sorted(self._filling)[:3]} were never completed")
        if self._past_end:
            with naming(self.file.path):
                os.truncate(self.file.path, self._end)


class BackgroundCheckpoint:
    """A checkpoint written by a thread of its own while training goes on: :meth:`wait` for it (its errors raise
    there), :meth:`done` to look. ``nbytes``: the bytes of the tensors it writes (the weights and the optimizer state);
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
        # Sent to this thread, which takes it on its way out of the call and stops first: sent to the process,
        # the signal may go to another thread (the training thread, asleep), and this one would go on writing
        # until that one is scheduled and stops the rest (seen on a loaded machine: the checkpoint put in place).
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


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
