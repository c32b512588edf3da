"""Supervised fine-tuning data as people have it: JSONL, Parquet or a ``datasets`` directory, to packed batches.

A file is read through the ``datasets`` library (the ``[hf]`` extra), streamed
(never loaded whole, never downloaded): ``*.jsonl``/``*.json`` and
``*.parquet`` files, or a directory written by ``Dataset.save_to_disk`` (of a
``DatasetDict``: its ``train`` split for training, its ``validation`` or
``test`` split for evaluation). Each record has one of three shapes, chosen
by the keys of the first record, as ``trl``'s ``SFTTrainer`` takes them:

- ``{"text": ...}``: language modelling, the loss on every token;
- ``{"prompt": ..., "completion": ...}`` (strings): the loss on the completion's tokens;
- ``{"messages": [{"role": ..., "content": ...}, ...]}``: rendered by the chat
  template, the loss on the assistant's tokens.

``loss_on="all"`` trains on every token of every shape. Every record is
checked, and tokenized, before the first batch (one pass over the file): a
record of another shape than the first, a chat role other than :data:`ROLES`
(ShareGPT's ``human``/``gpt`` included), a chat without an assistant turn
(nothing to train on, unless ``loss_on="all"``), a line that is not UTF-8 or
not JSON, a record longer than ``max_record_bytes`` (:data:`MAX_RECORD_BYTES`,
16 MiB, by default), one the tokenizer or its chat template fails on, or whose
tokens reach past the model's vocabulary is refused naming the file and line
(row, for Parquet and ``datasets`` directories), and so is an empty file. An
example with no token to train on once cut to ``seq_len + 1`` tokens (its
completion or assistant turns past them, or fewer than two tokens) is left
out, its line named in a warning; a file (or part, with ``eval_fraction``)
with no other is refused naming ``seq_len``. JSON lines are read by this
module one line at a time (a longer line is refused before more of it is
read); a JSON array (``[...]``) is refused: one record a line.

Tokenization: a Hugging Face tokenizer (``PreTrainedTokenizerFast``) or
:class:`~nvoffload.data.ByteTokenizer`. Text and completions end with the
tokenizer's EOS token when it has one (trained on, as ``SFTTrainer`` does); no
BOS token is added to them (``add_special_tokens=False``; chat templates
write their own).
Chats use the tokenizer's own ``chat_template`` when it has one: with
``{% generation %}`` blocks the assistant tokens are the template's
(``return_assistant_tokens_mask``); otherwise they are the tokens that
rendering each assistant turn adds to the conversation before it (with
``add_generation_prompt``), which needs a template that renders a
conversation's beginning as a prefix of the whole (one that rewrites earlier
turns is refused). Without a template (bytes, or a tokenizer that has none)
the default is :data:`DEFAULT_CHAT_TEMPLATE`, ChatML-like::

    <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello!<|im_end|>\\n

each piece tokenized on its own; an assistant turn's trained tokens are its
content and ``<|im_end|>\\n`` (so the model learns to stop), never the
``<|im_start|>assistant\\n`` header.

Batches (:class:`SFTBatch`) hold inputs, targets (the next token, ``-100``
where no loss is taken, as torch and Hugging Face do) and position ids. With
``packing`` (the default) whole examples are placed one after the other in
rows of ``seq_len`` positions, in order, a row closed when the next example
does not fit (its rest is padding, not trained); each example's positions
restart at 0, which is how a model keeps attention within an example: the GPT
preset (:class:`nvoffload.models.GPT`) builds a block-diagonal causal mask
from them, and so do Hugging Face models whose masks come from
``transformers``' ``create_causal_mask`` (Llama, GPT-2, Mistral, Qwen, ... with
sdpa, eager or flash attention) when no ``attention_mask`` is given; a model
that ignores ``position_ids`` attends across the examples of a row. Without
packing each row holds one example, padded at the end to the batch's
longest. Padding is the tokenizer's ``pad_token`` (its EOS token when it has
none; 0 for bytes), never trained (its targets are ``-100``). An example
longer than ``seq_len + 1`` tokens is truncated to its first ``seq_len + 1``.

Training order: shuffled with a buffer of ``shuffle_buffer`` examples (seeded
by ``seed`` and the epoch; 0 keeps the file's order), epoch after epoch. The
position in the data (epoch and example) is :meth:`SFTDataset.state_dict`,
so a resumed run goes on at the exact next example.

Example::

    from nvoffload.data.sft import SFTDataset

    data = SFTDataset("chat.jsonl", tokenizer, seq_len=512)
    batch = data.batch(8)                              # the next 8 packed rows
    loss = causal_lm_loss(model, batch, batch.num_items)   # nvoffload.sft
    for batch in SFTDataset("eval.jsonl", tokenizer, seq_len=512).batches(8):   # one pass, in order
        ...
"""

