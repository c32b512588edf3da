"""The main job: ``nvoffload finetune`` trains, reports per step, and cleans up its swap directory."""

import io
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import run_cli

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
    with pytest.raises(ValueError, match="seq_len 100000 exceeds the tiny preset's context of 64 positions"):
        FinetuneConfig(preset="tiny", seq_len=100_000)  # ran for minutes without a step
    with pytest.raises(ValueError, match="device must be cpu or cuda"):
        FinetuneConfig(device="mps")
    with pytest.raises(ValueError, match="device: "):
        FinetuneConfig(device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU is usable here .* use --device cpu"):
            FinetuneConfig(device="cuda")  # was torch's AssertionError traceback
    FinetuneConfig(stream=True, grad_accum_steps=2, max_grad_norm=1.0, dtype="float16")  # the optimizer's, streamed
    FinetuneConfig(grad_accum_steps=2, max_grad_norm=1.0, dtype="float16")  # a GradScaler, unscaled before clipping
    with pytest.raises(ValueError, match="max_grad_norm must be positive"):
        FinetuneConfig(max_grad_norm=0.0)
    with pytest.raises(ValueError, match="stash_host_bytes keeps the vertical schedule's block inputs of a streamed model"):
        FinetuneConfig(stash_host_bytes=1 << 20)  # the stash is the streamed vertical schedule's
    with pytest.raises(ValueError, match="not a Hugging Face model directory"):
        FinetuneConfig(model_dir=str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="init_from is for presets"):
        FinetuneConfig(model_dir=str(tmp_path), init_from=str(tmp_path / "config.json"))
    with pytest.raises(ValueError, match="init_from: no such file"):
        FinetuneConfig(init_from=str(tmp_path / "absent.safetensors"))
    with pytest.raises(ValueError, match="save_to: the directory"):
        FinetuneConfig(save_to=str(tmp_path / "absent" / "out.safetensors"))
    for bad in ({"resume": True}, {"save_every": 5}):
        with pytest.raises(ValueError, match="needs a checkpoint_dir"):
            FinetuneConfig(**bad)
    with pytest.raises(ValueError, match="save_every must be >= 1"):
        FinetuneConfig(checkpoint_dir=str(tmp_path), save_every=0)


def _checkpoints(directory) -> list[str]:
    """The checkpoints in ``directory`` (beside them: the run's metrics.jsonl and loss.png)."""
    return sorted(e for e in os.listdir(directory) if e.startswith("checkpoint-"))


def _said(out: str) -> list[str]:
    """The lines of ``out`` but the steps' and the checkpoints' starts, each checkpoint's end without its figures."""
    lines = [line for line in out.splitlines() if not line.startswith("step ") and " started: " not in line]
    return [line.split(" (in ")[0] if line.startswith("checkpoint of step") else line for line in lines]


def test_cli_checkpoints_resume_and_refuse_an_unwritable_directory(tmp_path, capsys):
    """The run says, in the command line's words, before step 1: the model and its parameters, where each part
    lives, the budgets and the swap directory; then what --resume found, and each checkpoint and --save-to as it
    is written. It said none of it."""
    swap = tmp_path / "swap"
    swap.mkdir()
    (tmp_path / "file").write_text("x")
    base = ["finetune", "--preset", "tiny", "--batch-size", "2", "--swap-dir", str(swap), "--no-progress"]
    rc = main([*base, "--steps", "2", "--checkpoint-dir", str(tmp_path / "file" / "ckpt")])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""  # no step ran
    assert captured.err.startswith("nvoffload finetune: error: --checkpoint-dir: cannot write training checkpoints in")
    ckpt, out_file = tmp_path / "ckpt", tmp_path / "out.safetensors"
    header = [
        "model: the tiny preset, 121K parameters, float32; 2 x 64 tokens x 1 micro-batches a step",
        "placement: parameters and gradients on cpu; optimizer state (fp32 master and moments) on NVMe where the host"
        " budget cannot keep it, updated by the CPU; activations on cpu",
        "budgets: --cpu-memory 64M (optimizer staging and resident state)",
        f"swap directory: {swap}",
    ]
    assert main([*base, "--steps", "3", "--checkpoint-dir", str(ckpt), "--save-every", "1", "--keep-last", "1", "--resume",
                 "--save-to", str(out_file)]) == 0  # fmt: skip
    lines = _said(capsys.readouterr().out)
    assert lines[:9] == [*header, f"no checkpoint in {ckpt} to resume from: starting at step 1",
                         *(f"checkpoint of step {s} written: {ckpt}/checkpoint-{s}" for s in (1, 2, 3)),
                         f"weights written to {out_file}"]  # fmt: skip
    assert lines[9].startswith("121K parameters, 3 steps: loss ")
    assert _checkpoints(ckpt) == ["checkpoint-3"] and out_file.is_file()
    assert main([*base, "--steps", "5", "--checkpoint-dir", str(ckpt), "--resume"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:5] == [*header, f"resumed from {ckpt}/checkpoint-3: step 3 of 5 done"]
    assert [line.split(":")[0] for line in lines[5:9]] == [
        "step 4", "step 5", "checkpoint of step 5 started", "checkpoint of step 5 written"
    ]  # fmt: skip
    assert _checkpoints(ckpt) == ["checkpoint-3", "checkpoint-5"]
    assert main([*base, "--steps", "5", "--checkpoint-dir", str(ckpt), "--resume"]) == 0
    assert "nothing to do: the checkpoint" in capsys.readouterr().out


def test_finetune_loss_decreases_and_cleans_up(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_swap_root() == str(tmp_path / "nvoffload")
    # 4 MiB: the half beyond the optimizer's staging keeps part of the state resident, the rest moves on NVMe
    result = finetune(FinetuneConfig(preset="tiny", steps=40, batch_size=8, lr=3e-3, cpu_memory_bytes=4 << 20), progress=False)
    losses = result.losses
    assert len(losses) == 40 and sum(losses[-5:]) / 5 < losses[0] - 0.5
    last = result.steps[-1]
    assert last.tokens_per_s > 0 and last.nvme_bytes > 0 and last.io_gb_per_s > 0 and last.host_held_bytes > 0
    assert os.listdir(tmp_path / "nvoffload") == []  # the run's swap file and lock are gone


def _killed_runs_files(root) -> int:
    """Make ``root`` the default swap directory a killed run left: its lock and a swap file; returns its pid."""
    import socket

    root.mkdir()
    with open("/proc/sys/kernel/pid_max") as f:
        dead = int(f.read()) + 1  # no process can have it
    (root / "nvoffload.lock").write_text(f"{dead} {socket.gethostname()}\n")
    (root / f"nvoffload-{dead}-0123456789ab.swap").write_bytes(b"\0" * 8192)
    return dead


def test_default_swap_directory_is_reused_and_a_killed_runs_files_are_cleaned(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    root = tmp_path / "nvoffload"
    dead = _killed_runs_files(root)
    with pytest.warns(UserWarning, match=rf"removed 1 swap file\(s\) .* left by process {dead}"):
        finetune(FinetuneConfig(preset="tiny", steps=1, batch_size=2), progress=False)
    assert os.listdir(root) == []


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
    assert rc == 0 and len(printed) == 4 + 4  # the header's lines, then the steps'
    for i, (line, running) in enumerate(printed[4:7], start=1):
        assert line.startswith(f"step {i}: loss ") and "tok/s" in line and running
    assert "3 steps: loss" in printed[7][0] and not printed[7][1]


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


@pytest.mark.parametrize("data", [None, "chat"], ids=["text", "packed-chat"])
def test_streamed_accumulation_by_the_vertical_schedule_trains_as_in_memory(tmp_path, data):
    """--stream --grad-accum 4 runs each block over the 4 micro-batches while it is on the device (the header says
    so): the losses and weights equal the in-memory run's, and micro-batch after micro-batch (--no-vertical) too,
    with clipping that bites, on text and on packed chat rows (position_ids restarting within a row); and with the
    block inputs offloaded, kept in host memory up to --activation-host-memory and the rest on NVMe, or in the stash
    (--stash-host-memory), the same way."""
    init = tmp_path / "init.safetensors"
    save_file(GPT(GPTConfig.preset("tiny")).state_dict(), init)
    common = dict(preset="tiny", steps=3, batch_size=2, grad_accum_steps=4, lr=3e-3, warmup_steps=0, max_grad_norm=0.05,
                  swap_dir=str(tmp_path), init_from=str(init), data_path=data, loss_on="all" if data else "completion")  # fmt: skip
    streamed = dict(stream=True, cpu_memory_bytes=8 << 20, device_memory_bytes=64 << 20)
    runs, said = {}, {}
    spilled = dict(offload_activations=True, activation_host_bytes=48 << 10)  # some of the inputs, not all
    for name, extra in (("plain", {}), ("vertical", streamed), ("each", {**streamed, "vertical": False}),
                        ("spilled", {**streamed, **spilled}), ("stashed", {**streamed, "stash_host_bytes": 48 << 10})):
        said[name] = []
        config = FinetuneConfig(**common, **extra, save_to=str(tmp_path / f"{name}.safetensors"))
        runs[name] = finetune(config, progress=False, on_message=said[name].append)
    assert "each block runs over the 4 micro-batches while on cpu (vertical schedule" in said["vertical"][0]
    assert said["each"][0].endswith("micro-batches a step; micro-batch after micro-batch")
    assert all(s.grad_norm > 0.05 for s in runs["vertical"].steps)  # every step clipped
    assert "activations offloaded: up to 48K kept in host memory, the rest to NVMe" in said["spilled"][1]
    assert "its inputs are kept in the stash (up to 48K in host memory, the rest on NVMe)" in said["stashed"][0]
    for name in ("vertical", "each", "spilled", "stashed"):
        assert runs[name].losses == pytest.approx(runs["plain"].losses, rel=1e-4), name
        tuned, plain = load_file(tmp_path / f"{name}.safetensors"), load_file(tmp_path / "plain.safetensors")
        for key in plain:
            torch.testing.assert_close(tuned[key], plain[key], rtol=1e-4, atol=1e-5)


def test_cli_streamed_budget_too_small(tmp_path, capsys):
    rc = main(["finetune", "--preset", "tiny", "--steps", "1", "--swap-dir", str(tmp_path), "--stream",
               "--device-memory", "64K", "--no-progress"])  # fmt: skip
    assert rc == 2 and "--device-memory must be at least" in capsys.readouterr().err  # the flag, not the field


def test_cli_checkpoint_of_another_model(tmp_path, capsys):
    init = tmp_path / "small.safetensors"
    save_file(GPT(GPTConfig.preset("small")).state_dict(), init)
    for mode in ([], ["--stream"]):
        rc = main(["finetune", "--preset", "tiny", "--steps", "1", "--swap-dir", str(tmp_path), "--init-from", str(init),
                   "--no-progress", *mode])  # fmt: skip
        err = capsys.readouterr().err
        assert rc == 2 and "error:" in err and "shape" in err, (mode, err)


# -- Hugging Face model directories (--model) ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Tiny Hugging Face model directories, made here (nothing is downloaded): a GPT-2 (tied head) with a byte-level
    BPE tokenizer trained on a few strings, a Llama (untied head, rotary buffers) without a tokenizer (so the
    text is tokenized as bytes), and a model whose vocabulary is too small for bytes."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from nvoffload.pretrained import save_pretrained

    root = tmp_path_factory.mktemp("hf")
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(["def f(x):\n    return x + 1\n", "the quick brown fox"], vocab_size=300, show_progress=False)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe)
    common = dict(vocab_size=300, bos_token_id=0, eos_token_id=0)
    gpt2 = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                   attn_pdrop=0.0, **common)  # fmt: skip
    llama = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=64, **common)  # fmt: skip
    dirs = {}
    for name, config, extra in (("gpt2", gpt2, tokenizer.save_pretrained), ("llama", llama, None),
                                ("bytes-too-many", transformers.LlamaConfig(**{**llama.to_dict(), "vocab_size": 200}), None)):  # fmt: skip
        torch.manual_seed(0)
        dirs[name] = root / name
        save_pretrained(transformers.AutoModelForCausalLM.from_config(config), dirs[name], extra=extra)
    return dirs


STREAM = ["--stream", "--cpu-memory", "8M", "--device-memory", "64M"]
FP16_ACCUM = ["--dtype", "float16", "--grad-accum", "2"]


@pytest.mark.parametrize(
    "kind,mode",
    [("gpt2", []), ("gpt2", STREAM), ("llama", FP16_ACCUM), ("llama", [*STREAM, *FP16_ACCUM, "--max-grad-norm", "0.5"])],
    ids=["gpt2", "gpt2-stream", "llama-fp16-accum", "llama-stream-fp16-accum-clip"],
)
def test_cli_finetunes_a_hugging_face_directory(hf_dirs, tmp_path, capsys, kind, mode):
    """--model DIR --save-to OUT: OUT is a Hugging Face directory of the trained weights (and the tokenizer)."""
    transformers = pytest.importorskip("transformers")
    src, out, swap = hf_dirs[kind], tmp_path / "out", tmp_path / "swap"
    swap.mkdir()
    rc = main(["finetune", "--model", str(src), "--steps", "3", "--seq-len", "16", "--batch-size", "2", "--lr", "1e-2",
               "--warmup-steps", "0", "--swap-dir", str(swap), "--save-to", str(out), "--no-progress", *mode])  # fmt: skip
    printed = capsys.readouterr().out.splitlines()
    assert rc == 0 and printed[0].startswith(f"model: {src}, ") and printed[3] == f"swap directory: {swap}"
    assert [line.split(":")[0] for line in printed[4:7]] == ["step 1", "step 2", "step 3"]
    assert printed[7] == f"weights written to {out}"
    assert os.listdir(swap) == [] and sorted(os.listdir(tmp_path)) == ["out", "swap"]
    dtype = torch.float16 if "float16" in mode else torch.float32
    with open(out / "config.json") as f:
        assert json.load(f)["dtype"] == str(dtype).removeprefix("torch.")
    tuned = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    start = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=dtype).state_dict()
    assert tuned.dtype == dtype
    moved = [k for k, v in tuned.state_dict().items() if not torch.equal(v, start[k])]
    assert len(moved) == len(start)  # every tensor was trained (under fp16, some steps may be skipped, not all)
    if kind == "gpt2":
        text = "def the quick fox"
        theirs = transformers.AutoTokenizer.from_pretrained(src)(text)["input_ids"]
        assert transformers.AutoTokenizer.from_pretrained(out)(text)["input_ids"] == theirs
    else:
        assert not any("tokenizer" in name for name in os.listdir(out))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_streamed_and_in_memory_hf_finetune_agree(hf_dirs, tmp_path, kind):
    """The same Hugging Face model, data and clipping: streamed and in-memory runs give the same losses and weights
    (streamed, the two micro-batches of a step run by the vertical schedule)."""
    transformers = pytest.importorskip("transformers")
    common = dict(model_dir=str(hf_dirs[kind]), steps=4, batch_size=2, seq_len=16, lr=1e-2, warmup_steps=0,
                  grad_accum_steps=2, max_grad_norm=0.05, swap_dir=str(tmp_path))  # fmt: skip
    plain = finetune(FinetuneConfig(**common, save_to=str(tmp_path / "plain")), progress=False).losses
    streamed = finetune(
        FinetuneConfig(**common, save_to=str(tmp_path / "streamed"), stream=True, cpu_memory_bytes=8 << 20,
                       device_memory_bytes=64 << 20), progress=False,
    ).losses  # fmt: skip
    assert streamed == pytest.approx(plain, rel=1e-4)
    a = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain").state_dict()
    b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "streamed").state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)


