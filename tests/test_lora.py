"""LoRA on a streamed base, built the natural way: the base model on the meta device, ``peft.get_peft_model``, then
``nvoffload.initialize(checkpoint=open_checkpoint(base_dir))``; checked against plain torch + PEFT. And parameters
frozen after ``initialize``."""

from __future__ import annotations

import json
import os

import pytest
import torch

import nvoffload
from nvoffload.checkpoint import open_checkpoint

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.filterwarnings(
    # peft.get_peft_model asks transformers 5 a deprecated question: theirs, not the library's
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning",
)

LR, VOCAB, LAYERS, STEPS = 1e-2, 128, 4, 4
KiB, MiB = 1 << 10, 1 << 20
FAMILIES = {
    "llama": (
        lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
            num_key_value_heads=2,
        )),
        dict(target_modules=["q_proj", "v_proj"]),
    ),
    "gpt2": (
        lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=LAYERS, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )),
        dict(target_modules=["c_attn", "mlp.c_proj"], fan_in_fan_out=True),
    ),
}  # fmt: skip


def lora_config(family: str):
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **FAMILIES[family][1])


def base_model(family: str, *, meta: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    if not meta:
        return FAMILIES[family][0]()
    with torch.device("meta"):
        return FAMILIES[family][0]()


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(step))


def loss_of(model, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=x).loss


def train_step(model, optimizer, step: int) -> None:
    loss_of(model, batch(step)).backward()
    optimizer.step()
    optimizer.zero_grad()


def offload_config(tmp_path, block_bytes: int) -> nvoffload.OffloadConfig:
    """Host memory for three blocks only (each step reads every block, and writes back what changed), all
    of the device's for the model."""
    return nvoffload.OffloadConfig(
        swap_dirs=[tmp_path], cpu_memory_bytes=2 * (3 * block_bytes + 64 * KiB), device_memory_bytes=64 * MiB,
    )  # fmt: skip


def block_bytes(model: torch.nn.Module) -> int:
    layers = nvoffload.streaming.find_blocks(model)
    return max(sum(p.numel() * p.element_size() for p in layer.parameters()) + 8 * KiB for layer in layers)


def streamed_lora(tmp_path, family: str):
    """The base model saved as a Hugging Face directory, and a PEFT LoRA model over it built on the meta device,
    streamed from that directory."""
    base_model(family, meta=False).save_pretrained(tmp_path / "base")
    model = peft.get_peft_model(base_model(family, meta=True), lora_config(family))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    with open_checkpoint(tmp_path / "base") as ckpt:
        return nvoffload.initialize(model, optimizer, offload_config(tmp_path, block_bytes(model)), checkpoint=ckpt)


