"""A Hugging Face Trainer driving a streamed model logs the true gradient norm (the optimizer's), not the 0.0 that
``clip_grad_norm_`` finds on parameters whose gradients nvoffload released during backward."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import nvoffload  # noqa: E402
from test_trainer import dataset, streamed, tiny_gpt2  # noqa: E402


def logged_grad_norms(model, optimizer, tmp_path, *, max_grad_norm: float, accum: int) -> list[float]:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=2,
        gradient_accumulation_steps=accum, max_grad_norm=max_grad_norm, learning_rate=3e-3,
        lr_scheduler_type="constant", report_to=[], save_strategy="no", logging_steps=1,
        use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset(), optimizers=(optimizer, None))
    trainer.train()
    return [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]


@pytest.mark.parametrize(
    "max_grad_norm, recipe",
    [(0.5, {"max_grad_norm": 0.5, "gradient_accumulation_steps": 2}), (0.0, {"gradient_accumulation_steps": 2})],
    ids=["clipped", "unclipped"],
)
def test_trainer_logs_the_optimizers_grad_norm_of_released_gradients(tmp_path, max_grad_norm, recipe):
    ref = tiny_gpt2()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True)
    expected = logged_grad_norms(ref, ref_opt, tmp_path / "ref", max_grad_norm=max_grad_norm, accum=2)
    model, opt = streamed(model, tmp_path, **recipe)
    try:
        assert opt.config.release_grads
        got = logged_grad_norms(model, opt, tmp_path / "streamed", max_grad_norm=max_grad_norm, accum=2)
        assert len(expected) == 3 and min(expected) > 0.5
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=0)
        assert got[-1] == opt.grad_norm()
    finally:
        opt.close()
