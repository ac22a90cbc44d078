"""Environments a multi-turn rollout may run: the built-ins and classes registered at start-up — never code
or a URL a request names.

A request names one (``"environment": {"name": "visual_search", "options": {...}}``); the name is looked
up in the `EnvironmentRegistry`, built once when the role starts from the built-ins
(`BUILTIN_ENVIRONMENTS`), the installed entry points of the group ``weir.environments``, the operator's
``WEIR_ENVIRONMENTS`` (``name=package.module:Class``) and ``WEIR_HTTP_ENVIRONMENTS`` (``name=http(s)://...``:
an environment served elsewhere, reached only at that configured URL). An unknown name is 400
``unknown_tool`` naming it.

An environment is a class built as ``Class(**options)`` (the request's ``options``; a bad one is 400)
with::

    tools: Sequence[str]                       # registered tools it offers (rendered into the prompt)
    state: dict                                # what those tools see as `ToolContext.state`
    def reset(self, info: PromptInfo) -> Observation | str | None
    def step(self, action: ToolCall | str) -> tuple[observation, reward | None, done]

One instance per sample. ``reset``'s observation is added to the prompt as a ``user`` turn, so it must
be the same for every sample of a group (a group shares its prompt; the rollout checks). A call of one
of ``tools`` is run by the rollout (the registered tool over ``state``); any other call, and the model's
final text (no call), go to ``step``. Its rewards are summed over the trajectory; ``done`` ends it; an
observation with ``done`` false after a final text continues the conversation as a ``user`` turn.
``reset`` and ``step`` run in a worker thread under the tools' deadline (`rollout.tools` says what
that bounds and what it does not); one that raises or is late ends the trajectory (``tool_error``).
"""

from __future__ import annotations

import base64
import binascii
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NotRequired, Protocol, TypedDict, cast, runtime_checkable

import httpx

from .plugins import PluginError, check_name, load_callable, load_installed
from .tools import DEFAULT_TIMEOUT_S, Observation, ToolCall, ToolError, UnknownTool, observation_of

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "ENTRY_POINT_GROUP",
    "Environment",
    "EnvironmentRef",
    "EnvironmentRegistry",
    "HttpEnvironment",
    "PromptInfo",
    "Step",
    "VisualSearch",
    "step_of",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "weir.environments"
_URL = re.compile(r"^https?://[^\s/?#]+(?:/[^\s?#]*)?$")


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptInfo:
    """What ``reset`` is told: the prompt's messages (OpenAI-style, as given), its group and sample."""

    messages: Sequence[Any]
    group_id: str
    sample_index: int
    prompt_index: int


@dataclass(frozen=True, slots=True)
class Step:
    """One ``step``'s answer: what the model sees next, the reward of this step (None: none), whether the
    trajectory is over."""

    observation: Observation | None
    reward: float | None
    done: bool


@runtime_checkable
class Environment(Protocol):
    tools: Sequence[str]
    state: dict[str, Any]

    def reset(self, info: PromptInfo) -> Any: ...

    def step(self, action: ToolCall | str) -> Any: ...


def step_of(value: Any) -> Step:
    """``step``'s ``(observation, reward, done)`` as a `Step`; anything else is `TypeError`."""
    if isinstance(value, Step):
        return value
    if not isinstance(value, tuple) or len(value) != 3:
        raise TypeError(f"step must return (observation, reward | None, done), not {type(value).__name__}")
    observation, reward, done = value
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)):
        raise TypeError(f"a step's reward must be a number or None, not {type(reward).__name__}")
    return Step(None if observation is None else observation_of(observation), reward, bool(done))


@dataclass(frozen=True, slots=True, kw_only=True)
class EnvironmentRef:
    """A request's environment, resolved at start-up names: how to build one instance per sample."""

    name: str
    factory: Callable[..., Environment]
    options: Mapping[str, Any] = field(default_factory=dict)
    timeout_s: float = DEFAULT_TIMEOUT_S  # each reset / step's deadline

    def build(self) -> Environment:
        return self.factory(**dict(self.options))


# -- the built-in visual environment ---------------------------------------------------------------
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (230, 25, 25),
    "green": (25, 200, 40),
    "blue": (30, 60, 235),
    "yellow": (240, 220, 20),
    "magenta": (220, 30, 220),
    "cyan": (20, 220, 230),
}


