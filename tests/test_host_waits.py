"""Host waits on device work wake when the work ends and stay bounded (``device.bounded_wait``): a short poll, then
a blocking wait on a helper thread (a CUDA event made with ``blocking=True``), not sleeps backing off to 1 ms."""

from __future__ import annotations

import threading

import pytest
import torch

from nvoffload.device import SPIN_S, bounded_wait, compute_device


def gated():
    """``(query, block, go)``: work that ends when the test sets ``go``; ``block`` waits for it with no limit."""
    go, done = threading.Event(), threading.Event()

    def block():
        go.wait()
        done.set()

    return done.is_set, block, go


def test_a_wait_returns_when_the_blocking_wait_returns():
    query, block, go = gated()
    result = []
    waiter = threading.Thread(target=lambda: result.append(bounded_wait(query, block, 60.0)))
    waiter.start()
    assert waiter.is_alive() and not result  # it cannot return before the work ends
    go.set()
    waiter.join(60.0)
    assert result == [True]


def test_a_wait_is_bounded_and_a_done_one_does_not_block():
    query, block, go = gated()
    try:
        assert bounded_wait(query, block, SPIN_S / 10) is False  # gives up at its limit; the helper stays blocked
    finally:
        go.set()
    assert bounded_wait(lambda: True, lambda: pytest.fail("blocked on done work"), 60.0) is True


@pytest.mark.cuda
def test_a_cuda_event_wait_is_bounded_and_wakes_when_the_work_ends():
    device = compute_device("cuda")
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time at 2 GHz
    event = device.record()
    assert event.raw.query() is False
    assert event.synchronize(1e-3) is False  # bounded
    assert event.synchronize(60.0) is True and event.query()
