"""Every `weir` command the README and the documentation name exists, with every option it is shown with.

Read from README.md and docs/*.md: each ``weir SUBCOMMAND …`` in a code block (a line, its ``\\`` continuations
joined, its ``#`` comment read as prose) or in inline code, checked against the parser `weir` itself builds
(`launcher.cli.build_parser`): the subcommand is one of its commands, and each ``--option`` after it, up to the end
of the command, is one of that command's options. Placeholders (``ROLE``, ``DIR``, ``…``), values, quoted text
(``--sglang-args '{"tp_size": 2}'``) and alternatives (``add|remove``, ``(--demo | --dataset F)``) are not options;
a command ends at a shell separator (``&&``, ``;``, a pipe to another program, a redirection) or where the next
``weir`` begins.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from launcher.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
PAGES = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE = re.compile(r"(`+)(.+?)\1")
# `weir` as a command: not part of a word, a path's last part allowed (.venv/bin/weir), then a space
COMMAND = re.compile(r"(?<![\w.\-\[/])(?:[\w./]*/)?weir(?=[ \t]+\S)")
QUOTED = re.compile(r"(?<!\w)(?:'[^']*'|\"[^\"]*\")")  # a quoted value, not an apostrophe (`weir up`'s)
SHELL_END = re.compile(r"&&|\|\||;|\s\|\s+(?=[a-z./]+\s)(?!-)|\s>>?\s|\s2>")
OPTION = re.compile(r"--[a-z0-9][a-z0-9-]*")


@dataclass(frozen=True)
class Use:
    """One `weir` command as a page shows it."""

    page: str
    line: int
    text: str  # the command, from `weir` to its end

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text.strip()}"


def _code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, text) of the places a command can be written: each code-block line (continuations joined,
    its comment a place of its own) and each inline code span outside code blocks (a span may wrap lines)."""
    places: list[tuple[int, str]] = []
    in_block = False
    pending: tuple[int, str] | None = None
    paragraph: list[tuple[int, str]] = []

    def spans() -> None:  # the inline code of the paragraph so far, a wrapped span read as one line
        joined, starts = "", []
        for number, line in paragraph:
            starts.append((len(joined), number))
            joined += line + " "
        for span in INLINE.finditer(joined):
            number = max(n for offset, n in starts if offset <= span.start())
            places.append((number, span.group(2)))
        paragraph.clear()

    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            spans()
            in_block = not in_block
            pending = None
            continue
        if not in_block:
            if line.strip():
                paragraph.append((number, line))
            else:
                spans()
            continue
        if pending is not None:
            number, line = pending[0], pending[1] + " " + line.strip()
            pending = None
        if line.rstrip().endswith("\\"):
            pending = (number, line.rstrip()[:-1])
            continue
        code, *comment = re.split(r"(?:^|\s)#(?:\s|$)", line, maxsplit=1)
        places.append((number, code))
        if comment and comment[0].strip():
            places += [(number, span.group(2)) for span in INLINE.finditer(comment[0])] or [(number, comment[0])]
    spans()
    return places


def uses() -> list[Use]:
    """Every `weir` command of the README and the docs."""
    found = []
    for page in PAGES:
        name = str(page.relative_to(REPO))
        for number, place in _code_lines(page.read_text(encoding="utf-8")):
            place = place.replace("\\|", "|")  # a pipe escaped in a table cell
            commands = list(COMMAND.finditer(place))
            for i, command in enumerate(commands):
                end = commands[i + 1].start() if i + 1 < len(commands) else len(place)
                found.append(Use(name, number, "weir" + place[command.end() : end]))
    return found


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _top_options() -> set[str]:
    return set(build_parser()._option_string_actions)


def parse_use(use: Use) -> tuple[str | None, list[str]]:
    """The subcommand (None: `weir --option` or a placeholder such as ``weir COMMAND``) and the options named."""
    text = QUOTED.sub(" ", use.text)
    text = SHELL_END.split(text, maxsplit=1)[0]
    words = text.split()[1:]  # after `weir`
    if not words:
        return None, []
    first = re.split(r"['’]", words[0].strip("`'\".,:;()"))[0]  # `weir train`'s: the command is train
    if first.startswith("-"):
        return None, [m.group(0) for m in OPTION.finditer(first)]
    if not re.fullmatch(r"[a-z][a-z0-9-]*", first):
        return None, []  # a placeholder (COMMAND, SUBCOMMAND) or prose
    options = []
    for word in words[1:]:
        for piece in re.split(r"[|\[\]()]", word):
            piece = piece.strip("`'\".,:;…")
            if piece.startswith("--") and (m := OPTION.match(piece)):
                options.append(m.group(0))
    return first, options


ALL = uses()


def test_the_pages_name_weir_commands() -> None:
    """The scan finds the commands (a broken scan would pass everything)."""
    assert len(ALL) > 100
    named = {parse_use(u)[0] for u in ALL}
    assert {"up", "train", "serve", "prep", "twin", "engines", "init-model", "export-hf", "token", "demo"} <= named


@pytest.mark.parametrize("page", [str(p.relative_to(REPO)) for p in PAGES])
def test_every_command_and_option_exists(page: str) -> None:
    commands = _subcommands()
    top = _top_options()
    wrong = []
    for use in (u for u in ALL if u.page == page):
        sub, options = parse_use(use)
        if sub is None:
            wrong += [f"{use}  ← weir {option}: no such option" for option in options if option not in top]
            continue
        if sub not in commands:
            wrong.append(f"{use}  ← no command `weir {sub}` (commands: {', '.join(commands)})")
            continue
        known = set(commands[sub]._option_string_actions)
        wrong += [f"{use}  ← `weir {sub}` has no {option}" for option in options if option not in known]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    ("text", "sub", "options"),
    [
        ("weir train --model DIR --steps 2", "train", ["--model", "--steps"]),
        ('weir up --backend sglang --sglang-args \'{"tp_size": 2, "--x": 1}\'', "up", ["--backend", "--sglang-args"]),
        ("weir train (--demo | --dataset F) [--mode async|colocate]", "train", ["--demo", "--dataset", "--mode"]),
        ("weir engines add|remove N [--address ADDR]", "engines", ["--address"]),
        ("weir serve ROLE --port 8101", "serve", ["--port"]),
        ("weir COMMAND --help", None, []),
        ("weir --version", None, ["--version"]),
        ("weir up && curl --silent x", "up", []),
        ("weir train --demo | tee log --append", "train", ["--demo"]),
        ("weir train's options: --steps, and it's --lr", "train", ["--steps", "--lr"]),
    ],
)
def test_the_reader(text: str, sub: str | None, options: list[str]) -> None:
    assert parse_use(Use("t", 1, text)) == (sub, options)


def test_code_blocks_join_continuations_and_read_comments() -> None:
    page = "```sh\nweir train --demo \\\n   --steps 3   # then `weir up --engines 2`\n```\nsee `weir prep\n--out X`\n"
    found = [(number, " ".join(text.split())) for number, text in _code_lines(page)]
    assert found == [(2, "weir train --demo --steps 3"), (2, "weir up --engines 2"), (5, "weir prep --out X")]
