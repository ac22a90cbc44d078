"""A soak: `weir train --demo` plus concurrent OpenAI chat load on the same stack, for a fixed time, watching
every process for what grows.

It starts ``weir train --demo`` (the colour task: pictures through preprocess and the encoder, async RL, weights
published every step) with far more steps than it will reach, waits for RL's first step, then runs ``--chat``
threads sending chat completions with a picture through the real ``openai`` client to the rollout role (every
fourth picture new bytes, so the caches take new entries as a long run's would). Every ``--every`` seconds it
samples, per role process and for the trainer: resident memory (RSS, and its anonymous part), regular files
open, all file descriptors, threads; and the bytes under the stack's caches and its data directory.

At the end it stops the run and reports, per series, the value at the end of ``--warmup`` and at the end, and
the growth per 10 minutes after warm-up (a least-squares slope). Anonymous memory, regular files and threads are
**flat** when that growth is under ``--tolerance`` of the post-warm-up mean (and at least 1). RSS adds the
file-backed pages of the memory-mapped feature cache, and the descriptors the sockets of the clients' keep-alive
pools: both recorded, not judged; so are the caches and the data directory (bounded by their configured size and
by training's consumption). Writes ``soak.jsonl``, ``soak.png`` (the curves) and prints the report as JSON lines.
Run from the repo root::

    .venv/bin/python tests/benchmarks/soak.py --minutes 30
    .venv/bin/python tests/benchmarks/soak.py --minutes 1 --warmup 0.3   # a smoke run

This is a script, not a pytest module: nothing in it is named ``test_*``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from launcher.demo.task import colour_picture  # noqa: E402
from launcher.stack import stack_ports  # noqa: E402

# Judged flat or not: anonymous memory (RSS less the file-backed pages: a memory-mapped feature cache's pages are
# the cache, bounded by its size, and the kernel's to drop), regular files open, threads. RSS and every descriptor
# (sockets included: the clients' keep-alive pools, bounded by their limits) are recorded and plotted too.
GAUGED = ("anon_mib", "files", "threads")
RECORDED = ("rss_mib", "fds")
SIZES = ("cache_mib", "embeddings_mib", "data_mib")  # reported


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # a file replaced meanwhile (an atomic rename)
                total += (Path(root) / name).stat().st_size
    return total


def _process_figures(pid: int) -> dict[str, float] | None:
    """RSS and anonymous memory (MiB), regular files open, all descriptors and threads of ``pid`` and its
    children (an engine's helpers)."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
        rss = shared = files = fds = threads = 0
        for p in processes:
            with p.oneshot():
                memory = p.memory_info()
                rss += memory.rss
                shared += memory.shared  # file-backed resident pages (mapped files, shared libraries)
                files += len(p.open_files())
                fds += p.num_fds()
                threads += p.num_threads()
    except psutil.Error:
        return None
    return {
        "rss_mib": rss / 2**20,
        "anon_mib": (rss - shared) / 2**20,
        "files": float(files),
        "fds": float(fds),
        "threads": float(threads),
    }


def _role_pids(base_port: int) -> dict[str, int]:
    """Each role's process, found by the port it listens on (``weir serve ROLE --port P``)."""
    wanted = {str(port): name for name, _, port in stack_ports(base_port)}
    found: dict[str, int] = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        line = p.info["cmdline"] or []
        if "serve" in line and "--port" in line:
            port = line[line.index("--port") + 1] if line.index("--port") + 1 < len(line) else ""
            if port in wanted:
                found[wanted[port]] = int(p.info["pid"])
    return found


class ChatLoad:
    """``threads`` clients sending chat completions with a picture through the ``openai`` package."""

    def __init__(self, rollout_url: str, token: str, media: Path, threads: int) -> None:
        from openai import OpenAI

        self.client = OpenAI(base_url=f"{rollout_url}/v1", api_key=token, max_retries=0, timeout=120)
        self.model = self.client.models.list().data[0].id  # the served model's name
        self.media, self.threads = media, threads
        self.sent = self.failed = 0
        self.errors: dict[str, int] = {}
        self._stop = threading.Event()
        self._workers = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def start(self) -> None:
        for worker in self._workers:
            worker.start()

    def stop(self) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.join(150)

    def _run(self, index: int) -> None:
        k = 0
        while not self._stop.is_set():
            # every 4th picture is new (the caches grow as a run's media do); the rest are seen ones
            seed = 10_000 * (index + 1) + (k if k % 4 == 0 else k % 16)
            path = self.media / "soak" / f"{seed}.png"
            if not path.is_file():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(colour_picture("red" if seed % 2 else "blue", seed))
            try:
                self.client.chat.completions.create(
                    model=self.model,
                    messages=[
                        {
                            "role": "user",
                            "content": [
                                {"type": "image_url", "image_url": {"url": str(path)}},
                                {"type": "text", "text": "What colour is the picture?"},
                            ],
                        }
                    ],
                    max_tokens=8,
                )
                self.sent += 1
            except Exception as error:  # noqa: BLE001 - counted by type: the report says what failed
                self.failed += 1
                name = type(error).__name__
                self.errors[name] = self.errors.get(name, 0) + 1
                time.sleep(0.5)
            k += 1


def _slope_per_10min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value), per 600 s."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    var = sum((t - mx) ** 2 for t, _ in points)
    return 0.0 if var == 0 else 600.0 * sum((t - mx) * (v - my) for t, v in points) / var


