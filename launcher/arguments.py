"""Argument types of the ``weir`` command line that check what they name while the options are parsed: a
missing dataset or profile is one line from argparse and exit status 2, never a traceback from
deep inside the command. Also the text of the train options whose default depends on the task.

What the files hold is checked later, by the code that reads them; this module only sees that they are there.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

from .config import (
    AGENT_DEMO_DEFAULTS,
    DEMO_ARCH_DEFAULTS,
    DEMO_ARCHS,
    DEMO_DEFAULTS,
    GENERIC_DEFAULTS,
    VIDEO_DEMO_DEFAULTS,
    TrainDefaults,
)

__all__ = [
    "SPEC_NAMES",
    "Parser",
    "existing_file",
    "processor_spec",
    "profile_file",
    "report_to",
    "role_url",
    "shard_size",
    "task_default",
]


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr and exit status 2: what was wrong and where the
    options are listed, not the usage block (a page for `weir train`)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (`{self.prog} --help` lists the options)\n")


def report_to(text: str) -> str:
    """``--report-to``: trackers by name, comma-separated (`launcher.trackers.parse_report_to`), or none."""
    from .trackers import REPORTERS, parse_report_to

    try:
        parse_report_to(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: give {', '.join(REPORTERS)} (comma-separated) or none") from None
    return text


def existing_file(text: str) -> Path:
    """A file that exists (a dataset, an evaluation set, a results file)."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: {'a folder, not a file' if path.is_dir() else 'no such file'}")
    return path


def existing_dataset(text: str) -> Path:
    """A dataset that exists: a file (JSONL, JSON, Parquet, Arrow, CSV), a folder (``datasets``' ``save_to_disk``,
    a Hub-layout folder, shards), or a hub id ``owner/name`` — looked up in the Hugging Face cache later, offline
    (`preprocess.reading.open_dataset` reads which)."""
    path = Path(text)
    hub_id = re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", text) is not None
    if not path.exists() and (not hub_id or path.suffix.lower() in (".jsonl", ".json", ".parquet", ".arrow", ".csv")):
        raise argparse.ArgumentTypeError(f"{text}: no such file or folder")  # data/train.jsonl is no hub id
    return path


# Every family Weir has a processor spec for (`preprocess.spec.SPEC_FAMILIES`, spelled here so `weir --help`
# imports nothing); a text family has none.
SPEC_NAMES = ("qwen2_5_omni", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_omni_moe", "qwen3_5")
TEXT_FAMILIES = ("qwen3", "qwen3_moe")


def role_url(text: str) -> tuple[str, str]:
    """``ROLE=URL`` of ``weir train --role-url``: a role of the stack's table (``engine`` once per engine) and
    an http(s) URL with a host, as (role, URL without a trailing slash)."""
    from urllib.parse import urlsplit

    from services.roles import ROLES

    role, equals, url = text.partition("=")
    if not equals or role not in ROLES:
        raise argparse.ArgumentTypeError(f"{text!r}: ROLE=URL with ROLE one of {', '.join(ROLES)}")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 — reading it checks the port is a number in range
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise argparse.ArgumentTypeError(f"{text!r}: the URL is http(s)://HOST[:PORT], e.g. {role}=http://{role}:8100")
    return role, url.rstrip("/")


def processor_spec(text: str) -> str:
    """A processor spec by family name (`SPEC_NAMES`), or a model folder holding its processor configuration."""
    configs = ("preprocessor_config.json", "processor_config.json")  # what `ProcessorSpec.from_pretrained` reads
    if text in SPEC_NAMES or any((Path(text) / name).is_file() for name in configs):
        return text
    if text in TEXT_FAMILIES and not Path(text).exists():
        raise argparse.ArgumentTypeError(f"{text}: a text model has no media to prepare")
    what = "no such folder" if not Path(text).exists() else f"no {' or '.join(configs)} there"
    raise argparse.ArgumentTypeError(f"{text}: {what} (give {', '.join(SPEC_NAMES)} or a Hugging Face model folder)")


def profile_file(text: str) -> Path:
    """A sim profile: a file, or the name of one shipped in `profiles` (``relax-qwen3-4b-h800``)."""
    if Path(text).is_file():
        return Path(text)
    from profiles import resolve

    try:
        return resolve(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def shard_size(text: str) -> int:
    """``weir export-hf --max-shard-size``: a size in bytes, or with a decimal unit (500MB, 2GB), as bytes."""
    from trainer.hf_folder import parse_size  # here, not at the top: `weir --help` imports no torch

    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


_TASKS: tuple[tuple[str, TrainDefaults], ...] = (
    ("visual-search", AGENT_DEMO_DEFAULTS),
    ("video-audio", VIDEO_DEMO_DEFAULTS),
)


def task_default(key: str) -> str:
    """The default of a train option the task decides (`launcher.config`): generic, --demo, and each demo task
    whose value differs from the colour demo's."""

    def shown(defaults: Mapping[str, object]) -> str:
        value = defaults[key]
        return "no bound" if value is None else str(value)

    others = ", ".join(f"{task} {shown(d)}" for task, d in _TASKS if shown(d) != shown(DEMO_DEFAULTS))
    demo = shown(DEMO_DEFAULTS) + (f"; --demo-task {others}" if others else "")
    archs = ", ".join(f"--arch {arch} {value[key]}" for arch, value in DEMO_ARCH_DEFAULTS.items() if key in value)
    demo += f"; {archs} (without --arch the colour demo trains {DEMO_ARCHS['colours']})" if archs else ""
    return f"(default: {shown(GENERIC_DEFAULTS)}; with --demo: {demo})"
