"""Weight publishing: export → pause → update_weights_from_disk → continue on every engine, then the
new policy version to the data role (and new tower weights to the encoder role, when towers train).

Engines are told through SGLang's own endpoints, so the same call updates Weir's engine role and a
plain SGLang server. The NCCL path (``init_weights_update_group`` / ``update_weights_from_distributed``)
needs GPUs and is not built here.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import httpx

__all__ = ["publish_weights"]

logger = logging.getLogger(__name__)


def publish_weights(
    folder: str | Path,
    version: int,
    *,
    engine_urls: list[str],
    data_url: str | None = None,
    encoder_url: str | None = None,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Point every reachable engine at ``folder`` as weight version ``version``.

    An engine that cannot be reached (it died) is skipped and listed under ``"unreachable"``: the
    rollout role already routes around it, and one dead engine must not stop training. An engine
    that answers but refuses the weights is an error.
    """
    out: dict[str, Any] = {"unreachable": []}
    live: list[str] = []
    with httpx.Client(timeout=timeout_s) as client:
        start = time.perf_counter()
        for url in engine_urls:
            try:
                client.post(f"{url}/pause_generation", json={}).raise_for_status()
                live.append(url)
            except httpx.TransportError:
                logger.warning("engine %s is unreachable; publishing to the others", url)
                out["unreachable"].append(url)
        try:
            if encoder_url:  # while the engines are paused, so no new generation mixes old towers with new weights
                client.post(f"{encoder_url}/v1/weights", json={"model_path": str(folder)}).raise_for_status()
            for url in live:
                response = client.post(
                    f"{url}/update_weights_from_disk", json={"model_path": str(folder), "weight_version": str(version)}
                )
                if response.status_code != 200 or not response.json().get("success"):
                    raise RuntimeError(f"{url} refused the weights: {response.text}")
        finally:
            for url in live:
                with contextlib.suppress(httpx.TransportError):
                    client.post(f"{url}/continue_generation", json={})
        out["engines_s"] = time.perf_counter() - start
        if data_url:
            client.post(f"{data_url}/v1/policy", json={"version": version}).raise_for_status()
    return out