def adapters(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value for name, value in state.items() if "lora_" in name}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_lora_on_a_streamed_base_trains_like_torch_and_peft_and_writes_only_the_adapters(tmp_path, family):
    model, opt = streamed_lora(tmp_path, family)
    with opt:
        start = model.state_dict()
        init = adapters(start)
        assert init and all(bool(v.isfinite().all()) for v in init.values())
        assert all(not v.any() for n, v in init.items() if "lora_B" in n)  # PEFT's init: B zero, A Kaiming-uniform
        for name, value in init.items():  # Kaiming-uniform: U(-b, b), b = 1 / sqrt(fan_in)
            bound = value.shape[1] ** -0.5
            assert "lora_B" in name or (value.abs().max() <= bound and value.std() > bound / 2 / 3**0.5), name
        ref = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"), lora_config(family))
        assert sorted(ref.state_dict()) == sorted(start)
        ref.load_state_dict(init, strict=False)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1, fused=True)
        trainable = [p for p in model.parameters() if p.requires_grad]
        layer = [p for p in nvoffload.streaming.find_blocks(model)[0].parameters() if p.requires_grad]
        layer_bytes = sum(-(-p.numel() * 4 // 64) * 64 for p in layer)  # one layer's adapters in its block
        for step in range(STEPS):
            train_step(ref, ref_opt, step)
            opt.session.reset_stats()
            train_step(model, opt, step)
            read, written = opt.session.io_bytes()
            if step:  # the first step writes the state's first generation too
                # the optimizer: master weights and moments of the adapters only (fp32: 12 bytes an element)
                assert opt.memory_stats().written_bytes == 12 * sum(p.numel() for p in trainable)
                # the streamer: the blocks' adapter parts (each written back once per update, at most), no base weight;
                # how many of them a step writes back depends on when each update lands against its block's eviction
                streamed = opt.session.streamer.stats()
                adapter_parts = streamed.bytes_written // layer_bytes
                assert streamed.bytes_written % layer_bytes == 0 and adapter_parts <= len(trainable)
                assert written == opt.memory_stats().written_bytes + streamed.bytes_written
                assert read == opt.memory_stats().read_bytes + streamed.bytes_read
                assert streamed.bytes_read > 0  # the base weights are read again: the host holds 3 blocks
        state = model.state_dict()
        for name, value in ref.state_dict().items():
            if "lora_" in name:
                torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
                assert not torch.equal(state[name], init[name])
            else:
                assert torch.equal(state[name], start[name]), name
        # the adapter as PEFT saves it, and the merged model as merge_and_unload() gives it
        assert opt.session.save_pretrained(tmp_path / "adapter") == ["adapter_config.json", "adapter_model.safetensors"]
        base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
        loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
        for name, value in loaded.state_dict().items():
            assert torch.equal(value, state[name]), name
        opt.session.save_pretrained(tmp_path / "merged", merged=True, max_shard_bytes=100_000)
        index = json.loads((tmp_path / "merged" / "model.safetensors.index.json").read_text())
        assert index["metadata"]["total_parameters"] == sum(p.numel() for n, p in base.named_parameters() if "lora_" not in n)
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
        for name, value in loaded.merge_and_unload().state_dict().items():
            torch.testing.assert_close(merged[name], value, rtol=0, atol=1e-7, msg=name)


def set_trainable(model: torch.nn.Module, trainable: bool) -> None:
    """A block and the embeddings of a Llama model frozen or unfrozen."""
    model.model.layers[1].requires_grad_(trainable)
    model.model.embed_tokens.requires_grad_(trainable)


@pytest.mark.parametrize("change", ["frozen", "unfrozen"])
def test_a_block_frozen_or_unfrozen_after_initialize_trains_like_torch(tmp_path, change):
    ref = base_model("llama", meta=False)
    ref.save_pretrained(tmp_path / "base")
    model = base_model("llama", meta=True)
    if change == "unfrozen":  # frozen when initialize() runs
        set_trainable(ref, False)
        set_trainable(model, False)
    with open_checkpoint(tmp_path / "base") as ckpt:
        model, opt = nvoffload.initialize(
            model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1),
            offload_config(tmp_path, block_bytes(model)), checkpoint=ckpt,
        )  # fmt: skip
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1, fused=True)
    with opt:
        for step in range(STEPS):
            if step == 2:  # between steps
                set_trainable(ref, change == "unfrozen")
                set_trainable(model, change == "unfrozen")
                kept = {n: v.clone() for n, v in ref.state_dict().items() if "layers.1." in n or "embed" in n}
            train_step(ref, ref_opt, step)
            train_step(model, opt, step)
            for name, value in model.named_parameters():
                assert value.grad is None, name  # every gradient was taken by the optimizer
        state = model.state_dict()
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
        for name, value in kept.items():  # frozen: as they were; unfrozen: trained since
            assert torch.equal(state[name], value) == (change == "frozen"), name


def test_frozen_parameters_ask_no_swap_space_and_get_no_optimizer_state(tmp_path):
    # 10**11 frozen elements that take no memory (a stride-0 view): their optimizer state would need 2.4 TB
    frozen = torch.nn.Parameter(torch.zeros(1).expand(10**11), requires_grad=False)
    trained = torch.nn.Parameter(torch.ones(4096))
    with nvoffload.optim.OffloadOptimizer(
        torch.optim.AdamW([trained, frozen], lr=LR), swap_dir=tmp_path, cpu_memory_bytes=256 * MiB
    ) as opt:  # fmt: skip
        trained.grad = torch.full_like(trained, 0.5)
        opt.step()
        assert opt.memory_stats().nvme_bytes == 12 * trained.numel()  # fp32 master, m and v of the trained one
        torch.testing.assert_close(trained.detach(), torch.full((4096,), 1 - LR - LR * 0.01))