from __future__ import annotations

import gzip
import json
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources

import torch

from nvoffload.data import ByteTokenizer

__all__ = [
    "CHAT_DATA_NAME",
    "DEFAULT_CHAT_TEMPLATE",
    "IGNORE_INDEX",
    "SFTBatch",
    "SFTDataset",
    "resolve_data_path",
    "tokenize_record",
]

IGNORE_INDEX = -100  # targets without loss, as torch.nn.functional.cross_entropy and transformers take them
CHAT_DATA_NAME = "chat.jsonl"  # the shipped chat data (``--data chat``)
# The rendering used for chats when the tokenizer has no chat template (ChatML's markup).
DEFAULT_CHAT_TEMPLATE = "<|im_start|>{role}\n{content}<|im_end|>\n"
SHAPES = {"messages": ("messages",), "prompt-completion": ("prompt", "completion"), "text": ("text",)}
LOSS_ON = ("completion", "all")
ROLES = ("system", "developer", "user", "assistant", "tool")  # a chat's roles; the assistant's turns are trained
# The longest record read, in bytes (a JSON line; a Parquet or datasets record's strings): a record is held whole,
# and its tokens as Python ints (~40 bytes each), before it is cut to seq_len + 1 tokens.
MAX_RECORD_BYTES = 16 << 20
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_DATASETS_HINT = "reading --data needs the datasets library: pip install 'nvoffload[hf]'"


def resolve_data_path(path: str | os.PathLike) -> str:
    """``path``, or the shipped chat data's path for the name ``chat``."""
    if os.fspath(path) == "chat" and not os.path.exists("chat"):
        return str(resources.files("nvoffload.data").joinpath(CHAT_DATA_NAME))
    return os.fspath(path)


