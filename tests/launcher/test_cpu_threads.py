"""`weir train`'s processes share the host's cores (`launcher.cpu_threads`): each engine and trainer rank gets
its share, unless the user chose ``OMP_NUM_THREADS``; a stack started alone keeps torch's default."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.config import TrainConfig
from launcher.cpu_threads import THREADS_ENV, host_cores, thread_share
from launcher.stack import LocalStack, stack_ports
from launcher.training import _rank_threads


def _threads(stack: LocalStack) -> str | None:
    return stack._env(Path("model"), stack_ports(engines=stack.engines)).get(THREADS_ENV)


def test_engines_and_trainer_ranks_share_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(THREADS_ENV, raising=False)
    monkeypatch.setattr("launcher.cpu_threads.host_cores", lambda: 16)
    assert _threads(LocalStack(engines=1, trainer_ranks=1)) == "8"
    assert _threads(LocalStack(engines=2, trainer_ranks=2)) == "4"
    assert _threads(LocalStack(engines=3, trainer_ranks=2)) == "3"
    assert _threads(LocalStack(engines=1)) is None  # `weir up`: nothing beside it
    monkeypatch.setattr("launcher.cpu_threads.host_cores", lambda: 2)
    assert _threads(LocalStack(engines=2, trainer_ranks=2)) == "1"  # never none


def test_the_users_threads_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(THREADS_ENV, "5")
    assert _threads(LocalStack(engines=1, trainer_ranks=1)) == "5"  # passed on as the user set it
    assert _rank_threads(TrainConfig(demo=True, nproc=2)) == {}
    monkeypatch.delenv(THREADS_ENV)
    assert _threads(LocalStack(engines=1, trainer_ranks=1, env={THREADS_ENV: "3"})) == "3"


def test_ranks_started_by_weir_train_get_their_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(THREADS_ENV, raising=False)
    assert _rank_threads(TrainConfig(demo=True, nproc=2, engines=2)) == {THREADS_ENV: str(thread_share(4))}
    assert _rank_threads(TrainConfig(demo=True, nproc=2, attach=True)) == {}  # the stack is someone else's
    assert 1 <= thread_share(4) <= host_cores()