def test_an_adapter_directory_fills_the_adapter_of_a_streamed_base(tmp_path):
    ref_base = base_model("llama", meta=False)
    ref_base.save_pretrained(tmp_path / "base")
    ref = peft.get_peft_model(ref_base, lora_config("llama"))
    with torch.no_grad():  # a trained adapter: lora_B no longer zero
        for name, p in ref.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    ref.save_pretrained(tmp_path / "adapter")
    model = peft.get_peft_model(base_model("llama", meta=True), lora_config("llama"))
    with open_checkpoint(tmp_path / "base") as base, open_checkpoint(tmp_path / "adapter") as adapter:
        model, opt = nvoffload.initialize(
            model, torch.optim.AdamW(model.parameters(), lr=LR), offload_config(tmp_path, block_bytes(model)),
            checkpoint=[base, adapter],
        )  # fmt: skip
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)
    with opt:
        state = model.state_dict()
        for name, value in ref.state_dict().items():
            assert torch.equal(state[name], value), name
        for step in range(2):
            train_step(ref, ref_opt, step)
            train_step(model, opt, step)
        state = model.state_dict()
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


STREAM = ["--stream", "--cpu-memory", "8M", "--device-memory", "64M"]


def _tiny_llama_config():
    """A Llama of a vocabulary of 300 (the text as bytes needs 256 at least)."""
    return transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip


def tiny_llama_dir(path) -> None:
    """A Llama directory without a tokenizer (the text as bytes)."""
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_tiny_llama_config()).save_pretrained(path)


def finetune_lora(*args: str) -> int:
    from nvoffload.cli import main

    return main(["finetune", "--lora-rank", "4", "--lora-targets", "q_proj", "v_proj", "--seq-len", "16", "--batch-size",
                 "2", "--warmup-steps", "0", "--no-progress", *args])  # fmt: skip


@pytest.mark.parametrize("mode", [[], STREAM], ids=["", "stream"])
def test_finetune_lora_rank_trains_and_saves_an_adapter(tmp_path, capsys, monkeypatch, mode):
    """The adapter --save-to writes is PEFT's, and AutoPeftModelForCausalLM opens it from another working directory
    (the paths given relative): it had task_type null and the base model's path as typed."""
    monkeypatch.chdir(tmp_path)
    tiny_llama_dir("base")
    os.mkdir("swap")
    rc = finetune_lora("--model", "base", "--steps", "3", "--lr", "1e-2", "--swap-dir", "swap", "--save-to", "out", *mode)
    assert rc == 0, capsys.readouterr()
    assert sorted(os.listdir(tmp_path / "out")) == ["adapter_config.json", "adapter_model.safetensors"]
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    start = {name: value.clone() for name, value in base.state_dict().items()}
    tuned = peft.PeftModel.from_pretrained(base, tmp_path / "out")
    assert tuned.peft_config["default"].r == 4 and tuned.peft_config["default"].target_modules == {"q_proj", "v_proj"}
    state = tuned.state_dict()
    trained = [name for name, value in state.items() if "lora_B" in name]
    assert len(trained) == 4 and all(state[name].any() for name in trained)  # lora_B moved from zero
    for name, value in tuned.get_base_model().state_dict().items():  # the base is as it was
        assert "lora_" in name or torch.equal(value, start[name.replace(".base_layer", "")]), name
    os.mkdir("elsewhere")
    monkeypatch.chdir("elsewhere")
    opened = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "out")
    assert opened.peft_config["default"].task_type == "CAUSAL_LM"
    assert opened.peft_config["default"].base_model_name_or_path == str(tmp_path / "base")
    assert opened.state_dict().keys() == state.keys() and all(torch.equal(v, state[k]) for k, v in opened.state_dict().items())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_finetune_lora_starts_from_the_same_adapters_with_and_without_stream(tmp_path, capsys, device):
    """The adapters' initial weights depend on --seed alone: PEFT's draw after torch.manual_seed(seed) on the CPU, in
    memory and streamed, on any device. (One step of lr 1e-30 leaves lora_A as it started and lora_B at most 1e-30
    from zero.) They differed; then on a GPU, where the streamed run drew them with the GPU's generator."""
    tiny_llama_dir(tmp_path / "base")
    (tmp_path / "swap").mkdir()
    saved = {}
    for name, mode in (("memory", []), ("stream", STREAM)):
        rc = finetune_lora("--model", str(tmp_path / "base"), "--steps", "1", "--lr", "1e-30", "--seed", "3",
                           "--swap-dir", str(tmp_path / "swap"), "--save-to", str(tmp_path / name), "--device", device,
                           *mode)  # fmt: skip
        assert rc == 0, capsys.readouterr()
        with open_checkpoint(tmp_path / name) as ckpt:
            saved[name] = {key: ckpt.read(key) for key in ckpt.keys()}
    torch.manual_seed(3)
    ref = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
        peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )  # fmt: skip
    expected = {name.replace(".default", ""): value for name, value in ref.state_dict().items() if "lora_A" in name}
    assert len(expected) == 4
    for state in saved.values():
        assert state.keys() == {*expected, *(n.replace("lora_A", "lora_B") for n in expected)}
        assert all(torch.equal(state[name], value) for name, value in expected.items())
        assert all(float(v.abs().max()) <= 1e-29 for n, v in state.items() if "lora_B" in n)


