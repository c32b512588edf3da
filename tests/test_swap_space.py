"""What a run keeps in its swap directory: one count (:func:`nvoffload.planner.cost.swap_bytes`) for the planner's
NVMe memory and ``finetune``'s free-space check, held against the swap files a streamed run really writes, for
every optimizer state precision, the delayed update and LoRA."""

from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch

from nvoffload.finetune import FinetuneConfig, finetune
from nvoffload.finetune.checks import _swap_request
from nvoffload.planner import ModelShape, plan
from nvoffload.planner.cost import swap_bytes
from nvoffload.planner.profile import BUILTIN_PROFILES

transformers = pytest.importorskip("transformers")

SEQ_LEN = 16
ALIGNMENT = 4096  # the store's: every tensor (a chunk of the optimizer state, each generation) starts on it


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A Llama of 4.3M parameters in 39 tensors (2 MiB blocks in bf16), no tokenizer: bytes."""
    from nvoffload.pretrained import save_pretrained

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                      num_attention_heads=4, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf") / "llama"
    save_pretrained(transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16), path)
    return str(path)


# The host budget caches three of the four blocks (five with the delayed update's twins): no optimizer state is
# kept resident in host memory, all of it goes to the swap files.
CASES = {
    "fp32": dict(state_precision="fp32"),
    "bf16-moments": dict(state_precision="bf16-moments"),
    "bf16": dict(state_precision="bf16"),
    "8bit": dict(state_precision="8bit"),
    "8bit-accumulated": dict(state_precision="8bit", grad_accum_steps=2, vertical=False),
    "delayed-update": dict(state_precision="8bit", delayed_update=True, cpu_memory_bytes=22 << 20),
    "lora": dict(state_precision="fp32", lora_rank=8),
}


def _config(llama_dir, swap_dir, **fields) -> FinetuneConfig:
    base = dict(model_dir=llama_dir, stream=True, dtype="bfloat16", cpu_memory_bytes=14 << 20, steps=3, batch_size=1,
                seq_len=SEQ_LEN, warmup_steps=0, swap_dir=str(swap_dir))  # fmt: skip
    return FinetuneConfig(**{**base, **fields})


def _swap_files_bytes(directory) -> int:
    return sum(os.stat(f).st_size for f in glob.glob(os.path.join(directory, "*.swap")))


@pytest.mark.parametrize("case", list(CASES))
def test_the_counted_bytes_are_what_the_swap_files_take_after_a_step(llama_dir, tmp_path, case):
    """Three steps of the streamed Llama: the swap files' size never exceeds the count by more than the store's
    alignment (each tensor's entries rounded up to 4 KiB), and grows to within it. With the delayed update the count
    is an upper bound within 5%: it takes a twin of every weight and two kept gradient sums of every parameter,
    where the store keeps fewer for the parameters outside the blocks."""
    config = _config(llama_dir, tmp_path, **CASES[case])
    shape = ModelShape.from_hf_config(llama_dir)
    request = _swap_request(config, shape, SEQ_LEN)
    space = swap_bytes(request, stream=True, offload=False)
    assert space.state_params == request.trainable_params  # with LoRA the adapters only
    assert (request.trainable_params < shape.params // 10) == (config.lora_rank is not None)
    taken = []
    finetune(config, progress=False, on_step=lambda s: taken.append(_swap_files_bytes(tmp_path)))
    # each tensor's entries (its weights and twin, two generations of state and master, two kept sums), rounded up
    slack = (4 * 9 + 3) * (2 + 2 * 2 + 2) * ALIGNMENT
    assert all(size <= space.total + slack for size in taken), (case, taken, space)
    below = space.total // 20 if config.delayed_update else slack
    assert space.total - below <= taken[-1], (case, taken, space)  # the files grow to their peak
    # the count tells the precisions apart: each is further from the next than the slack
    assert slack < 2 * 2 * shape.params // 4


def test_the_planner_and_the_check_count_the_same_bytes(llama_dir, tmp_path):
    """The plan's NVMe memory for finetune's request is the check's count, for every precision (no state resident
    in host memory at this budget), and the compact states count what the planner says they keep."""
    shape = ModelShape.from_hf_config(llama_dir)
    profile = BUILTIN_PROFILES["h100-sxm-512g-4xgen4"]
    totals = {}
    for case, fields in CASES.items():
        config = _config(llama_dir, tmp_path, **fields)
        request = _swap_request(config, shape, SEQ_LEN)
        chosen = plan(request, profile)
        assert chosen.resident_state_bytes == 0, case
        totals[case] = swap_bytes(request, stream=True, offload=False).total
        assert chosen.memory_bytes["nvme"] == totals[case], case
    weights = shape.params * 2
    assert totals["fp32"] == weights + 2 * 12 * shape.params
    assert totals["bf16-moments"] == weights + 2 * 8 * shape.params
    assert totals["bf16"] == weights + 2 * 6 * shape.params
    assert totals["8bit"] == weights + 2 * (4 * shape.params + 2 * -(-shape.params // 256))


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
def test_compact_state_passes_the_check_on_a_disk_exact_adamw_does_not_fit(
    llama_dir, tmp_path, capsys, monkeypatch, precision
):
    """A file system with room for the compact state (and its 64 MiB to spare) but not for exact AdamW's: finetune
    with --optimizer-state bf16 or 8bit trains; fp32 is refused in one line, in human sizes, before anything is
    written. (The check counted exact AdamW's bytes whatever the precision: every one was refused.)"""
    from nvoffload.cli import main
    from nvoffload.io.store import spare_bytes

    swap = tmp_path / "swap"
    swap.mkdir()
    config = _config(llama_dir, swap, state_precision=precision)
    request = _swap_request(config, ModelShape.from_hf_config(llama_dir), SEQ_LEN)
    compact = swap_bytes(request, stream=True, offload=False).total
    free = compact + spare_bytes(compact) + (4 << 20)  # initialize() checks again, counting each tensor's alignment
    real = shutil.disk_usage
    monkeypatch.setattr("nvoffload.io.store.shutil.disk_usage", lambda p: real(p)._replace(free=free))
    argv = ["finetune", "--model", llama_dir, "--stream", "--dtype", "bfloat16", "--cpu-memory", "14M", "--batch-size",
            "1", "--seq-len", str(SEQ_LEN), "--steps", "1", "--swap-dir", str(swap), "--no-progress"]  # fmt: skip
    assert main([*argv, "--optimizer-state", precision]) == 0
    capsys.readouterr()
    assert main([*argv, "--optimizer-state", "fp32"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"nvoffload finetune: error: swap directory {swap} needs "), err
    assert " to spare but the file system has only " in err, err
    assert not any(word.isdigit() and len(word) > 4 for word in err.replace("(", " ").split()), err  # human sizes
    assert not os.listdir(swap)
