"""Instruction and chat data (nvoffload.data.sft, nvoffload.sft): targets, masks, packing, errors, evaluation.

Every expected value is computed here with plain torch from the rendered text, independently of the code
under test: the assistant's or completion's tokens are found by scanning the rendering, the losses are
``F.cross_entropy`` over the model's logits.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F

from nvoffload.data import ByteTokenizer
from nvoffload.data.sft import IGNORE_INDEX, SFTBatch, SFTDataset
from nvoffload.models import GPT, GPTConfig
from nvoffload.sft import causal_lm_loss, evaluate

datasets = pytest.importorskip("datasets")

CHATS = [
    [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "5."}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "See you."},
    ],
    [{"role": "user", "content": "Spell cat backwards."}, {"role": "assistant", "content": "tac"}],
]
PAIRS = [("Q: 2+3? A:", " 5"), ("Q: red+blue? A:", " purple"), ("Say hi:", " hi there"), ("x", "yz")]
SMALL_GPT = GPTConfig(vocab_size=256, seq_len=256, n_layer=2, n_head=2, d_model=32)


def _write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(SMALL_GPT).eval()


def _plain_loss(logits: torch.Tensor, ids: list[int], trained: list[bool]) -> torch.Tensor:
    """Summed cross-entropy of ``logits`` (one example, ``(len(ids) - 1, vocab)``) over the targets marked trained."""
    targets = torch.tensor(ids[1:])
    keep = torch.tensor(trained[1:])
    return F.cross_entropy(logits[keep], targets[keep], reduction="sum")


def _byte_chat(messages) -> tuple[list[int], list[bool]]:
    """The ChatML rendering as bytes, and which bytes are an assistant's reply (its content and '<|im_end|>\\n'),
    found by scanning the text."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    trained = [False] * len(text)
    at = 0
    for m in messages:
        header = f"<|im_start|>{m['role']}\n"
        at = text.index(header, at) + len(header)
        end = text.index("<|im_end|>\n", at) + len("<|im_end|>\n")
        if m["role"] == "assistant":
            trained[at:end] = [True] * (end - at)
        at = end
    return list(text.encode()), trained


def test_chat_loss_is_plain_cross_entropy_over_the_assistant_bytes(tmp_path):
    """The default (ChatML-like) template on bytes: the loss is over the assistant's tokens only, summed over
    all examples and divided by their count of targets."""
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    data = SFTDataset(path, ByteTokenizer(), seq_len=255, packing=False, shuffle_buffer=0)
    assert data.shape == "messages"
    batch = next(data.batches(len(CHATS)))
    model = _gpt()
    with torch.no_grad():
        loss = causal_lm_loss(model, batch, batch.num_items)
        total, count = 0.0, 0
        for messages in CHATS:
            ids, trained = _byte_chat(messages)
            logits = model(torch.tensor([ids[:-1]]))[0]
            total += _plain_loss(logits, ids, trained)
            count += sum(trained[1:])
    assert batch.num_items == count
    torch.testing.assert_close(loss, total / count, rtol=1e-6, atol=1e-6)
    # the targets are exactly the assistant bytes
    ids, trained = _byte_chat(CHATS[1])
    expected = [t if keep else IGNORE_INDEX for t, keep in zip(ids[1:], trained[1:])]
    assert batch.labels[1, : len(expected)].tolist() == expected
    assert (batch.labels[1, len(expected) :] == IGNORE_INDEX).all()


