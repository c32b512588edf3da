"""A stand-in copy stream held behind an event the test completes itself: a copy queued on it is in flight for as
long as the test says, whatever the machine's load (a copy that is merely slowed lands whenever the test's thread
is descheduled long enough)."""

from __future__ import annotations

import contextlib
import threading

import torch

from nvoffload.device import _SimEvent
from nvoffload.transfer import TransferEngine

FALLBACK_S = 60.0  # opens the held stream if the code under test waits for it (it fails then, instead of hanging)


@contextlib.contextmanager
def held_stream(engine: TransferEngine, direction: str = "h2d"):
    """Hold ``engine``'s host-to-device stream (or ``direction``'s): copies queued on it from now on run once the
    block ends, or once the fallback timer fired (then ``gate.query()`` is True)."""
    gate = _SimEvent()
    engine.device.copy_stream(direction).copy(torch.empty(1), torch.empty(1), gate, "the test's gate")
    timer = threading.Timer(FALLBACK_S, gate._complete)
    timer.start()
    try:
        yield gate
    finally:
        timer.cancel()
        gate._complete()
