"""The demo task: "What colour is the picture?", generated locally, checkable by exact match.

Each picture is a 56×56 PNG (the model's smallest grid: 4 image tokens) filled with one of four
colours, with pixel noise and a black or white shape drawn on it, so no two pictures are the same
bytes. The answer is the colour's name; the reward is ``exact_match``. Training pictures and the
held-out pictures used for the greedy-accuracy check are drawn with different seeds.

The random-weight embedded model cannot even produce a colour word at first, so the demo starts
with a short supervised warm-up on **text-only** prompts ("Name a colour." → each of the four
names, equally often). That teaches the answer format only: it never sees a picture, so after it
the model names a colour without regard to the picture. Tying the name to the picture is what RL learns.

The visual tool task (``weir train --demo --demo-task visual-search``, `write_agent_task`) is multi-turn:
each row is the built-in ``visual_search`` environment (a noise picture hiding one small coloured square,
rewarded 1.0 for its colour's name), the model may call ``crop`` and then answers. The random model never
writes a ``<tool_call>``, so its warm-up is supervised on **scripted trajectories** instead
(`agent_warmup_pairs`): crop the quarter holding the square, then name its colour — rendered by the
rollout role exactly as RL's trajectories are, the loss on the model's turns only.

The video-with-audio task (``weir train --demo --demo-task video-audio``, `write_video_audio_task`, Omni
models) is the colour task through a video with its own audio track (``use_audio_in_video``): one-second
clips of one colour with a tone, the same text-only warm-up.
"""

from __future__ import annotations

import functools
import io
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Required, TypedDict

import numpy as np
from PIL import Image, ImageDraw

from experience.records import Group
from rollout.api import RolloutRequest
from rollout.client import RolloutClient

__all__ = [
    "AGENT_QUESTION",
    "AgentWarmup",
    "COLOURS",
    "Pair",
    "QUESTION",
    "PromptRow",
    "VIDEO_QUESTION",
    "agent_curriculum",
    "agent_row",
    "agent_warmup_pairs",
    "agent_warmup_rows",
    "clip_warmup_pairs",
    "colour_clip",
    "colour_picture",
    "crop_call",
    "crop_diagnosis",
    "curriculum_patch",
    "evaluate_agent",
    "quarter_of",
    "square_of",
    "warmup_prompts",
    "write_agent_task",
    "write_demo_task",
    "write_colour_word_task",
    "write_video_audio_task",
]


class _Url(TypedDict):
    url: str


class _VideoUrl(_Url, total=False):
    use_audio_in_video: bool


class _ContentPart(TypedDict, total=False):
    type: Required[str]
    text: str
    image_url: _Url
    video_url: _VideoUrl


class _Message(TypedDict):
    role: str
    content: str | list[_ContentPart]


class _Reward(TypedDict):
    type: str
    answer: str


class _EnvironmentOptions(TypedDict):
    seed: int
    size: int
    patch: int


class _Environment(TypedDict):
    name: str
    options: _EnvironmentOptions


class PromptRow(TypedDict, total=False):
    """A demo task's row, as the tasks build it: a rollout prompt (its messages, and its reward or its
    environment and turns). The RL loop takes rows as plain dicts (a dataset's rows are free-form JSON), so the
    ``write_*_task`` functions hand them over as such."""

    messages: Required[list[_Message]]
    reward: _Reward
    environment: _Environment
    max_turns: int


COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 40, 35),
    "green": (40, 170, 60),
    "blue": (35, 70, 215),
    "yellow": (235, 210, 30),
}
QUESTION = "What colour is the picture?"
_SIZE = 56


