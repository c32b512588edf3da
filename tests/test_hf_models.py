"""Hugging Face causal LMs built on the meta device, streamed as they are: filled from sharded checkpoints or by
their own init, checked against the same models trained in RAM with torch's AdamW."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import nvoffload
from nvoffload.checkpoint import load_file, open_checkpoint, save_file
from nvoffload.streaming import find_blocks

transformers = pytest.importorskip("transformers")

MiB = 1 << 20
VOCAB = 128

# family -> (model class, config, the ModuleList of layers)
FAMILIES = {
    "llama": (
        transformers.LlamaForCausalLM,
        lambda: transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2,
        ),
        "model.layers",
    ),
    "mistral": (
        transformers.MistralForCausalLM,
        lambda: transformers.MistralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2,
        ),
        "model.layers",
    ),
    "gpt2": (
        transformers.GPT2LMHeadModel,
        lambda: transformers.GPT2Config(
            n_embd=32, n_layer=3, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        ),
        "transformer.h",
    ),
    "gpt_neox": (
        transformers.GPTNeoXForCausalLM,
        lambda: transformers.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
        ),
        "gpt_neox.layers",
    ),
    "opt": (
        transformers.OPTForCausalLM,
        lambda: transformers.OPTConfig(
            vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=3, num_attention_heads=4,
            max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0, bos_token_id=0, eos_token_id=0,
            pad_token_id=1,
        ),
        "model.decoder.layers",
    ),
}


def build(family: str, *, meta: bool, seed: int = 0):
    cls, make_config, _ = FAMILIES[family]
    torch.manual_seed(seed)
    if not meta:
        return cls(make_config())
    with torch.device("meta"):
        return cls(make_config())


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed))


def config(tmp_path, model: nn.Module) -> nvoffload.OffloadConfig:
    """Budgets just above the smallest that stream ``model``."""
    blocks = find_blocks(model)
    streamed = {p for b in blocks for p in b.parameters()}
    block = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks)
    resident = sum(p.numel() * p.element_size() for p in model.parameters() if p not in streamed)
    return nvoffload.OffloadConfig(
        swap_dirs=[tmp_path], device_memory_bytes=2 * resident + 3 * block + MiB, cpu_memory_bytes=2 * (3 * block + MiB)
    )


def assert_states_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


def train_side_by_side(model, opt, ref, steps: int) -> None:
    """``steps`` of the streamed model and of ``ref`` with torch's fused AdamW: same losses, and same weights after
    the first step (the first gradients) and the last."""
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    for step in range(steps):
        x = tokens(step)
        ref_loss = ref(input_ids=x, labels=x).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
        if step in (0, steps - 1):
            assert_states_close(model.state_dict(), ref.state_dict())


@pytest.mark.parametrize("family", FAMILIES)
def test_meta_model_from_sharded_checkpoint_trains_like_torch(tmp_path, family):
    """Built on the meta device, filled from ``save_pretrained`` shards (tied heads omitted there, GPT-NeoX's head
    under its old name): its layers found unnamed, its rotary buffers rebuilt equal to a CPU-built model's, the same
    logits, and three steps of the same losses and weights as the original trained with torch's fused AdamW."""
    ref = build(family, meta=False)
    ref.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 3
    model = build(family, meta=True)
    assert find_blocks(model) == list(model.get_submodule(FAMILIES[family][2]))
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied == (family in ("gpt2", "opt"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    with open_checkpoint(tmp_path / "hf") as ckpt:
        if tied:
            assert "lm_head.weight" not in ckpt
        if family == "gpt_neox":  # written under its old name, renamed as transformers does
            assert "embed_out.weight" in ckpt
        model, opt = nvoffload.initialize(model, opt, config(tmp_path, model), checkpoint=ckpt)
    try:
        assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
        buffers = dict(model.named_buffers())
        assert buffers.keys() == dict(ref.named_buffers()).keys()
        for name, value in ref.named_buffers():
            assert buffers[name].device == value.device and torch.equal(buffers[name], value), name
        x = tokens(100)
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=x).logits, ref(input_ids=x).logits, rtol=1e-5, atol=1e-6)
        train_side_by_side(model, opt, ref, steps=3)
        streamed = [p for block in find_blocks(model) for p in block.parameters()]
        assert all(p.untyped_storage().nbytes() == 0 for p in streamed)  # off the device between steps
        out = tmp_path / "trained.safetensors"
        opt.session.save_checkpoint(out)
        assert_states_close(load_file(out), ref.state_dict())
    finally:
        opt.session.close()


