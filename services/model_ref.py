"""A model as the user names it — a folder, or a Hugging Face hub id — turned into the folder that is loaded.

``WEIR_MODEL``, ``weir up|serve|train --model`` take either. A value that is an existing path is that folder.
Otherwise a value shaped like a hub id (``owner/name``, optionally ``owner/name@revision``: a branch, a tag or
a commit) is the snapshot folder of that revision in the Hugging Face cache (``HF_HUB_CACHE``, else
``HF_HOME/hub``): a snapshot already there is used as it is (no request is made, so five roles starting at
once do not ask the hub five times); one that is missing is downloaded by ``huggingface_hub``, unless
``HF_HUB_OFFLINE=1``, when the error says how to fetch it. Anything else stays the path it names, and the
folder check (`model_folder`) says it is not there.

The environment is read at each call, never at import, so a role sees the cache its own variables name.
Not here: which families Weir runs (`encoders.architectures`), the settings that hold the folder
(`services.settings.ModelFolder`), creating the tiny model (`encoders.embedded_model`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = [
    "ModelRefError",
    "hub_cache_dir",
    "hub_id",
    "model_folder",
    "model_name",
    "resolve_model",
    "served_names",
]

# The hub's own rule for a repository id: owner and name of letters, digits, "-", "_" and ".", neither
# starting nor ending with "-" or "." (so ".weir/model" stays a path); "--" and ".." are refused by the hub.
_PART = r"[A-Za-z0-9_](?:[\w.-]{0,94}[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"^(?P<repo>{_PART}/{_PART})(?:@(?P<revision>[\w./-]{{1,128}}))?$")


class ModelRefError(ValueError):
    """The model named is neither a model folder nor a hub id whose snapshot can be had; the message says
    what to do (one line)."""


def hub_id(value: str) -> tuple[str, str | None] | None:
    """``(repo id, revision or None)`` when ``value`` reads as a hub id, else None."""
    match = _HUB_ID.match(value)
    if match is None or "--" in value or ".." in value:
        return None
    return match["repo"], match["revision"]


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache this process uses: ``HF_HUB_CACHE`` (or its old name), else ``HF_HOME/hub``,
    else ``~/.cache/huggingface/hub`` — read now, not when huggingface_hub was imported."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def resolve_model(value: str | os.PathLike[str]) -> Path:
    """The folder ``value`` names: an existing path as it is; a hub id's snapshot (cached, else downloaded
    unless offline); any other value as the path it names (which `model_folder` then refuses)."""
    text = os.fspath(value)
    path = Path(text).expanduser()
    parsed = None if path.exists() else hub_id(text)
    if parsed is None:
        return path
    repo, revision = parsed
    from huggingface_hub import snapshot_download

    cache = hub_cache_dir()
    # `hf` is huggingface_hub's command since 1.0 (`huggingface-cli` before it, with the same arguments)
    fetch = f"`hf download {repo}{f' --revision {revision}' if revision else ''}` (or huggingface-cli download)"
    try:
        return Path(snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=True))
    except (OSError, ValueError):  # not cached (LocalEntryNotFoundError), or an id the hub refuses
        if _offline():
            raise ModelRefError(
                f"{text} is no folder here, and as a Hugging Face hub id it is not in the cache {cache} "
                f"(HF_HUB_OFFLINE=1): fetch it with {fetch}, or give a model folder"
            ) from None
    try:
        return Path(snapshot_download(repo, revision=revision, cache_dir=cache))
    except (OSError, ValueError) as error:  # no network, not found, gated, no token…
        reason = " ".join(str(error).split())[:300] or type(error).__name__
        raise ModelRefError(
            f"{text} is no folder here, and as a Hugging Face hub id it could not be downloaded to {cache} "
            f"({reason}): fetch it with {fetch}, or give a model folder"
        ) from None


def model_name(folder: Path) -> str:
    """The name a folder is listed by: ``owner/name`` for a hub cache snapshot
    (``…/models--owner--name/snapshots/<commit>``), else the folder's own name."""
    repo = folder.parent.parent.name
    if folder.parent.name == "snapshots" and repo.startswith("models--") and repo.count("--") == 2:
        return repo.removeprefix("models--").replace("--", "/")
    return folder.name


def served_names(value: str) -> list[str]:
    """The names a model is served under, as ``--served-model-name`` and ``WEIR_SERVED_MODEL_NAME`` give them:
    comma-separated (vLLM takes several names, SGLang one), in order, a repeat dropped; each 1 to 256 printable
    characters without spaces, else `ValueError`. Empty: none given, so the model is served under its own name
    (`model_name`: the folder's name, ``owner/name`` for a hub snapshot)."""
    names = [name.strip() for name in value.split(",") if name.strip()]
    for name in names:
        if len(name) > 256 or not name.isprintable() or any(c.isspace() for c in name):
            raise ValueError(
                f"{name[:80]!r} is no model name: 1 to 256 printable characters without spaces (several names "
                "are comma-separated)"
            )
    return list(dict.fromkeys(names))


def model_folder(value: str | os.PathLike[str]) -> Path:
    """`resolve_model`, checked: the folder holds a ``config.json`` and this process can read it and every
    weights file, else `ModelRefError` (a file another user wrote with mode 0600 is named here, at start-up,
    not as a loader's traceback)."""
    folder = resolve_model(value)
    try:
        found = (folder / "config.json").is_file()
        weights = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin"))
    except PermissionError as error:  # a folder on the way this user may not enter or list
        raise ModelRefError(
            f"{error.filename}: permission denied to this process (uid {os.getuid()}): make the model's folders "
            f"readable (chmod -R a+rX {folder}) or run the role as their owner"
        ) from None
    if not found:
        raise ModelRefError(
            f"{os.fspath(value)} is not a model folder (no config.json); give a model folder or a Hugging Face "
            "hub id (owner/name[@revision]), or create the embedded one with `weir init-model DIR`"
        )
    for file in [folder / "config.json", *weights]:
        if not os.access(file, os.R_OK):
            stat = file.stat()
            raise ModelRefError(
                f"{file} is not readable by this process (uid {os.getuid()}; the file is mode "
                f"{stat.st_mode & 0o777:04o}, owner uid {stat.st_uid}): make the model's files readable "
                f"(chmod -R a+rX {folder}) or run the role as their owner"
            )
    return folder
