"""Writes ``chat.jsonl``: 400 short made-up conversations (arithmetic, words, sorting, colours, numbers).

Every conversation is generated here from templates and a seeded generator, so
the file is reproducible and free of third-party text:
``python -m nvoffload.data._make_chat > nvoffload/data/chat.jsonl``.
"""

import json
import random
import sys

NUMBER_WORDS = "zero one two three four five six seven eight nine ten eleven twelve".split()
WORDS = "apple river stone cloud garden window bridge candle forest pencil rocket silver market ladder".split()
COLOURS = {("blue", "yellow"): "green", ("red", "yellow"): "orange", ("red", "blue"): "purple",
           ("red", "white"): "pink", ("black", "white"): "grey"}  # fmt: skip
SYSTEM = "Be brief."
MAX_BYTES = 129  # rendered with the default chat template: one row of the small preset (128 positions)


def _turn(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(6)
    if kind == 0:
        a, b = rng.randrange(2, 50), rng.randrange(2, 50)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 1:
        a, b = rng.randrange(2, 13), rng.randrange(2, 13)
        return f"What is {a} times {b}?", f"{a} times {b} is {a * b}."
    if kind == 2:
        w = rng.choice(WORDS)
        return f"Spell '{w}' backwards.", f"'{w}' backwards is '{w[::-1]}'."
    if kind == 3:
        xs = rng.sample(range(1, 30), rng.randrange(3, 5))
        return f"Sort these numbers: {', '.join(map(str, xs))}.", f"In order: {', '.join(map(str, sorted(xs)))}."
    if kind == 4:
        (a, b), c = rng.choice(sorted(COLOURS.items()))
        return f"What colour do you get by mixing {a} and {b}?", f"Mixing {a} and {b} gives {c}."
    n = rng.randrange(1, 13)
    return f"How do you write {n} in words?", f"{n} is written '{NUMBER_WORDS[n]}'."


def _bytes(messages: list[dict]) -> int:
    return sum(len(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n") for m in messages)


def conversations(count: int = 400, seed: int = 0) -> list[dict]:
    """One question and its answer each, a fifth with a system message, none over ``MAX_BYTES`` rendered."""
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.2 else []
        question, answer = _turn(rng)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if _bytes(messages) <= MAX_BYTES:
            out.append({"messages": messages})
    return out


if __name__ == "__main__":
    for record in conversations():
        sys.stdout.write(json.dumps(record) + "\n")