def test_cli_refuses_an_unwritable_save_to_before_training(hf_dirs, tmp_path, capsys):
    """One line led by the flag (a Hugging Face directory's refusals did not name --save-to), nothing created."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    swap = tmp_path / "swap"
    swap.mkdir()
    cases = [
        (["--model", str(hf_dirs["gpt2"])], tmp_path / "file" / "out", "is not a directory"),
        (["--model", str(hf_dirs["gpt2"]), *STREAM], tmp_path / "notes", "holds no saved model"),
        (["--model", str(hf_dirs["gpt2"])], tmp_path / "file", "exists and is not a directory"),
        (["--preset", "tiny"], tmp_path / "notes", "is a directory, not a safetensors file"),
    ]
    for args, save_to, message in cases:
        rc = main(["finetune", *args, "--steps", "1", "--seq-len", "16", "--swap-dir", str(swap), "--save-to",
                   str(save_to), "--no-progress"])  # fmt: skip
        captured = capsys.readouterr()
        assert rc == 2 and captured.out == "", (args, captured)  # no step ran
        assert captured.err.startswith("nvoffload finetune: error: --save-to: ") and message in captured.err, captured.err
        assert captured.err.count("\n") == 1
    assert os.listdir(swap) == [] and (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
    assert sorted(os.listdir(tmp_path)) == ["file", "notes", "swap"]


def test_cli_hugging_face_errors(hf_dirs, tmp_path, monkeypatch, capsys):
    base = ["finetune", "--steps", "1", "--swap-dir", str(tmp_path), "--no-progress"]
    assert main([*base, "--model", str(hf_dirs["bytes-too-many"])]) == 2
    assert "has no tokenizer, and its vocabulary of 200 is too small" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one model or the other
        main([*base, "--model", str(hf_dirs["gpt2"]), "--preset", "tiny"])
    assert "not allowed with argument" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    assert main([*base, "--model", str(hf_dirs["gpt2"])]) == 2
    assert "pip install 'nvoffload[hf]'" in capsys.readouterr().err


# -- faults at the command line's boundary (issue 36) ----------------------------------------------------------------


def test_a_loss_that_is_not_finite_stops_the_run_naming_the_step_and_saves_nothing_of_it(tmp_path, capsys):
    """--lr 1e30 trained to nan and exited 0: now the step whose loss is not finite stops the run (one line, exit
    2) before its checkpoint, so the last checkpoint is the last good step's."""
    from nvoffload.training_checkpoint import latest_training_checkpoint

    swap, ckpt = tmp_path / "swap", tmp_path / "ckpt"
    swap.mkdir()
    rc = main(["finetune", "--preset", "tiny", "--steps", "6", "--batch-size", "2", "--lr", "1e30", "--swap-dir",
               str(swap), "--checkpoint-dir", str(ckpt), "--save-every", "1", "--no-progress"])  # fmt: skip
    captured = capsys.readouterr()
    assert rc == 2 and captured.out.splitlines()[4].startswith("step 1: loss 5.")  # after the header's 4 lines
    assert captured.out.splitlines()[5].startswith("checkpoint of step 1 started: ")  # written beside step 2
    assert captured.out.splitlines()[6].startswith(f"checkpoint of step 1 written: {ckpt}/checkpoint-1 (in ")
    assert "step 2:" not in captured.out and captured.err.count("\n") == 1
    assert captured.err.startswith("nvoffload finetune: error: the loss is nan at step 2: training stopped")
    assert latest_training_checkpoint(ckpt).step == 1 and not any(n.startswith("checkpoint-2") for n in os.listdir(ckpt))
    assert os.listdir(swap) == []