def report(samples: list[dict[str, Any]], warmup_s: float, tolerance: float) -> list[dict[str, Any]]:
    """One line per (process, series): at warm-up's end, at the end, growth per 10 min after warm-up, flat."""
    out = []
    names = sorted({name for s in samples for name in s["processes"]})
    for name in names:
        for series in (*GAUGED, *RECORDED):
            points = [(s["t"], s["processes"][name][series]) for s in samples if name in s["processes"]]
            after = [(t, v) for t, v in points if t >= warmup_s]
            if len(after) < 2:
                continue
            mean = sum(v for _, v in after) / len(after)
            slope = _slope_per_10min(after)
            out.append(
                {
                    "process": name,
                    "series": series,
                    "at_warmup": round(after[0][1], 1),
                    "at_end": round(after[-1][1], 1),
                    "growth_per_10min": round(slope, 2),
                    # counts (files, threads) in the tens: one more in 10 minutes is not a trend
                    **({"flat": abs(slope) <= max(tolerance * mean, 1.0)} if series in GAUGED else {}),
                }
            )
    for series in SIZES:
        after = [(s["t"], s["sizes"][series]) for s in samples if s["t"] >= warmup_s]
        if len(after) >= 2:
            out.append(
                {
                    "process": "disk",
                    "series": series,
                    "at_warmup": round(after[0][1], 1),
                    "at_end": round(after[-1][1], 1),
                    "growth_per_10min": round(_slope_per_10min(after), 2),
                }
            )
    return out


