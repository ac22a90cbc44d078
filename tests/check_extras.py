"""Every extra of pyproject.toml resolves: ``pip install --dry-run --ignore-installed -e '.[X]'`` for the base
install and each extra, from package metadata alone (no GPU; wheels are not installed). A conflict — such as
a base pin that SGLang's own pins exclude — fails here, in `make test`, before any image is built.

    python tests/check_extras.py            (run by `make test`)
"""

from __future__ import annotations

import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    extras = sorted(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    failed = []
    for extra in ["", *extras]:
        target = f".[{extra}]" if extra else "."
        start = time.monotonic()
        run = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "-e", target],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        verdict = "resolves" if run.returncode == 0 else "DOES NOT RESOLVE"
        print(f"[extras] {target:<12} {verdict} ({time.monotonic() - start:.0f} s)", flush=True)
        if run.returncode != 0:
            failed.append(target)
            print("\n".join(line for line in run.stderr.splitlines() if not line.startswith("WARNING: Location")))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
