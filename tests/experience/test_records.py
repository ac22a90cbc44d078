"""The records' own rules that the store and the rollout rely on: what a policy version is."""

from __future__ import annotations

import pytest

from experience import policy_version_of


@pytest.mark.parametrize(
    "weight_version,version",
    [("0", 0), ("7", 7), ("0012", 12), ("default", 0), (3, 3), (0, 0)],
)
def test_a_policy_version_is_a_decimal_integer_or_default(weight_version: object, version: int) -> None:
    assert policy_version_of(weight_version) == version


@pytest.mark.parametrize(
    "weight_version",
    [
        "²",  # str.isdigit() is True for superscripts: int("²") would raise, not give a version
        "1²",
        "٣",  # an Arabic-Indic digit: isdecimal() is True, but it is not what a publisher writes
        "１",  # a fullwidth digit
        "",
        "-1",
        "+1",
        " 1",
        "1.0",
        "v2",
        "Default",
        None,
        True,
        -1,
        1.0,
    ],
)
def test_anything_else_is_not_a_policy_version(weight_version: object) -> None:
    with pytest.raises(ValueError, match="not a policy version"):
        policy_version_of(weight_version)
