"""A custom reward for the tests, loaded by dotted path: fails on the second sample of a group."""

from __future__ import annotations

from typing import Any


def flaky(response: str, reference: str | None, sample: dict[str, Any]) -> float:
    if sample["sample_index"] == 1:
        raise RuntimeError("this reward fails on purpose")
    return 1.0
