"""The tools' sandbox with real worker processes: a hostile tool (an infinite loop, a memory bomb, forked
children, a crash, a poisoned answer) costs its call — its worker and what it forked are killed and
replaced — and never the role; the built-ins give what they give in-process."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollout.environments import VisualSearch
from rollout.plugins import PluginError
from rollout.tools import Tool, ToolContext, ToolError, ToolFailed, ToolRegistry, calculator, crop
from tests.rollout import hostile_tools

HOSTILE = {
    name: getattr(hostile_tools, name)
    for name in (
        "echo",
        "spin",
        "hang",
        "memory_bomb",
        "fork_and_return",
        "fork_and_hang",
        "escape_and_hang",
        "crash",
        "refuse",
        "count",
        "smuggle_state",
    )
}


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, killed and not yet reaped by init, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def gone(pids: list[int], within_s: float = 5.0) -> bool:
    end = time.monotonic() + within_s
    while any(alive(p) for p in pids):
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def run(registry: ToolRegistry, name: str, arguments: dict[str, Any] | None = None, **state: Any) -> str:
    observation = asyncio.run(registry.get(name).run(arguments or {}, ToolContext(state=state)))
    return observation.text


@pytest.fixture()
def registry() -> Iterator[ToolRegistry]:
    tools = ToolRegistry(HOSTILE, timeout_s=1.0, workers=1, cpu_s=5, memory_mib=1024)
    yield tools
    tools.close()


def test_an_infinite_loop_is_killed_at_its_deadline_and_the_next_call_gets_a_fresh_worker(
    registry: ToolRegistry,
) -> None:
    first = run(registry, "echo", {"text": "hi"})
    (pid,) = registry.sandbox.pids
    assert first == f"hi from {pid}"
    start = time.monotonic()
    with pytest.raises(ToolFailed, match="'spin' ran past its 1 s deadline"):
        run(registry, "spin")
    assert time.monotonic() - start < 3
    assert not alive(pid) and registry.sandbox.pids == []
    assert run(registry, "echo", {"text": "again"}).startswith("again from ")
    assert registry.sandbox.pids != [pid]


def test_cpu_time_past_the_limit_ends_the_worker_before_the_deadline() -> None:
    tools = ToolRegistry(HOSTILE, timeout_s=60, workers=1, cpu_s=1)
    try:
        run(tools, "echo")
        start = time.monotonic()
        with pytest.raises(ToolFailed, match=r"'spin' ran past its CPU limit \(1 s\)"):
            run(tools, "spin")
        assert time.monotonic() - start < 10
        assert run(tools, "echo").startswith(" from ")
    finally:
        tools.close()


@pytest.mark.parametrize("gradual", [False, True])
def test_a_memory_bomb_fails_within_the_limit_and_the_role_is_untouched(gradual: bool) -> None:
    # a deadline far above the bomb's time (16 MiB at a time up to 1 GiB takes seconds on 2 loaded cores): the
    # memory limit must be what stops it
    registry = ToolRegistry(HOSTILE, timeout_s=60.0, workers=1, cpu_s=30, memory_mib=1024)
    try:
        _memory_bomb_in(registry, gradual)
    finally:
        registry.close()


def _memory_bomb_in(registry: ToolRegistry, gradual: bool) -> None:
    run(registry, "echo")
    (pid,) = registry.sandbox.pids
    before = rss_mib()
    with pytest.raises(ToolFailed, match=r"MemoryError: over the tool memory limit \(1024 MiB\)"):
        run(registry, "memory_bomb", {"gradual": gradual})
    assert rss_mib() - before < 100  # the 4 GiB never reached this process
    assert gone([pid])  # a worker that ran out of memory is replaced, whatever state it is in
    assert run(registry, "echo", {"text": "still"}).startswith("still from ")


def test_children_a_tool_leaves_behind_are_killed_and_fail_the_call(registry: ToolRegistry, tmp_path: Path) -> None:
    pids_file = tmp_path / "pids"
    with pytest.raises(ToolFailed, match=r"left [3-9] process\(es\) running"):
        run(registry, "fork_and_return", {"count": 3, "pids_file": str(pids_file)})
    children = [int(p) for p in pids_file.read_text().split()]
    assert len(children) == 3 and gone(children)
    assert run(registry, "echo", {"text": "ok"}).startswith("ok from ")


def test_children_of_a_tool_past_its_deadline_die_with_its_worker(registry: ToolRegistry, tmp_path: Path) -> None:
    pids_file = tmp_path / "pids"
    run(registry, "echo")
    (pid,) = registry.sandbox.pids
    with pytest.raises(ToolFailed, match="deadline"):
        run(registry, "fork_and_hang", {"count": 4, "pids_file": str(pids_file)})
    children = [int(p) for p in pids_file.read_text().split()]
    assert len(children) == 4 and gone([pid, *children])
    # the grandchildren are in the worker's process group too, so the same SIGKILL reached them; a loaded machine
    # may take a moment to schedule their deaths (the CI run that caught one alive did not wait)
    leftovers = [p for p in map(int, filter(str.isdigit, os.listdir("/proc"))) if alive(p) and _pgid(p) == pid]
    assert gone(leftovers), [p for p in leftovers if alive(p)]


def test_a_child_that_left_the_session_dies_with_its_worker(registry: ToolRegistry, tmp_path: Path) -> None:
    pids_file = tmp_path / "pid"
    with pytest.raises(ToolFailed, match="deadline"):
        run(registry, "escape_and_hang", {"pids_file": str(pids_file)})
    child = int(pids_file.read_text())
    assert _pgid(child) in (None, child) and gone([child])


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_a_crash_is_one_failed_call(registry: ToolRegistry) -> None:
    with pytest.raises(ToolFailed, match="'crash' exited with status 3"):
        run(registry, "crash")
    assert run(registry, "echo").startswith(" from ")


def test_a_bad_call_keeps_its_worker(registry: ToolRegistry) -> None:
    run(registry, "echo")
    pids = registry.sandbox.pids
    with pytest.raises(ToolError, match="x must be positive"):
        run(registry, "refuse")
    assert registry.sandbox.pids == pids


def test_state_the_tool_sets_is_copied_back_and_what_does_not_pickle_stays_behind(registry: ToolRegistry) -> None:
    import threading

    lock = threading.Lock()  # does not pickle: the tool does not see it, and it stays in the role's state
    state: dict[str, Any] = {"count": 41, "drop": "x", "lock": lock}
    out = asyncio.run(registry.get("count").run({}, ToolContext(state=state)))
    assert out.text == "42" and state == {"count": 42, "lock": lock}


def test_an_answer_that_would_run_code_in_the_role_is_refused(registry: ToolRegistry, tmp_path: Path) -> None:
    marker = tmp_path / "touched"
    with pytest.raises(ToolFailed, match="not plain data"):
        run(registry, "smuggle_state", {"path": str(marker)})
    assert not marker.exists()
    assert run(registry, "echo").startswith(" from ")


def test_calls_beyond_the_workers_wait_and_the_wait_counts_toward_the_deadline() -> None:
    tools = ToolRegistry(HOSTILE, timeout_s=1.0, workers=2)

    async def burst() -> tuple[Any, ...]:
        echo, hang = tools.get("echo"), tools.get("hang")
        await asyncio.gather(*(echo.run({}, ToolContext()) for _ in range(2)))  # both workers started
        return await asyncio.gather(
            hang.run({}, ToolContext()),
            hang.run({}, ToolContext()),
            echo.run({}, ToolContext()),  # waits for a worker: none is free before its deadline
            return_exceptions=True,
        )

    try:
        start = time.monotonic()
        outcomes = asyncio.run(burst())
        assert all(isinstance(o, ToolFailed) and "deadline" in str(o) for o in outcomes)
        assert time.monotonic() - start < 5 and len(tools.sandbox.pids) <= 2
        assert run(tools, "echo").startswith(" from ")
    finally:
        tools.close()


def test_close_kills_the_workers_and_later_calls_fail() -> None:
    tools = ToolRegistry(HOSTILE, workers=2)

    async def two() -> None:
        echo = tools.get("echo")
        await asyncio.gather(echo.run({}, ToolContext()), echo.run({}, ToolContext()))

    asyncio.run(two())
    pids = tools.sandbox.pids
    assert len(pids) == 2
    tools.close()
    assert gone(pids)
    with pytest.raises(ToolFailed, match="closed"):
        run(tools, "echo")


def test_a_tool_must_be_importable_by_the_workers() -> None:
    def local(arguments: dict[str, Any], context: ToolContext) -> str:
        return "x"

    for function in (local, lambda arguments, context: "x"):
        with pytest.raises(PluginError, match="module-level function"):
            ToolRegistry({"local": function})


def test_the_built_ins_give_what_they_give_in_process() -> None:
    tools = ToolRegistry()
    in_process = {name: Tool(name=name, function=f) for name, f in (("calculator", calculator), ("crop", crop))}
    env = VisualSearch(seed=5, size=224, patch=8)
    env.reset(None)  # type: ignore[arg-type]

    async def both(name: str, arguments: dict[str, Any]) -> tuple[Any, Any]:
        outs: list[Any] = []
        for tool in (tools.get(name), in_process[name]):
            try:
                outs.append(await tool.run(arguments, ToolContext(state=env.state)))
            except ToolError as bad:
                outs.append(("ToolError", str(bad)))
        return outs[0], outs[1]

    try:
        for expression in ("(3 + 4) * 12", "7 / 2", "2 ** 0.5", "10 // 3 - 2 ** 8", "1 / 0", "__import__('os')"):
            sandboxed, direct = asyncio.run(both("calculator", {"expression": expression}))
            assert sandboxed == direct
        for region in ({"x": 0, "y": 0, "w": 224, "h": 224}, {"x": 17, "y": 3, "w": 40, "h": 9}, {"x": 220, "w": 9}):
            arguments = {"y": 0, "h": 1, **region}
            sandboxed, direct = asyncio.run(both("crop", arguments))
            if isinstance(direct, tuple):
                assert sandboxed == direct
            else:
                (a,), (b,) = sandboxed.images, direct.images
                assert (a.mode, a.size, a.tobytes()) == (b.mode, b.size, b.tobytes())
    finally:
        tools.close()
