"""Tools a multi-turn rollout may call: the built-ins and functions registered at start-up — never code a
request names.

A request names tools (``"tools": ["calculator"]``) or an environment that offers them; the names are
looked up in the `ToolRegistry` built once when the role starts from the built-ins (`BUILTIN_TOOLS`),
the installed entry points of the group ``weir.tools`` and the operator's ``WEIR_TOOLS``
(``name=package.module:function``, comma-separated). A name that is not registered is `UnknownTool`
(an `InvalidPrompt`: 400 ``unknown_tool`` naming it); nothing is imported because of a request.

A tool has the signature::

    def tool(arguments: dict, context: ToolContext) -> str | bytes | PIL.Image.Image | Observation

``arguments`` are the model's JSON arguments; ``context.state`` is the trajectory's environment state
(the picture `crop` cuts from). Text is the observation; bytes (an encoded image) or a PIL image are an
image observation. A tool says what it is with a ``weir_tool`` attribute (the `tool` decorator): its
description and JSON-Schema parameters, rendered into the prompt by the chat template.

Failures, and what each does to the trajectory:

* `ToolError` — the call is bad (unknown arguments, a region outside the picture, an expression that is
  not arithmetic): the model's mistake. Its message becomes the observation (``error: ...``) and the
  trajectory goes on, so the policy can learn to recover.
* any other exception, or a tool that runs past its ``timeout_s`` — the tool is broken, not the model:
  the trajectory ends with finish reason ``tool_error`` and no reward (`multiturn`).

Resource limits, honestly: tools run in a bounded thread pool (`ToolRegistry`'s ``workers``) under a
per-call deadline. A Python thread cannot be killed, so a tool past its deadline ends its trajectory but
keeps its worker until it returns; the pool's bound stops runaway tools from taking more than
``workers`` threads (calls beyond wait, and their wait counts toward their deadline). There is no
memory or CPU limit per call and no sandbox: registered tools are operator code, trusted like reward
functions. The built-ins are pure and bounded (the calculator caps sizes and exponents).
"""

from __future__ import annotations

import ast
import asyncio
import io
import logging
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidPrompt
from .messages import FunctionTool, function_tool
from .plugins import PluginError, check_name, installed, load_callable