def test_prompt_completion_loss_is_plain_cross_entropy_over_the_completion(tmp_path):
    path = _write_jsonl(tmp_path / "pc.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS])
    data = SFTDataset(path, ByteTokenizer(), seq_len=64, shuffle_buffer=0)  # packed: all in one row
    assert data.shape == "prompt-completion"
    batch = next(data.batches(1))
    assert batch.input_ids.shape == (1, 64) and batch.position_ids is not None
    model = _gpt()
    with torch.no_grad():
        loss = causal_lm_loss(model, batch, batch.num_items)
        total = sum(
            _plain_loss(model(torch.tensor([list((p + c).encode())[:-1]]))[0], list((p + c).encode()),
                        [False] * len(p.encode()) + [True] * len(c.encode()))
            for p, c in PAIRS
        )  # fmt: skip
    count = sum(len(c.encode()) for _, c in PAIRS)
    assert batch.num_items == count
    torch.testing.assert_close(loss, total / count, rtol=1e-5, atol=1e-6)
    everything = next(SFTDataset(path, ByteTokenizer(), seq_len=64, loss_on="all", shuffle_buffer=0).batches(1))
    assert everything.num_items == sum(len((p + c).encode()) - 1 for p, c in PAIRS)


def test_packed_rows_give_each_example_the_loss_it_has_alone(tmp_path):
    """GPT preset: positions restart per example and attention stays within it, so a packed row's per-token
    losses are those of each example run alone; without the position ids they are not."""
    path = _write_jsonl(tmp_path / "pc.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS])
    packed = next(SFTDataset(path, ByteTokenizer(), seq_len=64, shuffle_buffer=0, loss_on="all").batches(1))
    alone = next(SFTDataset(path, ByteTokenizer(), seq_len=64, shuffle_buffer=0, loss_on="all", packing=False).batches(8))
    assert packed.input_ids.shape[0] == 1 and alone.input_ids.shape[0] == len(PAIRS) and alone.position_ids is None
    model = _gpt(1)
    with torch.no_grad():
        row = F.cross_entropy(model(packed.input_ids, position_ids=packed.position_ids)[0], packed.labels[0],
                              reduction="none")  # fmt: skip
        apart = F.cross_entropy(model(alone.input_ids).transpose(1, 2), alone.labels, reduction="none")
        unmasked = F.cross_entropy(model(packed.input_ids)[0], packed.labels[0], reduction="none")
    at = 0
    for i, (p, c) in enumerate(PAIRS):
        n = len((p + c).encode()) - 1
        torch.testing.assert_close(row[at : at + n], apart[i, :n], rtol=1e-5, atol=1e-5)
        at += n
    assert not torch.allclose(unmasked[: at], row[: at], atol=1e-3)  # the mask is what makes them equal


# -- Hugging Face tokenizers and models ------------------------------------------------------------------------------

_PLAIN_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
_GENERATION_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|> {% if m.role == 'assistant' %}{% generation %}{{ m.content }} <|end|> "
    "{% endgeneration %}{% else %}{{ m.content }} <|end|> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


@pytest.fixture(scope="module")
def hf():
    """A word-level tokenizer built here (whitespace-split words of the test data), and a tiny Llama."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    words = {w for chat in CHATS for m in chat for w in m["content"].split()}
    words |= {w for p, c in PAIRS for w in (p + " " + c).split()}
    specials = ["[UNK]", "<eos>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<pad>"]
    vocab = {w: i for i, w in enumerate(specials + sorted(words))}
    model = tokenizers.models.WordLevel(vocab, unk_token="[UNK]")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<eos>",
                                                     pad_token="<pad>")  # fmt: skip
    tokenizer.chat_template = _PLAIN_TEMPLATE
    config = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    torch.manual_seed(0)
    llama = transformers.AutoModelForCausalLM.from_config(config).eval()
    return tokenizer, llama, vocab


def _scanned_chat(ids: list[int], vocab: dict) -> list[bool]:
    """The assistant's tokens of a rendering: after each '<|assistant|>' up to and with the next '<|end|>'."""
    trained, inside = [], False
    for t in ids:
        trained.append(inside)
        if t == vocab["<|assistant|>"]:
            inside = True
        elif t == vocab["<|end|>"]:
            inside = False
    return trained


@pytest.mark.parametrize("template", ["prefixes", "generation"])
def test_hf_chat_template_loss_is_plain_cross_entropy_over_the_assistant_tokens(hf, tmp_path, template):
    tokenizer, llama, vocab = hf
    tokenizer.chat_template = _PLAIN_TEMPLATE if template == "prefixes" else _GENERATION_TEMPLATE
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    batch = next(SFTDataset(path, tokenizer, seq_len=64, packing=False, shuffle_buffer=0).batches(8))
    with torch.no_grad():
        loss = causal_lm_loss(llama, batch, batch.num_items)
        total, count = 0.0, 0
        for messages in CHATS:
            ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
            trained = _scanned_chat(ids, vocab)
            total += _plain_loss(llama(torch.tensor([ids[:-1]])).logits[0], ids, trained)
            count += sum(trained[1:])
    assert batch.num_items == count
    torch.testing.assert_close(loss, total / count, rtol=1e-5, atol=1e-6)


def test_rows_are_padded_with_the_tokenizers_pad_token_and_the_loss_is_unchanged(hf, tmp_path):
    """One chat a row, rows of different lengths: the inputs after each chat are the tokenizer's pad_token (they
    were id 0, or the EOS id), their targets -100, and the loss is the plain one over the assistant's tokens."""
    tokenizer, llama, vocab = hf
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    batch = next(SFTDataset(path, tokenizer, seq_len=64, packing=False, shuffle_buffer=0).batches(8))
    rendered = [tokenizer.apply_chat_template(m, tokenize=True, return_dict=True)["input_ids"] for m in CHATS]
    assert batch.input_ids.shape[1] > min(len(ids) - 1 for ids in rendered)  # some rows are padded
    total, count = 0.0, 0
    with torch.no_grad():
        for row, ids in enumerate(rendered):
            n = len(ids) - 1
            assert batch.input_ids[row, :n].tolist() == ids[:-1]
            assert (batch.input_ids[row, n:] == vocab["<pad>"]).all() and (batch.labels[row, n:] == IGNORE_INDEX).all()
            trained = _scanned_chat(ids, vocab)
            total += _plain_loss(llama(torch.tensor([ids[:-1]])).logits[0], ids, trained)
            count += sum(trained[1:])
        torch.testing.assert_close(causal_lm_loss(llama, batch, batch.num_items), total / count, rtol=1e-5, atol=1e-6)


def test_hf_prompt_completion_ends_with_eos_and_packs_like_unpacked(hf, tmp_path):
    """The completion and the EOS token are trained on; a Llama given restarting position ids keeps packed
    examples apart (transformers' packed-sequence mask): per-token losses equal the unpacked ones."""
    tokenizer, llama, vocab = hf
    path = _write_jsonl(tmp_path / "pc.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS])
    packed = next(SFTDataset(path, tokenizer, seq_len=32, shuffle_buffer=0).batches(1))
    alone = next(SFTDataset(path, tokenizer, seq_len=32, shuffle_buffer=0, packing=False).batches(8))
    expected = []
    for p, c in PAIRS:
        prompt, completion = [vocab[w] for w in p.split()], [vocab[w] for w in c.split()] + [vocab["<eos>"]]
        expected += [IGNORE_INDEX] * (len(prompt) - 1) + completion
    assert packed.labels[0, : len(expected)].tolist() == expected
    with torch.no_grad():
        row = F.cross_entropy(llama(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False).logits[0],
                              packed.labels[0], reduction="none")  # fmt: skip
        apart = F.cross_entropy(llama(input_ids=alone.input_ids).logits.transpose(1, 2), alone.labels, reduction="none")
    at = 0
    for i, (p, c) in enumerate(PAIRS):
        n = len(p.split()) + len(c.split())  # tokens with the EOS, less one
        torch.testing.assert_close(row[at : at + n], apart[i, :n], rtol=1e-5, atol=1e-5)
        at += n


def test_a_template_that_rewrites_earlier_turns_is_refused(hf, tmp_path):
    tokenizer, _, _ = hf
    tokenizer.chat_template = "{{ messages | length }} " + _PLAIN_TEMPLATE  # the count changes every prefix
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    with pytest.raises(ValueError, match="does not render the conversation up to message 1 as a prefix"):
        next(SFTDataset(path, tokenizer, seq_len=64, shuffle_buffer=0).batches(1))
    tokenizer.chat_template = _PLAIN_TEMPLATE


# -- reading ---------------------------------------------------------------------------------------------------------


def test_a_malformed_line_is_refused_naming_the_file_and_line(tmp_path):
    good = json.dumps({"messages": CHATS[0]})
    cases = {
        "not JSON": ([good, "", '{"messages": [}'], "line 3, column 15: not valid JSON"),
        "another shape": ([good, json.dumps({"prompt": "a", "completion": "b"})], "line 2: expected {\"messages\": ...}"),
        "no known key": ([json.dumps({"question": "a"})], "line 1: expected {\"messages\": ...} or {\"prompt\""),
        "bad messages": ([good, good, json.dumps({"messages": [{"role": "user"}]})], 'line 3: "messages" must be'),
        "not a string": ([json.dumps({"text": 3})], 'line 1: "text" must be a string'),
    }
    for name, (lines, message) in cases.items():
        path = tmp_path / f"{name.replace(' ', '-')}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        with pytest.raises(ValueError, match=rf"^{path}, {message}"):
            data = SFTDataset(path, ByteTokenizer(), seq_len=128, shuffle_buffer=0)
            list(data.batches(4))


def test_cli_refuses_a_malformed_line_in_one_line(tmp_path, capsys):
    from nvoffload.cli import main

    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "hello"}) + "\n" + json.dumps({"text": None, "prompt": "x"}) + "\n")
    rc = main(["finetune", "--preset", "tiny", "--data", str(path), "--steps", "2", "--swap-dir", str(tmp_path),
               "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and err == f'nvoffload finetune: error: {path}, line 2: expected {{"text": ...}} (the shape of the first record: text), got the keys [\'prompt\', \'text\']\n'


def _refused_by_finetune(tmp_path, capsys, data, *extra, model=("--preset", "tiny")) -> str:
    """The one error line ``nvoffload finetune`` gives for ``data`` (exit 2), having created nothing: no checkpoint
    directory, no file in the swap directory."""
    from nvoffload.cli import main

    swap = tmp_path / "swap"
    swap.mkdir(exist_ok=True)
    rc = main(["finetune", *model, "--data", str(data), "--steps", "40", "--batch-size", "4", "--seq-len", "64",
               "--swap-dir", str(swap), "--checkpoint-dir", str(tmp_path / "ckpt"), "--no-progress", *extra])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("nvoffload finetune: error: "), err
    assert not (tmp_path / "ckpt").exists() and not list(swap.iterdir())
    return err.removeprefix("nvoffload finetune: error: ").rstrip("\n")


def test_an_empty_file_is_refused_in_one_line(tmp_path, capsys):
    for name, content in (("empty.jsonl", ""), ("blank.jsonl", "\n  \n\n")):
        (tmp_path / name).write_text(content)
        assert _refused_by_finetune(tmp_path, capsys, tmp_path / name) == f"{tmp_path / name} holds no records: nothing to train on"


def test_bytes_that_are_not_utf8_are_named_by_file_line_and_offset(tmp_path, capsys):
    lines = [json.dumps({"text": f"line {i}"}).encode() for i in range(5)]
    lines[2] = lines[2].replace(b"line", b"li\xffne")
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    offset = len(lines[0]) + len(lines[1]) + 2 + lines[2].index(b"\xff")
    message = _refused_by_finetune(tmp_path, capsys, path)
    assert message == f"{path}, line 3: not valid UTF-8: byte 0xff at offset {offset} of the file (invalid start byte)"


def test_a_record_longer_than_the_bound_is_refused_before_it_is_read_whole(tmp_path, capsys):
    """A JSON line over ``max_record_bytes`` is refused naming the file, the line and the bound, having read no
    more than the bound of it (the peak of Python's allocations stays far below the line's 32 MiB); the CLI's
    --max-record-size sets the bound; a record at the bound is read."""
    import tracemalloc

    long_line = json.dumps({"text": "x" * (32 << 20)})
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"text": "short"}) + "\n" + long_line + "\n")
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as refused:
            SFTDataset(path, ByteTokenizer(), seq_len=16, max_record_bytes=1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(refused.value) == f"{path}, line 2: a record longer than max_record_bytes {1 << 20} (records are read whole)"
    assert peak < 8 << 20, peak
    message = _refused_by_finetune(tmp_path, capsys, path, "--max-record-size", "1M")
    assert message == f"{path}, line 2: a record longer than --max-record-size 1M (records are read whole)"
    fits = tmp_path / "fits.jsonl"
    fits.write_text(json.dumps({"text": "a" * 100}) + "\r\n" + json.dumps({"text": "bc"}) + "\n")
    data = SFTDataset(fits, ByteTokenizer(), seq_len=16, max_record_bytes=len(json.dumps({"text": "a" * 100})))
    assert data.shape == "text"
    records = [{"prompt": p, "completion": c} for p, c in PAIRS]
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "pc.parquet"))
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'pc.parquet'}, row 1: a record longer than max_record_bytes 20 "):
        SFTDataset(tmp_path / "pc.parquet", ByteTokenizer(), seq_len=16, max_record_bytes=20)


