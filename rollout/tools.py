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

Resource limits: every tool, built-in or registered, runs in a warm pool of worker processes
(`rollout.sandbox`: ``workers`` of them, each under a memory limit and a CPU-time limit per call) under a
per-call deadline; waiting for a free worker counts toward it. A tool past its deadline, over its CPU time,
crashed or out of memory has its worker — and everything the worker forked — killed and replaced: it
costs its trajectory (``tool_error``), never the role. A tool is therefore named by where it lives (a
module-level function, imported by the workers); it sees a copy of ``context.state`` and what it sets
there is copied back. Registered tools are operator code, trusted like reward functions: the sandbox
bounds runaway code, it is not a wall against malicious code (`rollout.sandbox` says what it leaves open).
"""

from __future__ import annotations

import ast
import asyncio
import io
import logging
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidPrompt
from .messages import FunctionTool, function_tool
from .plugins import PluginError, check_name, load_callable, load_installed
from .sandbox import Limits, Sandbox
from .tool_types import Observation, ToolContext, ToolError, ToolFailed, observation_of

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
DEFAULT_CPU_S = 10
DEFAULT_MEMORY_MIB = 8192
DEFAULT_WORKERS = 8


class UnknownTool(InvalidPrompt):
    """A request named a tool (or environment) that is not registered."""

    code = "unknown_tool"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made: the tool's name and its JSON arguments."""

    name: str
    arguments: dict[str, Any]


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
    """A registered tool: its name, function, deadline, and the sandbox it runs in (None: a thread of
    asyncio's default pool, unbounded — for a `Tool` built by hand, never by the registry)."""

    name: str
    function: Callable[..., Any]
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    timeout_s: float = DEFAULT_TIMEOUT_S
    sandbox: Sandbox | None = None

    @property
    def schema(self) -> FunctionTool:
        """The OpenAI function tool the chat template renders."""
        return function_tool(self.name, description=self.description, parameters=dict(self.parameters))

    async def run(self, arguments: dict[str, Any], context: ToolContext) -> Observation:
        """The observation; `ToolError` for a bad call, `ToolFailed` for a broken or slow tool."""
        if self.sandbox is not None:
            return await self.sandbox.call(self.name, arguments, context, timeout_s=self.timeout_s)
        loop = asyncio.get_running_loop()
        try:
            value = loop.run_in_executor(None, self.function, arguments, context)
            return observation_of(await asyncio.wait_for(value, self.timeout_s))
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
    deadline; every tool runs in one `rollout.sandbox.Sandbox` of ``workers`` processes, each limited to
    ``cpu_s`` CPU seconds per call and ``memory_mib`` of address space (started on first use, kept warm,
    killed by `close`)."""

    def __init__(
        self,
        functions: Mapping[str, Callable[..., Any]] | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        workers: int = DEFAULT_WORKERS,
        cpu_s: int = DEFAULT_CPU_S,
        memory_mib: int = DEFAULT_MEMORY_MIB,
    ) -> None:

        every = {**BUILTIN_TOOLS, **dict(functions or {})}
        for name, function in every.items():
            check_name(name)
            if not callable(function):
                raise PluginError(f"tool {name!r} is not callable")
        self._sandbox = Sandbox(
            {name: _spec_of(name, function) for name, function in every.items()},
            workers=workers,
            limits=Limits(cpu_s=cpu_s, memory_mib=memory_mib),
        )
        self._tools: dict[str, Tool] = {}
        for name, function in every.items():
            meta = getattr(function, "weir_tool", None) or {}
            doc = (function.__doc__ or "").strip().splitlines()
            self._tools[name] = Tool(
                name=name,
                function=function,
                description=str(meta.get("description") or (doc[0] if doc else name)),
                parameters=meta.get("parameters") or {"type": "object", "properties": {}},
                timeout_s=timeout_s,
                sandbox=self._sandbox,
            )

    @classmethod
    def load(
        cls,
        specs: Mapping[str, str] | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        workers: int = DEFAULT_WORKERS,
        cpu_s: int = DEFAULT_CPU_S,
        memory_mib: int = DEFAULT_MEMORY_MIB,
        entry_point_group: str | None = ENTRY_POINT_GROUP,
    ) -> ToolRegistry:
        """The built-ins, the installed entry points of ``entry_point_group``, then ``specs`` (``name`` →
        ``package.module:function``); a later one of the same name wins."""
        functions: dict[str, Callable[..., Any]] = load_installed(entry_point_group)
        for name, spec in (specs or {}).items():
            functions[name] = load_callable(spec)
        registry = cls(functions, timeout_s=timeout_s, workers=workers, cpu_s=cpu_s, memory_mib=memory_mib)
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

    @property
    def sandbox(self) -> Sandbox:
        """The worker processes the tools run in."""
        return self._sandbox

    def close(self) -> None:
        """Kill the tools' worker processes (and whatever they forked); a call after this is `ToolFailed`."""
        self._sandbox.close()


def _spec_of(name: str, function: Callable[..., Any]) -> str:
    """``package.module:function`` that imports as ``function`` itself: what a worker process imports."""
    spec = f"{getattr(function, '__module__', None)}:{getattr(function, '__qualname__', None)}"
    try:
        found = load_callable(spec)
    except PluginError:
        found = None
    if found is not function or spec.startswith("__main__:"):
        raise PluginError(
            f"tool {name!r} must be a module-level function (the tools' worker processes import it by "
            f"'package.module:function'); {spec!r} does not import as it"
        )
    return spec
