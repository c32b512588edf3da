"""``nvoffload finetune --data``: chat and instruction data end to end, metrics and the loss PNG, and ``--resume``
after SIGKILL going on at the exact next example, bit-identical to a run never stopped."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading

import pytest
import torch
from conftest import cli_server

from nvoffload.checkpoint import load_file
from nvoffload.cli import main

pytest.importorskip("datasets")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _pairs(path, count: int = 60) -> str:
    """Short prompt-completion records (a few fit in one row of the tiny preset's 64 positions)."""
    with open(path, "w") as f:
        for i in range(count):
            f.write(json.dumps({"prompt": f"{i} + {i % 7} =", "completion": f" {i + i % 7}."}) + "\n")
    return str(path)


def _command(tmp_path, name: str, data: str, steps: int) -> list[str]:
    return [
        "finetune", "--preset", "tiny", "--data", data, "--steps", str(steps),
        "--batch-size", "2", "--grad-accum", "2", "--max-grad-norm", "1.0", "--eval-fraction", "0.2",
        "--eval-every", "3", "--swap-dir", str(tmp_path / f"{name}-swap"), "--checkpoint-dir",
        str(tmp_path / f"{name}-ckpt"), "--save-every", "1", "--resume", "--no-progress",
        "--save-to", str(tmp_path / f"{name}.safetensors"),
    ]  # fmt: skip


def _records(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_resume_after_sigkill_goes_on_at_the_same_example_and_ends_bit_identical(tmp_path, request):
    steps = 6
    data = _pairs(tmp_path / "pairs.jsonl")
    for name in ("ref", "run"):
        (tmp_path / f"{name}-swap").mkdir()
    # each run a process of its own, forked from one that imported torch, datasets and nvoffload once
    cli = cli_server()
    # the reference beside the two runs below
    reference = cli.start("-m nvoffload", _command(tmp_path, "ref", data, steps), os.devnull, tmp_path / "ref.err")
    request.addfinalizer(lambda: reference.kill() or reference.wait(60))  # if a check failed
    output = tmp_path / "run.fifo"
    os.mkfifo(output)
    process = cli.start("-m nvoffload", _command(tmp_path, "run", data, steps), output, output)
    lines: list[str] = []
    saved = threading.Event()

    def read() -> None:
        with open(output) as f:
            for line in f:
                lines.append(line)
                # Step 2's checkpoint is written in the background while step 3 runs (one at a time: it ends
                # before step 3's starts), so "step 3:" may come before it ends: wait for the line that says it ended.
                if line.startswith("checkpoint of step 2 written"):
                    saved.set()
        saved.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert saved.wait(240), "".join(lines)[-3000:]
    process.send_signal(signal.SIGKILL)
    assert process.wait(60) == -signal.SIGKILL, "".join(lines)[-3000:]  # killed before it could finish
    reader.join(60)

    done = cli.run("-m nvoffload", _command(tmp_path, "run", data, steps), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed_at = int(next(line for line in done.stdout.splitlines() if line.startswith("step ")).split(":")[0].removeprefix("step "))
    assert 3 <= resumed_at <= steps  # it went on from a checkpoint at step 2 or later
    assert reference.wait(300) == 0, (tmp_path / "ref.err").read_text()[-3000:]
    expected, actual = load_file(tmp_path / "ref.safetensors"), load_file(tmp_path / "run.safetensors")
    assert all(torch.equal(expected[k], actual[k]) for k in expected)
    final = f"checkpoint-{steps}/optimizer.safetensors"
    ref_state, run_state = load_file(tmp_path / "ref-ckpt" / final), load_file(tmp_path / "run-ckpt" / final)
    assert all(torch.equal(ref_state[k], run_state[k]) for k in ref_state)
    # every step recorded once, with the reference's loss to the bit: the same examples, in the same order
    ref, run = _records(tmp_path / "ref-ckpt" / "metrics.jsonl"), _records(tmp_path / "run-ckpt" / "metrics.jsonl")
    assert [r["step"] for r in run] == list(range(1, steps + 1))
    assert [r["loss"] for r in run] == [r["loss"] for r in ref]
    assert [r.get("eval_loss") for r in run] == [r.get("eval_loss") for r in ref]
    assert [r["step"] for r in run if "eval_loss" in r] == [3, 6]
    assert (tmp_path / "run-ckpt" / "loss.png").read_bytes()[:8] == PNG_MAGIC


def test_quick_start_on_the_shipped_chat_data_records_metrics_and_draws_the_loss(tmp_path, capsys):
    """The README's quick start: the shipped chat JSONL with the default preset and byte tokens."""
    log = tmp_path / "run"
    rc = main(["finetune", "--data", "chat", "--eval-fraction", "0.02", "--eval-every", "2", "--steps", "2",
               "--batch-size", "2", "--swap-dir", str(tmp_path), "--log-dir", str(log), "--no-progress"])  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert rc == 0
    assert out[-3].startswith("evaluation loss ") and "(perplexity " in out[-3] and out[-3].endswith("after step 2")
    assert out[-2:] == [f"metrics: {log / 'metrics.jsonl'}", f"loss curves: {log / 'loss.png'}"]
    records = _records(log / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "read_bytes", "written_bytes"):
        assert all(isinstance(r[key], (int, float)) for r in records), key
    assert records[0]["lr"] < records[1]["lr"]  # the warm-up
    assert records[1]["grad_norm"] > 0 and records[1]["written_bytes"] > 0
    assert "eval_loss" not in records[0] and records[1]["eval_perplexity"] == pytest.approx(
        float(torch.tensor(records[1]["eval_loss"]).exp()), rel=1e-6
    )
    assert (log / "loss.png").read_bytes()[:8] == PNG_MAGIC
    assert sorted(os.listdir(log)) == ["loss.png", "metrics.jsonl"] + (["tensorboard"] if _has_tensorboard() else [])


def _has_tensorboard() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


def test_without_matplotlib_the_run_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    data = _pairs(tmp_path / "pairs.jsonl", 10)
    rc = main(["finetune", "--preset", "tiny", "--data", data, "--steps", "1", "--batch-size", "2", "--swap-dir",
               str(tmp_path), "--log-dir", str(tmp_path / "run"), "--no-progress"])  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert rc == 0 and out[-1] == "no loss curves: matplotlib is not installed (pip install 'nvoffload[bench]')"
    assert os.listdir(tmp_path / "run") == ["metrics.jsonl"]


def test_metrics_of_a_resumed_run_drop_what_came_after_its_checkpoint(tmp_path):
    from nvoffload.metrics import MetricsLog

    with MetricsLog(tmp_path) as log:
        for step in range(1, 6):
            log.record(step, loss=1.0 / step, eval_loss=None)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # a line cut short by a kill
    with MetricsLog(tmp_path, resume_step=3) as log:
        log.record(4, loss=0.2)
        assert [(r["step"], r["loss"]) for r in log.records()] == [(1, 1.0), (2, 0.5), (3, 1 / 3), (4, 0.2)]
        assert "eval_loss" not in log.records()[0]
    with MetricsLog(tmp_path) as log:  # a new run starts a new file
        assert log.records() == []


def test_data_options_are_checked_before_anything_runs(tmp_path):
    from nvoffload.finetune import FinetuneConfig

    data = _pairs(tmp_path / "pairs.jsonl", 4)
    for bad, message in (
        ({"data_path": str(tmp_path / "absent.jsonl")}, "data_path: no such file"),
        ({"data_path": data, "text_path": data}, "one or the other"),
        ({"eval_fraction": 0.1}, "need a data_path"),
        ({"data_path": data, "eval_fraction": 1.5}, r"eval_fraction must be in \(0, 1\)"),
        ({"data_path": data, "eval_fraction": 0.1, "eval_data_path": data}, "one or the other"),
        ({"data_path": data, "eval_every": 2}, "needs eval_data_path or eval_fraction"),
        ({"data_path": data, "loss_on": "prompt"}, "loss_on must be one of completion, all"),
    ):
        with pytest.raises(ValueError, match=message):
            FinetuneConfig(**bad)


def test_a_hugging_face_model_streams_through_chat_data_with_its_template(tmp_path, capsys):
    """--model DIR with a tokenizer that has a chat template, --data chat, --stream: trains on the assistant's
    tokens and evaluates block by block."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from nvoffload.pretrained import save_pretrained

    bpe = tokenizers.ByteLevelBPETokenizer()
    with open(os.path.join(os.path.dirname(__file__), "..", "nvoffload", "data", "chat.jsonl")) as f:
        texts = [m["content"] for line in f for m in json.loads(line)["messages"]]
    bpe.train_from_iterator(texts, vocab_size=400, show_progress=False, special_tokens=["<eos>", "<|user|>", "<|assistant|>"])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    tokenizer.chat_template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<eos>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    config = transformers.GPT2Config(vocab_size=400, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    save_pretrained(transformers.AutoModelForCausalLM.from_config(config), tmp_path / "gpt2", extra=tokenizer.save_pretrained)
    rc = main(["finetune", "--model", str(tmp_path / "gpt2"), "--data", "chat", "--eval-fraction", "0.05", "--steps",
               "3", "--batch-size", "4", "--seq-len", "64", "--lr", "1e-2", "--swap-dir", str(tmp_path), "--stream",
               "--cpu-memory", "8M", "--device-memory", "64M", "--log-dir", str(tmp_path / "run"), "--no-progress"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    records = _records(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["eval_loss"] > 0


def test_resuming_a_text_run_with_data_is_refused_naming_the_checkpoint(tmp_path, capsys):
    data = _pairs(tmp_path / "pairs.jsonl", 10)
    base = ["finetune", "--preset", "tiny", "--batch-size", "2", "--swap-dir", str(tmp_path), "--no-progress",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume"]  # fmt: skip
    assert main([*base, "--steps", "1"]) == 0
    capsys.readouterr()
    assert main([*base, "--steps", "2", "--data", data]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'ckpt' / 'checkpoint-1'} holds a position in other data than {data}" in err


@pytest.mark.slow
def test_data_parallel_finetune_on_instruction_data_trains_as_one_process(tmp_path, capsys):
    """Two ranks whose rows hold different numbers of targets: each rank's loss is divided by the global
    batch's count, so the averaged gradients are those of one process on the whole batch (a mean per rank
    would weigh the ranks' targets unequally)."""
    from test_distributed import assert_trained_alike

    with open(tmp_path / "uneven.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"prompt": f"{i}?", "completion": " " + "ab" * (1 + (i * 7) % 11)}) + "\n")
    args = ["finetune", "--preset", "tiny", "--data", str(tmp_path / "uneven.jsonl"), "--no-packing", "--steps", "3",
            "--batch-size", "4", "--grad-accum", "2", "--max-grad-norm", "0.05", "--eval-fraction", "0.2",
            "--no-progress"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    for ranks in (1, 2):
        (tmp_path / f"swap{ranks}").mkdir()
    # the two ranks under torchrun, and meanwhile the one process in this one (no second interpreter to start)
    two = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--log-dir",
         str(tmp_path / "torchrun"), "-m", "nvoffload", *args, "--swap-dir", str(tmp_path / "swap2"),
         "--save-to", str(tmp_path / "2.safetensors")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks' OMP_NUM_THREADS
    try:
        assert main([*args, "--swap-dir", str(tmp_path / "swap1"), "--save-to", str(tmp_path / "1.safetensors")]) == 0
        out1 = capsys.readouterr().out
    finally:
        torch.set_num_threads(threads)
        out2, err2 = two.communicate(timeout=300)
    assert two.returncode == 0, out2[-3000:] + err2[-3000:]
    weights = {ranks: load_file(tmp_path / f"{ranks}.safetensors") for ranks in (1, 2)}
    lines = {ranks: [re.findall(r"(?:loss|eval) [\d.]+", line) for line in out.splitlines() if line.startswith("step ")]
             for ranks, out in ((1, out1), (2, out2))}  # fmt: skip
    assert len(lines[2]) == 3 and lines[2][-1][1].startswith("eval ")
    assert lines[1] == lines[2]  # the step's loss and evaluation loss, to the 3 decimals printed
    assert_trained_alike(weights[2], weights[1])


def test_tensorboard_gets_the_same_scalars_when_it_is_installed(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nvoffload.metrics import MetricsLog

    with MetricsLog(tmp_path) as log:
        for step in range(1, 5):
            log.record(step, loss=1.0 / step, eval_loss=0.75 if step == 2 else None)
    with MetricsLog(tmp_path, resume_step=2) as log:  # steps 3 and 4 came after the checkpoint: done again
        log.record(3, loss=0.125)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 0.5), (3, 0.125)]
    assert [(e.step, e.value) for e in events.Scalars("eval_loss")] == [(2, 0.75)]
