"""Where the time went: spans of every engine on their own tracks, written as Chrome trace-event JSON.

>>> with nvoffload.trace.tracing("step.json"):    # doctest: +SKIP
...     loss = model(x, y); loss.backward(); optimizer.step()

opens in https://ui.perfetto.dev (or ``chrome://tracing``) with one track per
kind of work:

- ``compute``: each streamed block's forward and backward (``forward 3``,
  ``backward 3``), and the waits for a block's weights (``wait 3``);
- ``h2d`` and ``d2h``: every copy between host and device memory, named by
  what it moves;
- ``nvme read`` and ``nvme write``: every request of the I/O engine, from the
  moment a native thread starts it to the moment the last of its blocks ends;
- ``adam``: every optimizer chunk update.

Times are ``time.monotonic_ns()`` (the native I/O threads read the same
clock). With CUDA, copies are timed by CUDA events on their streams, resolved
when the trace is written; compute spans are the host's, which on a GPU is
when the work was issued. Tracing costs a lock and a list append per span;
without an active trace every hook is one global read.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator

from nvoffload.core.atomic import replace_file

__all__ = ["TRACKS", "Trace", "active", "start", "stop", "tracing"]

TRACKS = ("compute", "h2d", "d2h", "nvme read", "nvme write", "adam")
_PID = 1


class Trace:
    """Spans by track; :meth:`write` saves them as trace-event JSON (``ph: "X"`` complete events, microseconds)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._spans: list[tuple[str, str, int, int, dict]] = []  # track, name, start ns, end ns, args
        self._pending: list[tuple[str, str, Callable[[], tuple[int, int] | None], dict]] = []
        self.start_ns = time.monotonic_ns()

    def add(self, track: str, name: str, start_ns: int, end_ns: int, **args) -> None:
        """One span of ``track`` (one of :data:`TRACKS`) from ``start_ns`` to ``end_ns`` (``time.monotonic_ns``).
        Work under way when the recording started (an update, a read ahead) is recorded from that moment on;
        work that ended before it is left out."""
        if end_ns < self.start_ns:
            return
        start_ns = max(start_ns, self.start_ns)
        with self._lock:
            self._spans.append((track, name, start_ns, max(end_ns, start_ns), args))

    def add_later(self, track: str, name: str, resolve: Callable[[], tuple[int, int] | None], **args) -> None:
        """A span whose times are known later (device events): ``resolve()`` gives them when the trace is read,
        or None to drop the span."""
        with self._lock:
            self._pending.append((track, name, resolve, args))

    @contextlib.contextmanager
    def span(self, track: str, name: str, **args) -> Iterator[None]:
        """Time the ``with`` body as one span."""
        start = time.monotonic_ns()
        try:
            yield
        finally:
            self.add(track, name, start, time.monotonic_ns(), **args)

    def spans(self) -> list[tuple[str, str, float, float, dict]]:
        """``(track, name, start_s, end_s, args)`` of every span, seconds from the trace's start, by start."""
        with self._lock:
            pending, self._pending = self._pending, []
        for track, name, resolve, args in pending:
            times = resolve()
            if times is not None:
                self.add(track, name, *times, **args)
        with self._lock:
            spans = sorted(self._spans, key=lambda s: s[2])
        return [(t, n, (a - self.start_ns) / 1e9, (b - self.start_ns) / 1e9, args) for t, n, a, b, args in spans]

    def events(self) -> list[dict]:
        """The trace events: a name for the process and each track, then one complete event per span."""
        spans = self.spans()
        tracks = list(TRACKS) + sorted({s[0] for s in spans} - set(TRACKS))
        tid = {track: i + 1 for i, track in enumerate(tracks)}
        events = [{"name": "process_name", "ph": "M", "pid": _PID, "tid": 0, "args": {"name": "nvoffload"}}]
        for track in tracks:
            events.append({"name": "thread_name", "ph": "M", "pid": _PID, "tid": tid[track], "args": {"name": track}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": _PID, "tid": tid[track], "args": {"sort_index": tid[track]}})
        for track, name, start_s, end_s, args in spans:
            event = {"name": name, "cat": track, "ph": "X", "pid": _PID, "tid": tid[track],
                     "ts": round(start_s * 1e6, 3), "dur": round((end_s - start_s) * 1e6, 3)}  # fmt: skip
            if args:
                event["args"] = args
            events.append(event)
        return events

    def write(self, path: str | os.PathLike) -> None:
        """Write the trace to ``path`` (JSON object format), atomically."""
        with replace_file(path, "w", encoding="utf-8") as f:
            json.dump({"traceEvents": self.events(), "displayTimeUnit": "ms"}, f)


_active: Trace | None = None


def active() -> Trace | None:
    """The trace being recorded, or None."""
    return _active


def start() -> Trace:
    """Start recording a :class:`Trace` of everything nvoffload does (traces do not nest)."""
    global _active
    if _active is not None:
        raise RuntimeError("a trace is already being recorded")
    _active = Trace()
    return _active


def stop(path: str | os.PathLike | None = None) -> Trace | None:
    """Stop recording; write the trace to ``path`` when given. Returns it (None when none was recorded)."""
    global _active
    recorded, _active = _active, None
    if recorded is not None and path is not None:
        recorded.write(path)
    return recorded


@contextlib.contextmanager
def tracing(path: str | os.PathLike | None = None) -> Iterator[Trace]:
    """:func:`start` and :func:`stop` around a ``with`` body (the trace is written to ``path`` also when it raises)."""
    recording = start()
    try:
        yield recording
    finally:
        stop(path)
