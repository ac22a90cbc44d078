"""`wire.aiohttp_transport`: a role's async client sends through aiohttp's pool, and every failure is named by what
happened on the wire — only a connection that never opened is "not sent" (and so retried), never a server that
read the request and hung up. Real sockets on loopback: a plain asyncio server that misbehaves on purpose."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Coroutine

import httpx
import pytest

from services.http import async_client

# a request read whole, and its connection (the reader: the rest of what the client sends)
Handler = Callable[[bytes, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")),
        0,
    )
    return head + await reader.readexactly(length)


async def _serving(handler: Handler, call: Callable[[str], Awaitable[object]]) -> tuple[object, int]:
    """``call(base_url)`` against a server whose connections ``handler`` answers; (its result, requests read)."""
    seen = 0

    async def counted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal seen
        try:
            while True:
                request = await _read_request(reader)
                seen += 1
                await handler(request, reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(counted, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        try:
            return await call(f"http://127.0.0.1:{port}"), seen
        finally:
            server.close()


def _post(*, retry_s: float = 5.0, timeout: float = 10.0) -> Callable[[str], Coroutine[None, None, object]]:
    async def call(url: str) -> object:
        async with async_client(url, token="t", timeout=timeout, connect_retry_s=retry_s) as client:
            response = await client.post("/v1/x", content=b'{"a": 1}', headers={"content-type": "application/json"})
            return response.status_code, response.json()

    return call


def test_an_answer_comes_back_whole_with_the_token_and_body_sent() -> None:
    async def answer(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert b"authorization: Bearer t" in request.replace(b"Authorization", b"authorization")
        assert request.endswith(b'{"a": 1}')
        body = b'{"ok": true}'
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
        writer.write(head + body)
        await writer.drain()

    result, seen = asyncio.run(_serving(answer, _post()))
    assert result == (200, {"ok": True}) and seen == 1


def test_a_server_that_reads_the_request_and_hangs_up_is_a_read_error_sent_once() -> None:
    received: list[bytes] = []

    async def hang_up(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(request)
        writer.close()
        raise ConnectionError("closed on purpose")

    with pytest.raises(httpx.TransportError) as caught:
        asyncio.run(_serving(hang_up, _post(retry_s=5.0)))
    # not a connect error: the request went out, so the retry budget (5 s) must not send it again
    assert not isinstance(caught.value, httpx.ConnectError | httpx.ConnectTimeout)
    assert isinstance(caught.value, httpx.RemoteProtocolError | httpx.ReadError)
    assert len(received) == 1


def test_a_server_reset_mid_answer_is_a_read_error() -> None:
    async def half(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{"ok')
        await writer.drain()
        writer.close()
        raise ConnectionError("closed on purpose")

    with pytest.raises(httpx.TransportError) as caught:
        asyncio.run(_serving(half, _post()))
    assert not isinstance(caught.value, httpx.ConnectError | httpx.ConnectTimeout)


def test_a_silent_server_is_a_read_timeout() -> None:
    async def silent(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client gives up and closes (a handler still open holds the server's close)

    with pytest.raises(httpx.ReadTimeout):
        asyncio.run(_serving(silent, _post(timeout=1.0)))


def test_a_refused_connection_is_a_connect_error() -> None:
    with socket.socket() as held:  # bound, never listening: connections to it are refused
        held.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{held.getsockname()[1]}"
        with pytest.raises(httpx.ConnectError):
            asyncio.run(_post(retry_s=0)(url))


def test_a_malformed_answer_is_a_protocol_error_not_an_aiohttp_one() -> None:
    async def garbled(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 2x0 NOT A STATUS\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()

    with pytest.raises(httpx.RemoteProtocolError):
        asyncio.run(_serving(garbled, _post()))


def test_a_peer_that_never_reads_the_body_times_the_call_out() -> None:
    """aiohttp has no write timeout of its own; the call is bounded all the same, and not as a connect error."""

    async def deaf(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")  # the head, then nothing more is read: the body backs up
        await asyncio.sleep(30)

    async def run() -> None:
        server = await asyncio.start_server(deaf, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            async with async_client(url, token=None, timeout=1.0, connect_retry_s=5) as client:
                await client.post("/big", content=b"x" * (64 << 20))
        finally:
            server.close()

    with pytest.raises(httpx.TimeoutException) as caught:
        asyncio.run(run())
    assert not isinstance(caught.value, httpx.ConnectTimeout)