def test_a_run_stopped_in_its_first_step_leaves_nothing(tmp_path, capsys):
    """--init-from weights holding NaN: the loss of step 1, before any update, is not finite. One line naming the
    weights, exit 2, and nothing left: no checkpoint directory, no --log-dir, no swap file (the checkpoint
    directory stayed, holding an empty metrics.jsonl, and the line said to lower the learning rate)."""
    weights = GPT(GPTConfig.preset("tiny")).state_dict()
    weights["tok_emb.weight"][:] = math.nan
    save_file(weights, tmp_path / "nan.safetensors")
    swap = tmp_path / "swap"
    swap.mkdir()
    for logs in ([], ["--log-dir", str(tmp_path / "logs")]):
        rc = main(["finetune", "--preset", "tiny", "--init-from", str(tmp_path / "nan.safetensors"), "--steps", "3",
                   "--batch-size", "2", "--swap-dir", str(swap), "--checkpoint-dir", str(tmp_path / "ckpt"),
                   "--save-every", "1", "--no-progress", *logs])  # fmt: skip
        err = capsys.readouterr().err
        assert rc == 2 and err == (
            "nvoffload finetune: error: the loss is nan at step 1, before any update: the weights the run starts from"
            f" ({tmp_path / 'nan.safetensors'}) give it\n"
        )
        assert sorted(os.listdir(tmp_path)) == ["nan.safetensors", "swap"] and os.listdir(swap) == []


