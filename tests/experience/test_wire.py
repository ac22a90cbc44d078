"""`experience.wire` (orjson) against the standard library's ``json`` on what the roles exchange: every float and
integer reads back as the same value either way, a group crosses unchanged, and what ``json`` would have let
through (``NaN``, ``Infinity``, integers past 64 bits) is refused as malformed."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from experience import Group, wire
from tests.experience.test_store import group

EDGES = [0.0, -0.0, 0.1, 1e-7, -1e-300, 5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, -13.815510557964274]
INTS = [0, -1, 2**31, 2**53 + 1, 2**63 - 1, -(2**63), 151_645]


def test_numbers_read_back_as_the_standard_library_reads_them() -> None:
    rng = random.Random(0)
    floats = EDGES + [rng.uniform(-40.0, 0.0) for _ in range(5000)] + [rng.lognormvariate(0, 30) for _ in range(2000)]
    doc = {"logprobs": floats, "ids": INTS + [rng.randrange(0, 2**40) for _ in range(2000)], "text": 'é\u4e2d\n"x"'}
    ours = wire.dumps(doc)
    assert json.loads(ours) == doc  # what the other side reads, if it uses json
    assert wire.loads(json.dumps(doc)) == doc == wire.loads(ours)  # what we read, whoever wrote it
    assert math.copysign(1.0, wire.loads(ours)["logprobs"][1]) == -1.0  # -0.0 keeps its sign


def test_numpy_values_are_written_as_numbers() -> None:
    doc = {"lp": [np.float32(-0.5), np.float64(-1.25)], "id": np.int64(7), "ids": np.arange(3, dtype=np.int32)}
    assert json.loads(wire.dumps(doc)) == {"lp": [-0.5, -1.25], "id": 7, "ids": [0, 1, 2]}
    sliced = np.arange(6, dtype=np.float32).reshape(2, 3)[:, 1]  # not contiguous: orjson's numpy path refuses it
    assert json.loads(wire.dumps({"a": sliced, "t": torch.tensor([1.5, -2.0])})) == {"a": [1.0, 4.0], "t": [1.5, -2.0]}
    with pytest.raises(TypeError):
        wire.dumps({"s": {1, 2}})


def test_a_group_crosses_the_wire_unchanged() -> None:
    sent = group("g", [0.25, 1.0, -0.5], prompt=40, response=30, version=3)
    assert Group.from_json(wire.loads(wire.dumps(sent.to_json()))).to_json() == sent.to_json()


@pytest.mark.parametrize("text", ["NaN", '{"a": Infinity}', "[-Infinity]", "[1e400]", "{not json", ""])
def test_what_json_would_let_through_is_malformed(text: str) -> None:
    with pytest.raises(json.JSONDecodeError):  # wire.JSONDecodeError is one: FastAPI answers it as it did
        wire.loads(text)


def test_an_integer_past_64_bits_reads_as_the_nearest_double() -> None:
    """orjson's one lossy reading (``json`` keeps the integer): no id, count or version the roles exchange comes
    near 2**63, and the schemas refuse one that does (a token id must fit int32: tests/services/data)."""
    assert wire.loads(str(2**64)) == float(2**64) and isinstance(wire.loads(str(2**64)), float)
    assert wire.loads(str(2**63 - 1)) == 2**63 - 1 and wire.loads(str(-(2**63))) == -(2**63)


def test_packed_arrays_read_back_exactly_and_refuse_what_is_not_one() -> None:
    rng = random.Random(1)
    floats = EDGES + [rng.uniform(-40.0, 0.0) for _ in range(3000)] + [math.nan, -math.inf]
    back = wire.unpack(wire.pack(floats, "<f8"), "<f8")
    assert back[:-2] == floats[:-2] and math.isnan(back[-2]) and back[-1] == -math.inf
    assert math.copysign(1.0, back[1]) == -1.0  # -0.0 keeps its sign
    ids = [0, 1, 151_645, 2**31 - 1, -(2**31)]
    assert wire.unpack(wire.pack(ids, "<i4"), "<i4") == ids and wire.unpack(wire.pack([], "<i4"), "<i4") == []
    assert all(type(v) is int for v in wire.unpack(wire.pack(ids, "<i4"), "<i4"))
    with pytest.raises(OverflowError):
        wire.pack([2**31], "<i4")
    for bad in ("not base64!", "AAA", "AAAAAA==", 5, None, ["AAAA"]):  # "AAAAAA==": 4 bytes, not a float64
        with pytest.raises(ValueError):
            wire.unpack(bad, "<f8")
