"""The main job: ``nvoffload finetune`` trains, reports per step, and cleans up its swap directory."""

import io
import os
import sys

import pytest
import torch

from nvoffload.checkpoint import load_file, save_file
from nvoffload.cli import main
from nvoffload.data import ByteTokenizer, TokenDataset, load_text
from nvoffload.finetune import FinetuneConfig, default_swap_root, finetune
from nvoffload.models import GPT, GPTConfig


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


def test_config_validation(tmp_path):
    with pytest.raises(ValueError, match="unknown GPT preset"):
        FinetuneConfig(preset="huge")
    with pytest.raises(ValueError, match="dtype"):
        FinetuneConfig(dtype="int8")
    with pytest.raises(ValueError, match="cannot use grad_accum_steps > 1, max_grad_norm"):
        FinetuneConfig(stream=True, grad_accum_steps=2, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="float16"):
        FinetuneConfig(stream=True, dtype="float16")
    with pytest.raises(ValueError, match="init_from: no such file"):
        FinetuneConfig(init_from=str(tmp_path / "absent.safetensors"))
    with pytest.raises(ValueError, match="save_to: the directory"):
        FinetuneConfig(save_to=str(tmp_path / "absent" / "out.safetensors"))


def test_finetune_loss_decreases_and_cleans_up(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_swap_root() == str(tmp_path / "nvoffload")
    result = finetune(FinetuneConfig(preset="tiny", steps=40, batch_size=8, lr=3e-3), progress=False)
    losses = result.losses
    assert len(losses) == 40 and sum(losses[-5:]) / 5 < losses[0] - 0.5
    last = result.steps[-1]
    assert last.tokens_per_s > 0 and last.nvme_bytes > 0 and last.io_gb_per_s > 0 and last.host_held_bytes > 0
    assert os.listdir(tmp_path / "nvoffload") == []  # the run's swap directory is gone


def test_cli(tmp_path, monkeypatch):
    """--no-progress prints each step's line as the step finishes: while the run's swap file still exists."""
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 50)
    printed = []  # (line, whether the run was still on when it was written)

    class Stdout(io.StringIO):
        def write(self, s):
            if s.strip():
                printed.append((s, any(tmp_path.glob("*.swap"))))
            return super().write(s)

    monkeypatch.setattr(sys, "stdout", Stdout())
    rc = main(["finetune", "--preset", "tiny", "--steps", "3", "--text", str(text), "--swap-dir", str(tmp_path),
               "--cpu-memory", "8M", "--no-progress"])  # fmt: skip
    assert rc == 0 and len(printed) == 4
    for i, (line, running) in enumerate(printed[:3], start=1):
        assert line.startswith(f"step {i}: loss ") and "tok/s" in line and running
    assert "3 steps: loss" in printed[3][0] and not printed[3][1]


def test_cli_missing_text_or_swap_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for option, path in (("--swap-dir", tmp_path / "no-swap"), ("--text", tmp_path / "no-text.txt")):
        rc = main(["finetune", "--preset", "tiny", "--steps", "1", "--no-progress", option, str(path)])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("nvoffload finetune: error: ") and str(path) in err, (option, err)
        assert err.count("\n") == 1 and "Traceback" not in err


def test_cli_errors(capsys):
    with pytest.raises(SystemExit):
        main(["finetune", "--cpu-memory", "lots"])
    assert main(["finetune", "--steps", "0"]) == 2
    assert "steps must be >= 1" in capsys.readouterr().err


def test_streamed_finetune_from_a_checkpoint_within_budgets(tmp_path):
    """--stream: parameters on NVMe, budgets below the model's state; starts from and saves a checkpoint."""
    cfg = GPTConfig.preset("tiny")
    torch.manual_seed(1)
    start = GPT(cfg)
    init = tmp_path / "init.safetensors"
    save_file(start.state_dict(), init)
    params_bytes = sum(p.numel() * 4 for p in start.parameters())
    # The training state is 16 B/parameter. The host budget is 3.5 B/parameter plus 1 MiB staging the
    # activations (one 512 KiB saved tensor written and one read, at batch 8) and as much for the optimizer's half.
    device_budget, host_budget = 2 * params_bytes, 7 * params_bytes // 2 + (2 << 20)
    out = tmp_path / "tuned.safetensors"
    config = FinetuneConfig(
        preset="tiny", steps=30, batch_size=8, lr=3e-3, swap_dir=str(tmp_path), stream=True,
        cpu_memory_bytes=host_budget, device_memory_bytes=device_budget, offload_activations=True,
        activation_memory_bytes=1 << 20,
        init_from=str(init), save_to=str(out),
    )  # fmt: skip
    result = finetune(config, progress=False)
    losses = result.losses
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5
    # the first loss is the checkpoint's model, not a fresh initialization
    x, y = TokenDataset(ByteTokenizer().encode(load_text()), cfg.seq_len, seed=0).batch(8)
    with torch.no_grad():
        assert losses[0] == pytest.approx(float(start(x, y)), rel=1e-5)
    for s in result.steps:
        assert 0 < s.device_bytes <= device_budget and 0 < s.host_held_bytes <= host_budget
        assert s.nvme_bytes > 0 and s.io_gb_per_s > 0
    tuned = load_file(out)
    assert tuned.keys() == start.state_dict().keys()
    moved = [name for name, value in start.state_dict().items() if not torch.equal(tuned[name], value)]
    assert len(moved) == len(tuned)  # every tensor was trained
    assert os.listdir(tmp_path) == sorted(["init.safetensors", "tuned.safetensors"])  # swap files removed


def test_streamed_and_in_memory_finetune_agree(tmp_path):
    """Same weights, same data: the streamed run's losses equal the default mode's (fp32 rounding)."""
    init = tmp_path / "init.safetensors"
    save_file(GPT(GPTConfig.preset("tiny")).state_dict(), init)
    common = dict(preset="tiny", steps=5, batch_size=4, lr=1e-3, swap_dir=str(tmp_path), init_from=str(init))
    plain = finetune(FinetuneConfig(**common), progress=False).losses
    streamed = finetune(
        FinetuneConfig(**common, stream=True, cpu_memory_bytes=8 << 20, device_memory_bytes=64 << 20), progress=False
    ).losses
    assert streamed == pytest.approx(plain, rel=1e-4)


def test_cli_streamed_budget_too_small(tmp_path, capsys):
    rc = main(["finetune", "--preset", "tiny", "--steps", "1", "--swap-dir", str(tmp_path), "--stream",
               "--device-memory", "64K", "--no-progress"])  # fmt: skip
    assert rc == 2 and "device_memory_bytes must be at least" in capsys.readouterr().err


def test_cli_checkpoint_of_another_model(tmp_path, capsys):
    init = tmp_path / "small.safetensors"
    save_file(GPT(GPTConfig.preset("small")).state_dict(), init)
    for mode in ([], ["--stream"]):
        rc = main(["finetune", "--preset", "tiny", "--steps", "1", "--swap-dir", str(tmp_path), "--init-from", str(init),
                   "--no-progress", *mode])  # fmt: skip
        err = capsys.readouterr().err
        assert rc == 2 and "error:" in err and "shape" in err, (mode, err)
