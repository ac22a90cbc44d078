"""Tools that misbehave, for test_sandbox.py and test_multiturn.py: the sandbox's worker processes import
this module, so it imports nothing heavy (no torch, not the rollout package's __init__)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from rollout.tools import ToolContext, ToolError


def echo(arguments: dict[str, Any], context: ToolContext) -> str:
    return f"{arguments.get('text', '')} from {os.getpid()}"


def slow(arguments: dict[str, Any], context: ToolContext) -> str:
    time.sleep(2)
    return "late"


def broken(arguments: dict[str, Any], context: ToolContext) -> str:
    raise RuntimeError("the tool's backend is down")


def spin(arguments: dict[str, Any], context: ToolContext) -> str:
    while True:  # an infinite loop in pure Python
        pass


def hang(arguments: dict[str, Any], context: ToolContext) -> str:
    time.sleep(3600)
    return "never"


def memory_bomb(arguments: dict[str, Any], context: ToolContext) -> str:
    if arguments.get("gradual"):
        hoard = []
        while True:  # 16 MiB at a time until the limit
            hoard.append(bytearray(16 << 20))
    blob = bytearray(4 << 30)  # 4 GiB at once
    return str(len(blob))


def _fork_sleepers(count: int, pids_file: str) -> None:
    pids = []
    for _ in range(count):
        pid = os.fork()
        if pid == 0:  # the child: sleep, never return into the worker's loop
            if os.fork() == 0:  # and a grandchild, orphaned at once
                time.sleep(600)
                os._exit(0)
            time.sleep(600)
            os._exit(0)
        pids.append(pid)
    Path(pids_file).write_text(" ".join(map(str, pids)))


def fork_and_return(arguments: dict[str, Any], context: ToolContext) -> str:
    _fork_sleepers(int(arguments["count"]), str(arguments["pids_file"]))
    return "forked"


def fork_and_hang(arguments: dict[str, Any], context: ToolContext) -> str:
    _fork_sleepers(int(arguments["count"]), str(arguments["pids_file"]))
    time.sleep(3600)
    return "never"


def escape_and_hang(arguments: dict[str, Any], context: ToolContext) -> str:
    """A child that leaves the worker's session (and process group) before the deadline."""
    pid = os.fork()
    if pid == 0:
        os.setsid()
        time.sleep(600)
        os._exit(0)
    Path(str(arguments["pids_file"])).write_text(str(pid))
    time.sleep(3600)
    return "never"


def crash(arguments: dict[str, Any], context: ToolContext) -> str:
    os._exit(3)


def refuse(arguments: dict[str, Any], context: ToolContext) -> str:
    raise ToolError("x must be positive")


def count(arguments: dict[str, Any], context: ToolContext) -> str:
    context.state["count"] = context.state.get("count", 0) + 1
    context.state.pop("drop", None)
    return str(context.state["count"])


class _Payload:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (Path.touch, (Path(self.path),))


def smuggle_state(arguments: dict[str, Any], context: ToolContext) -> str:
    context.state["evil"] = _Payload(str(arguments["path"]))
    return "ok"