def test_text_is_read_as_its_encoding_and_a_bad_byte_is_named_with_its_offset(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes("déjà vu ".encode("latin-1") * 3)
    with pytest.raises(ValueError, match=rf"{path} is not valid utf-8: byte 0xe9 at offset 1 .*--text-encoding"):
        load_text(path)  # was decoded with replacement characters without a word
    assert load_text(path, encoding="latin-1") == "déjà vu " * 3
    with pytest.raises(ValueError, match=rf"{path} is 24 bytes, more than the 23 a text may have here"):
        load_text(path, encoding="latin-1", max_bytes=23)
    with pytest.raises(ValueError, match="/dev/zero is not a regular file"):
        load_text("/dev/zero")  # was read until memory ran out


def _unshare_tmpfs(root, size: str) -> list[str] | None:
    """The command prefix that runs in a private mount namespace with a ``size`` tmpfs at ``root``; None where
    unshare or the mount is not allowed."""
    import shutil
    import subprocess

    prefix = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c"]
    mount = f"mount -t tmpfs -o size={size} tmpfs {root}"
    if shutil.which("unshare") is None or subprocess.run([*prefix, mount], capture_output=True).returncode:
        return None
    return [*prefix, f'{mount} && exec "$0" "$@"']


def test_too_little_space_for_the_offloaded_activations_is_refused_before_anything_is_written(tmp_path):
    """A real small file system (a tmpfs in a private mount namespace) that holds the optimizer state but not it and
    a micro-batch's activations: refused up front, naming both, with nothing written. The free-space check counted
    only the optimizer state."""
    import subprocess

    def command(root, *more: str) -> list[str] | None:  # in root: a small tmpfs as the swap directory, and ckpt
        swap = root / "small"
        swap.mkdir(parents=True)
        prefix = _unshare_tmpfs(swap, "180m")  # the optimizer state is 78 MB (and a reserve), the activations 126 MB
        argv = ["finetune", "--preset", "small", "--steps", "1", "--batch-size", "16", "--swap-dir", str(swap),
                "--checkpoint-dir", str(root / "ckpt"), "--no-progress", *more]  # fmt: skip
        return None if prefix is None else [*prefix, sys.executable, "-m", "nvoffload", *argv]

    refused, fits = command(tmp_path / "refused", "--offload-activations"), command(tmp_path / "fits")
    if refused is None or fits is None:
        pytest.skip("cannot mount a small tmpfs in a private mount namespace here (unshare --user --mount)")
    # the same run without offloaded activations fits there: run beside the refused one, in a namespace of its own
    fitting = subprocess.Popen(fits, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        done = subprocess.run(refused, capture_output=True, text=True, timeout=300)
    finally:
        out, err = fitting.communicate(timeout=300)
    swap = tmp_path / "refused" / "small"
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"nvoffload finetune: error: swap directory {swap} needs")
    assert "a micro-batch's offloaded activations (120M)" in done.stderr  # 4 x 16 x 128 x (7 x 256 + 2 x 1024) x 4 bytes
    assert os.listdir(tmp_path / "refused") == ["small"]
    assert fitting.returncode == 0 and out.splitlines()[4].startswith("step 1: loss"), err[-2000:]


@pytest.mark.parametrize("mode", [[], ["--stream", "--cpu-memory", "256M"]], ids=["optimizer", "stream"])
def test_a_write_error_under_offloaded_activations_is_one_line_and_the_last_checkpoint_stays(tmp_path, mode):
    """A real write error while activations are written (a file size limit, RLIMIT_FSIZE, in the child: EFBIG as a
    full disk's ENOSPC): one line naming the tensor and the swap file, exit 2, the swap files gone, the checkpoint
    of the step before intact. It was a 42-line RuntimeError traceback, exit 1."""
    import resource
    import subprocess

    from nvoffload.training_checkpoint import latest_training_checkpoint

    swap, ckpt = tmp_path / "swap", tmp_path / "ckpt"
    swap.mkdir()
    argv = ["finetune", "--preset", "small", "--batch-size", "16", "--swap-dir", str(swap), "--checkpoint-dir",
            str(ckpt), "--no-progress", *mode]  # fmt: skip
    assert main([*argv, "--steps", "1"]) == 0

    def limit_file_size():  # above the optimizer's swap file (39 MB), below the activations' (126 MB a micro-batch)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))

    cmd = [sys.executable, "-m", "nvoffload", *argv, "--steps", "2", "--resume", "--offload-activations"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, preexec_fn=limit_file_size)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == f"resumed from {ckpt}/checkpoint-1: step 1 of 2 done"  # no step finished
    assert done.stderr.startswith("nvoffload finetune: error: writing saved activation #")
    assert "File too large" in done.stderr and f"{swap}/nvoffload-" in done.stderr
    assert os.listdir(swap) == [] and latest_training_checkpoint(ckpt).step == 1


def _restore_sigint():
    """A terminal's Ctrl-C: the child's SIGINT at its default, whatever this process inherited (a job started in the
    background of a script, as `.ci/stress &`, has SIGINT ignored, and the child would train on)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupted_in_its_steps(proc: subprocess.Popen) -> tuple[int, str]:
    """SIGINT ``proc`` (a finetune run) once it printed its step 2; its exit status and stderr."""
    import queue
    import signal
    import threading

    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True)
    reader.start()
    try:
        while not lines.get(timeout=120).startswith("step 2:"):  # the run is in its steps
            pass
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=120)
    finally:
        proc.kill()
    err = proc.stderr.read()
    reader.join(timeout=60)  # at the end of its output
    return rc, err


def test_ctrl_c_is_one_line_exit_130_and_removes_the_swap_files(tmp_path):
    """SIGINT mid-run: one line, exit 130, no KeyboardInterrupt traceback; the swap file and lock are gone. The line
    says what --resume has: nothing without --checkpoint-dir, no checkpoint before the first is written (it said
    "the last checkpoint written" either way), else the latest's path and step. The three runs at once."""
    from nvoffload.training_checkpoint import latest_training_checkpoint

    procs = {}
    for checkpoints in ("none", "not yet", "written"):
        swap, ckpt = tmp_path / checkpoints / "swap", tmp_path / checkpoints / "ckpt"
        swap.mkdir(parents=True)
        cmd = [sys.executable, "-m", "nvoffload", "finetune", "--preset", "tiny", "--steps", "100000", "--batch-size",
               "2", "--swap-dir", str(swap), "--no-progress"]  # fmt: skip
        if checkpoints != "none":  # a checkpoint every step, or after the last only
            cmd += ["--checkpoint-dir", str(ckpt), *(["--save-every", "1"] if checkpoints == "written" else [])]
        procs[checkpoints] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                              preexec_fn=_restore_sigint)  # fmt: skip
    try:
        ended = {checkpoints: _interrupted_in_its_steps(proc) for checkpoints, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
    said = "nvoffload finetune: interrupted (Ctrl-C)"
    latest = latest_training_checkpoint(tmp_path / "written" / "ckpt")
    expected = {
        "none": f"{said}; no --checkpoint-dir was given: nothing to --resume from\n",
        "not yet": f"{said} before any checkpoint was written in {tmp_path / 'not yet' / 'ckpt'}: --resume would start at step 1\n",
        "written": f"{said}; --resume goes on from {latest.path} (step {latest.step})\n",
    }
    for checkpoints, (rc, err) in ended.items():
        assert rc == 130 and err == expected[checkpoints], (checkpoints, rc, err)
        assert os.listdir(tmp_path / checkpoints / "swap") == [], checkpoints


CTRL_C_AT_IMPORT = """
import importlib.abc, os, signal, sys

class CtrlC(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch":  # as torch starts loading: SIGINT, as a terminal's Ctrl-C sends it
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlC())
from nvoffload.cli import main  # what the nvoffload command runs
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_while_torch_loads_is_one_line_exit_130(tmp_path):
    """Ctrl-C as the command starts, while torch is still being imported (a second or more): one line, exit 130,
    nothing written. It was a KeyboardInterrupt traceback of 37 lines (``import nvoffload.cli`` imported torch, before
    main could answer anything)."""
    import subprocess

    cmd = [sys.executable, "-c", CTRL_C_AT_IMPORT, "finetune", "--preset", "tiny", "--steps", "1", "--swap-dir",
           str(tmp_path), "--no-progress"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, preexec_fn=_restore_sigint)
    assert (done.returncode, done.stdout) == (130, ""), done.stderr[-3000:]
    assert done.stderr == "nvoffload: interrupted (Ctrl-C) while starting: nothing was written\n"
    assert os.listdir(tmp_path) == []


def test_host_memory_refused_by_the_system_names_the_budget_and_what_is_available(tmp_path):
    """--cpu-memory within the machine's memory that the system still refuses (here an address-space limit,
    RLIMIT_AS, in the child): the error names the flag, the size and the memory available. It said only 'Cannot
    allocate memory'."""
    import resource
    import subprocess

    def limit_address_space():  # below the 8 GiB slab asked, whatever the interpreter and torch take
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    cmd = [sys.executable, "-m", "nvoffload", "finetune", "--preset", "tiny", "--steps", "1", "--no-progress",
           "--swap-dir", str(tmp_path), "--stream", "--cpu-memory", "8G"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, preexec_fn=limit_address_space)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1, done.stderr[-3000:]
    assert done.stderr.startswith(
        "nvoffload finetune: error: cannot allocate the host memory asked, --cpu-memory 8G: "
    ) and re.search(r": [\d.]+[KMGT] of this machine's [\d.]+G is available\n$", done.stderr)  # sizes as --cpu-memory takes them
    assert os.listdir(tmp_path) == []