def test_chats_without_an_assistant_turn_or_with_unknown_roles_are_refused_naming_the_line(tmp_path, capsys):
    """Among good chats, line 7 without an assistant turn and line 10 with the role 'bot': each is refused naming
    the file and line (not blamed on --seq-len mid-run); ShareGPT's roles too; --loss-on all takes a chat
    without an assistant turn (it trains on every token), not an unknown role."""
    chats = [{"messages": CHATS[i % len(CHATS)]} for i in range(12)]
    chats[6] = {"messages": [{"role": "user", "content": "Nobody answers."}]}
    chats[9] = {"messages": [{"role": "user", "content": "Hi"}, {"role": "bot", "content": "Hello"}]}
    path = _write_jsonl(tmp_path / "chat.jsonl", chats)
    message = _refused_by_finetune(tmp_path, capsys, path)
    assert message == (f"{path}, line 7: a chat without an assistant turn has nothing to train on: remove it, or train"
                       " on every token (--loss-on all)")  # fmt: skip
    role = f"{path}, line 10: the role 'bot' is none of system, developer, user, assistant, tool"
    assert _refused_by_finetune(tmp_path, capsys, path, "--loss-on", "all").startswith(role)
    sharegpt = _write_jsonl(tmp_path / "sharegpt.jsonl", [{"messages": [{"role": "human", "content": "Hi"},
                                                                        {"role": "gpt", "content": "Hello"}]}])  # fmt: skip
    with pytest.raises(ValueError, match=rf"^{sharegpt}, line 1: the role 'human' is none of .* \(ShareGPT's human and gpt are user and assistant: rename them\)$"):
        SFTDataset(sharegpt, ByteTokenizer(), seq_len=64)
    chats[9] = {"messages": CHATS[0]}
    batch = next(SFTDataset(_write_jsonl(tmp_path / "all.jsonl", chats), ByteTokenizer(), seq_len=256, loss_on="all",
                            shuffle_buffer=0, packing=False).batches(12))  # fmt: skip
    assert batch.input_ids.shape[0] == 12