class VisualSearch:
    """A picture generated locally: grey noise with one small coloured square, too small to read from the
    whole picture at a modest token budget; the model crops (the ``crop`` tool over ``state["image"]``)
    and answers the colour's name. Reward: 1.0 for the exact name (case and a final period ignored), else
    0.0. ``seed`` fixes the picture (every sample of a group gets the same one), ``size`` its side and
    ``patch`` the square's side, in pixels."""

    tools: Sequence[str] = ("crop",)

    def __init__(self, seed: int = 0, size: int = 448, patch: int = 12) -> None:
        if not (isinstance(seed, int) and isinstance(size, int) and isinstance(patch, int)):
            raise ValueError("visual_search options seed, size and patch are integers")
        if not 56 <= size <= 2048 or not 1 <= patch <= size // 4:
            raise ValueError("visual_search needs 56 <= size <= 2048 and 1 <= patch <= size / 4")
        self.seed, self.size, self.patch = seed, size, patch
        self.state: dict[str, Any] = {}
        self.answer = ""

    def reset(self, info: PromptInfo) -> Observation:
        import numpy as np
        from PIL import Image

        rng = np.random.default_rng(self.seed)
        pixels = rng.integers(100, 156, size=(self.size, self.size, 3), dtype=np.uint8)
        self.answer = sorted(COLOURS)[int(rng.integers(len(COLOURS)))]
        x, y = (int(v) for v in rng.integers(0, self.size - self.patch, size=2))
        pixels[y : y + self.patch, x : x + self.patch] = COLOURS[self.answer]
        self.state["image"] = Image.fromarray(pixels)
        self.state["patch_xy"] = (x, y)
        return Observation(
            text=f"This {self.size}x{self.size} picture hides a small coloured square. Use the crop tool to look "
            "closer, then answer with the colour's name only.",
            images=(self.state["image"],),
        )

    def step(self, action: ToolCall | str) -> tuple[Observation | None, float | None, bool]:
        if isinstance(action, ToolCall):
            raise ToolError(f"no tool {action.name!r} here; the tools are {list(self.tools)}")
        given = " ".join(action.strip().lower().rstrip(".").split())
        return None, float(given == self.answer), True


# -- environments served elsewhere ----------------------------------------------------------------
class _WireCall(TypedDict):
    name: str
    arguments: dict[str, Any]  # the model's JSON arguments, as it wrote them


class _WireAction(TypedDict):
    text: NotRequired[str]
    tool_call: NotRequired[_WireCall]


class _ResetBody(TypedDict):
    options: dict[str, Any]  # the request's options, free-form JSON
    messages: list[Any]
    group_id: str
    sample_index: int


class _StepBody(TypedDict):
    session: Any  # whatever the environment's reset answered
    action: _WireAction


class _Answer(TypedDict, total=False):
    """An environment server's answer, read field by field (each checked where it is read)."""

    session: Any
    observation: Any
    reward: Any
    done: Any


