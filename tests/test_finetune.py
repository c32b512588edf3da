"""The main job: ``nvoffload finetune`` trains, reports per step, and cleans up its swap directory."""

import importlib
import os

import pytest

from nvoffload.cli import main
from nvoffload.data import ByteTokenizer, TokenDataset, load_text
from nvoffload.finetune import FinetuneConfig, default_swap_root, finetune

HAS_STORE = hasattr(importlib.import_module("nvoffload.io"), "TensorStore")
needs_store = pytest.mark.skipif(not HAS_STORE, reason="nvoffload.io.TensorStore not available")


def test_corpus_and_tokenizer():
    text = load_text()
    assert 200_000 < len(text) < 1_000_000
    tok = ByteTokenizer()
    ids = tok.encode("héllo")
    assert ids.tolist() == list("héllo".encode()) and tok.decode(ids) == "héllo"
    x, y = TokenDataset(tok.encode(text), 16, seed=1).batch(3)
    assert x.shape == y.shape == (3, 16) and (x[:, 1:] == y[:, :-1]).all()
    with pytest.raises(ValueError, match="seq_len"):
        TokenDataset(tok.encode("abc"), 8)


def test_config_validation():
    with pytest.raises(ValueError, match="unknown GPT preset"):
        FinetuneConfig(preset="huge")
    with pytest.raises(ValueError, match="dtype"):
        FinetuneConfig(dtype="int8")


@needs_store
def test_finetune_loss_decreases_and_cleans_up(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_swap_root() == str(tmp_path / "nvoffload")
    result = finetune(FinetuneConfig(preset="tiny", steps=40, batch_size=8, lr=3e-3), progress=False)
    losses = result.losses
    assert len(losses) == 40 and sum(losses[-5:]) / 5 < losses[0] - 0.5
    last = result.steps[-1]
    assert last.tokens_per_s > 0 and last.nvme_bytes > 0 and last.io_gb_per_s > 0 and last.host_staging_bytes > 0
    assert os.listdir(tmp_path / "nvoffload") == []  # the run's swap directory is gone


@needs_store
def test_cli(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 50)
    rc = main(["finetune", "--preset", "tiny", "--steps", "3", "--text", str(text), "--swap-dir", str(tmp_path),
               "--cpu-memory", "8M", "--no-progress"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0 and "step 3:" in out and "tok/s" in out and "loss" in out


def test_cli_errors(capsys):
    with pytest.raises(SystemExit):
        main(["finetune", "--cpu-memory", "lots"])
    assert main(["finetune", "--steps", "0"]) == 2
    assert "steps must be >= 1" in capsys.readouterr().err
