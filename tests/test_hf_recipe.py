"""The fine-tuning recipe on Hugging Face models as a 100B run does it: built on the meta device, filled from
small shards under budgets smaller than the model, clipped at 1.0 over 2 micro-batches, saved back as a model
directory; checked against torch."""

from __future__ import annotations

import math

import pytest
import torch
from test_streaming_recipe import MasterLoop

import nvoffload
from nvoffload.checkpoint import open_checkpoint
from nvoffload.streaming import find_blocks

transformers = pytest.importorskip("transformers")

STEPS, LR, VOCAB = 10, 3e-3, 128
KiB, MiB = 1 << 10, 1 << 20
FAMILIES = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2,
    )),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2,
    )),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=8, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )),
}  # fmt: skip


def build(family: str, *, meta: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    if not meta:
        return FAMILIES[family]()
    with torch.device("meta"):
        return FAMILIES[family]()


def budgets(tmp_path, model, **recipe) -> nvoffload.OffloadConfig:
    """A device budget smaller than the model and a host budget smaller than its training state, with room for the
    optimizer's chunks to hold whole parameters (whose norms are then clip_grad_norm_'s to the last bit)."""
    blocks = find_blocks(model)
    streamed = {p for b in blocks for p in b.parameters()}
    block = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks)
    resident = sum(p.numel() * p.element_size() for p in model.parameters() if p not in streamed)
    return nvoffload.OffloadConfig(
        swap_dirs=[tmp_path], device_memory_bytes=2 * resident + 3 * block + 64 * KiB,
        cpu_memory_bytes=5 * MiB // 2, optimizer_memory_fraction=0.6, **recipe,
    )  # fmt: skip


def hf_loss(model, x, y):
    return model(input_ids=x, labels=y).loss


def micro_batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    return [(x, x) for x in torch.randint(0, VOCAB, (2, 2, 16), generator=g)]


def streamed_from_shards(tmp_path, family, dtype, **recipe):
    """The reference model, and a copy built on the meta device and filled from its 20 KB shards, streamed."""
    ref = build(family, meta=False).to(dtype)
    ref.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    model = build(family, meta=True).to(dtype)
    offload = budgets(tmp_path, model, **recipe)
    with open_checkpoint(tmp_path / "hf") as ckpt:
        model, opt = nvoffload.initialize(
            model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1), offload, checkpoint=ckpt
        )
    n_params = sum(p.numel() for p in model.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert offload.device_memory_bytes < model_bytes and offload.cpu_memory_bytes < 16 * n_params
    return ref, model, opt


def streamed_step(model, opt, batches) -> float:
    for x, y in batches:
        opt.scale_loss(hf_loss(model, x, y) / len(batches)).backward()
    norm = opt.grad_norm()
    opt.step()
    opt.zero_grad()
    return norm


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt2"])
def test_ten_clipped_accumulated_steps_equal_fused_adamw_and_save_as_a_model_directory(tmp_path, family):
    ref, model, opt = streamed_from_shards(tmp_path, family, torch.float32, max_grad_norm=1.0, gradient_accumulation_steps=2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1, fused=True)
    with opt:
        for step in range(STEPS):
            batches = micro_batches(step)
            for x, y in batches:
                (hf_loss(ref, x, y) / 2).backward()
            ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))
            ref_opt.step()
            ref_opt.zero_grad()
            assert streamed_step(model, opt, batches) == pytest.approx(ref_norm, rel=1e-5)
        state = model.state_dict()
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
        opt.session.save_pretrained(tmp_path / "tuned", max_shard_bytes=20_000)
        assert len(list((tmp_path / "tuned").glob("*.safetensors"))) > 3
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tuned").state_dict()
        for name, value in state.items():
            torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)


def test_bf16_equals_the_fp32_master_loop(tmp_path):
    ref, model, opt = streamed_from_shards(tmp_path, "llama", torch.bfloat16, max_grad_norm=1.0, gradient_accumulation_steps=2)
    loop = MasterLoop(ref, 1.0, loss=hf_loss)
    with opt:
        for step in range(STEPS):
            batches = micro_batches(step)
            assert streamed_step(model, opt, batches) == pytest.approx(loop.step(batches), rel=1e-5)
        state = model.state_dict()
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)


def test_fp16_equals_grad_scaler_and_adamw_with_skipped_steps(tmp_path):
    scaling = nvoffload.LossScaling(init_scale=2.0**16, growth_interval=3)
    ref, model, opt = streamed_from_shards(
        tmp_path, "llama", torch.float16, max_grad_norm=1.0, gradient_accumulation_steps=2, loss_scaling=scaling
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=scaling.init_scale, growth_interval=scaling.growth_interval)
    loop = MasterLoop(ref, 1.0, scaler, loss=hf_loss)
    skipped = 0
    with opt:
        for step in range(STEPS):
            batches = micro_batches(step)
            assert opt.loss_scale == scaler.get_scale()
            ref_norm, norm = loop.step(batches), streamed_step(model, opt, batches)
            if math.isfinite(ref_norm):
                assert norm == pytest.approx(ref_norm, rel=1e-5)
            else:
                assert not math.isfinite(norm)
                skipped += 1
        assert skipped >= 1
        state = model.state_dict()
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)
