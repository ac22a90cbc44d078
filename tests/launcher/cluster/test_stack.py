"""`weir up --ray` on one machine: the local Ray it starts runs its dashboard, which `serve status` (and
`serve deploy`) talk to."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from launcher.cluster.stack import RayStack
from services.cluster.placement import ENGINE_RESOURCE


def test_the_local_ray_starts_with_its_dashboard(tmp_path: Path) -> None:
    options = RayStack(home=tmp_path, engines=3).local_ray_options()
    assert options["include_dashboard"] is True and options["dashboard_host"] == "127.0.0.1"
    assert options["namespace"] == "weir" and options["resources"][ENGINE_RESOURCE] == 64


@pytest.mark.slow
@pytest.mark.integration
def test_serve_status_answers_for_the_local_ray(tmp_path: Path) -> None:
    """Start the local Ray as `weir up --ray` does (no roles deployed) and ask Serve's own command line, which
    reads the dashboard's REST API (127.0.0.1:8265)."""
    import ray

    stack = RayStack(home=tmp_path)
    stack.connect()
    try:
        assert stack.started_ray
        done = subprocess.run(
            [str(Path(sys.executable).parent / "serve"), "status"], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert "applications" in done.stdout
    finally:
        ray.shutdown()
