"""Media placeholders in token ids, expanded to each item's exact token count.

A chat template emits one placeholder token per media item (``<|IMAGE|>``, ``<|VIDEO|>``,
``<|AUDIO|>``); the model expects that token repeated once per feature token. Expanding with the
counts the plan computed — the same counts the features carry — is what keeps prompt ids, features
and model in agreement ("Image features and image tokens do not match" cannot happen).

Qwen3-VL lays a video out differently (``spec.video_timestamps``): its one ``<|video_pad|>`` becomes,
per temporal patch, the text ``<t seconds>`` then ``<|vision_start|>``, that patch's pads and
``<|vision_end|>`` — `timestamped_video_ids` builds those ids, which `expand_placeholders` then puts
in place of the placeholder.

An Omni video taken with its own audio track (``use_audio_in_video``) is laid out by `omni.py`
(`omni.audio_in_video_ids`), whose ids `expand_placeholders` puts in place of the video placeholder.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from .errors import MediaError

__all__ = ["expand_placeholders", "timestamped_video_ids", "video_timestamps"]


def video_timestamps(frame_indices: Sequence[int], video_fps: float, temporal_patch_size: int = 2) -> list[float]:
    """Seconds of each temporal patch, as `Qwen3VLProcessor._calculate_timestamps` (transformers 5.19).

    The indices are padded to the temporal patch with the last one; each patch's time is the mean
    of its first and last frame's ``index / video_fps`` (``video_fps``: the source's frame rate).
    """
    indices = list(frame_indices)
    indices += [indices[-1]] * (-len(indices) % temporal_patch_size)
    seconds = [i / video_fps for i in indices]
    return [
        (seconds[i] + seconds[i + temporal_patch_size - 1]) / 2 for i in range(0, len(seconds), temporal_patch_size)
    ]


def timestamped_video_ids(
    encode: Callable[[str], list[int]],
    *,
    frame_indices: Sequence[int],
    video_fps: float,
    grid_thw: Sequence[int],
    merge_size: int,
    temporal_patch_size: int,
    video_id: int,
    vision_start_id: int,
    vision_end_id: int,
) -> list[int]:
    """Ids of a Qwen3-VL video placeholder's expansion (`Qwen3VLProcessor.replace_video_token`).

    Per temporal patch: ``encode(f"<{t:.1f} seconds>")``, vision_start, ``gh·gw / merge²`` video
    pads, vision_end. ``encode`` tokenizes text without special tokens; each timestamp sits between
    special tokens, so encoding it alone gives the ids the whole prompt's tokenization gives.
    """
    grid_t, grid_h, grid_w = (int(v) for v in grid_thw)
    per_patch = grid_h * grid_w // (merge_size * merge_size)
    times = video_timestamps(frame_indices, video_fps, temporal_patch_size)
    out: list[int] = []
    for t in times[:grid_t]:
        out += [*encode(f"<{t:.1f} seconds>"), vision_start_id, *[video_id] * per_patch, vision_end_id]
    return out


def expand_placeholders(
    input_ids: Sequence[int], placeholder_ids: Mapping[str, int], items: Sequence[tuple[str, int | Sequence[int]]]
) -> list[int]:
    """Replace the i-th placeholder with ``items[i][1]`` copies of it; kinds must match in order.

    ``placeholder_ids`` maps "image" / "video" / "audio" to the placeholder token id. An item given
    as a sequence of ids (a Qwen3-VL video: `timestamped_video_ids`) replaces its placeholder with
    those ids as they are.
    """
    kind_of = {token: kind for kind, token in placeholder_ids.items()}
    out: list[int] = []
    queue = list(items)
    for token in input_ids:
        kind = kind_of.get(token)
        if kind is None:
            out.append(token)
            continue
        if not queue:
            raise MediaError(f"the prompt has more {kind} placeholders than media items", code="placeholder_mismatch")
        expected, count = queue.pop(0)
        if expected != kind:
            raise MediaError(f"placeholder for {kind} where a {expected} item comes", code="placeholder_mismatch")
        out.extend([token] * count if isinstance(count, int) else count)
    if queue:
        raise MediaError(f"{len(queue)} media items have no placeholder in the prompt", code="placeholder_mismatch")
    return out
