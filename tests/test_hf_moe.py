"""Mixture-of-experts models under transformers 5, whose experts are fused on load (``experts.gate_up_proj`` from the
hub's ``experts.N.gate_proj.weight``, ...): streamed from the hub layout and saved back in it, one tensor at a time."""

import json
import os
import subprocess
import sys

import pytest
import torch

import nvoffload
from nvoffload.checkpoint import SafetensorsReader, open_checkpoint, save_file
from nvoffload.finetune import FinetuneConfig, finetune
from nvoffload.pretrained import build_meta_model, save_pretrained

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("transformers 4 keeps one module per expert: nothing is converted", allow_module_level=True)
AutoModelForCausalLM = transformers.AutoModelForCausalLM
VOCAB = 300
SMALL_SHARD = 20_000  # bytes: several shards
STREAMED = dict(stream=True, cpu_memory_bytes=8 << 20, device_memory_bytes=64 << 20)  # finetune's streaming fields
COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
              max_position_embeddings=64, num_experts_per_tok=2, bos_token_id=0, eos_token_id=0)  # fmt: skip
CONFIGS = {
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **COMMON, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=32, intermediate_size=64
    ),
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_local_experts=4, intermediate_size=64),
}
HUB_NAMES = {  # what the hub's files hold for layer 0's expert 3, and the model's fused parameters
    "qwen2_moe": ["model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.0.mlp.experts.3.up_proj.weight",
                  "model.layers.0.mlp.experts.3.down_proj.weight"],
    "mixtral": ["model.layers.0.block_sparse_moe.experts.3.w1.weight",
                "model.layers.0.block_sparse_moe.experts.3.w3.weight",
                "model.layers.0.block_sparse_moe.experts.3.w2.weight"],
}  # fmt: skip


def make_model(kind, seed=0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(CONFIGS[kind]())


def make_llama():
    """A dense model of the same sizes."""
    torch.manual_seed(0)
    common = {k: v for k, v in COMMON.items() if k != "num_experts_per_tok"}
    return AutoModelForCausalLM.from_config(transformers.LlamaConfig(**common, intermediate_size=64))


def hub_dir(kind, path, seed=0):
    """A model directory as the hub holds it: transformers' own save_pretrained (one tensor per expert)."""
    model = make_model(kind, seed)
    model.save_pretrained(path)
    return model


def stored(path):
    """Every tensor of a model directory, by name."""
    with open_checkpoint(path) as ckpt:
        return {name: ckpt.read(name) for name in ckpt.keys()}


def assert_hub_layout(kind, path):
    names = stored(path).keys()
    assert set(HUB_NAMES[kind]) <= names
    assert not any("gate_up_proj" in n or n.endswith("experts.down_proj") for n in names)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("max_shard_bytes", [SMALL_SHARD, None])
def test_save_pretrained_writes_the_hub_layout_as_transformers_does(tmp_path, kind, max_shard_bytes):
    """Each expert's projections as tensors of their own, under the hub's names (Mixtral's block_sparse_moe): the
    tensors of transformers' save_pretrained, shards of at most max_shard_bytes, which it loads back. (transformers
    keeps the experts of one projection in one shard; here they are split like any tensors.)"""
    model = make_model(kind)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    written = save_pretrained(model, ours, **({} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}))
    model.save_pretrained(theirs, **({} if max_shard_bytes is None else {"max_shard_size": max_shard_bytes}))
    shards = [n for n in written if n.endswith(".safetensors")]
    assert (len(shards) > 3) == (max_shard_bytes is not None)
    for shard in shards:
        with SafetensorsReader(ours / shard) as reader:
            assert sum(reader.info(n).nbytes for n in reader.keys()) <= (max_shard_bytes or 10**9) or len(reader) == 1
    ours_tensors, theirs_tensors = stored(ours), stored(theirs)
    assert sorted(ours_tensors) == sorted(theirs_tensors)
    assert all(torch.equal(ours_tensors[n], theirs_tensors[n]) for n in ours_tensors)
    assert_hub_layout(kind, ours)
    fused = model.model.layers[0].mlp.experts
    half = fused.gate_up_proj.shape[1] // 2
    gate, up, down = (stored(ours)[n] for n in HUB_NAMES[kind])
    assert torch.equal(gate, fused.gate_up_proj[3, :half]) and torch.equal(up, fused.gate_up_proj[3, half:])
    assert torch.equal(down, fused.down_proj[3])
    back = AutoModelForCausalLM.from_pretrained(ours).state_dict()
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


