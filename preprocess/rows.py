"""Dataset rows as Weir's rollout prompts: what `weir train --dataset` sends the rollout role.

A row in Weir's own shape (``messages``, and a ``reward`` spec) is taken as it is. A verl / slime row —
``prompt`` (chat messages, or a string: one user turn) whose text carries ``<image>`` / ``<video>`` /
``<audio>`` markers, the ``images`` / ``videos`` / ``audios`` columns bound to them in order, and
``reward_model: {"ground_truth": ..., "style": "rule"}`` — becomes ``{"messages", "reward"}``:

* each marker becomes an OpenAI content part (``image_url`` / ``video_url`` / ``audio_url``) between the
  text around it: a value with bytes (raw, a Hugging Face ``Image`` / ``Audio`` struct, a decoded
  ``Audio`` written as WAV) as a data URI, a path as an absolute path (relative ones from the dataset's
  folder; the preprocess role reads it only under its media roots, ``WEIR_MEDIA_ROOTS``);
* ``reward_model.ground_truth`` becomes the built-in ``math`` reward (math-verify: the response's last
  ``\\boxed{}`` or expression against the ground truth, as verl's rule rewards for geo3k / GSM8K / MATH
  grade), the closest of `rollout.rewards`' built-ins; a row without ``reward_model`` gets ``none``;
* ``data_source`` is kept (the evaluator reports per source); ``extra_info``, ``ability`` and the rest are
  dropped.

A row that cannot be made a prompt this way is skipped with a warning that names its row and `DatasetError`
code (``marker_mismatch``, ``media_not_found``, ``unsupported_media_value``, ``unsupported_reward``,
``invalid_row``); a dataset none of whose rows can be raises the first row's error. A row that cannot be read
at all (a line that is no JSON: ``invalid_json``, …; `preprocess.reading.BadRow`) is never skipped: the
dataset is refused with their count and the first one's line and code (`dataset_refusal`: what ``weir train``
says, in one line, before anything starts). This module does not check that media decode (``weir prep`` does,
row by item) nor talk to any role.
"""

from __future__ import annotations

import base64
import logging
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path

from .dataset import MARKERS, RowMedia, column_values, prompt_messages, row_media
from .errors import DatasetError
from .probe import MediaKind
from .reading import BadRow, open_dataset

__all__ = ["dataset_refusal", "iter_prompt_rows", "prompt_row"]

logger = logging.getLogger(__name__)

_KINDS: tuple[MediaKind, ...] = ("image", "video", "audio")
_MARKED: dict[str, MediaKind] = {"image": "image", "video": "video", "audio": "audio"}


def _url(ref: RowMedia) -> str:
    if ref.data is not None:
        return "data:application/octet-stream;base64," + base64.b64encode(ref.data).decode("ascii")
    assert ref.path is not None
    if not ref.path.is_file():
        raise DatasetError(f"no file at {ref.path}", code="media_not_found")
    return str(ref.path)


def _parts(text: str, media: dict[MediaKind, list[RowMedia]]) -> str | list[dict[str, object]]:
    """``text`` with each marker replaced by the next medium of its kind (the text as given when it has none)."""
    if MARKERS.search(text) is None:
        return text
    parts: list[dict[str, object]] = []
    start = 0
    for match in MARKERS.finditer(text):
        if match.start() > start:
            parts.append({"type": "text", "text": text[start : match.start()]})
        kind = _MARKED[match.group(1)]
        parts.append({"type": f"{kind}_url", f"{kind}_url": {"url": _url(media[kind].pop(0))}})
        start = match.end()
    if start < len(text):
        parts.append({"type": "text", "text": text[start:]})
    return parts


def _in_part(part: object, media: dict[MediaKind, list[RowMedia]]) -> list[object]:
    """A content part with the markers of its text replaced (`_parts`); any other part as given."""
    text = part.get("text") if isinstance(part, Mapping) and part.get("type") == "text" else None
    if not isinstance(text, str) or MARKERS.search(text) is None:
        return [part]
    return list(_parts(text, media))


def _reward(spec: object) -> dict[str, object]:
    if spec is None:
        return {"type": "none"}
    truth = spec.get("ground_truth") if isinstance(spec, Mapping) else None
    style = spec.get("style", "rule") if isinstance(spec, Mapping) else None
    if style != "rule" or isinstance(truth, bool) or not isinstance(truth, str | int | float):
        raise DatasetError(
            f"reward_model {str(spec)[:120]}: a rule-style ground truth (a string or a number) maps to the built-in "
            "math reward; register a custom reward (WEIR_REWARD_FUNCTIONS) and write Weir's rows for the others",
            code="unsupported_reward",
        )
    return {"type": "math", "answer": str(truth)}


