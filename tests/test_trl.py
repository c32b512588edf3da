"""trl's ``SFTTrainer`` on a model streamed by ``nvoffload.initialize`` (built on the meta device, filled from its model
directory) with nvoffload's optimizer, full fine-tuning and LoRA: the losses of plain ``SFTTrainer`` on the model in
memory (within twice torch's own fused-vs-unfused AdamW spread), the true gradient norm logged, a resume from the
Trainer's checkpoint bit-identical to the run never stopped; what cannot work on a streamed model is refused."""

from __future__ import annotations

import pytest
import torch

import nvoffload
from nvoffload.checkpoint import open_checkpoint

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

pytestmark = pytest.mark.filterwarnings(
    # peft.get_peft_model asks transformers 5 a deprecated question: theirs, not the library's
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning",
)

STEPS, SAVED_AT, LR, ACCUM = 5, 3, 1e-3, 2
MiB = 1 << 20
ANIMALS, THINGS = ["fox", "cat", "dog", "cow"], ["moon", "fence", "log", "sun", "river"]
TEXTS = [f"the {ANIMALS[i % 4]} jumps over the {THINGS[i % 5]} number {i}" for i in range(40)]


def lora_config():
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE tokenizer trained here on the texts (no download), with EOS and padding tokens."""
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXTS, vocab_size=300, min_frequency=1, show_progress=False, special_tokens=["<eos>", "<pad>"])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", pad_token="<pad>")


@pytest.fixture
def base_dir(tmp_path, tokenizer):
    """A tiny Llama saved as a Hugging Face model directory."""
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "base")
    return tmp_path / "base"


def sft(model, tokenizer, out, *, optimizer=None, peft_config=None, **args):
    """``SFTTrainer`` as a fine-tuner builds it, on ``{"text": ...}`` records: ``STEPS`` steps of ``ACCUM``
    micro-batches, clipped at 1.0 (its default), a checkpoint after step ``SAVED_AT``; ``args``: more of
    ``SFTConfig``."""
    config = trl.SFTConfig(
        str(out), max_steps=STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=ACCUM, learning_rate=LR,
        max_length=32, logging_steps=1, save_strategy="steps", save_steps=SAVED_AT, report_to=[], use_cpu=True,
        bf16=False, activation_checkpointing=True, seed=0, data_seed=0, disable_tqdm=True, **args,
    )  # fmt: skip
    data = datasets.Dataset.from_dict({"text": TEXTS})
    return trl.SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                          optimizers=(optimizer, None), peft_config=peft_config)  # fmt: skip


def streamed(tmp_path, base_dir, *, lora: bool):
    """The model built on the meta device (wrapped by PEFT first, for LoRA), filled from ``base_dir`` and streamed
    with a device budget smaller than its weights, nvoffload's AdamW clipping and accumulating as the Trainer
    asks."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(base_dir))
    if lora:
        model = peft.get_peft_model(model, lora_config())
    offload = nvoffload.OffloadConfig(
        swap_dirs=[tmp_path], cpu_memory_bytes=8 * MiB, device_memory_bytes=800 << 10, max_grad_norm=1.0,
        gradient_accumulation_steps=ACCUM,
    )  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)  # the Trainer's default decay
    with open_checkpoint(base_dir) as checkpoint:
        model, opt = nvoffload.initialize(model, optimizer, offload, checkpoint=checkpoint)
    assert opt.config.release_grads
    assert opt.session.memory.limit_bytes("device") < sum(p.numel() * 4 for p in model.parameters())
    return model, opt