def colour_picture(colour: str, seed: int) -> bytes:
    """One PNG: the colour with noise, and a black or white circle, square or triangle on it."""
    rng = np.random.default_rng(seed)
    base = np.array(COLOURS[colour], dtype=np.int16)
    pixels = np.clip(base + rng.integers(-24, 25, (_SIZE, _SIZE, 3)), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels)
    draw = ImageDraw.Draw(image)
    ink = (0, 0, 0) if rng.random() < 0.5 else (255, 255, 255)
    x, y = (int(v) for v in rng.integers(6, 30, 2))
    size = int(rng.integers(10, 20))
    shape = int(rng.integers(3))
    if shape == 0:
        draw.ellipse((x, y, x + size, y + size), fill=ink)
    elif shape == 1:
        draw.rectangle((x, y, x + size, y + size), fill=ink)
    else:
        draw.polygon([(x, y + size), (x + size, y + size), (x + size // 2, y)], fill=ink)
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def _picture_row(path: Path, colour: str) -> PromptRow:
    return {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": str(path)}},
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
        "reward": {"type": "exact_match", "answer": colour},
    }


def _write_colour_task(
    folder: Path,
    suffix: str,
    media: Callable[[str, int], bytes],
    row: Callable[[Path, str], PromptRow],
    per_colour: int,
    held_out: int,
) -> tuple[list[dict], list[dict]]:
    """Each colour's ``per_colour + held_out`` media files (``media(colour, seed)``, written under ``folder`` when
    missing); returns (training rows, held-out rows), ``row(path, colour)`` each."""
    folder = folder.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    train: list[PromptRow] = []
    evaluation: list[PromptRow] = []
    for c, colour in enumerate(COLOURS):
        for i in range(per_colour + held_out):
            path = folder / f"{colour}-{i:03d}.{suffix}"
            if not path.is_file():
                path.write_bytes(media(colour, 1000 * c + i))
            (train if i < per_colour else evaluation).append(row(path, colour))
    # Interleave colours so any prefix of the rows is balanced.
    order = sorted(range(len(train)), key=lambda k: (k % per_colour, k // per_colour))
    return [dict(train[k]) for k in order], [dict(row) for row in evaluation]


def write_demo_task(media_root: Path, *, per_colour: int = 16, held_out: int = 4) -> tuple[list[dict], list[dict]]:
    """Write the pictures under ``media_root/colours``; returns (training rows, held-out rows).

    Rows are rollout prompts (``messages`` with the picture's absolute path, and the reward).
    """
    return _write_colour_task(media_root / "colours", "png", colour_picture, _picture_row, per_colour, held_out)


# -- the colour-word task (`weir train --demo --demo-task colour-words`, the text models' demo) -----------------

_FILLERS = ("the", "a", "circle", "square", "triangle", "star", "line", "tone", "image", "picture", "high", "low")


def write_colour_word_task(*, per_colour: int = 16, held_out: int = 4) -> tuple[list[dict], list[dict]]:
    """A text task a text model learns on two cores, the colour task's twin: which colour a line of words names
    (exact match, four colours). Each line is five filler words with one colour word at a random place; no
    held-out line is a training line. (Measured on the tiny Qwen3: whether a three-digit number is even or odd
    did not move off chance in 150 steps, held-out 44 % → 50 %: the answer hides in how the tokenizer cuts it.)"""
    rng = np.random.default_rng(39)
    seen: set[str] = set()
    rows: dict[str, list[PromptRow]] = {colour: [] for colour in COLOURS}
    while any(len(r) < per_colour + held_out for r in rows.values()):
        colour = list(COLOURS)[len(seen) % len(COLOURS)]
        words = [str(w) for w in rng.choice(_FILLERS, 5)]
        words.insert(int(rng.integers(6)), colour)
        line = " ".join(words)
        if line in seen or len(rows[colour]) >= per_colour + held_out:
            seen.add(line)
            continue
        seen.add(line)
        content = f"Which colour is named in: {line}?"
        rows[colour].append(
            {"messages": [{"role": "user", "content": content}], "reward": {"type": "exact_match", "answer": colour}}
        )
    train = [row for i in range(per_colour) for row in (rows[c][i] for c in COLOURS)]
    evaluation = [row for c in COLOURS for row in rows[c][per_colour:]]
    return [dict(row) for row in train], [dict(row) for row in evaluation]


# -- the video-with-its-audio task (`weir train --demo --demo-task video-audio`) -------------------------
# The colour task through an Omni model's video-with-audio path: each row is a short clip of one colour (the
# pictures' noise and shapes, one frame each) with its own audio track (a tone, the same for every colour),
# sent as a ``video_url`` with ``use_audio_in_video``, so the preprocess role takes the track and the prompt
# interleaves the frames' and the track's tokens in time. The answer is the clip's colour.
VIDEO_QUESTION = "What colour is the video?"
_CLIP_FPS, _CLIP_FRAMES, _CLIP_RATE = 10, 10, 16000


def colour_clip(colour: str, seed: int) -> bytes:
    """One second of ``colour`` (H.264, 56×56, 10 fps) with a mono AAC tone track, as an MP4."""
    import av

    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        video = container.add_stream("libx264", rate=_CLIP_FPS)
        video.width = video.height = _SIZE
        video.pix_fmt = "yuv420p"
        video.options = {"crf": "18", "preset": "veryfast"}
        audio = container.add_stream("aac", rate=_CLIP_RATE, layout="mono")
        for i in range(_CLIP_FRAMES):
            pixels = np.asarray(Image.open(io.BytesIO(colour_picture(colour, seed * _CLIP_FRAMES + i))).convert("RGB"))
            for packet in video.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in video.encode(None):
            container.mux(packet)
        t = np.arange(_CLIP_FRAMES * _CLIP_RATE // _CLIP_FPS) / _CLIP_RATE
        wave = (0.4 * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32)[None]
        step = audio.codec_context.frame_size or 1024
        for start in range(0, wave.shape[1], step):
            frame = av.AudioFrame.from_ndarray(
                np.ascontiguousarray(wave[:, start : start + step]), format="fltp", layout="mono"
            )
            frame.sample_rate, frame.pts = _CLIP_RATE, start
            for packet in audio.encode(frame):
                container.mux(packet)
        for packet in audio.encode(None):
            container.mux(packet)
    return out.getvalue()


def write_video_audio_task(
    media_root: Path, *, per_colour: int = 8, held_out: int = 2
) -> tuple[list[dict], list[dict]]:
    """Write the clips under ``media_root/clips``; returns (training rows, held-out rows), as `write_demo_task`."""
    return _write_colour_task(media_root / "clips", "mp4", colour_clip, _clip_row, per_colour, held_out)


def _clip_row(path: Path, colour: str) -> PromptRow:
    return {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": str(path), "use_audio_in_video": True}},
                    {"type": "text", "text": VIDEO_QUESTION},
                ],
            }
        ],
        "reward": {"type": "exact_match", "answer": colour},
    }


def warmup_prompts() -> list[tuple[list[dict[str, Any]], str]]:
    """(messages, answer) for the text-only format warm-up: each colour name once."""
    return [([{"role": "user", "content": "Name a colour."}], colour) for colour in COLOURS]


_WARMUP_CLIP_SEED = 500  # warm-up clips' seeds: past any training or held-out clip's (1000 * colour + i, i < 500)


def clip_warmup_pairs(
    media_root: Path,
    answer_ids: Callable[[str], list[int]],
    *,
    rollout_url: str,
    token: str | None = None,
) -> list[tuple[list[int], list[int], list[str]]]:
    """The video task's format warm-up: one clip of each colour, each paired with **every** colour's name
    equally often, as supervised pairs (prompt ids, response ids, feature keys).

    A text-only warm-up does not carry over to ~300-token video prompts on the tiny model (measured: sampled
    answers such as ``gre1en``, greedy held-out 0 %, every group's reward 0 — no gradient at all), so the
    format is taught with a clip in the context. Each clip gets all four answers, so the best the warm-up can
    do is a uniform guess per clip: it teaches the answer's form, never the clip's colour (RL's part). The
    clips are written beside the task's (their own seeds) and their prompts are the rollout role's own, so the
    trainer's feature cache holds them."""
    folder = (media_root / "clips").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for c, colour in enumerate(COLOURS):
        path = folder / f"warmup-{colour}.mp4"
        if not path.is_file():
            path.write_bytes(colour_clip(colour, seed=1000 * c + _WARMUP_CLIP_SEED))
        video: _ContentPart = {"type": "video_url", "video_url": {"url": str(path), "use_audio_in_video": True}}
        rows.append({"messages": [{"role": "user", "content": [video, {"type": "text", "text": VIDEO_QUESTION}]}]})
    body = {
        "prompts": [{**row, "n": 1} for row in rows],
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "record": False,
    }
    groups = rollouts(rollout_url, body, token=token)
    return [
        (list(group.prompt_ids), answer_ids(colour), list(group.feature_keys)) for group in groups for colour in COLOURS
    ]


def rollouts(rollout_url: str, body: Mapping[str, object], *, token: str | None = None) -> list[Group]:
    """The groups of one ``POST /v1/rollouts`` (``body``: its JSON, read through `rollout.api.RolloutRequest`)."""
    with RolloutClient(rollout_url, token=token, timeout_s=600) as client:
        return client.rollouts(RolloutRequest.model_validate(body)).groups


# -- the visual tool task (`weir train --demo --demo-task visual-search`) ------------------------------
# Every row is the built-in `visual_search` environment (`rollout.environments.VisualSearch`): a noise
# picture of AGENT_SIZE pixels with one small square of six colours; the model may call `crop` and answers
# the colour's name; the environment's reward is 1.0 for the exact name. Seeds are kept only when the
# square lies wholly inside one quarter of the picture, so one crop of that quarter (AGENT_SIZE / 2 pixels:
# the model's smallest grid, 4 image tokens) shows it whole — the call the scripted warm-up makes.
AGENT_QUESTION = "What colour is the small square?"
AGENT_SIZE = 112
AGENT_PATCH = 12
AGENT_MAX_TURNS = 3
# A curriculum of square sizes (`curriculum_patch`) for the sparse reward: RL's first rows hide a square of
# AGENT_CURRICULUM_START pixels — the environment's largest at AGENT_SIZE (a quarter of its side), so a quarter's
# crop (2 × 2 image tokens of 28 pixels) has a whole 14-pixel patch of its colour in each token it covers, a whole
# token where it lies on their grid — shrinking linearly to AGENT_PATCH over the rows of the first
# AGENT_CURRICULUM_SHARE of the steps; the held-out rows always hide AGENT_PATCH.
AGENT_CURRICULUM_START = AGENT_SIZE // 4
AGENT_CURRICULUM_SHARE = 0.6
_TRAIN_SEEDS, _HELD_OUT_SEEDS, _WARMUP_SEEDS = 0, 100_000, 200_000


@functools.lru_cache(maxsize=4096)
def square_of(seed: int, size: int = AGENT_SIZE, patch: int = AGENT_PATCH) -> tuple[str, tuple[int, int]]:
    """The colour and top-left corner of `visual_search`'s square for these options (the environment's own
    `reset`, so the two never disagree)."""
    from rollout.environments import PromptInfo, VisualSearch

    env = VisualSearch(seed=seed, size=size, patch=patch)
    env.reset(PromptInfo(messages=[], group_id="", sample_index=0, prompt_index=0))
    x, y = env.state["patch_xy"]
    return env.answer, (int(x), int(y))


def quarter_of(seed: int, size: int = AGENT_SIZE, patch: int = AGENT_PATCH) -> tuple[int, int, int, int] | None:
    """The quarter ``(x, y, w, h)`` of the picture holding the whole square, or None when it straddles two."""
    _, (x, y) = square_of(seed, size, patch)
    half = size // 2
    qx, qy = x // half, y // half
    if (x + patch - 1) // half != qx or (y + patch - 1) // half != qy:
        return None
    return qx * half, qy * half, half, half


def crop_call(seed: int, patch: int = AGENT_PATCH) -> str:
    """The scripted call: crop the quarter that holds the square (Qwen's ``<tool_call>`` JSON format)."""
    region = quarter_of(seed, patch=patch)
    if region is None:
        raise ValueError(f"seed {seed}: the square straddles two quarters")
    arguments = dict(zip(("x", "y", "w", "h"), region, strict=True))
    return "<tool_call>\n" + json.dumps({"name": "crop", "arguments": arguments}) + "\n</tool_call>"


def _agent_seeds(start: int, per_colour: int) -> list[int]:
    """``per_colour`` usable seeds (the square inside one quarter) per colour from ``start`` on, the colours
    interleaved so any prefix is balanced."""
    return [seed for seed, _ in _usable_seeds(start, [AGENT_PATCH] * (per_colour * len(_square_colours())))]


def _square_colours() -> list[str]:
    from rollout.environments import COLOURS as SQUARE_COLOURS

    return sorted(SQUARE_COLOURS)


def _usable_seeds(start: int, patches: list[int]) -> list[tuple[int, int]]:
    """One ``(seed, patch)`` per entry of ``patches``, from ``start`` on: row i's square has colour i mod 6 (so any
    prefix is balanced) and lies inside one quarter at that patch size; no seed is used twice."""
    colours = _square_colours()
    ranges = sorted((_TRAIN_SEEDS, _HELD_OUT_SEEDS, _WARMUP_SEEDS))
    end = next((bound for bound in ranges if bound > start), None)  # the next range's first seed: not to be reached
    cursor = dict.fromkeys(colours, start)  # where each colour's search goes on (a seed's colour is its own)
    chosen = []
    for i, patch in enumerate(patches):
        colour = colours[i % len(colours)]
        seed = cursor[colour]
        while square_of(seed, patch=patch)[0] != colour or quarter_of(seed, patch=patch) is None:
            seed += 1
        if end is not None and seed >= end:
            raise ValueError(f"{len(patches)} rows from seed {start} reach seed {end}, where another range starts")
        cursor[colour] = seed + 1
        chosen.append((seed, patch))
    return chosen


def curriculum_patch(index: int, ramp: int) -> int:
    """The square's side in training row ``index``: `AGENT_CURRICULUM_START` at the first, shrinking linearly to
    `AGENT_PATCH` at row ``ramp`` and after."""
    done = min(1.0, index / max(1, ramp))
    return round(AGENT_CURRICULUM_START - (AGENT_CURRICULUM_START - AGENT_PATCH) * done)


def agent_row(seed: int, patch: int = AGENT_PATCH) -> PromptRow:
    """One rollout prompt of the visual tool task: the question, the environment (its reward), max_turns."""
    return {
        "messages": [{"role": "user", "content": AGENT_QUESTION}],
        "environment": {"name": "visual_search", "options": {"seed": seed, "size": AGENT_SIZE, "patch": patch}},
        "max_turns": AGENT_MAX_TURNS,
    }


def write_agent_task(*, rows: int = 48, ramp: int | None = None, held_out: int = 2) -> tuple[list[dict], list[dict]]:
    """(``rows`` training rows, ``held_out`` per colour held out) of the visual tool task; nothing is written (the
    environment draws its picture from the seed). The training rows, in the order the driver sends them, hide
    squares shrinking from `AGENT_CURRICULUM_START` to `AGENT_PATCH` over the first ``ramp`` (`curriculum_patch`;
    None: every one `AGENT_PATCH`); the held-out rows `AGENT_PATCH`, from another range of seeds."""
    patches = [AGENT_PATCH if ramp is None else curriculum_patch(i, ramp) for i in range(rows)]
    train = [dict(agent_row(seed, patch)) for seed, patch in _usable_seeds(_TRAIN_SEEDS, patches)]
    return train, [dict(agent_row(s)) for s in _agent_seeds(_HELD_OUT_SEEDS, held_out)]


def agent_curriculum(steps: int, groups_per_step: int) -> tuple[list[dict], list[dict]]:
    """`write_agent_task` for a run of ``steps`` steps of ``groups_per_step`` prompts: the square shrinks over the
    rows of the first `AGENT_CURRICULUM_SHARE` of the steps, and there are twice as many rows as the steps take
    (groups dropped for uniform rewards, and stale ones regenerated, draw more), so the driver, which cycles
    through them, never comes back to the large squares."""
    planned = steps * groups_per_step
    return write_agent_task(rows=2 * planned, ramp=round(AGENT_CURRICULUM_SHARE * planned))


def agent_warmup_rows(per_colour: int = 1) -> list[PromptRow]:
    """Rows for the scripted warm-up, from a third seed range (neither trained on by RL nor held out)."""
    return [agent_row(s) for s in _agent_seeds(_WARMUP_SEEDS, per_colour)]


Pair = tuple[list[int], list[int], list[str]]  # (prompt ids, response ids, feature keys): one supervised example


@dataclass(frozen=True, slots=True)
class AgentWarmup:
    """The scripted warm-up's examples, step by step (`pairs`): every row's crop call with its true quarter, and
    its answer turn with a colour that rotates from step to step — each row gets every colour's name in turn, each
    step every colour equally often. The warm-up so teaches where to look and the answer's format, never which
    colour a picture holds (that is RL's to learn). Measured before the rotation, with each row's true colour: 300
    steps on 6 trajectories left held-out answers right 0 % of the times the crop showed the square — a colour
    memorised per picture, the answer turn's entropy gone."""

    calls: list[Pair]  # prompt → the scripted crop call
    contexts: list[tuple[list[int], list[str]]]  # (prompt + call + the crop's observation) ids, their feature keys
    names: list[list[int]]  # every colour's answer ids, in a fixed order

    def pairs(self, step: int) -> list[Pair]:
        """The examples of warm-up step ``step``: every call, and row i's answer as colour (i + step) mod 6."""
        k = len(self.names)
        return self.calls + [(ids, self.names[(i + step) % k], keys) for i, (ids, keys) in enumerate(self.contexts)]


def agent_warmup_pairs(
    rows: list[PromptRow],
    answer_ids: Callable[[str], list[int]],
    *,
    rollout_url: str,
    token: str | None = None,
) -> AgentWarmup:
    """Scripted trajectories — crop the square's quarter, then answer — as supervised examples (`AgentWarmup`):
    (prompt → the call) and (prompt, call, the crop's observation → an answer). The loss falls on the model's
    turns only, never on the observation.

    The prompt and the observation are the rollout role's own: one unrecorded rollout per row with the
    call forced by the engine's ``regex`` decoding renders the tools into the prompt, runs ``crop`` and
    renders its image (through the preprocess role, so the trainer's feature cache holds it) exactly as RL
    rollouts will. The call's own tokens are then the tokenizer's (``answer_ids``), not the constrained
    decoder's, so the warm-up teaches the tokens the model will sample."""
    from rollout.environments import COLOURS as SQUARE_COLOURS

    seeds = [int(r["environment"]["options"]["seed"]) for r in rows]
    calls = [crop_call(s) for s in seeds]
    body = {
        "prompts": [
            {**row, "max_turns": 2, "n": 1, "sampling_params": {"regex": re.escape(call), "temperature": 0.0}}
            for row, call in zip(rows, calls, strict=True)
        ],
        "sampling_params": {"max_new_tokens": 400},
        "record": False,
    }
    groups = rollouts(rollout_url, body, token=token)
    warmup = AgentWarmup(calls=[], contexts=[], names=[answer_ids(c) for c in sorted(SQUARE_COLOURS)])
    for group, seed, call in zip(groups, seeds, calls, strict=True):
        (sample,) = group.samples
        mask = list(sample.loss_mask or [])
        if 0 not in mask:
            raise RuntimeError(f"seed {seed}: the scripted crop call got no observation ({sample.finish_reason})")
        start = mask.index(0)
        end = start + (mask[start:].index(1) if 1 in mask[start:] else len(mask) - start)
        observation = list(sample.response_ids[start:end])
        prompt, keys = list(group.prompt_ids), list(group.feature_keys)
        call_ids = answer_ids(call)
        warmup.calls.append((prompt, call_ids, keys))
        warmup.contexts.append((prompt + call_ids + observation, keys + list(sample.feature_keys)))
    return warmup


def evaluate_agent(
    rollout_url: str,
    rows: list[dict[str, Any]],
    *,
    max_new_tokens: int,
    token: str | None = None,
    decode: Callable[[list[int]], str] | None = None,
    report: dict[str, float] | None = None,
) -> float:
    """Mean reward of greedy trajectories for multi-turn ``rows`` (their environment and max_turns sent on;
    not recorded); a sample without a reward counts as 0. With ``decode`` (the tokenizer's) and ``report``,
    ``report`` receives where the trajectories go wrong (`crop_diagnosis`)."""
    keys = ("messages", "reward", "tools", "environment", "max_turns")
    body = {
        "prompts": [{**{k: r[k] for k in keys if k in r}, "n": 1} for r in rows],
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
        "record": False,
    }
    groups = rollouts(rollout_url, body, token=token)
    rewards = [s.reward or 0.0 for g in groups for s in g.samples]
    if decode is not None and report is not None:
        squares = [(int(r["environment"]["options"]["seed"]), int(r["environment"]["options"]["patch"])) for r in rows]
        report.update(crop_diagnosis([decode(list(g.samples[0].response_ids)) for g in groups], squares, rewards))
    return sum(rewards) / max(1, len(rewards))


_CROP_ARGUMENTS = re.compile(r'"x":\s*(\d+),\s*"y":\s*(\d+),\s*"w":\s*(\d+),\s*"h":\s*(\d+)')


def crop_diagnosis(responses: list[str], squares: list[tuple[int, int]], rewards: list[float]) -> dict[str, float]:
    """Where visual-search trajectories go wrong — the two decisions the reward multiplies: ``crop_hit``, the
    share whose first crop shows the whole square; ``colour_given_hit``, the share of those answered right;
    ``colour_given_miss``, the share answered right without seeing it (chance: 1/6). From the decoded responses
    (the model's turns and the observations between them) and each row's ``(seed, patch)``."""
    hits, right_hit, right_miss = 0, 0, 0
    for text, (seed, patch), reward in zip(responses, squares, rewards, strict=True):
        _, (x, y) = square_of(seed, patch=patch)
        match = _CROP_ARGUMENTS.search(text)
        hit = False
        if match:
            cx, cy, cw, ch = (int(v) for v in match.groups())
            hit = cx <= x and cy <= y and x + patch <= cx + cw and y + patch <= cy + ch
        hits += hit
        right_hit += hit and reward > 0
        right_miss += (not hit) and reward > 0
    n = max(1, len(responses))
    return {
        "crop_hit": hits / n,
        "colour_given_hit": right_hit / max(1, hits),
        "colour_given_miss": right_miss / max(1, len(responses) - hits),
    }
