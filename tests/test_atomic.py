"""The one atomic-write helper: a file is replaced whole or not at all."""

import os

import pytest

from nvoffload.core.atomic import AtomicFile, replace_file


def test_replace_file_replaces_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text("old")
    with replace_file(path, "w", encoding="utf-8") as f:
        f.write("new")
        assert path.read_text() == "old"  # still the old file until the block ends
    assert path.read_text() == "new"
    assert os.listdir(tmp_path) == ["profile.json"]


def test_replace_file_keeps_the_old_file_when_the_writer_fails(tmp_path):
    path = tmp_path / "loss.png"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="drawing failed"), replace_file(path) as f:
        f.write(b"half")
        raise RuntimeError("drawing failed")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["loss.png"]


def test_a_killed_writer_leaves_one_temporary_that_the_next_write_replaces(tmp_path):
    path = tmp_path / "trace.json"
    killed = AtomicFile(path)  # a writer that never commits (its process was killed)
    os.write(killed.fd, b"partial")
    os.close(killed.fd)
    with replace_file(path, "w", encoding="utf-8") as f:
        f.write("{}")
    assert path.read_text() == "{}"
    assert os.listdir(tmp_path) == ["trace.json"]
