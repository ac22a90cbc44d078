"""Planning: the exact token cost of an item under a spec and a budget, from its header alone.

`plan_header` is pure arithmetic over a `MediaHeader`; `plan_media` reads the header first.
A `MediaPlan` is also the recipe the decoders follow, so what is produced is what was planned.
The cache key is derived from the plan, so a hit needs no decode at all.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from .budget import TokenBudget
from .errors import BudgetExceededError, CorruptMediaError, MediaError
from .grid import (
    audio_samples_for_tokens,
    audio_samples_for_tokens_qwen3_omni,
    audio_token_count,
    frame_indices,
    qwen3_vl_video_geometry,
    smart_nframes,
    smart_resize,
    smart_resize_qwen_vl_utils,
    video_frame_max_pixels,
)
from .probe import MediaHeader, MediaKind, detect_kind, probe, resampled_length
from .source import MediaSource, read_source
from .spec import ProcessorSpec

__all__ = ["MediaPlan", "plan_header", "plan_media", "plan_sample"]


@dataclass(frozen=True, slots=True, kw_only=True)
class MediaPlan:
    """Token cost and geometry of one item, before and after the budget."""

    kind: MediaKind
    header: MediaHeader
    num_tokens: int
    tokens_unbudgeted: int
    grid_thw: tuple[int, int, int] | None = None
    resized_size: tuple[int, int] | None = None  # (height, width)
    frame_indices: tuple[int, ...] = ()
    sample_fps: float = 0.0
    second_per_grid_t: float = 0.0
    num_samples: int = 0  # audio samples at the spec's rate, after any truncation
    num_frames: int = 0  # audio mel frames L
    truncated: bool = False
    shrunk: bool = False
    # A video taken with its own audio track (Omni ``use_audio_in_video``): that track's plan. Not part of
    # the video's signature (the track's features are their own item, cached under their own key).
    audio: MediaPlan | None = None

    @property
    def exact(self) -> bool:
        return self.header.exact

    def signature(self) -> str:
        """What the budget decided, as a stable string (part of the cache key)."""
        return json.dumps(
            [self.kind, self.grid_thw, self.resized_size, self.frame_indices, self.num_samples],
            separators=(",", ":"),
        )

    def cache_key(self, digest: str, spec: ProcessorSpec) -> str:
        text = f"{digest}|{spec.fingerprint}|{self.signature()}"
        return hashlib.sha256(text.encode()).hexdigest()[:40]

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"type": self.kind, "num_tokens": self.num_tokens}
        out["tokens_unbudgeted"] = self.tokens_unbudgeted
        out["exact"] = self.exact
        if self.grid_thw is not None:
            out["grid_thw"] = list(self.grid_thw)
            out["resized_size"] = list(self.resized_size or ())
            out["source_size"] = [self.header.height, self.header.width]
        if self.kind == "video":
            out["frame_indices"] = list(self.frame_indices)
            out["second_per_grid_t"] = self.second_per_grid_t
        if self.kind == "audio":
            out["num_frames"] = self.num_frames
            out["num_samples"] = self.num_samples
            out["truncated"] = self.truncated
        if self.shrunk:
            out["shrunk"] = True
        if self.audio is not None:
            out["audio"] = self.audio.to_dict()
        return out


def _over(kind: str, tokens: int, limit: int) -> BudgetExceededError:
    return BudgetExceededError(f"{kind} costs {tokens} tokens, over its budget of {limit}")


def _plan_image(header: MediaHeader, spec: ProcessorSpec, budget: TokenBudget) -> MediaPlan:
    factor, merge2 = spec.factor, spec.merge_size**2

    def geometry(max_pixels: int) -> tuple[int, int, int]:
        h, w = smart_resize(header.height, header.width, factor, spec.min_pixels, max_pixels)
        return h, w, (h // spec.patch_size) * (w // spec.patch_size) // merge2

    h, w, tokens = geometry(spec.max_pixels)
    unbudgeted, limit, shrunk = tokens, budget.max_image_tokens, False
    if limit is not None and tokens > limit:
        if budget.policy == "refuse":
            raise _over("image", tokens, limit)
        # The processor's own max_pixels knob: reproducible with the reference.
        h, w, tokens = geometry(min(spec.max_pixels, limit * factor * factor))
        if tokens > limit:
            raise _over("image", tokens, limit)
        shrunk = True
    grid = (1, h // spec.patch_size, w // spec.patch_size)
    return MediaPlan(
        kind="image",
        header=header,
        num_tokens=tokens,
        tokens_unbudgeted=unbudgeted,
        grid_thw=grid,
        resized_size=(h, w),
        shrunk=shrunk,
    )


def _plan_video(header: MediaHeader, spec: ProcessorSpec, budget: TokenBudget) -> MediaPlan:
    if spec.video_sampler == "transformers":
        return _plan_video_natively(header, spec, budget)
    factor, tps = spec.factor, spec.temporal_patch_size

    def geometry(total_pixels: float, max_frames: int) -> tuple[int, int, int, int]:
        n = smart_nframes(
            header.total_frames,
            header.video_fps,
            fps=spec.video_fps,
            min_frames=spec.video_min_frames,
            max_frames=max_frames,
            frame_factor=tps,
        )
        if n == 0:
            raise MediaError(
                f"the video has {header.total_frames} frames; at least {tps} are needed",
                code="video_too_short",
            )
        cap = video_frame_max_pixels(
            n,
            min_pixels=spec.video_min_pixels,
            max_pixels=spec.video_max_pixels,
            total_pixels=total_pixels,
            frame_factor=tps,
        )
        h, w = smart_resize_qwen_vl_utils(header.height, header.width, factor, spec.video_min_pixels, cap)
        grid_t = -(-n // tps)
        return n, h, w, grid_t * (h // factor) * (w // factor)

    max_frames = min(spec.video_max_frames, header.total_frames)
    n, h, w, tokens = geometry(spec.video_total_pixels, max_frames)
    unbudgeted, limit, shrunk = tokens, budget.max_video_tokens, False
    if limit is not None and tokens > limit:
        if budget.policy == "refuse":
            raise _over("video", tokens, limit)
        # First a smaller total pixel budget (fewer pixels per frame, down to the per-frame
        # floor), then fewer frames: both are qwen-vl-utils knobs (total_pixels, max_frames).
        total = min(spec.video_total_pixels, float(limit * factor * factor))
        n, h, w, tokens = geometry(total, max_frames)
        while tokens > limit and n > tps:
            n, h, w, tokens = geometry(total, n - tps)
        if tokens > limit:
            raise _over("video", tokens, limit)
        shrunk = True
    sample_fps = n / header.total_frames * header.video_fps
    return MediaPlan(
        kind="video",
        header=header,
        num_tokens=tokens,
        tokens_unbudgeted=unbudgeted,
        grid_thw=(-(-n // tps), h // spec.patch_size, w // spec.patch_size),
        resized_size=(h, w),
        frame_indices=tuple(frame_indices(header.total_frames, n)),
        sample_fps=sample_fps,
        second_per_grid_t=tps / sample_fps,
        shrunk=shrunk,
    )


def _plan_video_natively(header: MediaHeader, spec: ProcessorSpec, budget: TokenBudget) -> MediaPlan:
    """transformers' video processor sampling and resizing (`grid.qwen3_vl_video_geometry`). Its one
    size knob is the whole clip's pixel budget: tokens are clip pixels / (temporal patch × factor²), so
    a token budget becomes a smaller ``max_pixels`` (frames are never dropped: the processor's frame
    count depends on the clip's duration alone)."""
    factor, tps = spec.factor, spec.temporal_patch_size

    def geometry(max_pixels: int) -> tuple[list[int], int, int, int]:
        indices, h, w = qwen3_vl_video_geometry(
            header.total_frames,
            header.video_fps,
            header.height,
            header.width,
            fps=spec.video_fps,
            min_frames=spec.video_min_frames,
            max_frames=spec.video_max_frames,
            factor=factor,
            temporal_factor=tps,
            min_pixels=spec.video_clip_min_pixels,
            max_pixels=max_pixels,
        )
        return indices, h, w, -(-len(indices) // tps) * (h // factor) * (w // factor)

    indices, h, w, tokens = geometry(spec.video_clip_max_pixels)
    unbudgeted, limit, shrunk = tokens, budget.max_video_tokens, False
    if limit is not None and tokens > limit:
        if budget.policy == "refuse":
            raise _over("video", tokens, limit)
        cap = min(spec.video_clip_max_pixels, limit * tps * factor * factor)
        while tokens > limit and cap >= spec.video_clip_min_pixels:
            indices, h, w, tokens = geometry(cap)
            cap = int(cap * 0.9)
        if tokens > limit:
            raise _over("video", tokens, limit)
        shrunk = True
    sample_fps = len(indices) / header.total_frames * header.video_fps
    return MediaPlan(
        kind="video",
        header=header,
        num_tokens=tokens,
        tokens_unbudgeted=unbudgeted,
        grid_thw=(-(-len(indices) // tps), h // spec.patch_size, w // spec.patch_size),
        resized_size=(h, w),
        frame_indices=tuple(indices),
        sample_fps=sample_fps,
        second_per_grid_t=tps / sample_fps,
        shrunk=shrunk,
    )


def _audio_tokens(n: int, spec: ProcessorSpec) -> tuple[int, int]:
    return audio_token_count(n, family=spec.audio_family, hop_length=spec.hop_length, n_window=spec.audio_n_window)


def _plan_audio(header: MediaHeader, spec: ProcessorSpec, budget: TokenBudget) -> MediaPlan:
    n = resampled_length(header.num_samples, header.sample_rate, spec.sampling_rate)
    unbudgeted = _audio_tokens(n, spec)[1]
    truncated = False
    if n > spec.max_audio_samples:
        if budget.policy == "refuse":
            raise BudgetExceededError(
                f"audio is {n / spec.sampling_rate:.2f} s, over the model's maximum of {spec.max_audio_seconds:g} s"
            )
        n, truncated = spec.max_audio_samples, True
    limit = budget.max_audio_tokens
    tokens = _audio_tokens(n, spec)[1]
    if limit is not None and tokens > limit:
        if budget.policy == "refuse":
            raise _over("audio", tokens, limit)
        if spec.audio_family == "qwen3_omni":
            fit = audio_samples_for_tokens_qwen3_omni(limit, spec.hop_length, spec.audio_n_window)
        else:
            fit = audio_samples_for_tokens(limit, spec.hop_length)
        n, truncated = min(n, fit), True
    frames, tokens = _audio_tokens(n, spec)
    # Qwen3-Omni's extractor runs a reflect-padded STFT on the clip itself: it needs n_fft/2 + 1 samples.
    shortest = spec.n_fft // 2 + 1 if spec.audio_family == "qwen3_omni" else 0
    if tokens < 1 or n < shortest:
        least = shortest if spec.audio_family == "qwen3_omni" else 3 * spec.hop_length
        raise MediaError(
            f"the audio is {n} samples long; it gives no token (at least {least} needed)",
            code="audio_too_short",
        )
    return MediaPlan(
        kind="audio",
        header=header,
        num_tokens=tokens,
        tokens_unbudgeted=unbudgeted,
        num_samples=n,
        num_frames=frames,
        truncated=truncated,
        shrunk=truncated and n < spec.max_audio_samples,
    )


def plan_header(header: MediaHeader, spec: ProcessorSpec, budget: TokenBudget | None = None) -> MediaPlan:
    budget = budget or TokenBudget()
    if header.kind == "image":
        return _plan_image(header, spec, budget)
    if header.kind == "video":
        if header.total_frames <= 0:
            raise CorruptMediaError("the video stream has no frames")
        return _plan_video(header, spec, budget)
    return _plan_audio(header, spec, budget)


def plan_media(
    source: MediaSource,
    spec: ProcessorSpec,
    budget: TokenBudget | None = None,
    *,
    kind: MediaKind | None = None,
) -> MediaPlan:
    """Exact token count and grid of one item from its header; nothing is decoded.

    ``kind`` is detected from the bytes when not given (see `detect_kind`).
    """
    budget = budget or TokenBudget()
    data = read_source(source)
    kind = kind or detect_kind(data)
    return plan_header(probe(data, kind, max_decode_pixels=budget.max_decode_pixels), spec, budget)


def plan_sample(headers: list[MediaHeader], spec: ProcessorSpec, budget: TokenBudget | None = None) -> list[MediaPlan]:
    """Plans for the items of one sample, held to ``budget.max_sample_tokens`` together.

    Under ``shrink`` each item gets a share of the sample budget proportional to its own cost,
    then is replanned with that as its item limit.
    """
    budget = budget or TokenBudget()
    plans = [plan_header(h, spec, budget) for h in headers]
    limit = budget.max_sample_tokens
    total = sum(p.num_tokens for p in plans)
    if limit is None or total <= limit:
        return plans
    if budget.policy == "refuse":
        raise BudgetExceededError(f"the sample costs {total} tokens, over its budget of {limit}")
    shrunk = []
    for plan in plans:
        share = max(1, plan.num_tokens * limit // total)
        item_limit = budget.limit_for(plan.kind)
        share = share if item_limit is None else min(share, item_limit)
        shrunk.append(plan_header(plan.header, spec, budget.with_limit(plan.kind, share)))
    total = sum(p.num_tokens for p in shrunk)
    if total > limit:
        raise BudgetExceededError(f"the sample costs {total} tokens even after shrinking, over its budget of {limit}")
    return shrunk