def plot(samples: list[dict[str, Any]], warmup_s: float, path: Path) -> Path:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 12))
    axes = figure.subplots(6, 1, sharex=True)
    names = sorted({name for s in samples for name in s["processes"]})
    labels = ("anonymous memory (MiB)", "regular files open", "threads", "RSS (MiB)", "descriptors (with sockets)")
    for axis, series, label in zip(axes[:5], (*GAUGED, *RECORDED), labels, strict=True):
        for name in names:
            points = [(s["t"] / 60, s["processes"][name][series]) for s in samples if name in s["processes"]]
            if points:
                axis.plot(*zip(*points, strict=True), label=name)
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    axes[0].legend(loc="upper left", fontsize=7, ncol=3)
    for series in SIZES:
        axes[5].plot([s["t"] / 60 for s in samples], [s["sizes"][series] for s in samples], label=series)
    axes[5].set_ylabel("MiB on disk")
    axes[5].legend(loc="upper left", fontsize=7)
    axes[5].grid(alpha=0.3)
    axes[5].set_xlabel("minutes")
    for axis in axes:
        axis.axvline(warmup_s / 60, color="grey", linestyle="--", linewidth=1)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long to soak (default: 30)")
    parser.add_argument("--warmup", type=float, default=5.0, help="minutes not judged (default: 5)")
    parser.add_argument("--every", type=float, default=15.0, help="seconds between samples (default: 15)")
    parser.add_argument("--chat", type=int, default=2, help="concurrent chat clients (default: 2)")
    parser.add_argument("--tolerance", type=float, default=0.05, help="flat: growth per 10 min under this share")
    parser.add_argument("--home", type=Path, default=None, help="the stack's home (default: a temporary folder)")
    parser.add_argument("--base-port", type=int, default=19500, help="the stack's base port (default: 19500)")
    parser.add_argument("--out", type=Path, default=Path(".weir/soak"), help="report folder (default: .weir/soak)")
    args = parser.parse_args()
    import tempfile

    home = args.home or Path(tempfile.mkdtemp(prefix="weir-soak-"))
    args.out.mkdir(parents=True, exist_ok=True)
    log = open(args.out / "train.log", "wb")  # noqa: SIM115 - closed at the end
    train = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launcher.cli",
            "train",
            "--demo",
            "--steps",
            "1000000",
            "--home",
            str(home),
            "--base-port",
            str(args.base_port),
        ],  # fmt: skip
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    rollout = f"http://127.0.0.1:{args.base_port}"
    try:
        deadline = time.monotonic() + 600
        # The clock starts at RL's first step (the stack started, the warm-up done): from then on every role works.
        while not (home / "api-token").is_file() or not _ready(rollout) or _last_step(Path(log.name)) is None:
            if train.poll() is not None or time.monotonic() > deadline:
                print(json.dumps({"soak": "failed", "why": "RL did not start", "log": str(log.name)}))
                return 1
            time.sleep(1)
        load = ChatLoad(rollout, (home / "api-token").read_text().strip(), home / "media", args.chat)
        load.start()
        samples: list[dict[str, Any]] = []
        start = time.monotonic()
        total = args.minutes * 60
        with tqdm(total=round(total), unit="s", desc="soak") as bar, open(args.out / "soak.jsonl", "w") as jsonl:
            while (now := time.monotonic() - start) < total and train.poll() is None:
                pids = {**_role_pids(args.base_port), "trainer": train.pid}
                figures = {name: f for name, pid in pids.items() if (f := _process_figures(pid)) is not None}
                sizes = {
                    "cache_mib": _tree_bytes(home / "cache") / 2**20,
                    "embeddings_mib": _tree_bytes(home / "embeddings") / 2**20,
                    "data_mib": _tree_bytes(home / "data") / 2**20,
                }
                sample = {"t": now, "processes": figures, "sizes": sizes, "chat_sent": load.sent}
                samples.append(sample)
                jsonl.write(json.dumps(sample) + "\n")
                jsonl.flush()
                bar.update(round(now) - bar.n)
                bar.set_postfix(chats=load.sent, failed=load.failed)
                time.sleep(args.every)
        load.stop()
        warmup_s = args.warmup * 60
        lines = report(samples, warmup_s, args.tolerance)
        for line in lines:
            print(json.dumps(line))
        steps = _last_step(Path(log.name))
        summary = {
            "soak": "done" if train.poll() is None else "the run ended early",
            "minutes": round((time.monotonic() - start) / 60, 1),
            "steps": steps,
            "chat_sent": load.sent,
            "chat_failed": load.failed,
            "chat_errors": load.errors,
            "flat": all(line.get("flat", True) for line in lines),
            "plot": str(plot(samples, warmup_s, args.out / "soak.png")),
        }
        print(json.dumps(summary))
        return 0 if summary["flat"] and summary["soak"] == "done" else 1
    finally:
        roles = _role_pids(args.base_port)  # before the run stops: what it must stop with it
        if train.poll() is None:
            os.killpg(train.pid, signal.SIGINT)  # Ctrl-C: the run stops its stack on the way out
            try:
                train.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(train.pid, signal.SIGKILL)
        left = {name: pid for name, pid in roles.items() if psutil.pid_exists(pid)}
        if left:  # a finding, not the soak's to hide: say it, then leave no stack behind
            print(json.dumps({"soak": "roles left running after the run stopped", "roles": sorted(left)}))
            for pid in left.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        log.close()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _last_step(log: Path) -> int | None:
    """The last ``step N/total`` the run printed."""
    import re

    steps = re.findall(rb"step (\d+)/\d+", log.read_bytes())
    return int(steps[-1]) if steps else None


if __name__ == "__main__":
    sys.exit(main())
