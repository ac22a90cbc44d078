"""A video with its own audio track (Qwen-Omni's ``use_audio_in_video``): token layout and 3-D positions.

An Omni processor given ``use_audio_in_video=True`` does not place a video's audio after the video: it
replaces ``<vision_bos><video><vision_eos>`` by ``<vision_bos><audio_bos>`` + the video's and the
track's placeholder tokens interleaved in time + ``<audio_eos><vision_eos>``. Time is counted in mRoPE
positions: video token k of temporal patch t sits at ``t · second_per_grid · position_id_per_seconds``,
audio token j at ``j``. The two families interleave differently:

* Qwen2.5-Omni (`Qwen2_5OmniProcessor`, 25 positions/s): both streams are cut into chunks of
  ``int(25 · seconds_per_chunk)`` positions (2 s) and laid out chunk by chunk, video chunk first.
* Qwen3-Omni-MoE (`Qwen3OmniMoeProcessor`, 13 positions/s): a token-by-token merge — the next video
  token goes first while its time is ``<=`` the next audio token's.

`audio_in_video_layout` gives that order as runs, `audio_in_video_ids` the ids that replace the
video placeholder (between its vision_bos and vision_eos), and `omni_positions` the (3, L) positions
of a whole prompt, equal to the model class's ``get_rope_index`` (transformers 5.19) — per item, so one
prompt may hold a video with its audio and one without, which ``get_rope_index`` (one flag per call)
cannot. This module builds no features: the track's features are an ordinary audio item
(`pipeline.process_bytes(data, "audio", ...)` on the video's bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from .errors import MediaError

__all__ = [
    "OmniFamily",
    "OmniItem",
    "OmniTokens",
    "audio_in_video_ids",
    "audio_in_video_layout",
    "omni_positions",
]

OmniFamily = Literal["qwen2_5", "qwen3_omni"]


def _chunked_index(indices: Sequence[float] | np.ndarray, per_chunk: int) -> list[tuple[int, int]]:
    """Processor's ``get_chunked_index``: the chunk counter moves on by one per crossing token, so a
    jump over several chunk boundaries still opens only one new chunk (kept as it is)."""
    out, start, chunk = [], 0, 1
    for i, value in enumerate(indices):
        if value >= chunk * per_chunk:
            out.append((start, i))
            start, chunk = i, chunk + 1
    out.append((start, len(indices)))
    return out


def _runs(kinds: list[str]) -> list[tuple[str, int]]:
    runs: list[tuple[str, int]] = []
    for kind in kinds:
        if runs and runs[-1][0] == kind:
            runs[-1] = (kind, runs[-1][1] + 1)
        else:
            runs.append((kind, 1))
    return runs


def audio_in_video_layout(
    *,
    grid_thw: Sequence[int],
    merge_size: int,
    second_per_grid: float,
    audio_tokens: int,
    position_id_per_seconds: float,
    family: OmniFamily,
    seconds_per_chunk: float = 2.0,
) -> list[tuple[str, int]]:
    """The interleaved order of a video's and its track's tokens as ``("video" | "audio", count)`` runs,
    as the family's processor computes it (its float64 numpy arithmetic)."""
    grid_t, grid_h, grid_w = (int(v) for v in grid_thw)
    per_t = (grid_h // merge_size) * (grid_w // merge_size)
    video = np.repeat(np.arange(grid_t), per_t) * second_per_grid * position_id_per_seconds
    audio = np.arange(audio_tokens)
    if family == "qwen2_5":
        per_chunk = int(position_id_per_seconds * seconds_per_chunk)
        video_chunks, audio_chunks = _chunked_index(video, per_chunk), _chunked_index(audio, per_chunk)
        kinds: list[str] = []
        for j in range(max(len(video_chunks), len(audio_chunks))):
            if j < len(video_chunks):
                kinds += ["video"] * (video_chunks[j][1] - video_chunks[j][0])
            if j < len(audio_chunks):
                kinds += ["audio"] * (audio_chunks[j][1] - audio_chunks[j][0])
        return [run for run in _runs(kinds) if run[1]]
    v = a = 0
    kinds = []
    while v < len(video) and a < len(audio):
        if video[v] <= audio[a]:
            kinds.append("video")
            v += 1
        else:
            kinds.append("audio")
            a += 1
    kinds += ["video"] * (len(video) - v) + ["audio"] * (len(audio) - a)
    return _runs(kinds)


@dataclass(frozen=True, slots=True, kw_only=True)
class OmniTokens:
    """The placeholder and delimiter token ids of an Omni tokenizer."""

    image: int
    video: int
    audio: int
    vision_bos: int
    vision_eos: int
    audio_bos: int
    audio_eos: int


def audio_in_video_ids(layout: Sequence[tuple[str, int]], tokens: OmniTokens) -> list[int]:
    """What replaces a video-with-audio's one placeholder: ``audio_bos``, the interleaved placeholders,
    ``audio_eos`` (the chat template already wrote the vision_bos / vision_eos around it)."""
    ids = [tokens.audio_bos]
    for kind, count in layout:
        ids += [tokens.video if kind == "video" else tokens.audio] * count
    return ids + [tokens.audio_eos]


@dataclass(frozen=True, slots=True, kw_only=True)
class OmniItem:
    """One media item of an Omni prompt, in prompt order, as `omni_positions` needs it.

    ``audio_tokens``: an audio item's tokens, or a video's own track's (``with_audio``).
    ``second_per_grid``: a video's seconds per temporal patch, as given to the model.
    """

    kind: Literal["image", "video", "audio"]
    grid_thw: tuple[int, int, int] = (0, 0, 0)
    second_per_grid: float = 0.0
    audio_tokens: int = 0
    with_audio: bool = False


def _vision(start: torch.Tensor, t_index: torch.Tensor, grid_thw: tuple[int, int, int], merge: int) -> torch.Tensor:
    """``get_llm_pos_ids_for_vision``: (t, h, w) per token, + start."""
    gh, gw = grid_thw[1] // merge, grid_thw[2] // merge
    h = torch.arange(gh).view(1, -1, 1).expand(len(t_index), -1, gw).flatten()
    w = torch.arange(gw).view(1, 1, -1).expand(len(t_index), gh, -1).flatten()
    t = t_index.view(-1, 1).expand(-1, gh * gw).flatten()
    return torch.stack([t, h.to(t.dtype), w.to(t.dtype)]) + start


def omni_positions(
    ids: Sequence[int],
    items: Sequence[OmniItem],
    tokens: OmniTokens,
    *,
    family: OmniFamily,
    merge_size: int,
    position_id_per_seconds: float,
    seconds_per_chunk: float = 2.0,
) -> tuple[torch.Tensor, int | float]:
    """(3, L) mRoPE positions of one Omni prompt and its delta (max + 1 − L), as the model class's
    ``get_rope_index`` computes them — Qwen2.5-Omni int64, Qwen3-Omni-MoE float32 (a video's time
    positions are fractional there, and every position after one may be too).

    ``items`` are the prompt's media in order; each must sit in ``ids`` as its processor lays it out
    (bos, placeholders, eos; a video with its audio: vision_bos, audio_bos, the interleaved
    placeholders, audio_eos, vision_eos).
    """
    qwen3 = family == "qwen3_omni"
    dtype = torch.float32 if qwen3 else torch.int64
    ids = list(ids)
    pieces: list[torch.Tensor] = []

    def after_last() -> torch.Tensor:
        # What the reference does everywhere: one past the max of the *last piece* it appended.
        return pieces[-1].max() + 1 if pieces else torch.zeros((), dtype=dtype)

    def arange(n: int, start: torch.Tensor) -> torch.Tensor:
        return (torch.arange(n).view(1, -1).expand(3, -1) + start).to(dtype)

    st = 0
    for number, item in enumerate(items):
        body = {"image": tokens.image, "audio": tokens.audio}.get(item.kind, tokens.video)
        try:
            first = ids.index(body, st)
        except ValueError:
            raise MediaError(
                f"media item {number} ({item.kind}) has no placeholder in the prompt", code="placeholder_mismatch"
            ) from None
        bos_len = 2 if item.with_audio else 1
        text_len = first - st - bos_len
        if text_len < 0:
            raise MediaError(
                f"media item {number} ({item.kind}) is not preceded by its bos tokens", code="placeholder_mismatch"
            )
        st_idx = after_last()
        if text_len:
            pieces.append(arange(text_len, st_idx))
            st_idx = st_idx + text_len if qwen3 else after_last()
        if qwen3:
            pieces.append(arange(bos_len, st_idx))
            st_idx = st_idx + bos_len
        else:  # Qwen2.5-Omni gives vision_bos and audio_bos one position
            pieces += [arange(1, st_idx)] * bos_len
            st_idx = after_last()
        grid = tuple(int(v) for v in item.grid_thw)
        merge2 = merge_size * merge_size
        if item.kind == "audio":
            pieces.append(arange(item.audio_tokens, st_idx))
            length = item.audio_tokens
        elif item.kind == "image":
            t_index = (torch.arange(grid[0]) * 1 * position_id_per_seconds).to(dtype)
            pieces.append(_vision(st_idx, t_index, grid, merge_size))  # type: ignore[arg-type]
            length = grid[0] * grid[1] * grid[2] // merge2
        else:
            spg = torch.tensor(item.second_per_grid, dtype=torch.float32)
            t_index = (torch.arange(grid[0]) * spg * position_id_per_seconds).to(dtype)
            video = _vision(st_idx, t_index, grid, merge_size)  # type: ignore[arg-type]
            length = grid[0] * grid[1] * grid[2] // merge2
            if not item.with_audio:
                pieces.append(video)
            else:
                audio = arange(item.audio_tokens, st_idx)
                length += item.audio_tokens
                pieces += _interleave(video, audio, st_idx, qwen3, int(position_id_per_seconds * seconds_per_chunk))
        st += text_len + bos_len + length + bos_len
        st_idx = after_last()
        if qwen3:
            pieces.append(arange(bos_len, st_idx))
        else:
            pieces += [arange(1, st_idx)] * bos_len
    if st < len(ids):
        pieces.append(arange(len(ids) - st, after_last()))
    positions = torch.cat(pieces, dim=1) if pieces else torch.zeros((3, 0), dtype=dtype)
    if positions.shape[1] != len(ids):
        raise MediaError(
            f"the prompt's media layout gives {positions.shape[1]} positions for {len(ids)} tokens",
            code="placeholder_mismatch",
        )
    top = positions.max().item() if len(ids) else -1
    return positions, top + 1 - len(ids)


def _interleave(
    video: torch.Tensor, audio: torch.Tensor, st_idx: torch.Tensor, qwen3: bool, per_chunk: int
) -> list[torch.Tensor]:
    """The positions of a video-with-audio block in the model's order (see the module docstring)."""
    pieces: list[torch.Tensor] = []
    if not qwen3:
        video_chunks = _chunked_index((video[0] - st_idx).tolist(), per_chunk)
        audio_chunks = _chunked_index((audio[0] - st_idx).tolist(), per_chunk)
        for j in range(max(len(video_chunks), len(audio_chunks))):
            if j < len(video_chunks):
                pieces.append(video[:, video_chunks[j][0] : video_chunks[j][1]])
            if j < len(audio_chunks):
                pieces.append(audio[:, audio_chunks[j][0] : audio_chunks[j][1]])
        return pieces
    v = a = 0
    while v < video.shape[1] and a < audio.shape[1]:
        if video[0][v] <= audio[0][a]:
            pieces.append(video[:, v : v + 1])
            v += 1
        else:
            pieces.append(audio[:, a : a + 1])
            a += 1
    if v < video.shape[1]:
        pieces.append(video[:, v:])
    if a < audio.shape[1]:
        pieces.append(audio[:, a:])
    return pieces
