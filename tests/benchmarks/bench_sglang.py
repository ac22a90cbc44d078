"""Weir's engine role on SGLang against SGLang's own server, on the same model, under the same load.

    python tests/benchmarks/bench_sglang.py --model DIR                 # a GPU with sglang: both as servers
    python tests/benchmarks/bench_sglang.py --cpu                       # the real engine on this CPU
    python tests/benchmarks/bench_sglang.py --backend standin           # CPU: both on the SGLang stand-in
    … [--concurrency 1 64 256] [--requests 512] [--max-new-tokens 128] [--out FILE.json]

With sglang installed (``--backend sglang``, the default when it imports), the peer is ``python -m
sglang.launch_server`` and Weir is ``weir serve engine --backend sglang``, each a process of its own on the
same GPU, one after the other; with ``--cpu``, on the CPU under the test scaffolding of
``tests/engines/sglang_cpu.py`` (its ``SERVER_ARGS`` added to both). Without sglang (``--backend standin``),
both run in this process on the rule-keeping stand-in of ``tests/engines/sglang_standin.py``: the peer is a
server shaped like SGLang's ``http_server`` (the tokenizer manager on the server's own loop), Weir is the engine
role with `SGLangEngine` — the harness is then tested, and the figure is the cost of Weir's layer (its owned
loop, its request checks), not a GPU's.

The same client drives both: ``concurrency`` requests always in flight, ``--requests`` in all, each with
``ignore_eos`` and ``max_new_tokens`` so every answer has the same length. It prints requests/s and
generated tokens/s per concurrency, and Weir's as a share of the peer's (goal ≥ 95 %).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


async def drive(url: str, *, concurrency: int, requests: int, max_new_tokens: int, vocab: int) -> dict[str, float]:
    """``requests`` /generate calls, ``concurrency`` at a time; requests/s and tokens/s over the wall time."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    generated = 0
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    bar = tqdm(total=requests, desc=f"  c={concurrency}", leave=False, file=sys.stderr)

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal generated
        while not queue.empty():
            i = queue.get_nowait()
            body = {
                "input_ids": [1 + (i * 7 + k) % (vocab - 1) for k in range(16)],
                "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 1.0},
            }
            answer = await client.post(f"{url}/generate", json=body)
            answer.raise_for_status()
            generated += len(answer.json()["output_ids"])
            bar.update()

    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    bar.close()
    return {"requests_per_s": requests / wall, "tokens_per_s": generated / wall, "wall_s": wall, "tokens": generated}


# -- the stand-in pair (CPU) ---------------------------------------------------------------------------