def test_a_warning_is_one_line_in_the_command_lines_words(tmp_path):
    """What a killed run left in the default swap directory is cleaned with a warning: printed as
    ``nvoffload finetune: warning: ...``, one line. It printed a raw ``UserWarning`` with a source line."""
    root = tmp_path / "nvoffload"
    dead = _killed_runs_files(root)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    done = run_cli(["finetune", "--preset", "tiny", "--steps", "1", "--batch-size", "2", "--no-progress"], env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"nvoffload finetune: warning: {root}: removed 1 swap file(s) ") and f"process {dead}" in line
    assert os.listdir(root) == []


def test_offloaded_activations_are_reported_each_step(tmp_path, capsys):
    """--offload-activations without --stream: the header names the staging memory and each step the bytes its
    activations sent to NVMe and kept in memory. No figure was shown."""
    rc = main(["finetune", "--preset", "tiny", "--steps", "2", "--batch-size", "2", "--swap-dir", str(tmp_path),
               "--offload-activations", "--activation-memory", "4M", "--no-progress"])  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0 and lines[2] == "budgets: --cpu-memory 64M (optimizer staging and resident state), --activation-memory 4M"
    assert "activations offloaded to NVMe" in lines[1]
    for line in lines[4:6]:
        assert re.search(r"\| activations \d+(\.\d+)?[KMG]?B? to NVMe, [1-9][\d.]*[KMG]B? held$", line), line


