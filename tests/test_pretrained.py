"""Hugging Face model directories: ``save_pretrained`` (plain and streamed models) and ``build_meta_model``."""

import errno
import json
import os

import pytest
import torch

import nvoffload
from nvoffload.checkpoint import (
    SafetensorsReader,
    SafetensorsWriter,
    load_file,
    open_checkpoint,
)
from nvoffload.core import atomic as _atomic
from nvoffload.models import GPT, GPTConfig
from nvoffload.pretrained import build_meta_model, check_save_directory, save_pretrained

transformers = pytest.importorskip("transformers")
AutoModelForCausalLM = transformers.AutoModelForCausalLM
VOCAB = 300
SMALL_SHARD = 20_000  # bytes: several shards for these models


def gpt2_config(**kw):
    """Tied embeddings; no dropout, so that forward passes repeat."""
    return transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **kw,
    )  # fmt: skip


def llama_config(**kw):
    """Untied head, rotary frequencies in a non-persistent buffer."""
    return transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, **kw,
    )  # fmt: skip


CONFIGS = {"gpt2": gpt2_config, "llama": llama_config}


def make_model(kind, seed=0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(CONFIGS[kind]())


def tree(path):
    """Every file under ``path`` and its bytes."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = f.read()
    return out


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("max_shard_bytes", [SMALL_SHARD, None])
def test_same_files_as_transformers(tmp_path, kind, max_shard_bytes):
    """The files, shard split, index, config and tensors of transformers' own save_pretrained."""
    model = make_model(kind)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    kw = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    written = save_pretrained(model, ours, **kw)
    model.save_pretrained(theirs, **({} if max_shard_bytes is None else {"max_shard_size": max_shard_bytes}))
    assert written == sorted(os.listdir(theirs)) == sorted(os.listdir(ours))
    shards = [n for n in written if n.endswith(".safetensors")]
    if max_shard_bytes is None:
        assert shards == ["model.safetensors"] and "model.safetensors.index.json" not in written
    else:
        assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
        index = read_json(ours / "model.safetensors.index.json")
        assert index == read_json(theirs / "model.safetensors.index.json")
        assert set(index["weight_map"].values()) == set(shards)
        for shard in shards:
            with SafetensorsReader(ours / shard) as reader:
                assert sum(reader.info(n).nbytes for n in reader.keys()) <= max_shard_bytes or len(reader) == 1
    assert read_json(ours / "config.json") == read_json(theirs / "config.json")
    assert read_json(ours / "generation_config.json") == read_json(theirs / "generation_config.json")
    for shard in shards:
        with SafetensorsReader(ours / shard) as a, SafetensorsReader(theirs / shard) as b:
            assert a.metadata == b.metadata == {"format": "pt"}
            assert sorted(a.keys()) == sorted(b.keys())
            assert all(torch.equal(a.read(n), b.read(n)) for n in a.keys())
    saved = load_file(ours)
    assert ("lm_head.weight" in saved) == (kind == "llama")  # tied in GPT-2: one name, as transformers writes
    back = AutoModelForCausalLM.from_pretrained(ours)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_streamed_model_saved_after_training_loads_with_from_pretrained(tmp_path, kind):
    """Train a streamed model (built on the meta device, filled from a model directory); save_pretrained writes
    the trained weights: from_pretrained's state dict equals model.state_dict() of the streamed model."""
    start = make_model(kind)
    save_pretrained(start, tmp_path / "start", max_shard_bytes=SMALL_SHARD)
    config = transformers.AutoConfig.from_pretrained(tmp_path / "start")
    model = build_meta_model(config)
    assert all(p.is_meta for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    offload = nvoffload.OffloadConfig(swap_dirs=[tmp_path], cpu_memory_bytes=8 << 20, device_memory_bytes=64 << 20)
    with open_checkpoint(tmp_path / "start") as ckpt:
        model, opt = nvoffload.initialize(model, opt, offload, checkpoint=ckpt)
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with opt:
        with torch.no_grad():  # the directory's weights, and the buffers computed off the meta device
            torch.testing.assert_close(model(input_ids=x).logits, start.eval()(input_ids=x).logits)
        for _ in range(2):
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
        trained = {k: v.clone() for k, v in model.state_dict().items()}
        written = opt.session.save_pretrained(tmp_path / "out", max_shard_bytes=SMALL_SHARD)
    assert "model.safetensors.index.json" in written and "config.json" in written
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    assert back.keys() == trained.keys()
    for name, value in trained.items():
        assert torch.equal(back[name], value), name
    moved = [k for k, v in start.state_dict().items() if not torch.equal(v, trained[k])]
    assert len(moved) == len(trained)  # every tensor was trained
    assert sorted(os.listdir(tmp_path)) == ["out", "start"]  # swap files and temporary directories gone


def test_bfloat16_config_dtype(tmp_path):
    model = make_model("llama").to(torch.bfloat16)
    save_pretrained(model, tmp_path / "out")
    assert read_json(tmp_path / "out" / "config.json")["dtype"] == "bfloat16"
    with SafetensorsReader(tmp_path / "out" / "model.safetensors") as reader:
        assert {reader.info(n).dtype for n in reader.keys()} == {torch.bfloat16}
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype="auto")
    assert back.dtype == torch.bfloat16
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())