def test_a_bad_line_past_the_first_steps_is_refused_before_anything_is_created(tmp_path, capsys):
    """A record of another shape, or two JSON values on one line, at line 251 of 300 (past the steps' first
    examples): refused naming the file, the line (and the column), before the checkpoint directory or a swap
    file is created (it was found mid-run, leaving the checkpoint directory's metrics.jsonl; the two values were
    taken as two records)."""
    lines = [json.dumps({"text": f"hello number {i}"}) for i in range(300)]
    for name, bad, message in (
        ("shape", json.dumps({"prompt": "a", "completion": "b"}), "line 251: expected {\"text\": ...}"),
        ("two", '{"text": "a"} {"text": "b"}', "line 251, column 15: not valid JSON (Extra data)"),
    ):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("\n".join(lines[:250] + [bad] + lines[251:]) + "\n")
        assert _refused_by_finetune(tmp_path, capsys, path).startswith(f"{path}, {message}")


_STRICT_TEMPLATE = (  # as Llama 2's and Mistral's: roles must alternate; and it marks chats of three turns or more
    "{% if messages | length > 2 %}<|system|> {% endif %}{% for m in messages %}"
    "{% if (m.role == 'user') != (loop.index0 is even) %}{{ raise_exception('Conversation roles must alternate"
    " user/assistant/user/assistant/...') }}{% endif %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def test_a_record_the_tokenizer_cannot_use_is_refused_naming_the_line_before_anything_is_created(hf, tmp_path, capsys):
    """Line 251 of 300 chats, past the first steps' examples: one the chat template raises on (roles that do not
    alternate), one whose beginning it renders otherwise than the whole (the assistant's tokens cannot be found),
    one with a token beyond the model's vocabulary. Each is refused naming the file and line, exit 2, nothing
    created (they were found while tokenizing mid-run: jinja2's TemplateError as a traceback, exit 1, or a message
    naming the file alone, leaving the checkpoint directory's metrics.jsonl)."""
    transformers = pytest.importorskip("transformers")
    tokenizer, _, vocab = hf
    last = max(vocab, key=vocab.get)  # the model's vocabulary ends before this word
    assert last not in {w for m in CHATS[0] for w in m["content"].split()}
    config = transformers.LlamaConfig(vocab_size=vocab[last], hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "llama")
    tokenizer.chat_template = _STRICT_TEMPLATE
    try:
        tokenizer.save_pretrained(tmp_path / "llama")
    finally:
        tokenizer.chat_template = _PLAIN_TEMPLATE
    capsys.readouterr()  # transformers' progress bar
    user, assistant = CHATS[0]
    for name, bad, message in (
        ("alternate", [user, user, assistant], "the tokenizer failed on it: TemplateError: Conversation roles must"
                                               " alternate user/assistant/user/assistant/..."),
        ("prefix", [user, assistant, user, assistant], "the tokenizer's chat template does not render the conversation"
                                                       " up to message 1 as a prefix of the whole"),
        ("vocabulary", [{"role": "user", "content": last}, assistant], f"the tokenizer produced id {vocab[last]}, beyond"
                                                                       f" the model's vocabulary of {vocab[last]}"),
    ):  # fmt: skip
        chats = [{"messages": CHATS[0]}] * 300
        path = _write_jsonl(tmp_path / f"{name}.jsonl", chats[:250] + [{"messages": bad}] + chats[251:])
        got = _refused_by_finetune(tmp_path, capsys, path, model=("--model", str(tmp_path / "llama")))
        assert got.startswith(f"{path}, line 251: {message}"), got


def test_examples_with_nothing_to_train_on_within_seq_len_are_left_out_naming_the_lines(tmp_path, capsys):
    """Lines 10 and 20 of 20: a prompt longer than the rows, its completion cut off. They are left out, named in a
    warning (they were trained on as padding, and a step of such examples alone stopped the run midway, leaving the
    checkpoint directory's metrics.jsonl); data with no other example, or an --eval-fraction part with no other,
    is refused before anything is created, naming the file, the lines and --seq-len (the held-out part was found
    empty after the first step)."""
    records = [{"prompt": "x" * (100 if i in (9, 19) else 5), "completion": " ok"} for i in range(20)]
    path = _write_jsonl(tmp_path / "long.jsonl", records)
    with pytest.warns(UserWarning) as caught:
        data = SFTDataset(path, ByteTokenizer(), seq_len=64, shuffle_buffer=0, packing=False)
    assert [str(w.message) for w in caught] == [
        f"{path}: 2 of the 20 examples of the file have no token to train on within seq_len + 1 = 65 tokens (line 10,"
        " line 20): left out; raise seq_len, or train on every token (loss_on all)"
    ]
    kept = _write_jsonl(tmp_path / "kept.jsonl", [r for i, r in enumerate(records) if i not in (9, 19)])
    expected = next(SFTDataset(kept, ByteTokenizer(), seq_len=64, shuffle_buffer=0, packing=False).batches(20))
    got = next(data.batches(20))
    assert torch.equal(got.input_ids, expected.input_ids) and torch.equal(got.labels, expected.labels)
    within = "within --seq-len + 1 = 65 tokens"
    cure = "raise --seq-len, or train on every token (--loss-on all)"
    assert _refused_by_finetune(tmp_path, capsys, path, "--eval-fraction", "0.1") == (
        f"{path}: no example of its held-out part has a token to train on {within} (line 10, line 20): {cure}"
    )
    path = _write_jsonl(tmp_path / "all.jsonl", [{"prompt": "x" * 100, "completion": " ok"}] * 7)
    assert _refused_by_finetune(tmp_path, capsys, path) == (
        f"{path}: no example of the file has a token to train on {within} (line 1, line 2, line 3, line 4, line 5,"
        f" ...): {cure}"
    )
    few = _write_jsonl(tmp_path / "few.jsonl", records[:5])
    assert _refused_by_finetune(tmp_path, capsys, few, "--eval-fraction", "0.1") == (
        f"{few}: --eval-fraction 0.1 holds out none of its 5 records: raise it (to 1/5 or more)"
    )


def test_a_json_array_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "records.json"
    path.write_text(json.dumps([{"text": "a"}, {"text": "b"}], indent=1))
    with pytest.raises(ValueError, match=rf"^{path} holds a JSON array, not JSON lines: write one record a line"):
        SFTDataset(path, ByteTokenizer(), seq_len=16)


def test_parquet_and_saved_datasets_read_as_the_jsonl(tmp_path):
    records = [{"prompt": p, "completion": c} for p, c in PAIRS]
    jsonl = _write_jsonl(tmp_path / "pc.jsonl", records)
    ds = datasets.Dataset.from_list(records)
    ds.to_parquet(str(tmp_path / "pc.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds, "validation": ds.select([1])}).save_to_disk(str(tmp_path / "dict"))
    expected = next(SFTDataset(jsonl, ByteTokenizer(), seq_len=64, shuffle_buffer=0).batches(4))
    for path in (tmp_path / "pc.parquet", tmp_path / "saved", tmp_path / "dict"):
        got = next(SFTDataset(path, ByteTokenizer(), seq_len=64, shuffle_buffer=0).batches(4))
        assert torch.equal(got.input_ids, expected.input_ids) and torch.equal(got.labels, expected.labels), path
    held = list(SFTDataset(tmp_path / "dict", ByteTokenizer(), seq_len=64, evaluation=True).batches(4))
    assert len(held) == 1 and held[0].num_items == len(PAIRS[1][1].encode())  # the validation split
    fraction = SFTDataset(tmp_path / "dict", ByteTokenizer(), seq_len=64, eval_fraction=0.25, evaluation=True)
    assert next(fraction.batches(4)).num_items == len(PAIRS[3][1].encode())  # held out of the train split
    bad = datasets.Dataset.from_list([*records, {"prompt": None, "completion": "x"}])
    bad.to_parquet(str(tmp_path / "bad.parquet"))
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'bad.parquet'}, row 4: expected"):
        list(SFTDataset(tmp_path / "bad.parquet", ByteTokenizer(), seq_len=64).batches(8))


def test_without_datasets_the_error_says_what_to_install(tmp_path, monkeypatch):
    path = _write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}])
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r"pip install 'nvoffload\[hf\]'"):
        SFTDataset(path, ByteTokenizer(), seq_len=8)