def gpt2_hub_state(ref) -> dict[str, torch.Tensor]:
    """GPT-2 as the hub stores it: the base model's names (``h.0...``, no ``transformer.``), no ``lm_head.weight``
    (tied), and each layer's old ``attn.bias`` causal mask."""
    n, d = ref.config.n_positions, ref.config.n_layer
    state = dict(ref.transformer.state_dict())
    state.update({f"h.{i}.attn.bias": torch.ones(n, n).tril().view(1, 1, n, n) for i in range(d)})
    return state


def test_hub_gpt2_checkpoint_without_prefix_loads_into_the_lm_head_model(tmp_path):
    ref = build("gpt2", meta=False)
    save_file(gpt2_hub_state(ref), tmp_path / "model.safetensors")
    model = build("gpt2", meta=True)
    with open_checkpoint(tmp_path / "model.safetensors") as ckpt:
        model, opt = nvoffload.initialize(
            model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), config(tmp_path, model),
            checkpoint=ckpt,
        )  # fmt: skip
    try:
        assert_states_close(model.state_dict(), ref.state_dict())
        train_side_by_side(model, opt, ref, steps=2)
    finally:
        opt.session.close()


def test_lm_head_checkpoint_loads_into_the_base_model(tmp_path):
    """The other direction: ``GPT2Model`` (names ``h.0...``) from ``GPT2LMHeadModel``'s ``transformer.h.0...``."""
    ref = build("gpt2", meta=False)
    ref.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    with torch.device("meta"):
        model = transformers.GPT2Model(ref.config)
    with open_checkpoint(tmp_path / "hf") as ckpt:
        model, opt = nvoffload.initialize(
            model, torch.optim.AdamW(model.parameters()), config(tmp_path, model), checkpoint=ckpt
        )
    try:
        x = tokens(0)
        with torch.no_grad():
            got, want = model(input_ids=x).last_hidden_state, ref.transformer(input_ids=x).last_hidden_state
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    finally:
        opt.session.close()


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda sd: sd.pop("h.1.mlp.c_fc.weight"), r"missing transformer\.h\.1\.mlp\.c_fc\.weight"),
        (lambda sd: sd.update({"h.0.mlp.c_gate.weight": torch.zeros(2)}), r"unexpected h\.0\.mlp\.c_gate\.weight'$"),
    ],
)
def test_prefix_mapping_keeps_real_mismatches(tmp_path, edit, match):
    state = gpt2_hub_state(build("gpt2", meta=False))
    edit(state)
    save_file(state, tmp_path / "model.safetensors")
    model = build("gpt2", meta=True)
    with open_checkpoint(tmp_path / "model.safetensors") as ckpt, pytest.raises(KeyError, match=match):
        nvoffload.initialize(model, torch.optim.AdamW(model.parameters()), config(tmp_path, model), checkpoint=ckpt)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_without_checkpoint_the_models_own_init_weights_fills_it(tmp_path, family):
    """No checkpoint, no param_init_fn: ``_init_weights`` of the model, children before parents (GPT-2's scaled
    residual projections, RMSNorm and Conv1D that have no ``reset_parameters``), and it trains."""
    model = build(family, meta=True)
    model, opt = nvoffload.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config(tmp_path, model))
    try:
        state = model.state_dict()
        assert not any(bool(v.isnan().any()) for v in state.values())
        std = model.config.initializer_range
        if family == "llama":
            norms = [k for k in state if k.endswith("norm.weight")]
            assert len(norms) == 7 and all(bool((state[k] == 1).all()) for k in norms)
            assert 0.8 * std < float(state["model.layers.1.mlp.down_proj.weight"].std()) < 1.2 * std
            assert torch.equal(model.model.rotary_emb.inv_freq, build(family, meta=False).model.rotary_emb.inv_freq)
        else:
            residual = std / math.sqrt(2 * model.config.n_layer)
            assert 0.8 * std < float(state["transformer.h.1.attn.c_attn.weight"].std()) < 1.2 * std
            assert 0.8 * residual < float(state["transformer.h.1.mlp.c_proj.weight"].std()) < 1.2 * residual
            assert bool((state["transformer.h.1.mlp.c_fc.bias"] == 0).all())
        x = tokens(0)
        losses = []
        for _ in range(5):
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        assert losses[-1] < losses[0] - 0.1
    finally:
        opt.session.close()


def only_linear_and_embedding(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)


