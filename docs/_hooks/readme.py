"""mkdocs hooks (mkdocs.yml: `hooks`): the README as the site's home page, and GitHub's table escapes.

* One source for the short version: `docs/index.md` is a placeholder replaced with README.md when the site
  is built, its `docs/…` links made relative to docs/, so the two cannot drift apart; mkdocs then checks the
  README's links and anchors like any page's.
* A `|` inside a code span in a table row is written `\\|` for GitHub, which would otherwise end the cell;
  Python-Markdown already keeps such a pipe in its cell and would print the backslash, so it is dropped there.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

CODE_SPAN = re.compile(r"`[^`\n]*`")


def _unescape_table_pipes(markdown: str) -> str:
    lines = markdown.split("\n")
    for i, line in enumerate(lines):
        if line.startswith("|") and "\\|" in line:
            lines[i] = CODE_SPAN.sub(lambda span: span.group(0).replace("\\|", "|"), line)
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri == "index.md":
        readme = Path(config["config_file_path"]).parent / "README.md"
        markdown = re.sub(r"\]\(docs/", "](", readme.read_text(encoding="utf-8"))
    return _unescape_table_pipes(markdown)
