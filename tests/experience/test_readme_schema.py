"""The README's micro-batch table is the contract trainers read: it must be `MICROBATCH_SCHEMA`, exactly.

The table under the heading "The micro-batch Arrow schema" lists every column of
`experience.records.MICROBATCH_SCHEMA` — name, Arrow type, meaning — in order; a column added,
renamed, retyped or redescribed in the code without the README (or the other way round) fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa

from experience.records import MICROBATCH_SCHEMA

README = Path(__file__).resolve().parents[2] / "docs" / "training.md"
HEADING = re.compile(r"^#+\s+The micro-batch Arrow schema\s*$")
HEADER = ["column", "Arrow type", "meaning"]


def _section() -> list[str]:
    """The README's lines from the schema heading up to the next heading."""
    lines = README.read_text(encoding="utf-8").splitlines()
    starts = [i for i, line in enumerate(lines) if HEADING.match(line)]
    assert len(starts) == 1, "README.md needs exactly one heading 'The micro-batch Arrow schema'"
    section = []
    for line in lines[starts[0] + 1 :]:
        if line.startswith("#"):
            break
        section.append(line)
    return section


def _table(section: list[str]) -> list[list[str]]:
    """The cells of the section's first Markdown table (header row first, separator row dropped)."""
    rows: list[list[str]] = []
    for line in section:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    assert len(rows) >= 2 and all(set(cell) <= set("-: ") for cell in rows[1]), "no Markdown table under the heading"
    return [rows[0], *rows[2:]]


def _unquote(cell: str) -> str:
    assert cell.startswith("`") and cell.endswith("`"), f"{cell!r}: names and types are written as `code`"
    return cell[1:-1]


def _arrow_type(text: str) -> pa.DataType:
    """``list<int32>`` → ``pa.list_(pa.int32())``; a primitive by its pyarrow alias (``float32``, ``string``)."""
    inner = re.fullmatch(r"list<(.+)>", text)
    if inner:
        return pa.list_(_arrow_type(inner.group(1)))
    return pa.type_for_alias(text)


def test_the_readme_table_is_the_microbatch_schema() -> None:
    header, *rows = _table(_section())
    assert header == HEADER
    assert all(len(row) == 3 for row in rows), "each row: column | Arrow type | meaning"
    documented = [_unquote(name) for name, _, _ in rows]
    assert documented == MICROBATCH_SCHEMA.names, "the README lists other columns, or in another order"
    for (_, kind, meaning), field in zip(rows, MICROBATCH_SCHEMA, strict=True):
        assert _arrow_type(_unquote(kind)) == field.type, f"{field.name}: README says {kind}, the schema {field.type}"
        assert meaning == field.metadata[b"description"].decode(), (
            f"{field.name}: its meaning differs from the schema's"
        )


def test_the_readme_names_the_schema_version_and_says_no_column_is_null() -> None:
    text = "\n".join(_section())
    version = MICROBATCH_SCHEMA.metadata[b"weir.schema"].decode()
    assert f"`{version}`" in text, f"the README must name the schema version {version!r}"
    assert "No column is nullable" in text
    assert not [field.name for field in MICROBATCH_SCHEMA if field.nullable], "the README says no column is nullable"