def train(model, opt, batches):
    """A step per batch; the losses."""
    losses = []
    for x in batches:
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_a_streamed_moe_model_reads_the_hub_layout_trains_like_torch_and_saves_it_back(tmp_path, kind):
    """build_meta_model + initialize(checkpoint=the hub's files): each stored expert tensor is read into its part of
    the fused parameter (the start's logits exactly); three steps train like plain torch; session.save_pretrained
    writes the hub layout, which from_pretrained loads as the trained weights."""
    start = hub_dir(kind, tmp_path / "start")
    reference = make_model(kind)
    batches = [torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    model = build_meta_model(transformers.AutoConfig.from_pretrained(tmp_path / "start"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    offload = nvoffload.OffloadConfig(swap_dirs=[tmp_path], cpu_memory_bytes=8 << 20, device_memory_bytes=64 << 20)
    with open_checkpoint(tmp_path / "start") as ckpt:
        model, opt = nvoffload.initialize(model, opt, offload, checkpoint=ckpt)
    with opt:
        with torch.no_grad():
            assert torch.equal(model(input_ids=batches[0]).logits, start.eval()(input_ids=batches[0]).logits)
        losses = train(model, opt, batches)
        trained = {k: v.clone() for k, v in model.state_dict().items()}
        opt.session.save_pretrained(tmp_path / "out", max_shard_bytes=SMALL_SHARD)
    plain = train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), batches)
    assert losses == pytest.approx(plain, rel=1e-4)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=1e-4, atol=1e-5)
    assert_hub_layout(kind, tmp_path / "out")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    assert back.keys() == trained.keys() and all(torch.equal(back[k], v) for k, v in trained.items())
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(trained[fused], start.state_dict()[fused])


def test_a_hub_directory_lacking_an_experts_tensor_is_refused_naming_the_fused_parameter(tmp_path):
    hub_dir("qwen2_moe", tmp_path / "start")
    with open_checkpoint(tmp_path / "start") as ckpt:
        tensors = {n: ckpt.read(n) for n in ckpt.keys() if n != "model.layers.1.mlp.experts.2.up_proj.weight"}
    save_file(tensors, tmp_path / "start" / "model.safetensors", {"format": "pt"})
    model = build_meta_model(transformers.AutoConfig.from_pretrained(tmp_path / "start"))
    offload = nvoffload.OffloadConfig(swap_dirs=[tmp_path], cpu_memory_bytes=8 << 20, device_memory_bytes=64 << 20)
    missing = r"missing model\.layers\.1\.mlp\.experts\.gate_up_proj \(parts of it\)'$"
    with open_checkpoint(tmp_path / "start") as ckpt, pytest.raises(KeyError, match=missing):
        nvoffload.initialize(model, torch.optim.AdamW(model.parameters()), offload, checkpoint=ckpt)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_finetune_of_a_moe_directory_saves_it_with_and_without_stream(tmp_path, kind):
    """finetune --model <MoE dir> --save-to OUT, in memory and streamed: every step runs, the two agree, and OUT is
    in the hub layout, loaded by from_pretrained."""
    hub_dir(kind, tmp_path / "start")
    common = dict(model_dir=str(tmp_path / "start"), steps=3, batch_size=2, seq_len=16, lr=1e-2, warmup_steps=0,
                  swap_dir=str(tmp_path))  # fmt: skip
    plain = finetune(FinetuneConfig(**common, save_to=str(tmp_path / "plain")), progress=False).losses
    streamed = finetune(
        FinetuneConfig(**common, save_to=str(tmp_path / "streamed"), **STREAMED), progress=False
    ).losses
    assert len(plain) == 3 and streamed == pytest.approx(plain, rel=1e-4)
    start = AutoModelForCausalLM.from_pretrained(tmp_path / "start").state_dict()
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "plain").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "streamed").state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)
    assert not torch.equal(a["model.layers.1.mlp.experts.down_proj"], start["model.layers.1.mlp.experts.down_proj"])
    assert_hub_layout(kind, tmp_path / "plain")
    assert_hub_layout(kind, tmp_path / "streamed")


