"""Every role's OpenAPI document, fuzzed with schemathesis: no generated input gets a 5xx or a trace.

Each role runs for real on a loopback port (the tiny model made locally, real caches and stores);
schemathesis reads the role's own ``/openapi.json`` and sends generated requests — valid and
invalid bodies, queries and paths — the way any HTTP client would. The example count per operation
is bounded so the suite stays well inside CI's time; ``WEIR_FUZZ_EXAMPLES`` raises it for a long run.
"""

from __future__ import annotations

import os
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.generation import GenerationMode

pytestmark = pytest.mark.integration

EXAMPLES = int(os.environ.get("WEIR_FUZZ_EXAMPLES", "12"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,  # the same inputs on every run: a failure here is reproducible, not flaky
    database=None,
)


@pytest.fixture(scope="module")
def roles(live_roles: dict[str, str]) -> dict[str, str]:
    return live_roles


def _check(case: Any, url: str) -> None:
    response = case.call(timeout=120)
    if case.formatted_path == "/pause_generation":  # a paused engine holds later requests: let them go
        httpx.post(f"{url}/continue_generation", json={}, timeout=30).raise_for_status()
    text = response.text
    where = f"{case.method} {case.formatted_path}"
    assert response.status_code < 500, f"{where} → {response.status_code}: {text[:500]}"
    assert "Traceback" not in text, f"{where} leaked a stack trace"
    content_type = response.headers.get("content-type") or [""]
    if response.status_code >= 400 and str(content_type[0]).startswith("application/json"):
        body = response.json()
        error = body.get("error", {}) if isinstance(body, dict) else {}
        # Every refusal carries a stable code (SGLang's own weight-update shape excepted: success/message).
        assert error.get("code") or (isinstance(body, dict) and "success" in body), (
            f"{where}: no error code: {text[:300]}"
        )


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("role", ["preprocess", "encoder", "engine", "data", "rollout"])
def test_no_input_gets_a_server_error(roles: dict[str, str], role: str, mode: GenerationMode) -> None:
    """Inputs that fit the schema (positive) and inputs that do not (negative), for every operation
    of the role's OpenAPI document (schemathesis generates them; hypothesis drives the search)."""
    schema = schemathesis.openapi.from_url(f"{roles[role]}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert operations, f"the {role} role documents no operation"
    failures: list[str] = []
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @FUZZ
        def fuzz(case: Any) -> None:
            _check(case, roles[role])

        try:
            fuzz()
        except Unsatisfiable:  # nothing in this operation can be made invalid (no parameters, no body)
            continue
        except AssertionError as error:  # collect: one report naming every failing operation
            failures.append(f"{operation.method.upper()} {operation.path}: {str(error).splitlines()[0]}")
    assert not failures, "\n".join(failures)


def test_every_role_is_fuzzed(roles: dict[str, str]) -> None:
    from services.roles import ROLES

    assert set(roles) == set(ROLES)