# -- order, position, evaluation split --------------------------------------------------------------------------------


def test_the_position_resumes_at_the_exact_next_example_across_epochs(tmp_path):
    records = [{"prompt": f"q{i}:", "completion": " " + "a" * (i % 7 + 1)} for i in range(40)]
    path = _write_jsonl(tmp_path / "pc.jsonl", records)
    make = lambda: SFTDataset(path, ByteTokenizer(), seq_len=24, seed=3, shuffle_buffer=8)  # noqa: E731
    straight = make()
    drawn = [straight.batch(3) for _ in range(12)]  # about three epochs
    assert straight.state_dict()["epoch"] >= 2
    for stop in (1, 5, 9):
        first = make()
        for _ in range(stop):
            first.batch(3)
        resumed = make()
        resumed.load_state_dict(first.state_dict())
        for b in drawn[stop:]:
            got = resumed.batch(3)
            assert torch.equal(got.input_ids, b.input_ids) and torch.equal(got.labels, b.labels), stop
    epoch_one = [straight_row for b in drawn[:2] for straight_row in b.input_ids.tolist()]
    assert epoch_one != [r for b in drawn[4:6] for r in b.input_ids.tolist()]  # each epoch shuffled anew


def test_the_evaluation_fraction_holds_out_every_kth_example(tmp_path):
    records = [{"text": f"example {i:02d}."} for i in range(20)]
    path = _write_jsonl(tmp_path / "t.jsonl", records)

    def texts(evaluation: bool) -> list[str]:
        data = SFTDataset(path, ByteTokenizer(), seq_len=16, packing=False, eval_fraction=0.25, evaluation=evaluation)
        return [bytes(r[r != 0].tolist()).decode() for b in data.batches(4) for r in b.input_ids]

    held, kept = texts(True), texts(False)
    assert held == [f"example {i:02d}" for i in (3, 7, 11, 15, 19)]
    assert len(kept) == 15 and not set(held) & set(kept)


