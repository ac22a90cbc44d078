"""Terminal output of the CLI: the prep report as a table."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from preprocess.prep import PrepReport

__all__ = ["console", "print_report"]

console = Console()


def _mb(n: int) -> str:
    return f"{n / 1e6:,.2f} MB"


def print_report(report: PrepReport, *, title: str) -> None:
    rate = report.items / report.seconds if report.seconds else 0.0
    table = Table(title=title, title_justify="left")
    for column in ("modality", "tokens before budget", "tokens after", "raw media", "cached features"):
        table.add_column(column, justify="right" if column != "modality" else "left")
    for kind in sorted(report.tokens_after):
        table.add_row(
            kind,
            f"{report.tokens_before.get(kind, 0):,}",
            f"{report.tokens_after.get(kind, 0):,}",
            _mb(report.raw_bytes.get(kind, 0)),
            _mb(report.feature_bytes.get(kind, 0)),
        )
    table.add_row(
        "[bold]total[/bold]",
        f"{sum(report.tokens_before.values()):,}",
        f"{sum(report.tokens_after.values()):,}",
        _mb(sum(report.raw_bytes.values())),
        _mb(sum(report.feature_bytes.values())),
    )
    console.print(table)
    console.print(
        f"{report.rows} rows ({report.rows_without_media} with no media), {report.items} items in "
        f"{report.seconds:.1f} s ({rate:.1f} items/s); "
        f"cache hits {report.cache_hits}; failed {report.failed}"
    )
    if report.failures:
        failures = Table(title="failures by error code", title_justify="left")
        failures.add_column("code")
        failures.add_column("items", justify="right")
        for code, count in sorted(report.failures.items()):
            failures.add_row(code, str(count))
        console.print(failures)
    if report.bad_rows:  # rows that could not be read at all: where the first ones are (report.json lists them)
        first = report.bad_rows[0]
        where = f"line {first['line']}" if first["line"] is not None else f"row {first['row']}"
        console.print(
            f"{report.rows_unreadable} rows could not be read; the first: {first['file']} {where} [{first['code']}] "
            f"{first['message']}",
            markup=False,
            highlight=False,
        )
