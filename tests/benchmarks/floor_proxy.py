"""The floor of a rollout layer: the least any service between a client and the engine can add to a call.

A bare ASGI app on uvicorn (uvloop, httptools: the roles' server) that forwards a ``POST /generate`` body to the
engine through one aiohttp session and answers with the engine's bytes — no schema, no tokenizer, no middleware.
With ``--journal`` it also appends the answer to a file and fsyncs it before answering (inline, on the event loop:
the cheapest durable record there is, one write and one fsync). `bench_rollout.py`'s overhead measurement runs it
as a process beside the stack and states Weir's added milliseconds against this floor's.

    python tests/benchmarks/floor_proxy.py --port 8190 --engine http://127.0.0.1:30000 [--journal FILE]
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import aiohttp
import uvicorn


def make_app(engine: str, journal: str | None) -> Any:
    session: aiohttp.ClientSession | None = None
    fd = os.open(journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if journal else None

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        nonlocal session
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            if session is not None:
                await session.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        headers = {k.decode(): v.decode() for k, v in scope["headers"] if k in (b"authorization", b"content-type")}
        if session is None:
            session = aiohttp.ClientSession()
        async with session.post(f"{engine}{scope['path']}", data=body, headers=headers) as response:
            status, answer = response.status, await response.read()
        if fd is not None and status == 200:
            os.write(fd, answer + b"\n")
            os.fsync(fd)
        head = [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": head})
        await send({"type": "http.response.body", "body": answer})

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--engine", required=True, help="the engine's base URL")
    parser.add_argument("--journal", default=None, help="append each answer here and fsync it before answering")
    args = parser.parse_args()
    app = make_app(args.engine.rstrip("/"), args.journal)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