# -- the loss of a step, and evaluation ------------------------------------------------------------------------------


def test_accumulated_micro_batches_give_the_mean_over_all_their_targets(tmp_path):
    """Two micro-batches with different numbers of targets: their losses over the step's count add up to the
    mean over all targets, and so do their gradients (the mean of the two means would not)."""
    path = _write_jsonl(tmp_path / "pc.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS])
    a, b = SFTDataset(path, ByteTokenizer(), seq_len=64, packing=False, shuffle_buffer=0).batches(2)
    assert a.num_items != b.num_items
    model = _gpt(2).train()
    n = a.num_items + b.num_items
    for batch in (a, b):
        causal_lm_loss(model, batch, n).backward()
    accumulated = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits = [model(batch.input_ids) for batch in (a, b)]
    flat = torch.cat([x.reshape(-1, 256) for x in logits])
    plain = F.cross_entropy(flat, torch.cat([a.labels.reshape(-1), b.labels.reshape(-1)]))
    plain.backward()
    for got, p in zip(accumulated, model.parameters()):
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-6)


def test_finetune_evaluation_equals_plain_torch_on_the_saved_weights(tmp_path):
    """A streamed run's evaluation (block by block, no gradient) equals plain torch's loss on the weights it
    saved, and evaluating changes nothing in the training (same weights as a run without evaluation)."""
    from nvoffload.checkpoint import load_file
    from nvoffload.finetune import FinetuneConfig, finetune

    records = [{"prompt": p, "completion": c} for p, c in PAIRS * 3]
    train = _write_jsonl(tmp_path / "train.jsonl", records)
    held = _write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "Q: 1+1? A:", "completion": " 2"}, *records[:3]])
    common = dict(preset="tiny", data_path=train, steps=3, batch_size=2, lr=3e-3, warmup_steps=0, stream=True,
                  swap_dir=str(tmp_path), cpu_memory_bytes=8 << 20, device_memory_bytes=64 << 20)  # fmt: skip
    out = tmp_path / "with-eval.safetensors"
    result = finetune(FinetuneConfig(**common, eval_data_path=held, eval_every=2, save_to=str(out)), progress=False)
    assert [s.eval_loss is not None for s in result.steps] == [False, True, True]
    finetune(FinetuneConfig(**common, save_to=str(tmp_path / "plain.safetensors")), progress=False)
    weights, plain_weights = load_file(out), load_file(tmp_path / "plain.safetensors")
    assert all(torch.equal(weights[k], plain_weights[k]) for k in weights)
    model = GPT(GPTConfig.preset("tiny"))
    model.load_state_dict(weights)
    total, count = 0.0, 0
    with torch.no_grad():
        for r in [{"prompt": "Q: 1+1? A:", "completion": " 2"}, *records[:3]]:
            ids = list((r["prompt"] + r["completion"]).encode())
            trained = [False] * len(r["prompt"].encode()) + [True] * len(r["completion"].encode())
            total += float(_plain_loss(model(torch.tensor([ids[:-1]]))[0], ids, trained))
            count += sum(trained[1:])
    assert result.steps[-1].eval_loss == pytest.approx(total / count, rel=1e-5)
    assert result.steps[-1].eval_perplexity == pytest.approx(torch.exp(torch.tensor(total / count)).item(), rel=1e-5)


