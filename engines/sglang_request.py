"""SGLang's request and answer shapes for the in-process Engine: `build_request` maps a `GenerateRequest` to
the keyword arguments of ``Engine.async_generate`` (``GenerateReqInput``'s fields), `result_from` reads its answer
back into a `GenerateResult`, `token_step` reads one streamed token. Pure functions, tested on CPU and checked
against SGLang's own classes by ``make sglang-check``.

Multimodal inputs go in process, per modality **one** dict per request: ``{"format": "processor_output", ...}``
with the Hugging Face processor keys (Weir's features are exactly those tensors), or with the encoder role's
embeddings under ``precomputed_embeddings`` and the ``modality`` named, plus the grids (or the clips'
``audio_feature_lens``), with ``input_ids`` whose placeholders are already expanded (`_embedded` says why not
SGLang's ``precomputed_embedding`` format). Every `SamplingParams` field
goes under SGLang's own name (penalties, ``min_p``, ``logit_bias`` with string keys, the detokenizer options, the
grammar of ``json_schema`` / ``regex`` / ``ebnf`` as given), and so do ``logprob_start_len`` / ``top_logprobs_num``.

Not served: a video laid out with its own audio track (an Omni prompt's ``vision_bos, audio_bos, <video>…``,
``use_audio_in_video`` in the processors' words). sglang 0.5.23's Qwen-Omni processor computes the 3-D positions
with ``use_audio_in_video=False`` whatever the request says (``multimodal/processors/qwen_vl.py``), so it would lay
the track out as an audio item of its own, at other positions than the ones the trainer computes: `refuse_video_tracks`
refuses such a prompt by name instead (`ModelLayout` reads the layout from the model's config).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Any, Literal, NotRequired, TypedDict

import numpy as np
import torch

import preprocess as pp

from .errors import InvalidEnginePrompt
from .protocol import FinishReason, GenerateRequest, GenerateResult, MediaInput, TokenStep
from .sampling import SGLangSampling  # the same JSON whoever writes it

__all__ = [
    "GenerateKwargs",
    "ModelLayout",
    "MediaData",
    "SGLangMeta",
    "SGLangOutput",
    "SGLangSampling",
    "build_request",
    "output_logprob",
    "refuse_video_tracks",
    "result_from",
    "token_step",
]


class MediaData(TypedDict, total=False):
    """One modality's item of ``image_data`` / ``video_data`` / ``audio_data``: SGLang's processor output
    (the Hugging Face processor keys, or the encoder stage's embedding in ``precomputed_embeddings``) with the
    grids / clip lengths."""

    format: Literal["processor_output"]
    modality: Literal["image", "video", "audio"]
    precomputed_embeddings: torch.Tensor
    pixel_values: torch.Tensor
    pixel_values_videos: torch.Tensor
    image_grid_thw: torch.Tensor
    video_grid_thw: torch.Tensor
    second_per_grid_ts: torch.Tensor
    audio_feature_lens: torch.Tensor
    input_features: torch.Tensor
    feature_attention_mask: torch.Tensor


class GenerateKwargs(TypedDict):
    """The keyword arguments of ``Engine.async_generate`` (``GenerateReqInput``'s fields) Weir sends."""

    input_ids: list[int]
    sampling_params: SGLangSampling
    return_logprob: bool
    rid: str
    logprob_start_len: NotRequired[int]
    top_logprobs_num: NotRequired[int]
    return_routed_experts: NotRequired[bool]
    image_data: NotRequired[list[MediaData]]
    video_data: NotRequired[list[MediaData]]
    audio_data: NotRequired[list[MediaData]]


class SGLangMeta(TypedDict, total=False):
    """The ``meta_info`` of SGLang's answer, the keys Weir reads. Log-prob entries are ``[logprob, token_id,
    text]``; top log-probs are lists of them per position (None where SGLang pads)."""

    id: str
    finish_reason: FinishReason  # as `GenerateResult.finish_reason` takes it
    prompt_tokens: int
    weight_version: str
    num_retractions: int
    routed_experts: str | None
    output_token_logprobs: list[list[Any]] | None
    input_token_logprobs: list[list[Any]] | None
    output_top_logprobs: list[list[list[Any]] | None] | None
    input_top_logprobs: list[list[list[Any]] | None] | None
    top_p_token_ids: list[int] | None
    top_p_token_offsets: list[int] | None


class SGLangOutput(TypedDict, total=False):
    """One answer (or streamed chunk) of ``Engine.async_generate``."""

    text: str
    output_ids: list[int]
    meta_info: SGLangMeta


def _embedded(kind: Literal["image", "video", "audio"], items: list[MediaInput]) -> MediaData:
    """The encoder stage's embeddings of one modality, as sglang 0.5.23 serves them to its Qwen models: a
    ``processor_output`` dict whose ``precomputed_embeddings`` its scheduler splices in without running the
    tower, the ``modality`` named (that key alone would be filed as an image). Its ``precomputed_embedding``
    format is not that: it keeps the tensor as the item's ``feature``, which the Qwen-VL models then feed to
    their vision tower as pixels (the real engine crashed so, `tests/engines/test_sglang_real.py`)."""
    embeddings = torch.cat([m.embedding for m in items])  # type: ignore[misc]
    return {"format": "processor_output", "modality": kind, "precomputed_embeddings": embeddings}


def _visual(items: list[MediaInput], kind: Literal["image", "video"], timestamped: bool) -> MediaData:
    grids = torch.tensor([m.grid_thw for m in items], dtype=torch.long)
    out: MediaData
    if all(m.embedding is not None for m in items):
        out = _embedded(kind, items)
    else:
        pixels = torch.from_numpy(np.concatenate([m.features.pixel_values for m in items]))  # type: ignore[union-attr]
        if kind == "image":
            out = {"format": "processor_output", "pixel_values": pixels}
        else:
            out = {"format": "processor_output", "pixel_values_videos": pixels}
    if kind == "image":
        out["image_grid_thw"] = grids
    else:
        out["video_grid_thw"] = grids
        if not timestamped:  # a timestamped layout's processor has no such output (`ModelLayout`)
            out["second_per_grid_ts"] = torch.tensor([m.second_per_grid_t for m in items])
    return out


def _audio(items: list[MediaInput]) -> MediaData:
    lengths = [int(m.audio_frames or 0) for m in items]
    mask = torch.zeros(len(items), max(lengths), dtype=torch.long)  # mel frames per clip, as the processor's mask
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    if all(m.embedding is not None for m in items):
        out = _embedded("audio", items)
        out["audio_feature_lens"] = torch.tensor(lengths)  # mel frames per clip, SGLang's name (Omni positions)
        out["feature_attention_mask"] = mask  # where SGLang's Qwen3-Omni processor reads them (it failed without)
        return out
    features = [m.features for m in items]
    assert all(isinstance(f, pp.AudioFeatures) for f in features)
    batch = torch.zeros(len(items), features[0].input_features.shape[0], max(lengths))  # type: ignore[union-attr]
    for i, (f, n) in enumerate(zip(features, lengths, strict=True)):
        batch[i, :, :n] = torch.from_numpy(np.array(f.input_features))  # type: ignore[union-attr]
    # The Qwen2.5-Omni processor's padded layout: (n, mel, L_max) with a feature attention mask.
    return {"format": "processor_output", "input_features": batch, "feature_attention_mask": mask}


_OMNI_THINKERS = ("qwen2_5_omni_thinker", "qwen3_omni_moe_thinker")


def refuse_video_tracks(input_ids: list[int], marker: tuple[int, int, int] | None) -> None:
    """`InvalidEnginePrompt` when ``input_ids`` hold a video laid out with its own audio track (``marker``: a
    `ModelLayout`'s ``video_tracks``), which this SGLang would lay out at other positions (the module's
    docstring)."""
    if marker is None:
        return
    bos, audio_bos, video = marker
    for i in range(2, len(input_ids)):
        if input_ids[i] == video and input_ids[i - 2] == bos and input_ids[i - 1] == audio_bos:
            raise InvalidEnginePrompt(
                "a video with its own audio track (use_audio_in_video) is not served on SGLang 0.5.23: its Qwen-Omni "
                "processor lays the track out as an audio item of its own, at other positions than the trainer's; "
                "send the clip's audio as a separate item, or serve this model on the transformers backend",
                field="use_audio_in_video",
            )


_TIMESTAMPED = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")


_STRUCTURAL = (
    *("image_token_id", "image_token_index", "video_token_id", "video_token_index"),
    *("audio_token_id", "audio_token_index", "vision_start_token_id", "vision_end_token_id"),
    *("audio_start_token_id", "audio_end_token_id"),
)


@dataclass(frozen=True, slots=True)
class ModelLayout:
    """What the requests for one model must know of it, read once from its ``config.json`` (`ModelLayout.of`):

    - ``video_tracks``: ``(vision_bos, audio_bos, video placeholder)`` of an Omni model, with which a video sent
      with its own track starts (`refuse_video_tracks`); None for the models with no such layout;
    - ``timestamped_video``: a video laid out frame by frame after a text timestamp (Qwen3-VL and its
      successors): their processor outputs no ``second_per_grid_ts``, and SGLang, which repeats the video grid
      per frame for these models but not that list, fails on a video sent with it (a multi-frame clip: an
      ``IndexError`` in its rope index, found on the real engine);
    - ``structural_tokens``: the placeholders and media bos / eos, never generated (as on the transformers
      backend): one in a response is read as a media slot when the trainer recomputes the sequence, and the
      model refuses that forward (the real engine sampled an image placeholder from a tiny Qwen3-VL)."""

    video_tracks: tuple[int, int, int] | None = None
    timestamped_video: bool = False
    structural_tokens: tuple[int, ...] = ()

    @classmethod
    def of(cls, config: dict[str, Any]) -> ModelLayout:
        """From a model's ``config.json``: the thinker's, or a whole Omni model's with its ``thinker_config``."""
        thinker = config.get("thinker_config") or config
        tracks = None
        if thinker.get("model_type") in _OMNI_THINKERS:
            video = thinker["video_token_id"] if "video_token_id" in thinker else thinker["video_token_index"]
            tracks = int(thinker["vision_start_token_id"]), int(thinker["audio_start_token_id"]), int(video)
        text_type = (config.get("text_config") or {}).get("model_type")
        found = {thinker.get(name) for name in _STRUCTURAL} | {config.get(name) for name in _STRUCTURAL}
        return cls(
            video_tracks=tracks,
            timestamped_video=config.get("model_type") in _TIMESTAMPED or text_type in _TIMESTAMPED,
            structural_tokens=tuple(sorted(t for t in found if isinstance(t, int) and not isinstance(t, bool))),
        )


def build_request(request: GenerateRequest, layout: ModelLayout = ModelLayout()) -> GenerateKwargs:
    """Keyword arguments for `sglang.Engine.generate` (one dict per modality, ids pre-expanded), for a model of
    ``layout``: its video layout, and its structural tokens never sampled, by a ``logit_bias`` of -inf over the
    request's own. SGLang reports log-probs after its bias, so there the other tokens' log-probs leave those
    tokens' mass out (the transformers backend reports it; a trained model puts next to none on them)."""
    params = request.sampling
    sampling: SGLangSampling = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "ignore_eos": params.ignore_eos,
        "no_stop_trim": params.no_stop_trim,
        "skip_special_tokens": params.skip_special_tokens,
        "spaces_between_special_tokens": params.spaces_between_special_tokens,
    }
    # only those off their neutral value, in this order
    if params.min_p != 0.0:
        sampling["min_p"] = params.min_p
    if params.repetition_penalty != 1.0:
        sampling["repetition_penalty"] = params.repetition_penalty
    if params.presence_penalty != 0.0:
        sampling["presence_penalty"] = params.presence_penalty
    if params.frequency_penalty != 0.0:
        sampling["frequency_penalty"] = params.frequency_penalty
    if params.min_new_tokens != 0:
        sampling["min_new_tokens"] = params.min_new_tokens
    if params.logit_bias or layout.structural_tokens:
        bias = {str(token): bias for token, bias in params.logit_bias}
        sampling["logit_bias"] = {**bias, **{str(token): float("-inf") for token in layout.structural_tokens}}
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
        if grammar_key == "json_schema":
            sampling["json_schema"] = source
        elif grammar_key == "regex":
            sampling["regex"] = source
        else:
            sampling["ebnf"] = source
    kwargs: GenerateKwargs = {
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
    images = [m for m in request.media if m.kind == "image"]
    if images:
        kwargs["image_data"] = [_visual(images, "image", layout.timestamped_video)]
    videos = [m for m in request.media if m.kind == "video"]
    if videos:
        kwargs["video_data"] = [_visual(videos, "video", layout.timestamped_video)]
    audio = [m for m in request.media if m.kind == "audio"]
    if audio:
        kwargs["audio_data"] = [_audio(audio)]
    return kwargs


def result_from(output: SGLangOutput, request: GenerateRequest) -> GenerateResult:
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


def output_logprob(meta: SGLangMeta, position: int) -> float:
    triples = meta.get("output_token_logprobs") or ()
    return float(triples[position][0]) if position < len(triples) else math.nan


def token_step(meta: SGLangMeta, request: GenerateRequest, position: int, token: int, logprob: float) -> TokenStep:
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
