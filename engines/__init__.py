"""Generation engines: one contract (`Engine`), three backends (transformers on CPU, SGLang on GPU, and a
simulated one that sleeps a cost model's time for capacity twins; the two that schedule their own requests
share one `scheduler.Scheduler`),
and what an engine role needs around them — SGLang's sampling dict mapped (`sampling_from`), media
resolved from the caches by key (`MediaResolver`), a model's limits checked (`ModelLimits`).

This package does not serve HTTP: the engine role (`services.engine`) puts SGLang's API in front of it, its
records (`api`) and a client of it (`client`) are here.

::

    engines/
      protocol.py             the records (SamplingParams, MediaInput, GenerateRequest/Result) and the Engine contract
      errors.py               the exception tree (EngineError and its codes)
      sampling.py             SGLang's sampling_params → SamplingParams: supported, ignored, refused keys
      grammar.py              constrained decoding (json_schema / regex / ebnf) with xgrammar: compiled, cached, matched
      api.py                  the engine role's records (SGLang's native API, weir_media's MediaRef), declared once
      client.py               EngineClient / AsyncEngineClient: a typed method per route, Weir's engine or SGLang's
      media.py                MediaRef (by feature or embedding key) → MediaInput, from the two caches
      limits.py               a model's vocabulary and context; prompts outside them are refused at submit
      factory.py              load_engine(model, backend=..., device=..., max_running=..., profile=...)
      scheduler.py            Scheduler: one engine's requests (queue, admission, pause, abort), driven by a Stepper
      transformers_backend.py TransformersEngine: a transformers model (CPU), checked at submit, on a Scheduler
      transformers_stepper.py TransformersStepper: one request's prefill or decode, its sampling and its stop
      prefill_cache.py        PrefillCache: a prompt's prefilled state kept for the next request with that prompt
      logits.py               SGLang's logit processing and sampling: penalize, sample_token, top_logprobs
      weights.py              new weights checked against the model: from a folder, or received in a group
      weights_group.py        join_weights_group: SGLang's weight-update process group, from either side
      sglang_backend.py       SGLangEngine: sglang.Engine in process (GPU), every call on one owned loop
      sglang_request.py       build_request / result_from: GenerateRequest ↔ SGLang's GenerateReqInput and answer
      sglang_loop.py          EngineLoop: one thread running one asyncio loop for an engine's whole life
      sglang_args.py          SGLang's server arguments: checked by name against ServerArgs, the GPUs they take
      sim_backend.py          SimEngine: no model; a profile's continuous-batching cost model, slept, over replicas
      sim_replica.py          SimReplica: one simulated engine, a Scheduler stepped by a SimStepper
      sim_stepper.py          SimStepper: the cost model applied on one clock (prefill, decode, weight updates)
      sim_profile.py          SimProfile: a simulated engine's constants and their sources; SimStats
"""

from __future__ import annotations

from .api import MediaRef
from .errors import EngineError, InvalidEnginePrompt, InvalidMedia, InvalidSampling, MediaNotFound, WeightsError
from .factory import DEFAULT_MAX_RUNNING, Backend, load_engine
from .limits import ModelLimits
from .media import MediaKind, MediaResolver
from .protocol import (
    PAUSE_MODES,
    Engine,
    GenerateRequest,
    GenerateResult,
    MediaInput,
    PauseMode,
    SamplingParams,
    TokenCallback,
    TopLogprobs,
)
from .sampling import (
    IGNORED_SAMPLING,
    KNOWN_SAMPLING,
    REFUSED_SAMPLING,
    SUPPORTED_SAMPLING,
    sample_count,
    sample_seed,
    sampling_from,
)

__all__ = [
    "DEFAULT_MAX_RUNNING",
    "IGNORED_SAMPLING",
    "KNOWN_SAMPLING",
    "PAUSE_MODES",
    "REFUSED_SAMPLING",
    "SUPPORTED_SAMPLING",
    "Backend",
    "Engine",
    "EngineError",
    "GenerateRequest",
    "GenerateResult",
    "InvalidMedia",
    "InvalidEnginePrompt",
    "InvalidSampling",
    "MediaInput",
    "MediaKind",
    "MediaNotFound",
    "MediaRef",
    "MediaResolver",
    "ModelLimits",
    "PauseMode",
    "SamplingParams",
    "TokenCallback",
    "TopLogprobs",
    "WeightsError",
    "load_engine",
    "sample_count",
    "sample_seed",
    "sampling_from",
]