__all__ = [
    "BUILTIN_TOOLS",
    "ENTRY_POINT_GROUP",
    "Observation",
    "Tool",
    "ToolCall",
    "ToolContext",
    "ToolError",
    "ToolFailed",
    "ToolRegistry",
    "UnknownTool",
    "calculator",
    "crop",
    "observation_of",
    "tool",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "weir.tools"
DEFAULT_TIMEOUT_S = 10.0


class ToolError(Exception):
    """A bad call (the model's mistake): its message is the observation, and the trajectory goes on."""


class ToolFailed(Exception):
    """A tool that raised something else or ran past its deadline: the trajectory ends (``tool_error``)."""


class UnknownTool(InvalidPrompt):
    """A request named a tool (or environment) that is not registered."""

    code = "unknown_tool"


@dataclass(frozen=True, slots=True)
class Observation:
    """What a tool or an environment shows the model: text, and images (encoded bytes or PIL images),
    rendered as a ``tool`` turn (a ``user`` turn for an environment's own messages)."""

    text: str = ""
    images: tuple[Any, ...] = ()


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made: the tool's name and its JSON arguments."""

    name: str
    arguments: dict[str, Any]


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


def image_bytes(image: Any) -> bytes:
    """An observation's image as encoded bytes (PIL images as PNG, lossless)."""
    if isinstance(image, bytes | bytearray):
        return bytes(image)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def tool(
    *, description: str, parameters: Mapping[str, Any] | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a tool function with what the chat template renders: its description and the JSON Schema
    of its arguments (an object schema)."""

    def mark(function: Callable[..., Any]) -> Callable[..., Any]:
        function.weir_tool = {  # type: ignore[attr-defined]
            "description": description,
            "parameters": dict(parameters or {"type": "object", "properties": {}}),
        }
        return function

    return mark


@dataclass(frozen=True, slots=True, kw_only=True)
class Tool:
    """A registered tool: its name, function, deadline, and the pool it runs in (None: asyncio's default)."""

    name: str
    function: Callable[..., Any]
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    timeout_s: float = DEFAULT_TIMEOUT_S
    executor: Executor | None = None

    @property
    def schema(self) -> FunctionTool:
        """The OpenAI function tool the chat template renders."""
        return function_tool(self.name, description=self.description, parameters=dict(self.parameters))

    async def run(self, arguments: dict[str, Any], context: ToolContext) -> Observation:
        """The observation; `ToolError` for a bad call, `ToolFailed` for a broken or slow tool."""
        loop = asyncio.get_running_loop()
        try:
            value = await asyncio.wait_for(
                loop.run_in_executor(self.executor, self.function, arguments, context), self.timeout_s
            )
            return observation_of(value)
        except ToolError:
            raise
        except TimeoutError:
            raise ToolFailed(f"tool {self.name!r} ran past its {self.timeout_s:g} s deadline") from None
        except Exception as error:  # noqa: BLE001 - any other failure of operator code ends the trajectory
            raise ToolFailed(f"tool {self.name!r} failed: {type(error).__name__}: {error}") from None


# -- built-ins --------------------------------------------------------------------------------------
_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPRESSION = 256
_MAX_MAGNITUDE = 10**100
_MAX_EXPONENT = 512


def evaluate(expression: str) -> int | float:
    """Arithmetic (numbers, + - * / // % **, parentheses) without ``eval``: the expression is parsed
    into Python's syntax tree and only those nodes are computed; a name, a call, an attribute
    (``__import__('os')``), a string or a too large number is `ToolError`."""
    if len(expression) > _MAX_EXPRESSION:
        raise ToolError(f"the expression is longer than {_MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError(f"{expression!r} is not an arithmetic expression") from None

    def walk(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value  # type: ignore[return-value]
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](walk(node.operand))  # type: ignore[no-any-return]
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
                raise ToolError(f"exponents above {_MAX_EXPONENT} are not computed")
            try:
                value = _BINARY[type(node.op)](left, right)
            except (ZeroDivisionError, OverflowError, ValueError) as error:
                raise ToolError(f"{type(error).__name__}: {error}") from None
            if isinstance(value, complex) or abs(value) > _MAX_MAGNITUDE:
                raise ToolError("the result is out of range")
            return value  # type: ignore[no-any-return]
        raise ToolError(f"only numbers and + - * / // % ** are allowed, not {type(node).__name__}")

    value = walk(tree.body)
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("the result is not a finite number")
    return value


@tool(
    description="Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses).",
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 12"}},
        "required": ["expression"],
    },
)
def calculator(arguments: Mapping[str, Any], context: ToolContext) -> str:
    """The built-in ``calculator``: `evaluate` on ``arguments["expression"]``."""
    expression = arguments.get("expression")
    if not isinstance(expression, str):
        raise ToolError("calculator needs 'expression': a string")
    value = evaluate(expression)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    return str(value)


@tool(
    description="Crop a region of the picture, in pixels from its top-left corner; returns the region as an image.",
    parameters={
        "type": "object",
        "properties": {
            "x": {"type": "integer", "minimum": 0},
            "y": {"type": "integer", "minimum": 0},
            "w": {"type": "integer", "minimum": 1},
            "h": {"type": "integer", "minimum": 1},
        },
        "required": ["x", "y", "w", "h"],
    },
)
def crop(arguments: Mapping[str, Any], context: ToolContext) -> Any:
    """The built-in visual ``crop``: the region ``(x, y, w, h)`` of ``context.state["image"]`` (a PIL
    image the environment holds) as a new image; a region outside the picture is `ToolError`."""
    image = context.state.get("image")
    if image is None:
        raise ToolError("there is no picture to crop here (crop needs an environment that holds one)")
    try:
        x, y, w, h = (arguments[k] for k in ("x", "y", "w", "h"))
    except KeyError as missing:
        raise ToolError(f"crop needs integer x, y, w, h (missing {missing})") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (x, y, w, h)):
        raise ToolError("crop needs integer x, y, w, h")
    width, height = image.size
    if x < 0 or y < 0 or w < 1 or h < 1 or x + w > width or y + h > height:
        raise ToolError(f"the region ({x}, {y}, {w}, {h}) is not inside the {width}x{height} picture")
    return image.crop((x, y, x + w, y + h))


BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator, "crop": crop}


class ToolRegistry:
    """The tools a request may name: built once, when the role starts. ``timeout_s`` is each call's
    deadline; registered (operator) tools run in a pool of ``workers`` threads, the pure built-ins in
    asyncio's default pool."""

    def __init__(
        self,
        functions: Mapping[str, Callable[..., Any]] | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        workers: int = 8,
    ) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="weir-tool") if functions else None
        self._tools: dict[str, Tool] = {}
        for name, function in {**BUILTIN_TOOLS, **dict(functions or {})}.items():
            check_name(name)
            if not callable(function):
                raise PluginError(f"tool {name!r} is not callable")
            meta = getattr(function, "weir_tool", None) or {}
            doc = (function.__doc__ or "").strip().splitlines()
            builtin = BUILTIN_TOOLS.get(name) is function
            self._tools[name] = Tool(
                name=name,
                function=function,
                description=str(meta.get("description") or (doc[0] if doc else name)),
                parameters=meta.get("parameters") or {"type": "object", "properties": {}},
                timeout_s=timeout_s,
                executor=None if builtin else self._pool,
            )

    @classmethod
    def load(
        cls,
        specs: Mapping[str, str] | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        workers: int = 8,
        entry_point_group: str | None = ENTRY_POINT_GROUP,
    ) -> ToolRegistry:
        """The built-ins, the installed entry points of ``entry_point_group``, then ``specs`` (``name`` →
        ``package.module:function``); a later one of the same name wins."""
        functions: dict[str, Callable[..., Any]] = {}
        if entry_point_group:
            for name, loader in installed(entry_point_group).items():
                try:
                    functions[name] = loader()
                except Exception as error:  # noqa: BLE001 - any failure of an installed plugin is reported by name
                    raise PluginError(f"entry point {name!r} of {entry_point_group!r} does not load: {error}") from None
        for name, spec in (specs or {}).items():
            functions[name] = load_callable(spec)
        registry = cls(functions, timeout_s=timeout_s, workers=workers)
        logger.info("tools registered: %s", registry.names)
        return registry

    @property
    def names(self) -> list[str]:
        return sorted(self._tools)

    def get(self, name: str, where: str = "tools") -> Tool:
        """The tool ``name``, or `UnknownTool` (400) naming it and listing what is registered."""
        try:
            return self._tools[name]
        except KeyError:
            pass
        raise UnknownTool(
            f"{where}: no tool {name!r} is registered; registered: {', '.join(self.names)}. Register one at "
            f"start-up with WEIR_TOOLS=name=package.module:function or the {ENTRY_POINT_GROUP!r} entry points"
        )

    def resolve(self, names: Sequence[str], where: str = "tools") -> tuple[Tool, ...]:
        """The tools ``names`` (each once, in order); `UnknownTool` for the first that is not registered."""
        seen: dict[str, Tool] = {}
        for k, name in enumerate(names):
            seen.setdefault(name, self.get(name, f"{where}[{k}]"))
        return tuple(seen.values())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