def prompt_row(row: Mapping[str, object], base: Path) -> dict[str, object]:
    """``row`` as a rollout prompt (see the module's docstring); `DatasetError` when it cannot be one."""
    if "messages" in row:
        return dict(row)
    if "prompt" not in row:
        raise DatasetError("a row needs 'messages' (Weir's rows) or 'prompt' (verl's / slime's)", code="invalid_row")
    # The markers and the columns agree and every value has a readable shape; the columns' media come first.
    columns = row_media(row, base)[: sum(len(column_values(row, kind)) for kind in _KINDS)]
    media = {kind: [ref for ref in columns if ref.kind == kind] for kind in _KINDS}
    messages: list[object] = []
    for message in prompt_messages(row["prompt"]):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise DatasetError("each message of 'prompt' needs a 'role'", code="invalid_row")
        content = message.get("content")
        if isinstance(content, str):
            content = _parts(content, media)
        elif isinstance(content, list):  # text parts may carry markers too
            content = [q for part in content for q in _in_part(part, media)]
        messages.append({**message, "content": content})
    out: dict[str, object] = {"messages": messages, "reward": row.get("reward") or _reward(row.get("reward_model"))}
    if isinstance(row.get("data_source"), str):
        out["data_source"] = row["data_source"]
    return out


def iter_prompt_rows(path: Path | str, split: str | None = None) -> Iterator[dict[str, object]]:
    """The rows of ``split`` of the dataset at ``path`` (any `preprocess.reading.open_dataset` reads) as rollout
    prompts. Rows that cannot be made prompts are skipped with a warning, and a dataset with none left raises
    the first one's error; rows that cannot be read at all (`BadRow`) raise one `DatasetError` at the end,
    with their count and the first one's line and code."""
    source = open_dataset(path, split)
    skipped: Counter[str] = Counter()
    first: DatasetError | None = None
    unreadable: list[BadRow] = []
    kept = 0
    for index, row in enumerate(source.records()):
        if isinstance(row, BadRow):
            unreadable.append(row)
            continue
        try:
            prompt = prompt_row(row, source.base)
        except DatasetError as error:
            logger.warning("dataset %s row %d skipped (%s): %s", path, index, error.code, error)
            skipped[error.code] += 1
            first = first or error
            continue
        kept += 1
        yield prompt
    if unreadable:
        bad = unreadable[0]
        raise DatasetError(
            f"{source.name}: {len(unreadable)} row{'s' * (len(unreadable) > 1)} cannot be read, the first at "
            f"{bad.where}: {bad.message}",
            code=bad.code,
        )
    if skipped:
        logger.warning("dataset %s: %d rows skipped by code %s", path, sum(skipped.values()), dict(skipped))
    if not kept and first is not None:
        raise first


def _rewarded(row: Mapping[str, object]) -> bool:
    """Whether a prompt row's samples get a reward: a reward spec other than ``none`` (the rollout's default when
    a row names none), or an environment (its steps' rewards)."""
    reward = row.get("reward")
    spec = reward.get("type", "none") if isinstance(reward, Mapping) else "none"
    return spec != "none" or row.get("environment") is not None


def dataset_refusal(
    path: Path | str, split: str | None = None, *, option: str = "--dataset", scored_elsewhere: bool = False
) -> str | None:
    """Why ``weir train --dataset path [--split split]`` cannot run, in one line naming ``option`` (None when it
    can): the dataset or split is not there, rows cannot be read, none can be a prompt, or none has a reward
    (``--eval-dataset``'s rows are scored too) unless ``scored_elsewhere`` (a rollout function of the user's
    scores its own samples). It reads every row once."""
    disabled, logger.disabled = logger.disabled, True  # the rows skipped are said once, when the run reads them
    rewarded = 0
    try:
        for row in iter_prompt_rows(path, split):
            rewarded += _rewarded(row)
    except DatasetError as error:
        said = str(error) if str(error).startswith(str(path)) else f"{path}: {error}"  # named once
        return f"{option} {said} [{error.code}]"
    finally:
        logger.disabled = disabled
    # Every group would be stored as having nothing to train on, and the trainer would wait forever.
    if not rewarded and not scored_elsewhere:
        return (
            f"{option} {path}: no row has a reward (a 'reward' spec, or verl's reward_model.ground_truth), so no "
            "sample could be trained on [no_reward]"
        )
    return None
