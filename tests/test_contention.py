"""nvoffload.planner.contention: the overlap arithmetic on hand-written fractions, and a real probe's shape."""

import pytest

from nvoffload.planner.contention import QUICK, measure_contention, overlapped_s


@pytest.mark.parametrize("compute_s, io_s", [(1.0, 1.0), (2.0, 1.0), (0.5, 1.0)])
def test_no_slowdown_overlaps_for_free(compute_s, io_s):
    assert overlapped_s(compute_s, io_s, 1.0, 1.0) == pytest.approx(max(compute_s, io_s))


def test_compute_halved_io_as_long_as_compute():
    # 1 s of compute, 1 s of I/O at full speed: after 1 s the I/O is done and half
    # the compute is, whose other half then takes 0.5 s alone.
    assert overlapped_s(1.0, 1.0, 0.5, 1.0) == pytest.approx(1.5)


def test_both_halved_serialise():
    assert overlapped_s(1.0, 1.0, 0.5, 0.5) == pytest.approx(2.0)


def test_io_left_over_runs_alone():
    # compute 1 s at 0.8 speed ends at 1.25 s, having done 1.25 * 0.5 = 0.625 s of the
    # 1.5 s of I/O; the other 0.875 s run alone: 2.125 s.
    assert overlapped_s(1.0, 1.5, 0.8, 0.5) == pytest.approx(2.125)


def test_nothing_to_overlap():
    assert overlapped_s(1.0, 0.0, 0.5, 0.5) == pytest.approx(1.0)
    assert overlapped_s(0.0, 1.0, 0.5, 0.5) == pytest.approx(1.0)
    assert overlapped_s(0.0, 0.0, 0.5, 0.5) == 0.0


def test_a_probe_measures_both_rates_and_removes_its_files(tmp_path):
    probe = measure_contention(str(tmp_path), **QUICK)
    assert probe.compute_gflops_alone > 0 and probe.compute_gflops_with_io > 0
    assert probe.io_gb_per_s_alone > 0 and probe.io_gb_per_s_with_compute > 0
    assert probe.compute_with_io == pytest.approx(probe.compute_gflops_with_io / probe.compute_gflops_alone)
    assert probe.overlap_floor(1.0, 0.0) == 1.0
    assert probe.to_dict()["io_fraction_with_compute"] == pytest.approx(probe.io_with_compute)
    assert "GB/s alone" in probe.describe()
    assert list(tmp_path.iterdir()) == []  # the probe's store and its subdirectory are gone


def test_io_bytes_must_be_whole_chunk_pairs(tmp_path):
    with pytest.raises(ValueError, match="multiple of"):
        measure_contention(str(tmp_path), seconds=0.1, io_bytes=(8 << 20) + 4096)