def test_evaluate_restores_training_mode_and_refuses_data_without_targets():
    model = _gpt().train()
    empty = SFTBatch(torch.zeros(1, 4, dtype=torch.int64), torch.full((1, 4), IGNORE_INDEX))
    with pytest.raises(ValueError, match="no token to take the loss on"):
        evaluate(model, [empty], "cpu")
    assert model.training


def test_a_streamed_models_accumulation_over_the_steps_targets_equals_one_backward_over_all(tmp_path):
    """The library's recipe (gradient_accumulation_steps and max_grad_norm in the config) with causal_lm_loss
    over the step's count: the same weights as torch AdamW after one backward of the mean over every target
    of the step's micro-batches, clipped."""
    from test_streaming_recipe import LR, WD, pair, streamed

    cfg, ref, model = pair()
    path = _write_jsonl(tmp_path / "pc.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS])
    data = SFTDataset(path, ByteTokenizer(), seq_len=cfg.seq_len, packing=False, shuffle_buffer=0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    model, opt = streamed(tmp_path, model, max_grad_norm=1.0, gradient_accumulation_steps=2)
    try:
        for _ in range(3):
            batches = [data.batch(1), data.batch(3)]  # unequal micro-batches
            n = sum(b.num_items for b in batches)
            for b in batches:
                opt.scale_loss(causal_lm_loss(model, b, n)).backward()
            opt.step()
            opt.zero_grad()
            logits = torch.cat([ref(b.input_ids).reshape(-1, 256) for b in batches])
            F.cross_entropy(logits, torch.cat([b.labels.reshape(-1) for b in batches])).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
        state = model.state_dict()
        for name, p in ref.state_dict().items():
            # fp32 sums in another order: within 2e-6 (dividing each micro-batch by its own count: 2e-2)
            torch.testing.assert_close(state[name], p, rtol=1e-4, atol=1e-5, msg=name)
    finally:
        opt.close()
