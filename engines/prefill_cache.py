"""`PrefillCache`: a prompt's prefilled state kept for the next request with the same prompt.

RL sends every prompt n times (a group's samples, n = 8 in the demo), and the transformers engine prefilled it n
times: on the Qwen3.5 demo prefills were 68 % of the engine's time. SGLang shares such prompts through its radix
cache; this is the transformers engine's smaller version of it — whole prompts only (the same token ids and the
same media), not shared prefixes, since the cache of a prompt's prefix cannot be cut out of a linear-attention
layer's state.

A hit gives exactly what the prefill would have computed (the same forward on the same inputs): the KV cache,
the next token's logits, the positions' offset and the routes of a mixture-of-experts model. Keys are digests of
the content — the token ids and each media item's arrays and geometry — never of a name the caller chose, so one
request cannot be given another's prompt by naming its media alike. Entries are copied in and out (a decode
extends some layers' states in place) and bounded by their tensors' bytes, least recently used first; a weight
update or ``flush_cache`` drops them all (the engine does both under its model lock).
"""

from __future__ import annotations

import copy
import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, fields, is_dataclass

import numpy as np
import torch
from transformers import DynamicCache

from .protocol import MediaInput

__all__ = ["DEFAULT_PREFILL_CACHE_BYTES", "Prefilled", "PrefillCache", "prefill_key"]

DEFAULT_PREFILL_CACHE_BYTES = 256 << 20  # a few groups' prompts of a small model; 0 turns the cache off


@dataclass(frozen=True, slots=True, kw_only=True)
class Prefilled:
    """A prompt's state after its prefill: what a request starting from it decodes on."""

    cache: DynamicCache  # the model's KV cache, linear-attention states included
    next_logits: torch.Tensor
    length: int
    rope_delta: int | float
    routes: tuple[torch.Tensor, ...]  # a mixture-of-experts model's routing of the prompt, when it was recorded


def prefill_key(ids: Sequence[int], media: Sequence[MediaInput], *, routes: bool) -> bytes:
    """The digest of what a prefill reads: the token ids, each media item (its kind, geometry and arrays: the
    embedding, or the features the towers encode) and whether the routes were recorded."""
    digest = hashlib.blake2b(digest_size=32)
    digest.update(np.asarray(ids, dtype=np.int64).tobytes())
    digest.update(b"routes" if routes else b"-")
    for item in media:
        digest.update(repr((item.kind, item.grid_thw, item.second_per_grid_t, item.audio_frames)).encode())
        if item.embedding is not None:
            _update(digest, item.embedding)
        if item.features is not None:
            _update(digest, item.features)
    return digest.digest()


def _update(digest: hashlib.blake2b, value: object) -> None:
    """``value``'s content into ``digest``: arrays by their dtype, shape and bytes, a dataclass field by field,
    anything else by its repr (the features' scalars and tuples)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        digest.update(repr((str(value.dtype), tuple(value.shape))).encode())
        digest.update(value.contiguous().view(torch.uint8).numpy().tobytes())
    elif isinstance(value, np.ndarray):
        digest.update(repr((str(value.dtype), value.shape)).encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    elif is_dataclass(value) and not isinstance(value, type):
        for field in fields(value):
            if field.name != "key":  # the caller's name for the content, not the content
                digest.update(field.name.encode())
                _update(digest, getattr(value, field.name))
    else:
        digest.update(repr(value).encode())


def tensor_bytes(value: object, depth: int = 4) -> int:
    """Bytes held by the tensors reachable from ``value`` (a cache's layers and their states)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if depth == 0:
        return 0
    if isinstance(value, dict):
        return sum(tensor_bytes(v, depth - 1) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(v, depth - 1) for v in value)
    if hasattr(value, "__dict__"):
        return sum(tensor_bytes(v, depth - 1) for v in vars(value).values())
    return 0


class PrefillCache:
    """Prefilled prompts by `prefill_key`, at most ``max_bytes`` of tensors (see the module). Not thread-safe:
    the engine calls it under its model lock."""

    def __init__(self, max_bytes: int = DEFAULT_PREFILL_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, tuple[Prefilled, int]] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: bytes) -> Prefilled | None:
        """A copy of the prompt's state (the caller's to extend), or None."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return _copied(entry[0])

    def put(self, key: bytes, prefilled: Prefilled) -> None:
        """Keep a copy of ``prefilled`` (taken before any decode extends it), evicting the least recently used."""
        size = tensor_bytes(prefilled.cache) + tensor_bytes(prefilled.next_logits) + tensor_bytes(prefilled.routes)
        if size > self.max_bytes or key in self._entries:
            return
        while self._bytes + size > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self._bytes -= evicted
        self._entries[key] = (_copied(prefilled), size)
        self._bytes += size

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)


def _copied(prefilled: Prefilled) -> Prefilled:
    return Prefilled(
        cache=copy.deepcopy(prefilled.cache),
        next_logits=prefilled.next_logits.clone(),
        length=prefilled.length,
        rope_delta=prefilled.rope_delta,
        routes=prefilled.routes,  # never changed: a decode appends its own rows to the request's list
    )