@pytest.mark.parametrize("mode", [{}, STREAMED], ids=["memory", "stream"])
def test_a_moe_run_checkpointed_and_resumed_trains_as_one_run(tmp_path, mode):
    """--checkpoint-dir writes the model in the hub layout; --resume reads each expert's tensors back into the fused
    parameters: two steps, then a resumed third, give the losses and weights of three steps in one run."""
    hub_dir("qwen2_moe", tmp_path / "start")
    common = dict(model_dir=str(tmp_path / "start"), batch_size=2, seq_len=16, lr=1e-2, warmup_steps=0,
                  swap_dir=str(tmp_path), **mode)  # fmt: skip
    whole = finetune(FinetuneConfig(**common, steps=3, save_to=str(tmp_path / "whole")), progress=False).losses
    ckpt = str(tmp_path / "ckpt")
    first = finetune(FinetuneConfig(**common, steps=2, checkpoint_dir=ckpt), progress=False).losses
    assert_hub_layout("qwen2_moe", tmp_path / "ckpt" / "checkpoint-2" / "model")
    resumed = FinetuneConfig(**common, steps=3, checkpoint_dir=ckpt, resume=True, save_to=str(tmp_path / "resumed"))
    rest = finetune(resumed, progress=False).losses
    assert first + rest == pytest.approx(whole, rel=1e-5)
    a, b = stored(tmp_path / "whole"), stored(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_a_conversion_it_cannot_revert_is_refused_before_anything_is_written(tmp_path):
    """A model whose loaded weights transformers converted other than by stacking experts (a Chunk of a fused
    gate_up, as some families store it): save_pretrained refuses, naming the conversion, and writes nothing."""
    from transformers.core_model_loading import Chunk, WeightConverter

    model = make_llama()
    model._weight_conversions = [
        WeightConverter("mlp.gate_up_proj.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"], [Chunk(dim=0)])
    ]  # as from_pretrained leaves it
    with pytest.raises(ValueError, match=r"Chunk\(dim=0\).*mlp\.gate_proj\.weight.*cannot write it back"):
        save_pretrained(model, tmp_path / "out")
    assert os.listdir(tmp_path) == []


_REGISTERED_CHUNK = """
import json, sys
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import Chunk, WeightConverter
register_checkpoint_conversion_mapping("llama", [WeightConverter(
    "mlp.gate_up_proj.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"], [Chunk(dim=0)])], overwrite=True)
from nvoffload.cli import main
for argv in json.loads(sys.argv[1]):  # one command line after the other, each run's end marked in both streams
    rc = main(argv)
    print(f"exit {rc}", flush=True)
    print(f"exit {rc}", file=sys.stderr, flush=True)
"""