@pytest.mark.parametrize("command", ["finetune", "plan", "calibrate"])
def test_help_describes_every_option_and_its_default(command):
    """Every option says what it does, and every option with a default says it (sizes as the flags take them);
    each command has a description. --warmup-steps, --weight-decay and --seed had no text, --cpu-memory no
    default, plan no description."""
    import argparse

    from nvoffload.cli import _subparser, build_parser

    parser = _subparser(build_parser(), command)
    assert parser.description
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help, action.option_strings
        if action.default not in (None, False, True, argparse.SUPPRESS) and "%(default)s" not in action.help:
            assert "default" in action.help, (action.option_strings, action.help)
    if command != "calibrate":
        help_text = parser.format_help()
        assert "(default 64M)" in help_text and "(default 1G)" in help_text


def test_a_checkpoint_directory_held_by_another_run_stops_every_rank_at_once(tmp_path):
    """Two gloo ranks (plain processes, as torchrun starts them, without torchrun stopping the others when one
    ends) on a --checkpoint-dir that a live run holds: rank 0's claim is refused, and every rank ends with that
    same one-line error. Rank 1 went on into the next collective, not told: a gloo traceback ("Connection closed
    by peer") once rank 0's process ended, a wait until the timeout (600 s) while it lived."""
    import socket
    import subprocess

    from nvoffload.training_checkpoint import claim_checkpoint_directory

    ckpt = tmp_path / "ckpt"
    release = claim_checkpoint_directory(ckpt)  # this process is the live run that holds it
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "XDG_CACHE_HOME": str(tmp_path / "cache")}  # fmt: skip
    cmd = [sys.executable, "-m", "nvoffload", "finetune", "--preset", "tiny", "--steps", "1", "--batch-size", "2",
           "--no-progress", "--checkpoint-dir", str(ckpt)]  # fmt: skip
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]  # fmt: skip
    try:
        ended = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
        release()
    errors = [[line for line in err.splitlines() if "error:" in line] for _, err in ended]
    said = f"nvoffload finetune: error: checkpoint directory {ckpt} is in use by process {os.getpid()} on "
    assert len(errors[0]) == 1 and errors[0][0].startswith(said), ended[0][1][-3000:]
    assert errors[1] == errors[0], ended[1][1][-3000:]
    assert all(p.returncode != 0 for p in procs) and "step 1" not in ended[0][0] + ended[1][0]


def test_the_loss_is_read_from_the_device_once_a_step_whatever_its_micro_batches(tmp_path, monkeypatch):
    """A read of the loss between a micro-batch's forward and its backward would wait for the GPU each time: the
    step's loss is summed on the device and read once, after the step (losses as before: the mean over the step's
    targets, the same whether they come in one micro-batch or four)."""
    reads = []
    item = torch.Tensor.item

    def counted(self):
        reads.append(self)
        return item(self)

    monkeypatch.setattr(torch.Tensor, "item", counted)

    def run(micro_batches: int, batch_size: int) -> tuple[int, list[float]]:
        reads.clear()
        (tmp_path / f"swap{micro_batches}").mkdir()
        config = FinetuneConfig(preset="tiny", steps=2, batch_size=batch_size, grad_accum_steps=micro_batches, lr=3e-3,
                                swap_dir=str(tmp_path / f"swap{micro_batches}"))  # fmt: skip
        losses = finetune(config, progress=False).losses
        return len(reads), losses

    reads_one, losses_one = run(1, 8)
    reads_four, losses_four = run(4, 2)
    assert reads_four == reads_one == 2
    assert losses_four == pytest.approx(losses_one, rel=1e-5)
