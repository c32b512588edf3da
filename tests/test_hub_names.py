"""``--model org/name`` of ``finetune`` and ``plan``: the model is found in the local Hugging Face cache as
``from_pretrained`` finds it offline (the snapshot ``refs/main`` names); a name not there is refused in one line,
exit status 2, nothing created, nothing downloaded."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from nvoffload.cli import main

transformers = pytest.importorskip("transformers")
huggingface_hub = pytest.importorskip("huggingface_hub")

REPO = "tiny-org/tiny-llama"
PROFILE = "rtx4090-256g-2xgen4"  # plan's: a built-in one
REVISION = "0123456789abcdef0123456789abcdef01234567"


def cache_repo(cache, repo: str, model_dir) -> None:
    """Lay ``model_dir``'s files out in ``cache`` as the Hub cache holds a download of ``repo``: each file a blob
    named by its hash under ``models--org--name/blobs``, linked from ``snapshots/<revision>/``, ``refs/main``
    naming that revision."""
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "blobs").mkdir(parents=True)
    (root / "snapshots" / REVISION).mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(REVISION)
    for name in os.listdir(model_dir):
        data = (model_dir / name).read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (root / "blobs" / blob).write_bytes(data)
        (root / "snapshots" / REVISION / name).symlink_to(os.path.join("..", "..", "blobs", blob))


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, request):
    """A Hugging Face cache holding a tiny Llama (bytes as tokens: no tokenizer) under ``REPO``, found through
    ``HF_HUB_CACHE`` or ``HF_HOME`` (``request.param``); offline, as a machine that must not download."""
    cache = tmp_path / "hf_home" / "hub"
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    cache_repo(cache, REPO, tmp_path / "model")
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    if getattr(request, "param", "HF_HUB_CACHE") == "HF_HOME":
        monkeypatch.setenv("HF_HOME", str(cache.parent))
    else:
        monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "swap").mkdir()
    return cache


def test_the_cache_is_laid_out_as_huggingface_hub_reads_it(hub_cache):
    (repo,) = huggingface_hub.scan_cache_dir(hub_cache).repos
    assert repo.repo_id == REPO and {r.commit_hash for r in repo.revisions} == {REVISION} and set(repo.refs) == {"main"}


@pytest.mark.parametrize("hub_cache", ["HF_HUB_CACHE", "HF_HOME"], indirect=True)
def test_finetune_takes_a_model_by_its_hub_name_from_the_cache(hub_cache, tmp_path, capsys):
    snapshot = hub_cache / "models--tiny-org--tiny-llama" / "snapshots" / REVISION
    rc = main([
        "finetune", "--model", REPO, "--steps", "2", "--seq-len", "16", "--batch-size", "2", "--lr", "1e-6",
        "--warmup-steps", "0", "--swap-dir", str(tmp_path / "swap"), "--save-to", str(tmp_path / "out"), "--no-progress",
    ])  # fmt: skip
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert str(snapshot) in out.out
    # 2 steps of AdamW at lr 1e-6 move each weight by about 2e-6 at most: the model trained was the cached one
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    for name, value in transformers.AutoModelForCausalLM.from_pretrained(snapshot).state_dict().items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=3e-6, msg=name)


def test_plan_takes_a_model_by_its_hub_name_from_the_cache(hub_cache, capsys):
    assert main(["plan", "--model", REPO, "--profile", PROFILE, "--json"]) == 0
    shape = json.loads(capsys.readouterr().out)["request"]["model"]
    assert (shape["n_layer"], shape["d_model"], shape["ffn"], shape["vocab_size"]) == (2, 32, 64, 256)


@pytest.mark.parametrize("command", ["finetune", "plan"])
@pytest.mark.parametrize("name", ["tiny-org/missing", "missing-dir"])
def test_a_name_neither_a_directory_nor_cached_is_refused_in_one_line_nothing_created(hub_cache, tmp_path, capsys, command, name):
    before = sorted(p for p in tmp_path.rglob("*"))
    extra = ["--profile", PROFILE] if command == "plan" else ["--checkpoint-dir", str(tmp_path / "ckpt")]
    assert main([command, "--model", name, "--swap-dir", str(tmp_path / "swap"), "--save-to", str(tmp_path / "out"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"nvoffload {command}: error: --model: {name} is not a directory")
    assert f"not in the Hugging Face cache {hub_cache}" in err and f"'hf download {name}'" in err
    assert sorted(p for p in tmp_path.rglob("*")) == before
