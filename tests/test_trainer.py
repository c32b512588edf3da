"""A Hugging Face Trainer given a streamed model: it trains as it would without nvoffload, clipping included,
or refuses; it never silently skips clipping."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import nvoffload  # noqa: E402

MiB = 1 << 20


def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=96, n_positions=32, n_embd=64, n_layer=8, n_head=4, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def dataset(n=8, seq_len=16):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (n, seq_len), generator=g)
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def train(model, optimizer, tmp_path, *, max_grad_norm, accum, steps=3):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=2,
        gradient_accumulation_steps=accum, max_grad_norm=max_grad_norm, learning_rate=3e-3,
        lr_scheduler_type="constant", report_to=[], save_strategy="no", logging_strategy="no",
        use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset(), optimizers=(optimizer, None))
    trainer.train()
    return trainer


def streamed(model, tmp_path, **recipe):
    config = nvoffload.OffloadConfig(
        swap_dirs=[tmp_path], cpu_memory_bytes=8 * MiB, device_memory_bytes=1 * MiB, **recipe
    )
    return nvoffload.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3), config)


def test_trainer_clips_and_accumulates_through_the_optimizer_like_plain_torch(tmp_path):
    ref = tiny_gpt2()
    model = copy.deepcopy(ref)
    train(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True), tmp_path / "ref", max_grad_norm=0.5, accum=2)
    model, opt = streamed(model, tmp_path, max_grad_norm=0.5, gradient_accumulation_steps=2)
    try:
        assert opt.session.memory.limit_bytes("device") < sum(p.numel() * 4 for p in model.parameters())
        train(model, opt, tmp_path / "streamed", max_grad_norm=0.5, accum=2)
        assert opt.grad_norm() > 0.5  # the steps were clipped
        state = model.state_dict()
        for name, p in ref.state_dict().items():
            torch.testing.assert_close(state[name], p, rtol=1e-5, atol=1e-6, msg=name)
        assert {int(s["step"]) for s in opt.state_dict()["state"].values()} == {3}
    finally:
        opt.close()


@pytest.mark.parametrize(
    "recipe, error, match",
    [
        ({"gradient_accumulation_steps": 2}, ValueError, r"TrainingArguments\(max_grad_norm=0.5\) .* would silently skip clipping"),
        ({"max_grad_norm": 0.5, "gradient_accumulation_steps": 4}, ValueError, r"gradient_accumulation_steps=2\) but"),
        ({"max_grad_norm": 0.5}, RuntimeError, r"backward ran 2 times .* gradient_accumulation_steps is 1"),
    ],
    ids=["no-clipping", "more-accumulation", "less-accumulation"],
)
def test_trainer_whose_recipe_the_optimizer_lacks_is_refused_with_weights_untouched(tmp_path, recipe, error, match):
    model = tiny_gpt2()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model, opt = streamed(model, tmp_path, **recipe)
    try:
        with pytest.raises(error, match=match):
            train(model, opt, tmp_path / "streamed", max_grad_norm=0.5, accum=2)
        state = model.state_dict()
        for name, p in before.items():
            torch.testing.assert_close(state[name], p, rtol=0, atol=0, msg=name)
    finally:
        opt.close()
