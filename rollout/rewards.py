"""Rewards: the built-ins, and custom functions registered when the role starts — never code a request names.

A request chooses a reward with a `RewardSpec`: ``none``, ``exact_match``, ``math`` (math-verify) and
``multiple_choice`` are built in; ``custom`` names a function in the `RewardRegistry`, which is
built once at start-up from the operator's ``WEIR_REWARD_FUNCTIONS`` (``name=package.module:function``,
comma-separated) and the installed entry points of the group ``weir.rewards``. A name that is not
registered — a dotted path like ``builtins:print`` included — is `UnknownReward`; nothing is ever
imported because of a request.

A custom reward has the signature::

    def reward(response: str, reference: str | None, sample: RewardContext) -> float

where ``reference`` is the spec's ``answer`` and ``sample`` (`RewardContext`, a typed dict, so
functions written for slime's dict-shaped samples keep working) holds ``group_id``, ``prompt_index``,
``sample_index``, ``finish_reason`` (``"stop"`` / ``"length"``) and ``response_ids``. It runs in a
worker thread under a deadline; one that raises marks its sample ``failed`` (the rest of the group
is still returned). This module does not run the deadline (the caller does).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from typing import TypedDict

from experience.records import SampleFinishReason

from .api import RewardSpec, RewardType
from .errors import UnknownReward
from .plugins import PluginError, check_name, load_callable, load_installed

__all__ = [
    "BUILTIN_REWARDS",
    "ENTRY_POINT_GROUP",
    "RewardContext",
    "RewardFunction",
    "RewardRegistry",
    "RewardSpec",
    "RewardType",
]

logger = logging.getLogger(__name__)


class RewardContext(TypedDict):
    """What a custom reward is told of the sample besides its text."""

    group_id: str
    prompt_index: int
    sample_index: int
    finish_reason: SampleFinishReason | None
    response_ids: list[int]


RewardFunction = Callable[[str, "str | None", RewardContext], float]

BUILTIN_REWARDS: tuple[str, ...] = ("none", "exact_match", "math", "multiple_choice")
ENTRY_POINT_GROUP = "weir.rewards"


def _normalize(text: str) -> str:
    return " ".join(text.strip().lower().rstrip(".").split())


_CHOICE = re.compile(r"(?:answer\s*(?:is|:)?\s*\(?|^\(?|\s\(?)([A-J])\)?(?:[.:)\s]|$)", re.IGNORECASE | re.MULTILINE)


def _choice(text: str) -> str | None:
    match = _CHOICE.search(text.strip())
    return match.group(1).upper() if match else None


def exact_match(response: str, answer: str) -> float:
    return float(_normalize(response) == _normalize(answer))


def math_reward(response: str, answer: str) -> float:
    from math_verify import parse, verify

    # math-verify's own timeouts use signal.alarm, which only works on the main thread; the caller
    # bounds the time instead (rewards run in a worker thread under a deadline).
    gold = parse(answer, parsing_timeout=None)  # type: ignore[arg-type]
    return float(verify(gold, parse(response, parsing_timeout=None), timeout_seconds=None))  # type: ignore[arg-type]


def multiple_choice(response: str, answer: str) -> float:
    return float(_choice(response) == answer.strip().upper()[:1])


class RewardRegistry:
    """The reward functions a request may name: built once, when the role starts."""

    def __init__(self, functions: Mapping[str, RewardFunction] | None = None) -> None:
        functions = dict(functions or {})
        for name, function in functions.items():
            check_name(name)
            if name in BUILTIN_REWARDS or name == "custom":
                raise PluginError(f"{name!r} is a built-in reward type; register custom functions under other names")
            if not callable(function):
                raise PluginError(f"reward function {name!r} is not callable")
        self._functions = functions

    @classmethod
    def load(
        cls, specs: Mapping[str, str] | None = None, *, entry_point_group: str | None = ENTRY_POINT_GROUP
    ) -> RewardRegistry:
        """The installed entry points of ``entry_point_group`` (None: none), then ``specs``
        (``name`` → ``package.module:function``), which win over an entry point of the same name."""
        functions: dict[str, RewardFunction] = load_installed(entry_point_group)
        for name, spec in (specs or {}).items():
            if name in functions:
                logger.info("reward function %r: %s replaces the installed entry point", name, spec)
            functions[name] = load_callable(spec)
        registry = cls(functions)
        logger.info("reward functions registered: %s", registry.names or "none")
        return registry

    @property
    def names(self) -> list[str]:
        """The registered custom names (the built-ins are always there)."""
        return sorted(self._functions)

    def function(self, name: str) -> RewardFunction:
        """The registered function ``name``, or `UnknownReward` listing what is registered."""
        try:
            return self._functions[name]
        except KeyError:
            pass
        hint = " (a request names a registered function; it never names code to import)" if ":" in name else ""
        registered = ", ".join(self.names) or "none"
        raise UnknownReward(
            f"no reward function {name!r} is registered{hint}; registered: {registered}. Register one at start-up "
            f"with WEIR_REWARD_FUNCTIONS=name=package.module:function or the {ENTRY_POINT_GROUP!r} entry points",
            registered=self.names,
        )

    def check(self, spec: RewardSpec) -> None:
        """Raise `UnknownReward` now, before any work, if ``spec`` names an unregistered function."""
        if spec.type == "custom":
            self.function(spec.function or "")

    def compute(self, spec: RewardSpec, response: str, sample: RewardContext) -> float | None:
        """The sample's reward (None for type "none"); a custom function's exceptions propagate."""
        if spec.type == "none":
            return None
        if spec.type == "exact_match":
            return exact_match(response, spec.answer or "")
        if spec.type == "math":
            return math_reward(response, spec.answer or "")
        if spec.type == "multiple_choice":
            return multiple_choice(response, spec.answer or "")
        return float(self.function(spec.function or "")(response, spec.answer, sample))
