"""The values tools exchange with the rollout: what a call is told (`ToolContext`), what it shows the model
(`Observation`, built by `observation_of`) and how it fails (`ToolError`: the model's mistake; `ToolFailed`: the
tool's). Both the role (`rollout.tools`, `rollout.sandbox`) and the tool workers (`rollout.sandbox_worker`) import
these, so they live apart from either."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Observation", "ToolContext", "ToolError", "ToolFailed", "observation_of"]


class ToolError(Exception):
    """A bad call (the model's mistake): its message is the observation, and the trajectory goes on."""


class ToolFailed(Exception):
    """A tool that raised something else or ran past its deadline: the trajectory ends (``tool_error``)."""


@dataclass(frozen=True, slots=True)
class Observation:
    """What a tool or an environment shows the model: text, and images (encoded bytes or PIL images),
    rendered as a ``tool`` turn (a ``user`` turn for an environment's own messages)."""

    text: str = ""
    images: tuple[Any, ...] = ()


@dataclass(slots=True, kw_only=True)
class ToolContext:
    """What a tool is told besides its arguments: the trajectory's environment ``state`` (shared with the
    environment, mutable), and where it is (group, sample, turn)."""

    state: dict[str, Any] = field(default_factory=dict)
    group_id: str = ""
    sample_index: int = 0
    turn: int = 0


def observation_of(value: Any) -> Observation:
    """A tool's or environment's return value as an `Observation` (text, bytes / PIL image, or a list
    of those); anything else is `TypeError`."""
    if isinstance(value, Observation):
        return value
    if value is None:
        return Observation()
    if isinstance(value, str):
        return Observation(text=value)
    if isinstance(value, bytes | bytearray) or _is_image(value):
        return Observation(images=(value,))
    if isinstance(value, list | tuple):
        parts = [observation_of(v) for v in value]
        return Observation(
            text="\n".join(p.text for p in parts if p.text), images=tuple(i for p in parts for i in p.images)
        )
    if isinstance(value, int | float) and not isinstance(value, bool):
        return Observation(text=repr(value))
    raise TypeError(f"an observation is text, an image (bytes or PIL) or a list of those, not {type(value).__name__}")


def _is_image(value: Any) -> bool:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - PIL is a dependency of the preprocess library
        return False
    return isinstance(value, Image.Image)