class RMSNorm(nn.Module):
    """A module without ``reset_parameters`` (its weight is ``torch.empty``)."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * self.weight


class Net(nn.Module):
    """Layers of a norm and a linear map; ``config``: the width, so it can be rebuilt from it."""

    def __init__(self, config: int):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(nn.Sequential(RMSNorm(config), nn.Linear(config, config)) for _ in range(3))
        self.register_buffer("scale", torch.full((config,), 2.0))
        self.register_buffer("freq", torch.arange(config, dtype=torch.float32).exp2(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return (x * self.scale + self.freq).square().mean()


@pytest.mark.parametrize(
    "make, init, match",
    [
        (lambda: Net(8), None, r"^blocks\.0\.0\.weight: built on the meta device, and reset_parameters\(\) left it"),
        (lambda: build("llama", meta=True), only_linear_and_embedding, r"^model\.norm\.weight: .* param_init_fn left"),
        (
            lambda: build("gpt2", meta=True),
            lambda m: m.reset_parameters() if isinstance(m, (nn.Embedding, nn.LayerNorm)) else None,
            r"^transformer\.h\.0\.attn\.c_attn\.weight, transformer\.h\.0\.attn\.c_attn\.bias, .* param_init_fn left",
        ),
    ],
)
def test_parameter_no_init_sets_is_refused_naming_it(tmp_path, make, init, match):
    with torch.device("meta"):
        model = make()
    with pytest.raises(ValueError, match=match):
        nvoffload.initialize(model, torch.optim.AdamW(model.parameters()), config(tmp_path, model), param_init_fn=init)


def test_buffers_of_a_model_rebuilt_from_its_config_and_persistent_ones_from_the_checkpoint(tmp_path):
    """Not a transformers model: ``type(model)(model.config)`` computes the non-persistent buffer, the checkpoint
    gives the persistent one (not the value the constructor computes)."""
    torch.manual_seed(0)
    ref = Net(8)
    for block in ref.blocks:
        nn.init.normal_(block[0].weight)
    ref.scale.fill_(3.0)
    save_file(ref.state_dict(), tmp_path / "net.safetensors")
    with torch.device("meta"):
        model = Net(8)
    with open_checkpoint(tmp_path / "net.safetensors") as ckpt:
        model, opt = nvoffload.initialize(
            model, torch.optim.AdamW(model.parameters()), config(tmp_path, model), checkpoint=ckpt
        )
    try:
        assert torch.equal(model.scale, torch.full((8,), 3.0)) and torch.equal(model.freq, ref.freq)
        x = torch.randn(4, 8)
        with torch.no_grad():
            assert torch.equal(model(x), ref(x))
    finally:
        opt.session.close()


class NoConfigNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.register_buffer("mask", torch.ones(8, 8).tril(), persistent=False)


def test_meta_buffer_of_a_model_without_config_is_refused_naming_it(tmp_path):
    with torch.device("meta"):
        model = NoConfigNet()
    with pytest.raises(ValueError, match=r"buffer 'mask' is on the meta device .* no `config`.*include_buffers=False"):
        nvoffload.initialize(model, torch.optim.AdamW(model.parameters()), config(tmp_path, model))


def mixed_gpt2(meta: bool):
    """GPT-2 in bf16 with its LayerNorms in fp32 (as ``_keep_in_fp32_modules`` keeps modules): every layer mixes."""
    model = build("gpt2", meta=meta).to(torch.bfloat16)
    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            module.float()
    return model


def test_block_of_mixed_dtypes_trains_like_an_fp32_master_loop(tmp_path):
    ref = mixed_gpt2(meta=False)
    ref.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    model = mixed_gpt2(meta=True)
    assert {p.dtype for p in model.transformer.h[0].parameters()} == {torch.bfloat16, torch.float32}
    with open_checkpoint(tmp_path / "hf") as ckpt:
        model, opt = nvoffload.initialize(
            model, torch.optim.AdamW(model.parameters(), lr=1e-3), config(tmp_path, model), checkpoint=ckpt
        )
    master = [p.detach().float() for p in ref.parameters()]  # fp32 parameters are their own master weights
    ref_opt = torch.optim.AdamW(master, lr=1e-3, fused=True)
    try:
        assert_states_close(model.state_dict(), ref.state_dict())
        for step in range(3):
            x = tokens(step)
            ref_loss = ref(input_ids=x, labels=x).loss
            ref_loss.backward()
            for m, p in zip(master, ref.parameters()):
                m.grad = p.grad.float()
                p.grad = None
            ref_opt.step()
            with torch.no_grad():
                for m, p in zip(master, ref.parameters()):
                    p.copy_(m)
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
        assert_states_close(model.state_dict(), ref.state_dict())
        out = tmp_path / "trained.safetensors"
        opt.session.save_checkpoint(out)
        assert_states_close(load_file(out), ref.state_dict())
    finally:
        opt.session.close()
