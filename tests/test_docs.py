"""The pages a user reads hold: every relative link and anchor resolves, and every command they show is run by a
test or marked as needing what this machine lacks, and each flag it shows is one its parser takes.

A shell block's commands carry a marker on the line above the block: ``<!-- tested: WHERE -->``, where WHERE is
``tests/test_x.py::test_name`` (that test's source names the command's subcommand or script and each of its
flags) or ``.ci/run`` (CI's own steps), one for the whole block or one per command separated by ``;``; or
``<!-- needs a GPU -->`` / ``<!-- needs drives of your own -->`` (paths the user supplies)."""

from __future__ import annotations

import argparse
import ast
import os
import re
import shlex
from pathlib import Path

import pytest
from conftest import run_cli

from nvoffload.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md")])
USER_PAGES = [p for p in PAGES if p.name == "README.md" and p.parent == ROOT or p.parent.name == "docs"]
PROGRAMS = ("nvoffload", "python", "torchrun", "pip", "bash")
MARKER = re.compile(r"<!-- (tested: (?P<test>[^>]+?)|needs (?P<needs>[^>]+?)) -->")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, code marks and punctuation other than '-' and '_' dropped,
    spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def outside_code(text: str) -> list[str]:
    lines, code = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            code = not code
        elif not code:
            lines.append(line)
    return lines


def anchors(page: Path) -> set[str]:
    found: dict[str, int] = {}
    result = set()
    for line in outside_code(page.read_text()):
        m = re.match(r"^#{1,6} (.*)$", line)
        if m:
            base = slug(m.group(1))
            n = found.get(base, 0)
            result.add(base if n == 0 else f"{base}-{n}")
            found[base] = n + 1
    return result


def links(page: Path) -> list[str]:
    return [a or b for line in outside_code(page.read_text()) for a, b in LINK.findall(line)]


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in links(page):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    return broken


class Command:
    def __init__(self, page: Path, line: int, text: str, marker: re.Match | None, index: int):
        self.page, self.line, self.text, self.marker, self.index = page, line, text, marker, index

    def __repr__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}: {self.text}"

    @property
    def tested_by(self) -> str | None:
        """Where this command is run (its entry of the block's ``tested:`` marker), or None."""
        if self.marker is None or not self.marker.group("test"):
            return None
        entries = [e.strip() for e in self.marker.group("test").split(";")]
        return entries[0] if len(entries) == 1 else entries[self.index] if self.index < len(entries) else "(none)"

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text.split("  #")[0].split(" # ")[0], comments=False)


def commands(page: Path) -> list[Command]:
    """The command lines of a page's shell blocks (continuations joined), each with the marker above its block."""
    found, block, marker, last_marker, index = [], None, None, None, 0
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if block is None:
            m = MARKER.search(line)
            if m:
                last_marker = m
            elif line.startswith("```"):
                block = line[3:].strip()
                marker, last_marker, index = last_marker, None, 0
            elif line.strip():
                last_marker = None
        elif line.startswith("```"):
            block = None
        elif block in ("bash", "sh", "console") and line.lstrip("$ ").startswith(PROGRAMS):
            start, text = i + 1, line.lstrip("$ ")
            while text.rstrip().endswith("\\"):
                i += 1
                text = text.rstrip()[:-1] + " " + lines[i].strip()
            found.append(Command(page, start, text, marker, index))
            index += 1
        i += 1
    return found


def all_commands() -> list[Command]:
    return [c for page in USER_PAGES for c in commands(page)]


def flags(words: list[str]) -> list[str]:
    return [w.split("=")[0] for w in words if w.startswith("--")]


def nvoffload_argv(words: list[str]) -> list[str] | None:
    """The arguments after ``nvoffload`` (``python -m nvoffload`` and ``torchrun ... -m nvoffload`` too)."""
    for i, w in enumerate(words):
        if w == "nvoffload" and (i == 0 or words[i - 1] == "-m"):
            return words[i + 1 :]
    return None


def named(words: list[str]) -> list[str]:
    """What a test running the command must name: the nvoffload subcommand, the script's file name or the module
    of ``python -m``, and the flags."""
    argv = nvoffload_argv(words)
    if argv:
        return [argv[0], *flags(argv)]
    what = words[2] if words[1:2] == ["-m"] else Path(words[1]).name
    return [what, *flags(words)]


def parser_flags(subcommand: str) -> set[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {s for a in sub.choices[subcommand]._actions for s in a.option_strings}


def test_every_link_and_anchor_resolves():
    broken = {str(p.relative_to(ROOT)): b for p in PAGES if (b := broken_links(p))}
    assert not broken, broken


def test_the_link_check_sees_a_missing_file_and_a_missing_anchor(tmp_path):
    page = tmp_path / "a.md"
    page.write_text("# Title\n\n## Some `code`, here\n\n[x](#some-code-here) [y](b.md) [z](#nope)\n")
    assert broken_links(page) == ["b.md: no such file", "#nope: no heading #nope in a.md"]


def test_the_readme_is_a_newcomers_five_minutes():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_every_command_shown_is_tested_or_marked():
    unmarked = [c for c in all_commands() if c.marker is None]
    assert not unmarked, unmarked


def test_a_tested_command_names_a_test_that_runs_its_subcommand_and_flags():
    wrong = []
    for c in all_commands():
        if c.tested_by is None:
            continue
        where, _, name = c.tested_by.partition("::")
        path = ROOT / where
        if not path.exists():
            wrong.append(f"{c}: {where} does not exist")
            continue
        source = path.read_text()
        if name:
            funcs = {n.name: ast.get_source_segment(source, n) for n in ast.walk(ast.parse(source))
                     if isinstance(n, ast.FunctionDef)}  # fmt: skip
            if name not in funcs:
                wrong.append(f"{c}: no function {name} in {where}")
                continue
            source = funcs[name]
        missing = [w for w in named(c.words) if w not in source]
        if missing:
            wrong.append(f"{c}: {c.tested_by} does not mention {missing}")
    assert not wrong, wrong


def test_every_flag_shown_is_one_its_parser_takes():
    wrong = []
    for c in all_commands():
        argv = nvoffload_argv(c.words)
        if argv:
            unknown = [f for f in flags(argv) if f not in parser_flags(argv[0])]
            if unknown:
                wrong.append(f"{c}: {argv[0]} takes no {unknown}")
    assert not wrong, wrong


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_parse(page):
    """Each ```python block is Python (blocks of a doctest session, or with ``...`` standing for the user's
    code, are left out)."""
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    bad = []
    for code in blocks:
        if ">>>" in code or re.search(r"^\s*\.\.\.\s*$|\.\.\.\s*#|[(,]\s*\.\.\.", code, flags=re.M):
            continue
        try:
            compile(code, str(page), "exec")
        except SyntaxError as e:
            bad.append(f"{e}: {code[:80]!r}")
    assert not bad, bad


def test_the_quick_start_main_job_runs_as_typed(tmp_path):
    """The README's first command, ``nvoffload finetune``, as a newcomer types it (a few steps): its default swap
    directory under the cache, emptied at the end."""
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    run = run_cli(["finetune", "--steps", "3", "--no-progress"], cwd=tmp_path, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "step 3: loss" in run.stdout and "3 steps: loss" in run.stdout
    assert os.listdir(tmp_path / "cache" / "nvoffload") == []
