"""The engine role over HTTP: the subset of SGLang 0.5's native API that RL systems use.

Same paths, field names and response shapes as SGLang (`POST /generate` — single and batch, ``n``,
log-probs, raw media —, weight updates, pause (``abort`` / ``retract`` / ``in_place``) / continue, abort,
flush, weight version, health, model and server info under both their names), so a client written for
SGLang works unchanged; a field it does not implement is refused naming the field (README's table).
Weights come from a folder (``/update_weights_from_disk``) or by broadcast from a trainer
(``/init_weights_update_group``, ``/update_weights_from_distributed``, ``/destroy_weights_update_group``:
gloo on CPU, NCCL on CUDA); ``/update_weights_from_tensor`` is refused by its field (pickled tensors).
One documented extension: ``weir_media`` on `/generate` passes the prompt's media by key
(`engines.api.MediaRef`). SGLang endpoints RL clients call but this role does not serve
(`UNSUPPORTED_ENDPOINTS`: memory release, IPC weight updates, ``/classify``) answer 400
``unsupported_endpoint`` naming themselves. Routes only: the engine, sampling, media and their errors are the
`engines` library's; the shared middle (auth, errors, ``/healthz``, ``/readyz``, ``/metrics``)
is `services.template`'s.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from pathlib import Path

from fastapi import FastAPI
from transformers import AutoTokenizer

import engines
import preprocess as pp
from engines import MediaResolver
from engines.api import ModelCard
from engines.limits import ModelLimits

from ..settings import load_settings
from ..template import build_app
from . import control, generation, info, weights
from .control import UNSUPPORTED_ENDPOINTS
from .service import EngineRole, Probe, engine_metrics
from .settings import EngineSettings

__all__ = ["UNSUPPORTED_ENDPOINTS", "create_app"]

LIBRARY_ERRORS: Mapping[type[Exception], int] = {
    engines.EngineError: 400,  # InvalidSampling, InvalidEnginePrompt, InvalidMedia, WeightsError
    engines.MediaNotFound: 404,
}


def create_app(settings: EngineSettings | None = None) -> FastAPI:
    """The engine role's app, assembled: the engine and what the routes share (`service.EngineRole`,
    ``app.state.weir``), the template's middle, and the routers — `generation` (its stream in
    `streaming`), `weights`, `control`, `info` — which read that state through `deps`."""
    settings = settings or load_settings(EngineSettings)
    engine = engines.load_engine(
        settings.model,
        backend=settings.backend,
        device=settings.device,
        max_running=settings.max_running,
        profile=settings.sim_profile,
        compression=settings.sim_compression,
        weights_group_timeout_s=settings.weights_group_timeout_s,
        routed_experts=settings.return_routed_experts,
        server_args=settings.sglang_args,
    )
    probe = Probe(engine)
    metrics, counted = engine_metrics(engine)
    role = EngineRole(
        settings=settings,
        engine=engine,
        probe=probe,
        counted=counted,
        model_card=ModelCard(
            id=settings.served_model_name[0],  # by default the model's own: owner/name for a hub snapshot
            created=int(time.time()),
            root=str(settings.model),
            max_model_len=ModelLimits.read(settings.model).max_context,
        ),
        tokenizer=AutoTokenizer.from_pretrained(settings.model),
        config=json.loads((settings.model / "config.json").read_text()),
        media=MediaResolver.open(settings.cache_dir, settings.embedding_cache_dir, settings.cache_max_bytes),
        spec=_spec(settings.model),
        placeholders=_placeholders(settings.model),
    )

    async def close() -> None:
        await asyncio.to_thread(engine.close)
        role.media.close()

    app: FastAPI = build_app(
        "engine",
        settings,
        ready=probe.ready,
        metrics=metrics,
        library_errors=LIBRARY_ERRORS,
        on_close=close,
        state=role,
        description=__doc__ or "",
    )
    for module in (generation, weights, control, info):
        app.include_router(module.router)
    return app


def _spec(model: Path) -> pp.ProcessorSpec:
    """The served model's processor (its preprocessor_config.json), as the preprocess role reads it."""
    if (model / "preprocessor_config.json").is_file():
        return pp.ProcessorSpec.from_pretrained(model)
    return pp.ProcessorSpec.qwen2_5_omni()


def _placeholders(model: Path) -> dict[str, int]:
    """The model's placeholder token per media kind (Qwen2.5-Omni's config names them)."""
    config = json.loads((model / "config.json").read_text())
    sections = [config, config.get("thinker_config") or {}]
    out = {}
    for kind, names in (
        ("image", ("image_token_id", "image_token_index")),
        ("video", ("video_token_id", "video_token_index")),
        ("audio", ("audio_token_id", "audio_token_index")),
    ):
        for section in sections:
            found = next((section[n] for n in names if isinstance(section.get(n), int)), None)
            if found is not None:
                out[kind] = int(found)
                break
    return out