@dataclass(frozen=True)
class SFTBatch:
    """Rows of a batch: ``input_ids`` and ``labels`` (the next token, or ``-100``), ``(rows, length)`` int64;
    ``position_ids`` restart at 0 at each example (None: one example a row, ``0..length-1``)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None = None

    @property
    def num_items(self) -> int:
        """The targets with a loss (labels other than -100)."""
        return int((self.labels != IGNORE_INDEX).sum())

    def select(self, rows: slice) -> SFTBatch:
        """These rows only."""
        pos = None if self.position_ids is None else self.position_ids[rows]
        return SFTBatch(self.input_ids[rows], self.labels[rows], pos)

    def to(self, device: torch.device | str) -> SFTBatch:
        pos = None if self.position_ids is None else self.position_ids.to(device)
        return SFTBatch(self.input_ids.to(device), self.labels.to(device), pos)


# -- reading ---------------------------------------------------------------------------------------------------------


def _import_datasets():
    try:
        import datasets
    except ImportError as exc:
        raise ImportError(f"{_DATASETS_HINT} ({exc})") from None
    return datasets


def _is_saved_dataset(path: str) -> bool:
    return os.path.isdir(path) and any(
        os.path.isfile(os.path.join(path, name)) for name in ("dataset_dict.json", "state.json", "dataset_info.json")
    )


def _is_json_lines(path: str) -> bool:
    return not _is_saved_dataset(path) and _file_kind(path) == "json"


def _open_records(path: str, evaluation: bool, max_record_bytes: int):
    """The records of ``path`` as a ``datasets.IterableDataset`` (streamed from local files; JSON lines by
    :func:`_json_lines`, one bounded line at a time)."""
    if not os.path.exists(path):
        raise FileNotFoundError(2, f"no such data file or directory: {path}", path)
    datasets = _import_datasets()
    if _is_saved_dataset(path):
        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            wanted = ("validation", "test") if evaluation else ("train",)
            split = next((s for s in wanted if s in ds), None)
            if split is None:
                raise ValueError(f"{path}: a DatasetDict without a {' or '.join(wanted)} split (it has {', '.join(ds)})")
            ds = ds[split]
        return ds.to_iterable_dataset()
    if _file_kind(path) == "json":
        lines = {"path": path, "max_record_bytes": max_record_bytes}
        return datasets.IterableDataset.from_generator(_json_records, gen_kwargs=lines)
    return datasets.load_dataset("parquet", data_files=path, split="train", streaming=True)


def _file_kind(path: str) -> str:
    name = path.lower()
    if name.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz")):
        return "json"
    if name.endswith(".parquet"):
        return "parquet"
    raise ValueError(
        f"{path}: not a .jsonl, .json or .parquet file, nor a directory written by datasets' save_to_disk"
    )


class _BadRecord(ValueError):
    """A record refused, named by its file and line (or row)."""


def _too_long(where: str, max_record_bytes: int) -> _BadRecord:
    return _BadRecord(f"{where}: a record longer than max_record_bytes {max_record_bytes} (records are read whole)")


def _json_lines(path: str, max_record_bytes: int) -> Iterator[tuple[str, object]]:
    """``(where, value)`` of each line of the JSON-lines file ``path`` that is not blank (``where``: the file and
    line), read one line at a time and no line longer than ``max_record_bytes`` whole.

    Raises ValueError naming the file and line for a line longer than that (before reading more of it), bytes
    that are not UTF-8 (their offset in the file), JSON that does not parse (the column) or a JSON array."""
    opener = gzip.open if path.lower().endswith(".gz") else open
    with opener(path, "rb") as f:
        number = offset = 0
        while line := f.readline(max_record_bytes + 2):  # the record, a newline and a carriage return before it
            number += 1
            where = f"{path}, line {number}"
            text = line.rstrip(b"\r\n") if line.endswith(b"\n") else line
            if len(text) > max_record_bytes:
                raise _too_long(where, max_record_bytes)
            try:
                decoded = text.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _BadRecord(
                    f"{where}: not valid UTF-8: byte 0x{text[exc.start : exc.start + 1].hex()} at offset"
                    f" {offset + exc.start} of the file ({exc.reason})"
                ) from None
            offset += len(line)
            if not decoded.strip():
                continue
            if number == 1 and decoded.lstrip().startswith("["):
                raise _BadRecord(f"{path} holds a JSON array, not JSON lines: write one record a line (jq -c '.[]')")
            try:
                yield where, json.loads(decoded)
            except json.JSONDecodeError as exc:
                raise _BadRecord(f"{where}, column {exc.colno}: not valid JSON ({exc.msg})") from None


def _json_records(path: str, max_record_bytes: int) -> Iterator[object]:
    for _, record in _json_lines(path, max_record_bytes):
        yield record


def _shape_of(record: dict) -> str | None:
    for shape, keys in SHAPES.items():
        if all(record.get(k) is not None for k in keys):
            return shape
    return None


def _check(record, shape: str | None, where: str, loss_on: str) -> str:
    """The record's shape, after checking it is ``shape`` (any of the three when None) with fields of the right
    types; a chat's roles must be :data:`ROLES`, and with ``loss_on="completion"`` one of them the assistant."""
    expected = " or ".join("{" + ", ".join(f'"{k}": ...' for k in keys) + "}" for keys in SHAPES.values())
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object ({expected}), got {type(record).__name__}")
    found = _shape_of(record)
    if found is None or (shape is not None and found != shape):
        want = expected if shape is None else "{" + ", ".join(f'"{k}": ...' for k in SHAPES[shape]) + "}"
        first = "" if shape is None else f" (the shape of the first record: {shape})"
        raise ValueError(f"{where}: expected {want}{first}, got the keys {sorted(record)}")
    if found == "messages":
        _check_chat(record["messages"], where, loss_on)
    else:
        for key in SHAPES[found]:
            if not isinstance(record[key], str):
                raise ValueError(f'{where}: "{key}" must be a string, got {type(record[key]).__name__}')
    return found


