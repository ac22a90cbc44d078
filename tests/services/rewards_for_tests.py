"""A custom reward for the tests: fails on the second sample of a group. Registered by name when the
role starts (``WEIR_REWARD_FUNCTIONS=flaky=tests.services.rewards_for_tests:flaky``), never named by a request."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def flaky(response: str, reference: str | None, sample: Mapping[str, Any]) -> float:
    if sample["sample_index"] == 1:
        raise RuntimeError("this reward fails on purpose")
    return 1.0
