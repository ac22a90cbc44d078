"""The one rule for media paths (`services.media_roots`): files under the roots, nothing else."""

from __future__ import annotations

from pathlib import Path

from services.media_roots import locate


def test_paths_resolve_under_the_roots_only(tmp_path: Path) -> None:
    first, second, outside = tmp_path / "a", tmp_path / "b", tmp_path / "secret"
    for folder in (first, second, outside):
        folder.mkdir()
    (second / "clip.mp4").write_bytes(b"x")
    (outside / "key").write_bytes(b"k")
    (first / "escape").symlink_to(outside / "key")
    roots = [first, second]
    assert locate("clip.mp4", roots).file == (second / "clip.mp4").resolve()  # tried under each root in turn
    assert locate(str(second / "clip.mp4"), roots).file is not None
    assert locate("missing.png", roots).file is None and locate("missing.png", roots).inside
    for hostile in ("../secret/key", str(outside / "key"), "/etc/passwd"):
        found = locate(hostile, roots)
        assert found.file is None and not found.inside, hostile
    # A link out of a root is never followed (under the other root the name is merely missing).
    assert locate("escape", roots).file is None and locate("escape", [first]) == locate("../secret/key", [first])
    assert locate("clip.mp4", []).file is None