def test_finetune_refuses_lora_targets_the_model_lacks_naming_the_flag_before_anything_is_written(tmp_path, capsys):
    """--lora-targets with a typo among good names (PEFT adapted the others silently; with every name wrong, PEFT's
    own message): one line naming the flag, the name and the model's linear layers, exit 2, nothing created."""
    tiny_llama_dir(tmp_path / "base")
    (tmp_path / "swap").mkdir()
    capsys.readouterr()  # transformers' progress bar
    for targets, wrong in ((["q_proj", "v_prj"], "v_prj"), (["qproj"], "qproj")):
        rc = finetune_lora("--model", str(tmp_path / "base"), "--lora-targets", *targets, "--steps", "1", "--swap-dir",
                           str(tmp_path / "swap"), "--save-to", str(tmp_path / "out"), "--checkpoint-dir",
                           str(tmp_path / "ckpt"), *STREAM)  # fmt: skip
        captured = capsys.readouterr()
        assert rc == 2 and captured.out == "" and captured.err == (
            f"nvoffload finetune: error: --lora-targets {wrong} name no linear layer of the llama model"
            " (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head)\n"
        ), captured.err  # fmt: skip
        assert sorted(os.listdir(tmp_path)) == ["base", "swap"] and os.listdir(tmp_path / "swap") == []


@pytest.mark.parametrize(
    "flags,message",
    [(["--lora-rank", "4"], "--lora-rank must be >= 1 and needs a --model"), (["--lora-targets", "q_proj"], "--lora-targets needs --lora-rank")],
)
def test_finetune_lora_flags_refused_name_the_flag(capsys, flags, message):
    from nvoffload.cli import main

    assert main(["finetune", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_wrapping_a_streamed_model_after_initialize_is_refused_with_the_way_out(tmp_path):
    base_model("llama", meta=False).save_pretrained(tmp_path / "base")
    model = base_model("llama", meta=True)
    with open_checkpoint(tmp_path / "base") as ckpt:
        model, opt = nvoffload.initialize(
            model, torch.optim.AdamW(model.parameters(), lr=LR), offload_config(tmp_path, block_bytes(model)),
            checkpoint=ckpt,
        )  # fmt: skip
    with opt:
        wrapped = peft.get_peft_model(model, lora_config("llama"))
        with pytest.raises(ValueError, match=r"get_peft_model.* before nvoffload.initialize\(\)"):
            loss_of(wrapped, batch(0))


def test_the_streamed_adapter_init_draws_peft_s_values_whatever_the_parameters_dtype():
    """The streamer initializes the adapters of a PEFT model built on the meta device where they sit, by PEFT's own
    init functions: it drew them there, in their device's generator and dtype, where PEFT draws them on the CPU in
    float32 and then moves them to the base's device and dtype. A float64 base on the CPU shows it here (its
    adapters, drawn in float64, were other values than PEFT's); on a GPU the streamed run's adapters came from the
    GPU's generator (test_finetune_lora_starts_from_the_same_adapters_with_and_without_stream, cuda)."""
    from nvoffload.streaming._materialize import _post_order
    from nvoffload.streaming._peft import PeftView

    base = transformers.LlamaForCausalLM(_tiny_llama_config()).to(torch.float64)
    torch.manual_seed(3)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    adapters = {name: p for name, p in model.named_parameters() if "lora_" in name}
    drawn = {name: p.detach().clone() for name, p in adapters.items()}
    assert len(drawn) == 8 and all(p.dtype == torch.float64 for p in drawn.values())
    with torch.no_grad():
        for p in adapters.values():
            p.fill_(torch.nan)
    torch.manual_seed(3)
    init = PeftView.of(model).adapter_init()
    for module in _post_order(model):
        init(module)
    assert all(torch.equal(p, drawn[name]) for name, p in adapters.items())
