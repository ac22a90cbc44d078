"""`SGLangEngine`: the engine protocol on SGLang's in-process `sglang.Engine` (GPU only).

SGLang's HTTP API refuses tensors (0.5.22+ rejects ``format`` dicts in MediaRef), so multimodal
inputs are passed in process: per modality **one** dict per request, either
``{"format": "processor_output", ...}`` with the Hugging Face processor keys (Weir's features are
exactly those tensors) or ``{"format": "precomputed_embedding", "precomputed_embeddings": ...}``
with the encoder role's embeddings plus the grids, together with ``input_ids`` whose placeholders
are already expanded. `build_request` is pure and unit-tested on CPU; the engine itself runs only
where a GPU and the ``sglang`` extra exist (tests marked ``gpu``).

Every `SamplingParams` field is passed on under SGLang's own name (penalties, ``min_p``, ``logit_bias``
with string keys, the detokenizer options, the grammar of ``json_schema`` / ``regex`` / ``ebnf`` as
given, which SGLang compiles with its own grammar backend), and so are ``logprob_start_len`` / ``top_logprobs_num``;
the pause mode goes to SGLang's ``pause_generation`` when its signature takes one.

What this backend does not do: per-token callbacks (``on_token`` is not called; a stream gets the
final result only), and its ``busy_s`` counts the time any request was in flight, not forward steps
(SGLang keeps its own scheduler metrics behind ``--enable-metrics``).
"""

from __future__ import annotations

import inspect
import threading
import time
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch

import preprocess as pp

from .errors import InvalidPrompt, WeightsError
from .limits import ModelLimits
from .protocol import GenerateRequest, GenerateResult, MediaInput, PauseMode, TokenCallback

__all__ = ["SGLangEngine", "build_request"]


def _visual(items: list[MediaInput], kind: str) -> dict[str, Any]:
    grids = torch.tensor([m.grid_thw for m in items], dtype=torch.long)
    prefix = "image" if kind == "image" else "video"
    out: dict[str, Any]
    if all(m.embedding is not None for m in items):
        out = {"format": "precomputed_embedding", "precomputed_embeddings": torch.cat([m.embedding for m in items])}  # type: ignore[misc]
    else:
        values = [m.features.pixel_values for m in items]  # type: ignore[union-attr]
        key = "pixel_values" if kind == "image" else "pixel_values_videos"
        out = {"format": "processor_output", key: torch.from_numpy(np.concatenate(values))}
    out[f"{prefix}_grid_thw"] = grids
    if kind == "video":
        out["second_per_grid_ts"] = torch.tensor([m.second_per_grid_t for m in items])
    return out


def _audio(items: list[MediaInput]) -> dict[str, Any]:
    lengths = [int(m.audio_frames or 0) for m in items]
    if all(m.embedding is not None for m in items):
        return {
            "format": "precomputed_embedding",
            "precomputed_embeddings": torch.cat([m.embedding for m in items]),  # type: ignore[misc]
            "audio_feature_lengths": torch.tensor(lengths),
        }
    features = [m.features for m in items]
    assert all(isinstance(f, pp.AudioFeatures) for f in features)
    batch = torch.zeros(len(items), features[0].input_features.shape[0], max(lengths))  # type: ignore[union-attr]
    mask = torch.zeros(len(items), max(lengths), dtype=torch.long)
    for i, (f, n) in enumerate(zip(features, lengths, strict=True)):
        batch[i, :, :n] = torch.from_numpy(np.array(f.input_features))  # type: ignore[union-attr]
        mask[i, :n] = 1
    # The Qwen2.5-Omni processor's padded layout: (n, mel, L_max) with a feature attention mask.
    return {"format": "processor_output", "input_features": batch, "feature_attention_mask": mask}


