"""Weight files readable as any other file the process writes.

safetensors creates every file it writes with mode 0600, whatever the umask, so a model folder written by
one user could only be read by that user: a compose one-shot service writing the model as root left the
engine and the encoder (uid 10001) unable to open it, and a trainer's published weights had the same trap.
Every folder of weights Weir writes (`weir init-model`, a trainer's export, `weir export-hf`, the towers sent
to the encoder) is therefore given, after writing, the mode the process's umask gives an ordinary new file
(0644 under the usual umask 022; a user who wants them private sets umask 077 and gets 0600).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["as_umask_allows", "current_umask"]


def current_umask() -> int:
    """The process's umask, read from /proc (Linux) so that no other thread sees it changed; elsewhere set and
    restored at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def as_umask_allows(path: str | Path) -> Path:
    """``path`` (a file, or every file directly in a folder) given mode ``0o666 & ~umask``; returns it."""
    root = Path(path)
    mode = 0o666 & ~current_umask()
    files = [root] if root.is_file() else [f for f in root.iterdir() if f.is_file() and not f.is_symlink()]
    for file in files:
        os.chmod(file, mode)
    return root