def test_a_failure_mid_write_leaves_the_previous_directory_intact(tmp_path, monkeypatch):
    out = tmp_path / "out"
    save_pretrained(make_model("gpt2", seed=0), out, max_shard_bytes=SMALL_SHARD)
    before = tree(out)
    new = make_model("gpt2", seed=1)
    real_write, calls = SafetensorsWriter.write, []

    def failing_write(self, name, tensor):
        calls.append(name)
        if len(calls) == 5:
            raise OSError(28, "No space left on device")
        real_write(self, name, tensor)

    monkeypatch.setattr(SafetensorsWriter, "write", failing_write)
    with pytest.raises(OSError, match="No space left"):
        save_pretrained(new, out, max_shard_bytes=SMALL_SHARD)
    monkeypatch.setattr(SafetensorsWriter, "write", real_write)
    assert len(calls) == 5 and tree(out) == before and os.listdir(tmp_path) == ["out"]  # no temporary directory

    def failing_extra(directory):
        assert sorted(os.listdir(directory)) == sorted(before)  # everything else is written by then
        raise RuntimeError("tokenizer failed")

    with pytest.raises(RuntimeError, match="tokenizer failed"):
        save_pretrained(new, out, max_shard_bytes=SMALL_SHARD, extra=failing_extra)
    assert tree(out) == before and os.listdir(tmp_path) == ["out"]

    # the same replacement succeeds, with one directory left: the new one
    for exchange in (True, False):  # renameat2(RENAME_EXCHANGE), and two renames where it is not supported
        if not exchange:
            monkeypatch.setattr(_atomic, "_exchange", lambda a, b: False)
        save_pretrained(new, out, max_shard_bytes=SMALL_SHARD)
        assert os.listdir(tmp_path) == ["out"] and tree(out).keys() == before.keys() and tree(out) != before
        back = load_file(out)
        assert all(torch.equal(back[k], v) for k, v in new.state_dict().items() if k != "lm_head.weight")
        new = make_model("gpt2", seed=2)


def test_targets_that_cannot_be_written(tmp_path):
    model = make_model("gpt2")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="exists and is not a directory"):
        save_pretrained(model, tmp_path / "file")
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        save_pretrained(model, tmp_path / "file" / "out")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        save_pretrained(model, tmp_path / "absent" / "out")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="holds no saved model"):
        save_pretrained(model, tmp_path / "notes")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
    with pytest.raises(ValueError, match="max_shard_bytes"):
        save_pretrained(model, tmp_path / "out", max_shard_bytes=0)
    assert sorted(os.listdir(tmp_path)) == ["file", "notes"]
    (tmp_path / "empty").mkdir()
    assert check_save_directory(tmp_path / "empty") == str(tmp_path / "empty")  # an empty directory may be replaced


def test_a_read_only_directory_is_refused(tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.geteuid() == 0:  # root writes into read-only directories: the kernel's answer to anyone else
        real_mkdir = os.mkdir

        def mkdir(path, mode=0o777):
            if os.path.dirname(os.fspath(path)) == str(locked):
                raise PermissionError(errno.EACCES, "Permission denied", path)
            real_mkdir(path, mode)

        monkeypatch.setattr(os, "mkdir", mkdir)
    try:
        with pytest.raises(PermissionError, match=f"cannot save a model to {locked}/out: cannot create a directory in"):
            save_pretrained(make_model("gpt2"), locked / "out")
        with pytest.raises(PermissionError, match="Permission denied"):
            check_save_directory(locked / "out")
    finally:
        locked.chmod(0o700)
    assert os.listdir(locked) == []


def test_a_plain_module_gets_weights_only(tmp_path):
    """Any nn.Module: no config.json (nvoffload's GPT has a dataclass config); of a tied parameter, the first name."""
    model = GPT(GPTConfig.preset("tiny"))
    assert save_pretrained(model, tmp_path / "gpt") == ["model.safetensors"]
    saved = load_file(tmp_path / "gpt")
    assert saved.keys() == model.state_dict().keys()
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())

    tied = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    tied[1].weight = tied[0].weight
    save_pretrained(tied, tmp_path / "tied")
    assert load_file(tmp_path / "tied").keys() == {"0.weight"}