class HttpEnvironment:
    """An environment served at a URL the operator configured (``WEIR_HTTP_ENVIRONMENTS``; never one a
    request gives). ``POST {url}/reset`` with ``{"options", "messages", "group_id", "sample_index"}``
    answers ``{"session", "observation"}``; ``POST {url}/step`` with ``{"session", "action"}`` (``{"text"}``
    or ``{"tool_call": {"name", "arguments"}}``) answers ``{"observation", "reward", "done"}``. An
    observation is ``{"text", "images": [base64 PNG/JPEG]}`` or null. It offers no registered tools:
    every call goes to the remote ``step``. The calls are synchronous (the rollout runs them in its
    worker threads, under the tools' deadline)."""

    tools: Sequence[str] = ()

    def __init__(self, url: str, timeout_s: float = 30.0, **options: Any) -> None:
        self.url, self.options, self.timeout_s = url.rstrip("/"), options, timeout_s
        self.state: dict[str, Any] = {}
        self.session: Any = None

    def _post(self, path: str, body: _ResetBody | _StepBody) -> _Answer:
        response = httpx.post(f"{self.url}{path}", json=body, timeout=self.timeout_s)
        response.raise_for_status()
        answer = response.json()
        if not isinstance(answer, dict):
            raise ValueError(f"{path}: the environment's answer is not an object")
        return cast(_Answer, answer)  # any object: each field is checked where it is read

    @staticmethod
    def _observation(value: Any) -> Observation | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError("an observation is {text, images} or null")
        try:
            images = tuple(base64.b64decode(i, validate=True) for i in value.get("images") or [])
        except (binascii.Error, TypeError) as error:
            raise ValueError(f"an observation image is not base64: {error}") from None
        return Observation(text=str(value.get("text") or ""), images=images)

    def reset(self, info: PromptInfo) -> Observation | None:
        answer = self._post(
            "/reset",
            _ResetBody(
                options=self.options,
                messages=list(info.messages),
                group_id=info.group_id,
                sample_index=info.sample_index,
            ),
        )
        self.session = answer.get("session")
        return self._observation(answer.get("observation"))

    def step(self, action: ToolCall | str) -> Step:
        wire = (
            _WireAction(tool_call=_WireCall(name=action.name, arguments=action.arguments))
            if isinstance(action, ToolCall)
            else _WireAction(text=action)
        )
        answer = self._post("/step", _StepBody(session=self.session, action=wire))
        reward = answer.get("reward")
        return step_of((self._observation(answer.get("observation")), reward, bool(answer.get("done"))))


BUILTIN_ENVIRONMENTS: dict[str, Callable[..., Environment]] = {"visual_search": VisualSearch}


class EnvironmentRegistry:
    """The environments a request may name: built once, when the role starts."""

    def __init__(
        self,
        classes: Mapping[str, Callable[..., Environment]] | None = None,
        urls: Mapping[str, str] | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.timeout_s = timeout_s
        self._classes: dict[str, Callable[..., Environment]] = {}
        for name, factory in {**BUILTIN_ENVIRONMENTS, **dict(classes or {})}.items():
            check_name(name)
            if not callable(factory):
                raise PluginError(f"environment {name!r} is not a class")
            self._classes[name] = factory
        for name, url in (urls or {}).items():
            check_name(name)
            if not _URL.match(url):
                raise PluginError(f"environment {name!r}: {url!r} is not an http(s) URL")
            self._classes[name] = _bound_http(url)

    @classmethod
    def load(
        cls,
        specs: Mapping[str, str] | None = None,
        urls: Mapping[str, str] | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        entry_point_group: str | None = ENTRY_POINT_GROUP,
    ) -> EnvironmentRegistry:
        """The built-ins, installed entry points, ``specs`` (``name`` → ``package.module:Class``), then
        ``urls`` (``name`` → an `HttpEnvironment` URL)."""
        classes: dict[str, Callable[..., Environment]] = load_installed(entry_point_group)
        for name, spec in (specs or {}).items():
            classes[name] = load_callable(spec)
        registry = cls(classes, urls, timeout_s=timeout_s)
        logger.info("environments registered: %s", registry.names)
        return registry

    @property
    def names(self) -> list[str]:
        return sorted(self._classes)

    def resolve(
        self, name: str, options: Mapping[str, Any] | None = None, where: str = "environment"
    ) -> EnvironmentRef:
        """The environment ``name`` with ``options``, or `UnknownTool` (400) naming it."""
        if name not in self._classes:
            raise UnknownTool(
                f"{where}.name: no environment {name!r} is registered; registered: {', '.join(self.names)}. "
                "Register one at start-up with WEIR_ENVIRONMENTS=name=package.module:Class, "
                "WEIR_HTTP_ENVIRONMENTS=name=http://host:port or the "
                f"{ENTRY_POINT_GROUP!r} entry points"
            )
        return EnvironmentRef(
            name=name, factory=self._classes[name], options=dict(options or {}), timeout_s=self.timeout_s
        )

    def tools_of(self, name: str) -> tuple[str, ...]:
        """The registered tools environment ``name`` offers (its class's ``tools``)."""
        return tuple(getattr(self._classes[name], "tools", ()) or ())


def _bound_http(url: str) -> Callable[..., HttpEnvironment]:
    def build(**options: Any) -> HttpEnvironment:
        return HttpEnvironment(url, **options)

    build.tools = ()  # type: ignore[attr-defined]
    return build
