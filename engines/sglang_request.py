"""SGLang's request and answer shapes for the in-process Engine: `build_request` maps a `GenerateRequest` to
the keyword arguments of ``Engine.async_generate`` (``GenerateReqInput``'s fields), `result_from` reads its answer
back into a `GenerateResult`, `token_step` reads one streamed token. Pure functions, tested on CPU and checked
against SGLang's own classes by ``make sglang-check``.

Multimodal inputs go in process, per modality **one** dict per request: ``{"format": "processor_output", ...}``
with the Hugging Face processor keys (Weir's features are exactly those tensors), or ``{"format":
"precomputed_embedding", "feature": ...}`` with the encoder role's embeddings plus the grids (or the clips'
``audio_feature_lens``), with ``input_ids`` whose placeholders are already expanded. Every `SamplingParams` field
goes under SGLang's own name (penalties, ``min_p``, ``logit_bias`` with string keys, the detokenizer options, the
grammar of ``json_schema`` / ``regex`` / ``ebnf`` as given), and so do ``logprob_start_len`` / ``top_logprobs_num``.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

import preprocess as pp

from .protocol import GenerateRequest, GenerateResult, MediaInput, TokenStep

__all__ = ["build_request", "output_logprob", "result_from", "token_step"]


def _visual(items: list[MediaInput], kind: str) -> dict[str, Any]:
    grids = torch.tensor([m.grid_thw for m in items], dtype=torch.long)
    prefix = "image" if kind == "image" else "video"
    out: dict[str, Any]
    if all(m.embedding is not None for m in items):
        # SGLang takes a precomputed embedding from "feature"; the other keys become the item's model data
        out = {"format": "precomputed_embedding", "feature": torch.cat([m.embedding for m in items])}  # type: ignore[misc]
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
            "feature": torch.cat([m.embedding for m in items]),  # type: ignore[misc]
            "audio_feature_lens": torch.tensor(lengths),  # mel frames per clip, SGLang's name (Omni positions)
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
        input_logprob_start=_logprob_start(request),
        input_top_logprobs=[_tops(p) for p in input_top] if input_top is not None else None,
        output_top_logprobs=[_tops(p) or [] for p in output_top] if output_top is not None else None,
        num_retractions=int(meta.get("num_retractions") or 0),
        top_p_token_ids=meta.get("top_p_token_ids") if request.sampling.return_top_p_token_ids else None,
        top_p_token_offsets=meta.get("top_p_token_offsets") if request.sampling.return_top_p_token_ids else None,
    )


def _tops(position: Any) -> list[tuple[float, int]] | None:
    return None if position is None else [(float(t[0]), int(t[1])) for t in position]


def output_logprob(meta: Mapping[str, Any], position: int) -> float:
    triples = meta.get("output_token_logprobs") or ()
    return float(triples[position][0]) if position < len(triples) else math.nan


def token_step(
    meta: Mapping[str, Any], request: GenerateRequest, position: int, token: int, logprob: float
) -> TokenStep:
    tops = meta.get("output_top_logprobs")
    top = _tops(tops[position]) if tops is not None and position < len(tops) else None
    if position:
        return TokenStep(token_id=token, logprob=logprob, top=top)
    inputs = meta.get("input_token_logprobs")
    input_top = meta.get("input_top_logprobs")
    return TokenStep(
        token_id=token,
        logprob=logprob,
        top=top,
        input_logprobs=[None if t[0] is None else float(t[0]) for t in inputs] if inputs is not None else None,
        input_logprob_start=_logprob_start(request),
        input_top_logprobs=[_tops(p) for p in input_top] if input_top is not None else None,
    )


def _logprob_start(request: GenerateRequest) -> int:
    return request.logprob_start_len if request.logprob_start_len >= 0 else len(request.input_ids) - 1
