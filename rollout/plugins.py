"""Code chosen by the operator when the role starts: ``package.module:function`` specs and entry points.

This is the only module of the library that imports code by name, and it is called only with
settings (``WEIR_REWARD_FUNCTIONS``, ``WEIR_ROLLOUT_FUNCTION``, ``WEIR_TOOLS``, ``WEIR_ENVIRONMENTS``) and
installed entry points (``weir.rewards``, ``weir.tools``, ``weir.environments``) — never with anything a
request carries (a request names a registered tool or environment, `rollout.tools` / `rollout.environments`).
Each loader raises `PluginError` (a `ValueError`, so settings
validation reports it against the variable) naming the spec that failed.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

__all__ = [
    "PluginError",
    "check_name",
    "installed",
    "load_callable",
    "load_installed",
    "load_coroutine_function",
    "parse_named_specs",
]

_SPEC = re.compile(r"^[A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)*$")
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")


class PluginError(ValueError):
    """A spec that is malformed, does not import, or does not name a suitable callable."""


def load_callable(spec: str) -> Callable[..., Any]:
    """The callable ``package.module:attribute`` (attribute may be dotted: ``module:Class.method``)."""
    if not _SPEC.match(spec):
        raise PluginError(f"{spec!r} is not 'package.module:function'")
    module_name, _, attribute = spec.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise PluginError(f"{spec!r}: module {module_name!r} does not import ({error})") from None
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise PluginError(f"{spec!r}: {module_name!r} has no attribute {attribute!r}") from None
    if not callable(target):
        raise PluginError(f"{spec!r} is not callable")
    return target  # type: ignore[no-any-return]


def load_coroutine_function(spec: str) -> Callable[..., Any]:
    """`load_callable`, and the callable must be ``async def`` (or an object whose ``__call__`` is)."""
    function = load_callable(spec)
    call = type(function).__call__  # an instance of a class whose __call__ is async counts too
    if not (inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(call)):
        raise PluginError(f"{spec!r} is not an async function (it must be declared 'async def')")
    return function


def parse_named_specs(value: str) -> dict[str, str]:
    """``"a=pkg.mod:f, b=pkg.mod:g"`` → ``{"a": "pkg.mod:f", "b": "pkg.mod:g"}``; names are unique."""
    specs: dict[str, str] = {}
    for entry in (e.strip() for e in value.split(",")):
        if not entry:
            continue
        name, sep, spec = (s.strip() for s in entry.partition("="))
        if not sep or not name or not spec:
            raise PluginError(f"{entry!r} is not 'name=package.module:function'")
        if name in specs:
            raise PluginError(f"{name!r} is given twice")
        specs[name] = spec
    return specs


def check_name(name: str) -> str:
    """``name`` if it can name a plugin (it never contains ``:``, so it can never be a dotted path)."""
    if not _NAME.match(name):
        raise PluginError(f"{name!r} is not a usable name (letters, digits, '_', '.', '-'; at most 64)")
    return name


def installed(group: str) -> dict[str, Callable[[], Any]]:
    """The entry points of ``group`` in the installed distributions: name → loader (not yet loaded)."""
    return {point.name: point.load for point in entry_points(group=group)}


def load_installed(group: str | None) -> dict[str, Callable[..., Any]]:
    """The entry points of ``group`` (None: none), each loaded: name → what it names. `PluginError` names
    the first that does not load (a registry starting without it would refuse requests naming it)."""
    loaded: dict[str, Callable[..., Any]] = {}  # a function or a class: whatever the entry point names
    if group:
        for name, loader in installed(group).items():
            try:
                loaded[name] = loader()
            except Exception as error:  # noqa: BLE001 - any failure of an installed plugin is reported by name
                raise PluginError(f"entry point {name!r} of {group!r} does not load: {error}") from None
    return loaded
