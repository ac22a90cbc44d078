"""A whole `weir train --demo --ray` run on a multi-node Ray cluster started on this machine (a head with the
data directory, two worker nodes standing in for GPU nodes) while engines are added, killed and removed, and
the count at the end: every group the rollout role recorded is stored or dropped with its reason, and every
sample trained was acknowledged exactly once.

Its own module: it starts its own cluster, and the other cluster tests' module-scoped one must be gone first
(one Ray connection per process).
"""

from __future__ import annotations

import os
import signal

import httpx
import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is imported (see test_multinode)
pytest.importorskip("ray.serve")

from tests.services.cluster.test_multinode import _free_port, _replica_pids, _replicas, _wait  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.mark.slow  # a whole training run (24 steps) on the cluster: minutes
def test_a_run_trains_through_scaling_and_an_engine_sigkill_with_exact_accounting(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    import json
    import subprocess
    import sys

    from experience.store import ExperienceStore
    from launcher.cluster.local import local_cluster
    from launcher.cluster.stack import RayStack

    with local_cluster(tmp_path_factory.mktemp("ray"), workers=2) as head:
        home, port = tmp_path_factory.mktemp("weir"), _free_port()
        stack = RayStack(home=home, engines=1, address=head.address, port=port, env={"WEIR_CLUSTER_HOST": "127.0.0.1"})
        try:
            stack.start()
            command = [sys.executable, "-m", "launcher.cli", "train", "--demo", "--ray", "--attach"]
            command += ["--address", head.address, "--serve-port", str(port), "--home", str(home)]
            command += ["--steps", "24", "--warmup-steps", "2"]
            log = home / "train.log"
            with open(log, "wb") as out:
                run = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
            metrics = home / "train" / "async" / "metrics.jsonl"

            def steps() -> int:
                return len(metrics.read_text().splitlines()) if metrics.is_file() else 0

            _wait(lambda: steps() >= 3 or run.poll() is not None, 600, "training under way")
            assert len(stack.scale_engines(3)) == 3  # 1 → 3 while it trains
            os.kill(_replica_pids("engine")[0], signal.SIGKILL)
            _wait(lambda: len(_replicas("engine")) == 3, 180, "the killed engine replaced")
            assert len(stack.scale_engines(1)) == 1  # 3 → 1
            assert run.wait(timeout=900) == 0, log.read_text()[-3000:]
            headers = {"Authorization": f"Bearer {stack.token}"}
            rollout_metrics = httpx.get(f"{stack.role_url('rollout')}/metrics", headers=headers).text
            finished = sum(
                float(line.split()[-1])
                for line in rollout_metrics.splitlines()
                if line.startswith("weir_rollout_groups_recorded_total")
            )
        finally:
            stack.stop()
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert len(records) == 24
        store = ExperienceStore(home / "data")
        try:
            stats = store.stats()
            trained = store.trained("trainer")
        finally:
            store.close()
        # Every group the rollout role recorded (the held-out checks are not) reached the data role: stored, or
        # dropped with its reason.
        assert finished == stats.groups + sum(stats.groups_dropped.values())
        # Every sample trained was acknowledged once: the steps' samples are the ledger's, one entry each.
        assert sum(r["samples"] for r in records) == len(trained)