def build_request(request: GenerateRequest) -> dict[str, Any]:
    """Keyword arguments for `sglang.Engine.generate` (one dict per modality, ids pre-expanded)."""
    params = request.sampling
    sampling: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "ignore_eos": params.ignore_eos,
        "no_stop_trim": params.no_stop_trim,
        "skip_special_tokens": params.skip_special_tokens,
        "spaces_between_special_tokens": params.spaces_between_special_tokens,
    }
    for name, neutral in (
        ("min_p", 0.0),
        ("repetition_penalty", 1.0),
        ("presence_penalty", 0.0),
        ("frequency_penalty", 0.0),
        ("min_new_tokens", 0),
    ):
        if getattr(params, name) != neutral:
            sampling[name] = getattr(params, name)
    if params.logit_bias:
        sampling["logit_bias"] = {str(token): bias for token, bias in params.logit_bias}
    if params.return_top_p_token_ids:  # honoured by slime's patched SGLang (meta_info.top_p_token_ids / _offsets)
        sampling["custom_params"] = {"return_top_p_token_ids": True}
    if params.stop:
        sampling["stop"] = list(params.stop)
    if params.stop_token_ids:
        sampling["stop_token_ids"] = list(params.stop_token_ids)
    if params.sampling_seed is not None:
        sampling["sampling_seed"] = params.sampling_seed
    if params.grammar is not None:
        grammar_key, source = params.grammar
        sampling[grammar_key] = source
    kwargs: dict[str, Any] = {
        "input_ids": list(request.input_ids),
        "sampling_params": sampling,
        "return_logprob": request.return_logprob,
        "rid": request.rid or uuid.uuid4().hex,
    }
    if request.return_logprob:
        kwargs["logprob_start_len"] = request.logprob_start_len
        if request.top_logprobs_num:
            kwargs["top_logprobs_num"] = request.top_logprobs_num
    if request.return_routed_experts:
        kwargs["return_routed_experts"] = True
    for kind, field in (("image", "image_data"), ("video", "video_data")):
        items = [m for m in request.media if m.kind == kind]
        if items:
            kwargs[field] = [_visual(items, kind)]
    audio = [m for m in request.media if m.kind == "audio"]
    if audio:
        kwargs["audio_data"] = [_audio(audio)]
    return kwargs


def result_from(output: dict[str, Any], request: GenerateRequest) -> GenerateResult:
    meta = output["meta_info"]
    triples = meta.get("output_token_logprobs") or []
    inputs = meta.get("input_token_logprobs")
    input_top = meta.get("input_top_logprobs")
    output_top = meta.get("output_top_logprobs")
    start = request.logprob_start_len if request.logprob_start_len >= 0 else len(request.input_ids) - 1
    return GenerateResult(
        rid=meta.get("id", request.rid),
        output_ids=list(output["output_ids"]),
        output_logprobs=[float(t[0]) for t in triples],
        finish_reason=meta["finish_reason"],
        prompt_tokens=int(meta["prompt_tokens"]),
        weight_version=str(meta.get("weight_version")),
        text=output.get("text", ""),
        routed_experts=meta.get("routed_experts"),
        input_logprobs=[None if t[0] is None else float(t[0]) for t in inputs] if inputs is not None else None,
        input_logprob_start=start,
        input_top_logprobs=[_tops(p) for p in input_top] if input_top is not None else None,
        output_top_logprobs=[_tops(p) or [] for p in output_top] if output_top is not None else None,
        num_retractions=int(meta.get("num_retractions") or 0),
        top_p_token_ids=meta.get("top_p_token_ids") if request.sampling.return_top_p_token_ids else None,
        top_p_token_offsets=meta.get("top_p_token_offsets") if request.sampling.return_top_p_token_ids else None,
    )


def _tops(position: Any) -> list[tuple[float, int]] | None:
    return None if position is None else [(float(t[0]), int(t[1])) for t in position]