def test_finetune_refuses_a_model_it_cannot_save_before_step_1(tmp_path):
    """A Llama directory stored with a fused gate_up_proj that transformers splits on load (a conversion registered
    by the user): finetune --save-to refuses before step 1 (one line, exit 2), in memory and streamed (both runs
    in one process: seconds of imports each otherwise)."""
    llama = make_llama()
    tensors = {k: v for k, v in llama.state_dict().items() if ".mlp.gate_proj" not in k and ".mlp.up_proj" not in k}
    for i, layer in enumerate(llama.model.layers):
        fused = torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight])
        tensors[f"model.layers.{i}.mlp.gate_up_proj.weight"] = fused
    (tmp_path / "start").mkdir()
    llama.config.save_pretrained(tmp_path / "start")
    save_file(tensors, tmp_path / "start" / "model.safetensors", {"format": "pt"})
    modes = {"memory": [], "stream": ["--stream", "--cpu-memory", "8M", "--device-memory", "64M"]}
    argvs = []
    for name, mode in modes.items():
        (tmp_path / name / "swap").mkdir(parents=True)
        argvs.append(["finetune", "--model", str(tmp_path / "start"), "--steps", "2", "--seq-len", "16", "--swap-dir",
                      str(tmp_path / name / "swap"), "--save-to", str(tmp_path / name / "out"), "--no-progress", *mode])  # fmt: skip
    run = subprocess.run([sys.executable, "-c", _REGISTERED_CHUNK, json.dumps(argvs)], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    outs, errs = run.stdout.split("exit 2\n"), run.stderr.split("exit 2\n")
    assert outs[-1] == errs[-1] == "" and len(outs) == len(errs) == len(modes) + 1, (run.stdout, run.stderr)  # each exit 2
    for name, out, err in zip(modes, outs, errs):
        assert "step 1" not in out, (name, out, err)
        last = err.splitlines()[-1]  # after transformers' own "Loading weights" bar
        assert last.startswith("nvoffload finetune: error: ") and "Chunk(dim=0)" in last, (name, err)
        assert "Traceback" not in err and err.count("error") == 1, (name, err)
        assert os.listdir(tmp_path / name) == ["swap"] and os.listdir(tmp_path / name / "swap") == []
    assert sorted(os.listdir(tmp_path)) == ["memory", "start", "stream"]


PEFT_ASKS_A_DEPRECATED_QUESTION = pytest.mark.filterwarnings(  # of transformers 5: theirs, not the library's
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)


@PEFT_ASKS_A_DEPRECATED_QUESTION
@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_lora_on_a_streamed_moe_model_trains_like_torch_and_peft(tmp_path, kind):
    """The README's LoRA recipe over a mixture of experts (build_meta_model, get_peft_model, initialize(checkpoint=the
    hub's files)): each expert's tensors fill their part of the fused parameters through PEFT's wrapping, three steps
    train the adapters as torch + PEFT do, the experts stay as they were; the adapter opens with PeftModel, the merged
    model is written in the hub layout. It was refused: the experts' tensors 'converted by transformers'."""
    peft = pytest.importorskip("peft")
    hub_dir(kind, tmp_path / "start")
    lora = lambda: peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)  # noqa: E731
    batches = [torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    model = peft.get_peft_model(build_meta_model(transformers.AutoConfig.from_pretrained(tmp_path / "start")), lora())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    offload = nvoffload.OffloadConfig(swap_dirs=[tmp_path], cpu_memory_bytes=8 << 20, device_memory_bytes=64 << 20)
    with open_checkpoint(tmp_path / "start") as ckpt:
        model, opt = nvoffload.initialize(model, opt, offload, checkpoint=ckpt)
    with opt:
        start = {k: v.clone() for k, v in model.state_dict().items()}
        reference = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "start"), lora())
        assert reference.state_dict().keys() == start.keys()
        reference.load_state_dict({k: v for k, v in start.items() if "lora_" in k}, strict=False)
        losses = train(model, opt, batches)
        trained = {k: v.clone() for k, v in model.state_dict().items()}
        opt.session.save_pretrained(tmp_path / "adapter")
        opt.session.save_pretrained(tmp_path / "merged", merged=True)
    plain = train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), batches)
    assert losses == pytest.approx(plain, rel=1e-4)
    for name, value in reference.state_dict().items():
        if "lora_" in name:
            torch.testing.assert_close(trained[name], value, rtol=1e-4, atol=1e-5, msg=name)
        else:
            assert torch.equal(trained[name], start[name]), name
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "start"), tmp_path / "adapter")
    assert all(torch.equal(v, trained[k]) for k, v in loaded.state_dict().items())
    assert_hub_layout(kind, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    for name, value in loaded.merge_and_unload().state_dict().items():
        torch.testing.assert_close(merged[name], value, rtol=0, atol=1e-6, msg=name)


def test_finetune_lora_of_a_streamed_moe_model_trains_as_in_memory(tmp_path, capsys):
    """finetune --model <Qwen2-MoE dir> --lora-rank 4 --lora-targets q_proj v_proj, streamed and in memory: the same
    adapters at the start (the seed's), the same losses and adapters after three steps; without --lora-targets (PEFT
    knows no default for the family) one line naming the flag and the model's linear layers, exit 2."""
    from nvoffload.cli import main

    hub_dir("qwen2_moe", tmp_path / "start")
    common = dict(model_dir=str(tmp_path / "start"), steps=3, batch_size=2, seq_len=16, lr=1e-2, warmup_steps=0,
                  swap_dir=str(tmp_path), lora_rank=4, lora_targets=("q_proj", "v_proj"))  # fmt: skip
    plain = finetune(FinetuneConfig(**common, save_to=str(tmp_path / "plain")), progress=False).losses
    streamed = finetune(FinetuneConfig(**common, save_to=str(tmp_path / "streamed"), **STREAMED), progress=False).losses
    assert len(plain) == 3 and streamed == pytest.approx(plain, rel=1e-4)
    a, b = stored(tmp_path / "plain"), stored(tmp_path / "streamed")
    assert a.keys() == b.keys() and len(a) == 8
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=name)
    capsys.readouterr()
    assert main(["finetune", "--model", str(tmp_path / "start"), "--lora-rank", "4", "--stream", "--swap-dir",
                 str(tmp_path), "--no-progress"]) == 2  # fmt: skip
    err = capsys.readouterr().err.splitlines()
    assert err == ["nvoffload finetune: error: --lora-targets: PEFT has no default modules to adapt in a qwen2_moe model:"
                   " name them (its linear layers: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj,"
                   " shared_expert_gate, lm_head)"], err  # fmt: skip