@contextlib.contextmanager
def standin_modules(vocab: int, step_s: float) -> Iterator[None]:
    from tests.engines import sglang_standin as standin

    fake = {
        "sglang": types.SimpleNamespace(Engine=functools.partial(standin.Engine, vocab=vocab, step_s=step_s)),
        "sglang.srt": types.SimpleNamespace(),
        "sglang.srt.managers": types.SimpleNamespace(io_struct=standin.io_struct),
    }
    saved = {name: sys.modules.get(name) for name in fake}
    sys.modules.update(fake)  # type: ignore[arg-type]
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def standin_peer_app(model: Path, vocab: int, step_s: float) -> Any:
    """SGLang's http_server, reduced to /generate: the Engine made on the server's running loop, each request
    the tokenizer manager's generator awaited on it (as SGLang's own FastAPI handler does)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI

    from tests.engines import sglang_standin as standin

    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        state["engine"] = standin.Engine(vocab=vocab, step_s=step_s, model_path=str(model))
        yield
        state["engine"].shutdown()

    app = FastAPI(lifespan=lifespan)

    @app.post("/generate")
    async def generate(body: dict[str, Any]) -> Any:
        import uuid

        manager = state["engine"].tokenizer_manager
        obj = standin.GenerateReqInput(rid=uuid.uuid4().hex, **body)
        return await manager.generate_request(obj).__anext__()

    return app


@contextlib.contextmanager
def standin_servers(model: Path, vocab: int, step_s: float, which: str) -> Iterator[str]:
    from services.engine.app import create_app
    from services.engine.settings import EngineSettings
    from tests.services.conftest import RunningServer

    if which == "peer":
        with RunningServer(standin_peer_app(model, vocab, step_s)) as server:
            yield server.url
        return
    with standin_modules(vocab, step_s):
        settings = EngineSettings(
            model=model,
            backend="sglang",
            sglang_args={"max_running_requests": 1024},
            cache_dir=model.parent / "cache",
            embedding_cache_dir=model.parent / "emb",
        )
        with RunningServer(create_app(settings)) as server:
            yield server.url


# -- the real pair (GPU, sglang installed) ---------------------------------------------------------------


@contextlib.contextmanager
def process_server(command: list[str], url: str, env: dict[str, str], timeout_s: float = 900) -> Iterator[str]:
    process = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{command[0:4]} exited with {process.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not healthy in {timeout_s} s")
            time.sleep(2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


def sglang_servers(model: Path, which: str, port: int, server_args: dict[str, Any], cpu: bool = False) -> Any:
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    # on the CPU each server runs under the test scaffolding (`python -m tests.engines.sglang_cpu MODULE`)
    python = [sys.executable, "-m", "tests.engines.sglang_cpu"] if cpu else [sys.executable, "-m"]
    if cpu:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if which == "peer":
        command = [*python, "sglang.launch_server", "--model-path", str(model), "--port", str(port)]
        for name, value in server_args.items():
            flag = f"--{name.replace('_', '-')}"
            if isinstance(value, bool):  # SGLang's boolean arguments are flags: present or not
                command += [flag] if value else []
            else:
                command += [flag, str(value)]
        return process_server(command, url, env)
    env.update({"WEIR_MODEL": str(model), "WEIR_SGLANG_ARGS": json.dumps(server_args), "WEIR_API_TOKEN": ""})
    env.update({"WEIR_CACHE_DIR": str(model.parent / "cache"), "WEIR_EMBEDDING_CACHE_DIR": str(model.parent / "emb")})
    command = [*python, "launcher.cli", "serve", "engine", "--backend", "sglang", "--port", str(port)]
    return process_server(command, url, env)


# -- the comparison ------------------------------------------------------------------------------------


def run(
    *,
    backend: str,
    model: Path,
    concurrency: list[int],
    requests: int,
    max_new_tokens: int,
    step_s: float = 0.002,
    port: int | None = None,
    server_args: dict[str, Any] | None = None,
    cpu: bool = False,
) -> dict[str, Any]:
    if cpu:
        from tests.engines.sglang_cpu import SERVER_ARGS

        server_args = {**SERVER_ARGS, **(server_args or {})}
    from tests.ports import free_port

    config = json.loads((model / "config.json").read_text())
    text = config.get("text_config") or config.get("thinker_config", {}).get("text_config") or config
    vocab = int(text["vocab_size"])
    results: dict[str, Any] = {"backend": backend, "model": str(model), "max_new_tokens": max_new_tokens, "runs": []}
    results["device"] = "cpu" if cpu else "gpu"
    for which in ("peer", "weir"):
        # each server on a port of its own: the peer's, just stopped, was still held when Weir's role bound it
        # (a CI run under load: "address already in use")
        own_port = port if port is not None and which == "peer" else free_port()
        servers = (
            standin_servers(model, vocab, step_s, which)
            if backend == "standin"
            else sglang_servers(model, which, own_port, server_args or {}, cpu)
        )
        with servers as url:
            for c in concurrency:
                measured = asyncio.run(
                    drive(url, concurrency=c, requests=max(requests, c), max_new_tokens=max_new_tokens, vocab=vocab)
                )
                results["runs"].append({"server": which, "concurrency": c, **measured})
                rates = f"{measured['requests_per_s']:8.1f} req/s {measured['tokens_per_s']:10.0f} tok/s"
                print(f"{which:>5}  c={c:<4} {rates}")
    for c in concurrency:
        peer, weir = (
            next(r for r in results["runs"] if r["server"] == s and r["concurrency"] == c) for s in ("peer", "weir")
        )
        share = weir["tokens_per_s"] / peer["tokens_per_s"]
        results.setdefault("weir_share", {})[str(c)] = share
        print(f"c={c:<4} Weir / SGLang's server: {share:6.1%} of tokens/s (goal ≥ 95 %)")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    try:
        import sglang  # noqa: F401

        default_backend = "sglang"
    except ImportError:
        default_backend = "standin"
    parser.add_argument("--backend", choices=("sglang", "standin"), default=default_backend)
    parser.add_argument("--model", type=Path, default=None, help="a model folder (default: the tiny model, made here)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--requests", type=int, default=512, help="requests per concurrency (at least the concurrency)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--sglang-args", default="{}", help="server arguments for both servers (JSON)")
    parser.add_argument(
        "--cpu", action="store_true", help="the real engine on this CPU (tests/engines/sglang_cpu.py's scaffolding)"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        import tempfile

        from encoders.embedded_model import init_model

        # a family SGLang serves natively
        model = init_model(Path(tempfile.mkdtemp(prefix="weir-bench-")) / "model", arch="qwen3-vl")
    results = run(
        backend=args.backend,
        model=model,
        concurrency=args.concurrency,
        requests=args.requests,
        max_new_tokens=args.max_new_tokens,
        server_args=json.loads(args.sglang_args),
        cpu=args.cpu,
    )
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