class SGLangEngine:
    """`sglang.Engine` behind the engine protocol (``pip install 'weir[sglang]'``, a CUDA GPU)."""

    def __init__(self, model_dir: str | Path, *, engine: Any = None, **engine_args: Any) -> None:
        """Start ``sglang.Engine(model_path=model_dir, **engine_args)``, or wrap ``engine``, one already started."""
        self.model_dir = Path(model_dir)
        self.limits = ModelLimits.read(self.model_dir)
        if engine is None:
            import sglang  # the GPU extra; imported here so the CPU install never needs it

            engine = sglang.Engine(model_path=str(model_dir), **engine_args)
        self.engine = engine
        self.weight_version = "0"
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._inflight = 0
        self._busy = 0.0  # closed busy intervals; the open one is added on read
        self._busy_since = 0.0
        self._paused = False

    @property
    def busy_s(self) -> float:
        with self._lock:
            return self._busy + (time.monotonic() - self._busy_since if self._inflight else 0.0)

    @property
    def running(self) -> int:
        return self._inflight

    @property
    def paused(self) -> bool:
        return self._paused

    def submit(self, request: GenerateRequest, on_token: TokenCallback | None = None) -> Future[GenerateResult]:
        self.limits.check(request)
        future: Future[GenerateResult] = Future()
        future.set_running_or_notify_cancel()  # a caller's cancel must not break the engine's set_result

        def run() -> None:
            self._enter()
            try:
                future.set_result(self._generate_now(request))
            except Exception as error:  # noqa: BLE001 - handed to the caller through the future
                future.set_exception(error)
            finally:
                self._leave()

        threading.Thread(target=run, daemon=True).start()
        return future

    def generate(self, request: GenerateRequest, timeout: float | None = None) -> GenerateResult:
        return self.submit(request).result(timeout)

    def _generate_now(self, request: GenerateRequest) -> GenerateResult:
        try:
            output = self.engine.generate(**build_request(request))
        except ValueError as error:  # SGLang's own input checks (length, vocabulary, media)
            raise InvalidPrompt(str(error)) from error
        return result_from(output, request)

    def _enter(self) -> None:
        with self._lock:
            if self._inflight == 0:
                self._busy_since = time.monotonic()
            self._inflight += 1

    def _leave(self) -> None:
        with self._lock:
            self._inflight -= 1
            if self._inflight == 0:
                self._busy += time.monotonic() - self._busy_since

    def update_weights(self, path: str, version: str | None = None) -> str:
        ok, message = self.engine.update_weights_from_disk(model_path=path, weight_version=version)
        if not ok:
            raise WeightsError(message, code="weights_rejected")
        self.weight_version = version or self.weight_version
        return self.weight_version

    def _weights_call(self, method: str, **kwargs: Any) -> None:
        """SGLang's Engine method of that name, given the keyword arguments its version takes (older
        ones lack ``weight_version``); its ``(success, message)`` refusal is `WeightsError`."""
        call = getattr(self.engine, method, None)
        if call is None:
            raise WeightsError(f"this SGLang's Engine has no {method}", code="weights_rejected")
        try:
            accepted = inspect.signature(call).parameters
            kwargs = {k: v for k, v in kwargs.items() if k in accepted or k in ("names", "dtypes", "shapes")}
        except (TypeError, ValueError):
            pass
        outcome = call(**kwargs)
        ok, message = outcome if isinstance(outcome, tuple) else (True, "")
        if not ok:
            raise WeightsError(str(message), code="weights_rejected")

    def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        self._weights_call(
            "init_weights_update_group",
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )

    def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], *, group_name: str, version: str | None
    ) -> str:
        self._weights_call(
            "update_weights_from_distributed",
            names=names,
            dtypes=dtypes,
            shapes=shapes,
            group_name=group_name,
            weight_version=version,
        )
        self.weight_version = version or self.weight_version
        return self.weight_version

    def destroy_weights_update_group(self, group_name: str) -> None:
        self._weights_call("destroy_weights_update_group", group_name=group_name)

    def pause(self, mode: PauseMode = "in_place") -> None:
        try:
            takes_mode = "mode" in inspect.signature(self.engine.pause_generation).parameters
        except (TypeError, ValueError):
            takes_mode = False
        if takes_mode:
            self.engine.pause_generation(mode=mode)
        else:  # an SGLang without pause modes: abort what runs ourselves, then pause
            if mode == "abort":
                self.abort_all()
            self.engine.pause_generation()
        self._paused = True

    def flush_cache(self) -> bool:
        flush = getattr(self.engine, "flush_cache", None)
        if flush is None:
            return True
        outcome = flush()
        return bool(getattr(outcome, "success", outcome if isinstance(outcome, bool) else True))

    def resume(self) -> None:
        self.engine.continue_generation()
        self._paused = False

    def abort(self, rid: str) -> bool:
        self.engine.abort_request(rid)
        return True

    def abort_all(self) -> None:
        self.engine.abort_request(abort_all=True)

    def healthy(self) -> bool:
        return True

    def close(self) -> None:
        self.engine.shutdown()
