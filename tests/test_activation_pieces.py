"""A saved activation larger than activation offload's host staging is written and read through it in pieces:
a transformers GPT-2 whose logits outgrow the staging trains as it does without activation offload."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import nvoffload  # noqa: E402

MiB = 1 << 20
BATCH, SEQ = 2, 256


def gpt2(n_embd: int, n_layer: int, n_head: int) -> torch.nn.Module:
    """GPT-2's vocabulary and context (its logits: 103 MB at batch 2 x 256), the width and depth given."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=50257, n_positions=1024, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def train(model, tmp_path, steps: int, **recipe) -> tuple[list[float], dict[str, torch.Tensor], nvoffload.OffloadOptimizer]:
    tmp_path.mkdir()
    config = nvoffload.OffloadConfig(
        swap_dirs=[tmp_path], cpu_memory_bytes=256 * MiB, device_memory_bytes=400 * MiB, **recipe
    )  # fmt: skip
    model, opt = nvoffload.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    data = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 50257, (BATCH, SEQ), generator=data)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.clone() for k, v in model.state_dict().items()}, opt


def test_logits_larger_than_the_staging_train_as_without_activation_offload(tmp_path):
    model = gpt2(n_embd=64, n_layer=2, n_head=4)
    reference = copy.deepcopy(model)
    losses, weights, opt = train(model, tmp_path / "offloaded", 2, offload_activations=True)
    try:
        stats = opt.session._activations.stats()
        staging = opt.session.config.activation_bytes
        logits_bytes = BATCH * SEQ * 50257 * 4
        assert logits_bytes > staging and stats.bytes_written > logits_bytes and stats.bytes_read > logits_bytes
    finally:
        opt.close()
    expected_losses, expected, ref_opt = train(reference, tmp_path / "kept", 2)
    ref_opt.close()
    assert losses == expected_losses
    for name, value in expected.items():
        assert torch.equal(weights[name], value), name
