"""Weight publishing: export → pause → update_weights_from_disk → continue on every engine, then the
new policy version to the data role (and new tower weights to the encoder role, when towers train).

Engines are told through SGLang's own endpoints, so the same call updates Weir's engine role and a
plain SGLang server. The NCCL path (``init_weights_update_group`` / ``update_weights_from_distributed``)
needs GPUs and is not built here.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx

__all__ = ["publish_weights"]


def publish_weights(
    folder: str | Path,
    version: int,
    *,
    engine_urls: list[str],
    data_url: str | None = None,
    encoder_url: str | None = None,
    timeout_s: float = 300.0,
) -> dict[str, float]:
    """Point every engine at ``folder`` as weight version ``version``; returns timings in seconds."""
    timings: dict[str, float] = {}
    with httpx.Client(timeout=timeout_s) as client:
        start = time.perf_counter()
        for url in engine_urls:
            client.post(f"{url}/pause_generation", json={}).raise_for_status()
        try:
            for url in engine_urls:
                response = client.post(
                    f"{url}/update_weights_from_disk", json={"model_path": str(folder), "weight_version": str(version)}
                )
                if response.status_code != 200 or not response.json().get("success"):
                    raise RuntimeError(f"{url} refused the weights: {response.text}")
        finally:
            for url in engine_urls:
                client.post(f"{url}/continue_generation", json={}).raise_for_status()
        timings["engines_s"] = time.perf_counter() - start
        if encoder_url:
            client.post(f"{encoder_url}/v1/weights", json={"model_path": str(folder)}).raise_for_status()
        if data_url:
            client.post(f"{data_url}/v1/policy", json={"version": version}).raise_for_status()
    return timings