def plain(base_dir, tokenizer, out, *, fused: bool, adapters: dict | None):
    """Plain ``SFTTrainer`` on the model in memory, torch's AdamW fused or not; with ``adapters``, LoRA by its
    ``peft_config``, the adapters starting as ``adapters``. Returns it trained."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    if adapters is None:
        trainer = sft(model, tokenizer, out, optimizer=torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=fused))
    else:  # the Trainer builds the optimizer over the adapters PEFT adds
        trainer = sft(model, tokenizer, out, peft_config=lora_config(), optim="adamw_torch_fused" if fused else "adamw_torch")
        assert not trainer.model.load_state_dict(adapters, strict=False).unexpected_keys
    trainer.train()
    return trainer


def logged(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def trained(state: dict[str, torch.Tensor], lora: bool) -> dict[str, torch.Tensor]:
    """The weights trained: the adapters' for LoRA (the base is frozen), else all."""
    return {name: value.clone() for name, value in state.items() if not lora or "lora_" in name}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sfttrainer_on_a_streamed_model_trains_as_on_the_model_in_memory_and_resumes_exactly(tmp_path, base_dir, tokenizer, lora):
    model, opt = streamed(tmp_path, base_dir, lora=lora)
    with opt:
        start = trained(model.state_dict(), lora)
        run = sft(model, tokenizer, tmp_path / "streamed", optimizer=opt)
        run.train()
        losses, norms, end = logged(run, "loss"), logged(run, "grad_norm"), trained(model.state_dict(), lora)
    refs = {f: plain(base_dir, tokenizer, tmp_path / f"plain-{f}", fused=f, adapters=start if lora else None) for f in (True, False)}
    ref_losses = {f: logged(t, "loss") for f, t in refs.items()}
    ref_end = {f: trained(t.model.state_dict(), lora) for f, t in refs.items()}
    # torch's own spread: fused against unfused AdamW, the same steps otherwise
    loss_spread = max(abs(a - b) for a, b in zip(ref_losses[True], ref_losses[False]))
    weight_spread = max_diff(ref_end[True], ref_end[False])
    assert len(losses) == STEPS and max(abs(a - b) for a, b in zip(losses, ref_losses[True])) <= 2 * loss_spread
    assert max_diff(end, ref_end[True]) <= 2 * weight_spread and max_diff(end, start) > 100 * weight_spread
    # the true gradient norm (before clipping at 1.0, which bit), not the 0.0 clip_grad_norm_ finds released
    torch.testing.assert_close(norms, logged(refs[True], "grad_norm"), rtol=1e-4, atol=0)
    assert min(norms) > 1.0

    model, opt = streamed(tmp_path, base_dir, lora=lora)  # a new process, as after a crash
    with opt:
        resumed = sft(model, tokenizer, tmp_path / "resumed", optimizer=opt)
        resumed.train(resume_from_checkpoint=str(tmp_path / "streamed" / f"checkpoint-{SAVED_AT}"))
        assert logged(resumed, "loss") == losses and logged(resumed, "grad_norm") == norms
        state = trained(model.state_dict(), lora)
        assert all(torch.equal(state[name], value) for name, value in end.items())


REFUSALS = {  # what is done: the way out the refusal names
    "peft_config": r"wrap the model \(peft.get_peft_model\) before nvoffload.initialize\(\)",
    "its-own-optimizer": r"its own optimizer \(AdamW\), which would train nothing: .* optimizers=\(optimizer, None\)",
}


@pytest.mark.parametrize("done", sorted(REFUSALS))
def test_what_cannot_work_on_a_streamed_model_is_refused_in_one_line_with_the_way_out(tmp_path, base_dir, tokenizer, done):
    model, opt = streamed(tmp_path, base_dir, lora=False)
    with opt:
        before = model.state_dict()
        if done == "peft_config":  # SFTTrainer wraps the streamed model itself
            trainer = sft(model, tokenizer, tmp_path / "out", optimizer=opt, peft_config=lora_config())
        else:  # no optimizers=: the Trainer makes its own AdamW
            trainer = sft(model, tokenizer, tmp_path / "out")
        with pytest.raises(ValueError, match=REFUSALS[done]) as refused:
            trainer.train()
        assert "\n" not in str(refused.value)
        after = {name.replace(".base_layer", ""): v for name, v in model.state_dict().items() if "lora_" not in name}
        assert all(torch.equal(after[name], value) for name, value in before.items())
