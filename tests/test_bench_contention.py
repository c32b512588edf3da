"""bench/contention.py's overlap_floor: the arithmetic on hand-written probe figures."""

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def probe(compute_fraction: float, io_fraction: float) -> dict:
    return {"compute_fraction_with_io": compute_fraction, "io_fraction_with_compute": io_fraction}


@pytest.fixture
def contention(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("contention")


@pytest.mark.parametrize("compute_s, io_s", [(1.0, 1.0), (2.0, 1.0), (0.5, 1.0)])
def test_no_slowdown_overlaps_for_free(contention, compute_s, io_s):
    assert contention.overlap_floor(compute_s, io_s, probe(1.0, 1.0)) == pytest.approx(1.0)


def test_compute_halved_io_as_long_as_compute(contention):
    # 1 s of compute, 1 s of I/O at full speed: after 1 s the I/O is done and half
    # the compute is, whose other half then takes 0.5 s alone.
    assert contention.overlap_floor(1.0, 1.0, probe(0.5, 1.0)) == pytest.approx(1.5)


def test_both_halved_serialise(contention):
    assert contention.overlap_floor(1.0, 1.0, probe(0.5, 0.5)) == pytest.approx(2.0)


def test_io_left_over_runs_alone(contention):
    # compute 1 s at 0.8 speed ends at 1.25 s, having done 1.25 * 0.5 = 0.625 s of the
    # 1.5 s of I/O; the other 0.875 s run alone: 2.125 s against 1.5 s of I/O alone.
    assert contention.overlap_floor(1.0, 1.5, probe(0.8, 0.5)) == pytest.approx(2.125 / 1.5)


def test_nothing_to_overlap(contention):
    p = probe(0.5, 0.5)
    assert contention.overlap_floor(1.0, 0.0, p) == pytest.approx(1.0)
    assert contention.overlap_floor(0.0, 1.0, p) == pytest.approx(1.0)
    assert contention.overlap_floor(0.0, 0.0, p) == 1.0