def _check_chat(messages, where: str, loss_on: str) -> None:
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise ValueError(f'{where}: "messages" must be a non-empty list of {{"role": str, "content": str}}')
    unknown = next((m["role"] for m in messages if m["role"] not in ROLES), None)
    if unknown is not None:
        raise ValueError(
            f"{where}: the role {unknown!r} is none of {', '.join(ROLES)} (ShareGPT's human and gpt are user and"
            " assistant: rename them)"
        )
    if loss_on == "completion" and not any(m["role"] == "assistant" for m in messages):
        raise ValueError(
            f"{where}: a chat without an assistant turn has nothing to train on: remove it, or train on every token"
            " (loss_on all)"
        )


def _text_bytes(record: dict, shape: str) -> int:
    """The UTF-8 bytes of the strings of a record checked to be of ``shape``."""
    texts = [m["content"] for m in record["messages"]] if shape == "messages" else [record[k] for k in SHAPES[shape]]
    return sum(len(t.encode("utf-8")) for t in texts)


# -- tokenizing ------------------------------------------------------------------------------------------------------


class _Encoder:
    """A Hugging Face tokenizer or a :class:`ByteTokenizer`, as lists of ids."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.bytes = isinstance(tokenizer, ByteTokenizer)
        self.eos = None if self.bytes else tokenizer.eos_token_id
        pad = None if self.bytes else tokenizer.pad_token_id
        self.pad = pad if pad is not None else self.eos if self.eos is not None else 0  # the inputs of padding
        self.template = None if self.bytes else getattr(tokenizer, "chat_template", None)
        self.generation = self.template is not None and bool(_GENERATION.search(self.template))

    def ids(self, text: str) -> list[int]:
        if self.bytes:
            return self.tokenizer.encode(text).tolist()
        return list(self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])

    def chat(self, messages: list[dict], **kwargs) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"])


def _chat(enc: _Encoder, messages: list[dict], where: str) -> tuple[list[int], list[bool]]:
    """The conversation's tokens and which of them are the assistant's."""
    if enc.template is None:
        head, tail = DEFAULT_CHAT_TEMPLATE.split("{content}")
        ids: list[int] = []
        trained: list[bool] = []
        for m in messages:
            for text, mine in ((head.format(role=m["role"]), False), (m["content"] + tail, m["role"] == "assistant")):
                piece = enc.ids(text)
                ids += piece
                trained += [mine] * len(piece)
        return ids, trained
    if enc.generation:
        out = enc.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
    ids = enc.chat(messages)
    trained = [False] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, upto = enc.chat(messages[:i], add_generation_prompt=True) if i else [], enc.chat(messages[: i + 1])
        if ids[: len(upto)] != upto or upto[: len(start)] != start:
            raise _BadRecord(
                f"{where}: the tokenizer's chat template does not render the conversation up to message {i} as"
                " a prefix of the whole, so the assistant's tokens cannot be found: use a template with"
                " {% generation %} blocks, or --loss-on all"
            )
        trained[len(start) : len(upto)] = [True] * (len(upto) - len(start))
    return ids, trained


def tokenize_record(record: dict, shape: str, tokenizer, loss_on: str = "completion", where: str = "the record"):
    """``(ids, trained)``: a record's token ids and, for each, whether its prediction is trained on.

    ``tokenizer`` is a Hugging Face tokenizer or a :class:`ByteTokenizer`;
    ``shape`` one of ``text``, ``prompt-completion``, ``messages``.
    """
    enc = tokenizer if isinstance(tokenizer, _Encoder) else _Encoder(tokenizer)
    eos = [] if enc.eos is None else [enc.eos]
    if shape == "messages":
        ids, trained = _chat(enc, record["messages"], where)
    elif shape == "prompt-completion":
        prompt, completion = enc.ids(record["prompt"]), enc.ids(record["completion"]) + eos
        ids, trained = prompt + completion, [False] * len(prompt) + [True] * len(completion)
    else:
        ids = enc.ids(record["text"]) + eos
        trained = [True] * len(ids)
    if loss_on == "all":
        trained = [True] * len(ids)
    return ids, trained


# -- examples, rows and batches --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Example:
    ids: list[int]
    trained: list[bool]

    @property
    def positions(self) -> int:
        """Input positions it takes in a row (its tokens but the last, which is only a target)."""
        return len(self.ids) - 1


def _held_out(index: int, fraction: float) -> bool:
    """Whether example ``index`` belongs to the evaluation part: every ``1/fraction``-th, spread evenly."""
    return int((index + 1) * fraction) > int(index * fraction)


def _collate(rows: list[list[_Example]], length: int, pad: int) -> SFTBatch:
    """Rows of examples laid out in ``length`` positions: inputs (``pad`` after the examples), next-token targets,
    positions from 0 each."""
    x = torch.full((len(rows), length), pad, dtype=torch.int64)
    y = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.int64)
    pos = torch.zeros(len(rows), length, dtype=torch.int64)
    for r, row in enumerate(rows):
        at = 0
        for ex in row:
            n = ex.positions
            ids = torch.tensor(ex.ids, dtype=torch.int64)
            x[r, at : at + n] = ids[:-1]
            y[r, at : at + n] = ids[1:].masked_fill(~torch.tensor(ex.trained[1:]), IGNORE_INDEX)
            pos[r, at : at + n] = torch.arange(n)
            at += n
        pos[r, at:] = torch.arange(length - at)  # the padding: a sequence of its own, never trained
    # one example a row (padding comes after it, so causal attention never sees it): plain positions
    return SFTBatch(x, y, pos if any(len(row) > 1 for row in rows) else None)


class SFTDataset:
    """Examples of a JSONL, Parquet or ``datasets`` directory as packed (or padded) batches; see the module docstring.

    Args:
        path: the data (``chat``: the shipped chat data, :data:`CHAT_DATA_NAME`).
        tokenizer: a Hugging Face tokenizer, or a :class:`ByteTokenizer`.
        seq_len: positions per row (an example takes its tokens less one).
        packing: several examples per row (False: one, padded to the batch's longest).
        loss_on: ``completion`` (the completion's or assistant's tokens; all of a text) or ``all``.
        seed, shuffle_buffer: the training order (:meth:`batch`); ``shuffle_buffer=0`` keeps the file's.
        eval_fraction: hold out every ``1/eval_fraction``-th example (spread evenly over the file) for evaluation.
        evaluation: this is the held-out part (all of it without ``eval_fraction``; a ``DatasetDict``'s
            validation or test split); else the rest (a ``DatasetDict``'s train split).
        vocab_size: refuse token ids from ``vocab_size`` on (the model's vocabulary).
        max_record_bytes: the longest record (a JSON line; the strings of a Parquet or ``datasets`` record).

    Every record is checked, and this part's tokenized, when the dataset is made (one pass over the file), so
    that data a run would stop at midway is refused before the run creates anything.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ImportError: ``datasets`` is not installed.
        ValueError: an unknown file type, an empty file, a JSON array; naming the file and line (Parquet and
            ``datasets`` directories: the row): a record longer than ``max_record_bytes``, bytes that are not
            UTF-8 (their offset), JSON that does not parse (the column), a record of another shape than the
            first or with fields of the wrong types, a chat role outside :data:`ROLES`, a chat without an
            assistant turn (with ``loss_on="completion"``), one the tokenizer (or its chat template) fails on,
            ids from ``vocab_size`` on; no example with a token to train on within ``seq_len + 1`` tokens.

    Warns (UserWarning) naming the lines of the examples left out: no token to train on within ``seq_len + 1``.
    """

    def __init__(
        self, path: str | os.PathLike, tokenizer, seq_len: int, *, packing: bool = True, loss_on: str = "completion",
        seed: int = 0, shuffle_buffer: int = 1000, eval_fraction: float = 0.0, evaluation: bool = False,
        vocab_size: int | None = None, max_record_bytes: int = MAX_RECORD_BYTES,
    ):  # fmt: skip
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if loss_on not in LOSS_ON:
            raise ValueError(f"loss_on must be one of {', '.join(LOSS_ON)}, got {loss_on!r}")
        if not 0 <= eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
        if shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer must be >= 0, got {shuffle_buffer}")
        if max_record_bytes < 1:
            raise ValueError(f"max_record_bytes must be >= 1, got {max_record_bytes}")
        self.path = resolve_data_path(path)
        self.seq_len, self.packing, self.loss_on, self.seed = seq_len, packing, loss_on, seed
        self.shuffle_buffer, self.eval_fraction, self.evaluation = shuffle_buffer, eval_fraction, evaluation
        self.vocab_size = vocab_size
        self._encoder = _Encoder(tokenizer)
        self.max_record_bytes = max_record_bytes
        # a DatasetDict's evaluation split, unless the fraction is held out of its train split
        self._evaluation_split = evaluation and not eval_fraction
        self._records = _open_records(self.path, self._evaluation_split, max_record_bytes)
        self._lines = _is_json_lines(self.path)  # JSON lines: bounded as they are read
        self.shape = self._checked_shape()
        self._position = (0, 0)  # (epoch, example) of the next example not in a batch yet
        self._stream: Iterator[tuple[int, int, _Example]] | None = None
        self._pending: tuple[int, int, _Example] | None = None

    # the training stream

    def state_dict(self) -> dict:
        """The position in the data: the epoch and the example (in that epoch's order) that comes next."""
        epoch, index = self._position
        return {"epoch": epoch, "example": index}

    def load_state_dict(self, state: dict) -> None:
        """Go on from where :meth:`state_dict` was taken."""
        self._position = (int(state["epoch"]), int(state["example"]))
        self._stream = self._pending = None

    def batch(self, batch_size: int) -> SFTBatch:
        """The next ``batch_size`` rows of the training order (epoch after epoch)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return self._collated([self._row() for _ in range(batch_size)])

    def _row(self) -> list[_Example]:
        row: list[_Example] = []
        while True:
            if self._pending is None:
                if self._stream is None:
                    self._stream = self._training_order(*self._position)
                self._pending = next(self._stream)
            epoch, index, ex = self._pending
            if self._closes(row, ex):
                return row
            row.append(ex)
            self._pending, self._position = None, (epoch, index + 1)

    def _training_order(self, epoch: int, start: int) -> Iterator[tuple[int, int, _Example]]:
        while True:
            records = self._part()
            if self.shuffle_buffer:
                records = records.shuffle(seed=self.seed + epoch, buffer_size=self.shuffle_buffer)
            found = False
            for index, record in enumerate(self._read(records.skip(start) if start else records), start=start):
                ex = self._example(record)
                if ex is not None:
                    found = True
                    yield epoch, index, ex
            if not found and start == 0:  # every one was checked to be: the file changed since
                raise ValueError(f"{self.path}: no example of {self._which()} to train on (changed since it was read?)")
            epoch, start = epoch + 1, 0

    # one pass, for evaluation

    def batches(self, batch_size: int) -> Iterator[SFTBatch]:
        """Every example once, in the file's order, ``batch_size`` rows a batch (the last may have fewer)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        examples = (e for e in map(self._example, self._read(self._part())) if e is not None)
        rows: list[list[_Example]] = []
        row: list[_Example] = []
        for ex in examples:
            if self._closes(row, ex):
                rows.append(row)
                row = []
                if len(rows) == batch_size:
                    yield self._collated(rows)
                    rows = []
            row.append(ex)
        if row:
            rows.append(row)
        if rows:
            yield self._collated(rows)

    def _closes(self, row: list[_Example], ex: _Example) -> bool:
        """Whether ``ex`` starts a new row after ``row``: it does not fit (packing), or ``row`` has one (padding)."""
        return bool(row) and (not self.packing or sum(e.positions for e in row) + ex.positions > self.seq_len)

    def _collated(self, rows: list[list[_Example]]) -> SFTBatch:
        """Packed rows take ``seq_len`` positions; padded ones the longest row's."""
        length = self.seq_len if self.packing else max(sum(e.positions for e in r) for r in rows)
        return _collate(rows, length, self._encoder.pad)

    # records to examples

    def _which(self) -> str:
        if not self.eval_fraction:
            return "the file"
        return "its held-out part" if self.evaluation else "what eval_fraction leaves for training"

    def _part(self):
        """This part's records: all, or those ``eval_fraction`` holds out (or leaves)."""
        if not self.eval_fraction:
            return self._records
        f, held = self.eval_fraction, self.evaluation
        return self._records.filter(lambda _, i: _held_out(i, f) == held, with_indices=True)

    def _read(self, records) -> Iterator[dict]:
        """``records``, a reader's error (pyarrow's, datasets') turned into one naming the file."""
        it = iter(records)
        while True:
            try:
                record = next(it)
            except StopIteration:
                return
            except _BadRecord:  # the JSON lines' reader names the line
                raise
            except Exception as exc:
                raise ValueError(f"{self.path}: {type(exc).__name__}: {exc}") from None
            yield record

    def _numbered(self) -> Iterator[tuple[str, object]]:
        """``(where, record)`` of every record of this file (or split), in order; ``where`` names the file and the
        line (a Parquet or ``datasets`` record: the row, from 0 as ``dataset[row]``)."""
        if self._lines:
            yield from _json_lines(self.path, self.max_record_bytes)
            return
        for row, record in enumerate(self._read(self._records)):
            yield f"{self.path}, row {row}", record

    def _checked_shape(self) -> str:
        """The shape of the first record, once every record is checked (one pass): its shape and fields, a chat's
        roles, its size within ``max_record_bytes``; and this part's records tokenized (:meth:`_tokenized`). Data
        that would stop the run midway is refused before anything is created; the examples with no token to train
        on are named in a warning (they are left out), and a part without any other is refused."""
        shape, examples, left_out = None, 0, []
        for index, (where, record) in enumerate(self._numbered()):
            shape = _check(record, shape, where, self.loss_on)
            if not self._lines and _text_bytes(record, shape) > self.max_record_bytes:
                raise _too_long(where, self.max_record_bytes)
            if self._in_part(index):
                examples += 1
                if self._tokenized(record, shape, where) is None:
                    left_out.append(where.removeprefix(f"{self.path}, "))
        if shape is None:
            raise ValueError(f"{self.path} holds no records: nothing to train on")
        if not examples:  # a held-out part of a few records
            n = index + 1
            raise ValueError(
                f"{self.path}: eval_fraction {self.eval_fraction} holds out none of its {n} records: raise it"
                f" (to 1/{n} or more)"
            )
        if not left_out:
            return shape
        within = f"token to train on within seq_len + 1 = {self.seq_len + 1} tokens"
        named = ", ".join(left_out[:5]) + (", ..." if len(left_out) > 5 else "")
        cure = "raise seq_len" + (", or train on every token (loss_on all)" if self.loss_on == "completion" else "")
        if len(left_out) == examples:
            raise ValueError(f"{self.path}: no example of {self._which()} has a {within} ({named}): {cure}")
        warnings.warn(
            f"{self.path}: {len(left_out)} of the {examples} examples of {self._which()} have no {within} ({named}):"
            f" left out; {cure}",
            stacklevel=3,
        )
        return shape

    def _in_part(self, index: int) -> bool:
        """Whether the record ``index`` of the file (or split) is one of this part's (see :meth:`_part`)."""
        return not self.eval_fraction or _held_out(index, self.eval_fraction) == self.evaluation

    def _tokenized(self, record: dict, shape: str, where: str) -> _Example | None:
        """The record (of ``shape``, checked) tokenized and truncated to ``seq_len + 1`` tokens; None when no
        prediction is left to train on (fewer than two tokens, or the trained ones cut off). Raises ValueError
        naming ``where`` for the tokenizer's errors and ids beyond ``vocab_size``."""
        try:
            ids, trained = tokenize_record(record, shape, self._encoder, self.loss_on, where)
        except _BadRecord:
            raise
        except Exception as exc:  # the tokenizer's or its chat template's (jinja2's raise_exception, ...)
            raise _BadRecord(f"{where}: the tokenizer failed on it: {type(exc).__name__}: {exc}") from exc
        ids, trained = ids[: self.seq_len + 1], trained[: self.seq_len + 1]
        if not any(trained[1:]):
            return None
        if self.vocab_size is not None and max(ids) >= self.vocab_size:
            raise _BadRecord(
                f"{where}: the tokenizer produced id {max(ids)}, beyond the model's vocabulary of {self.vocab_size}"
            )
        return _Example(ids, trained)

    def _example(self, record: dict) -> _Example | None:
        """A record of this part, tokenized as it was when the dataset was made (:meth:`_tokenized`)."""
        return self._tokenized(record, self.shape, self.path)
