"""JSON on the hot paths between roles, through orjson: an engine's answer (token ids and log-probs, read by the
rollout role), a finished group (sent to the data role and answered to the caller), a rollout answer (read by
the trainer's driver).

Profiled under the capacity twin (py-spy, 32 GPUs of the Relax profile), the standard library's JSON was 75 % of
the rollout role's CPU (decoding engine answers 45 %, encoding groups 30 %) and the largest single share of the
data role's and the driver's; orjson reads and writes the same documents several times faster. Floats keep
their exact values both ways (each is written as the shortest text that reads back as the same double).

Where it differs from ``json``, on what these bodies never hold legitimately: ``loads`` refuses ``NaN`` /
``Infinity`` literals, a UTF-8 byte-order mark, UTF-16 bodies and lone surrogate escapes (each an error, as any
malformed body), and reads an integer past 64 bits as the nearest double (token ids and versions are bounded and
refuse it; an unbounded integer field, a seed, would take it rounded); ``dumps`` writes a non-finite float as
``null`` (records refuse non-finite log-probs and rewards before they get here).
APIs that clients call with their own libraries (OpenAI's, SGLang's) keep FastAPI's encoding.

Packed arrays (`pack`, `unpack`): a long list of numbers as one base64 string of little-endian values — how Weir's
engine answers the rollout role's rollouts (``weir_packed``). Reading a 5,559-token answer's ids and log-probs as
JSON lists (SGLang's ``[logprob, id, null]`` entries: four objects a token) took 4.3 ms, packed 0.75 ms.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import orjson

__all__ = ["JSON_HEADERS", "JSONDecodeError", "PackedType", "dumps", "loads", "pack", "unpack"]

# int32 token ids (every vocabulary fits), float64 log-probs (the exact double JSON would carry).
PackedType = Literal["<i4", "<f8"]

JSONDecodeError = orjson.JSONDecodeError  # a subclass of json.JSONDecodeError (and so of ValueError)

# Sent with a body from ``dumps`` (httpx's ``content=`` sets no content type of its own).
JSON_HEADERS = {"content-type": "application/json"}


def _as_list(value: Any) -> Any:
    """What orjson does not write itself: a torch tensor or a non-contiguous numpy array, as its ``tolist()``."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def dumps(value: Any) -> bytes:
    """``value`` as compact JSON bytes; numpy arrays and scalars (and torch tensors) as lists and numbers (a
    backend's log-probs may be such values, which pydantic's encoder accepted)."""
    return orjson.dumps(value, default=_as_list, option=orjson.OPT_SERIALIZE_NUMPY)


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """The document in ``data``; `JSONDecodeError` (a ``ValueError``) when it is not JSON."""
    return orjson.loads(data)


def pack(values: Sequence[int] | Sequence[float] | np.ndarray, dtype: PackedType) -> str:
    """``values`` as base64 of their little-endian ``dtype`` bytes (`unpack` reads it back). An id outside int32
    raises ``OverflowError``, as a value JSON could carry but the packed form cannot."""
    array = np.asarray(values)
    if dtype == "<i4" and array.size and (array.min() < -(2**31) or array.max() >= 2**31):
        raise OverflowError("a value does not fit in int32")
    return base64.b64encode(array.astype(dtype, copy=False).tobytes()).decode("ascii")


def unpack(text: object, dtype: PackedType) -> list[Any]:
    """The numbers `pack` wrote, as a list of Python ints or floats; ``ValueError`` for anything else (not a
    string, not base64, a length that is not a whole number of values)."""
    if not isinstance(text, str):
        raise ValueError(f"a packed array is a base64 string, not {type(text).__name__}")
    try:
        raw = base64.b64decode(text, validate=True)
    except binascii.Error as error:
        raise ValueError(f"a packed array is not base64: {error}") from None
    size = np.dtype(dtype).itemsize
    if len(raw) % size:
        raise ValueError(f"a packed array of {len(raw)} bytes is not a whole number of {size}-byte values")
    values: list[Any] = np.frombuffer(raw, dtype=dtype).tolist()
    return values
