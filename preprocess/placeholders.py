"""Media placeholders in token ids, expanded to each item's exact token count.

A chat template emits one placeholder token per media item (``<|IMAGE|>``, ``<|VIDEO|>``,
``<|AUDIO|>``); the model expects that token repeated once per feature token. Expanding with the
counts the plan computed — the same counts the features carry — is what keeps prompt ids, features
and model in agreement ("Image features and image tokens do not match" cannot happen).

Qwen2.5-Omni's interleaved video-with-audio layout is not produced here (each item stands alone).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .errors import MediaError

__all__ = ["expand_placeholders"]


def expand_placeholders(
    input_ids: Sequence[int], placeholder_ids: Mapping[str, int], items: Sequence[tuple[str, int]]
) -> list[int]:
    """Replace the i-th placeholder with ``items[i][1]`` copies of it; kinds must match in order.

    ``placeholder_ids`` maps "image" / "video" / "audio" to the placeholder token id.
    """
    kind_of = {token: kind for kind, token in placeholder_ids.items()}
    out: list[int] = []
    queue = list(items)
    for token in input_ids:
        kind = kind_of.get(token)
        if kind is None:
            out.append(token)
            continue
        if not queue:
            raise MediaError(f"the prompt has more {kind} placeholders than media items", code="placeholder_mismatch")
        expected, count = queue.pop(0)
        if expected != kind:
            raise MediaError(f"placeholder for {kind} where a {expected} item comes", code="placeholder_mismatch")
        out.extend([token] * count)
    if queue:
        raise MediaError(f"{len(queue)} media items have no placeholder in the prompt", code="placeholder_mismatch")
    return out
