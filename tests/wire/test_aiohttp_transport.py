"""`wire.aiohttp_transport`: a role's async client sends through aiohttp's pool, and every failure is named by what
happened on the wire — only a connection that never opened is "not sent" (and so retried), never a server that
read the request and hung up. Real sockets on loopback: a plain asyncio server that misbehaves on purpose."""

from __future__ import annotations

import asyncio
import gzip
import socket
from collections.abc import Awaitable, Callable, Coroutine

import httpx
import pytest

from services.http import async_client
from services.logs import REQUEST_ID
from wire.pooled_client import PooledAsyncClient

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


# Each call goes out both ways a role's client sends: httpx's own (`client.post`, streams and any other call) and the
# short way a role client's call answered whole takes (`PooledAsyncClient.read_whole`); they must fail alike.
WAYS = ("httpx", "read_whole")


async def _send(client: httpx.AsyncClient, way: str, url: str, path: str, content: bytes) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if way == "httpx":
        return await client.post(path, content=content, headers=headers)
    assert isinstance(client, PooledAsyncClient)
    return await client.read_whole("POST", f"{url}{path}", headers=headers, content=content)


def _post(way: str, *, retry_s: float = 5.0, timeout: float = 10.0) -> Callable[[str], Coroutine[None, None, object]]:
    async def call(url: str) -> object:
        async with async_client(url, token="t", timeout=timeout, connect_retry_s=retry_s) as client:
            response = await _send(client, way, url, "/v1/x", b'{"a": 1}')
            return response.status_code, response.json()

    return call


@pytest.mark.parametrize("way", WAYS)
def test_an_answer_comes_back_whole_with_the_token_and_body_sent(way: str) -> None:
    async def answer(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert b"authorization: Bearer t" in request.replace(b"Authorization", b"authorization")
        assert request.endswith(b'{"a": 1}')
        body = b'{"ok": true}'
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
        writer.write(head + body)
        await writer.drain()

    result, seen = asyncio.run(_serving(answer, _post(way)))
    assert result == (200, {"ok": True}) and seen == 1


@pytest.mark.parametrize("way", WAYS)
def test_a_server_that_reads_the_request_and_hangs_up_is_a_read_error_sent_once(way: str) -> None:
    received: list[bytes] = []

    async def hang_up(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(request)
        writer.close()
        raise ConnectionError("closed on purpose")

    with pytest.raises(httpx.TransportError) as caught:
        asyncio.run(_serving(hang_up, _post(way, retry_s=5.0)))
    # not a connect error: the request went out, so the retry budget (5 s) must not send it again
    assert not isinstance(caught.value, httpx.ConnectError | httpx.ConnectTimeout)
    assert isinstance(caught.value, httpx.RemoteProtocolError | httpx.ReadError)
    assert len(received) == 1


@pytest.mark.parametrize("way", WAYS)
def test_a_server_reset_mid_answer_is_a_read_error(way: str) -> None:
    async def half(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{"ok')
        await writer.drain()
        writer.close()
        raise ConnectionError("closed on purpose")

    with pytest.raises(httpx.TransportError) as caught:
        asyncio.run(_serving(half, _post(way)))
    assert not isinstance(caught.value, httpx.ConnectError | httpx.ConnectTimeout)


@pytest.mark.parametrize("way", WAYS)
def test_a_silent_server_is_a_read_timeout(way: str) -> None:
    async def silent(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client gives up and closes (a handler still open holds the server's close)

    with pytest.raises(httpx.ReadTimeout):
        asyncio.run(_serving(silent, _post(way, timeout=1.0)))


@pytest.mark.parametrize("way", WAYS)
def test_a_refused_connection_is_a_connect_error(way: str) -> None:
    with socket.socket() as held:  # bound, never listening: connections to it are refused
        held.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{held.getsockname()[1]}"
        with pytest.raises(httpx.ConnectError):
            asyncio.run(_post(way, retry_s=0)(url))


@pytest.mark.parametrize("way", WAYS)
def test_a_malformed_answer_is_a_protocol_error_not_an_aiohttp_one(way: str) -> None:
    async def garbled(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 2x0 NOT A STATUS\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()

    with pytest.raises(httpx.RemoteProtocolError):
        asyncio.run(_serving(garbled, _post(way)))


@pytest.mark.parametrize("way", WAYS)
def test_a_peer_that_never_reads_the_body_times_the_call_out(way: str) -> None:
    """aiohttp has no write timeout of its own; the call is bounded all the same, and not as a connect error."""

    async def deaf(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")  # the head, then nothing more is read: the body backs up
        await asyncio.sleep(30)

    async def run() -> None:
        server = await asyncio.start_server(deaf, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            async with async_client(url, token=None, timeout=1.0, connect_retry_s=5) as client:
                await _send(client, way, url, "/big", b"x" * (64 << 20))
        finally:
            server.close()

    with pytest.raises(httpx.TimeoutException) as caught:
        asyncio.run(run())
    assert not isinstance(caught.value, httpx.ConnectTimeout)


def test_the_short_way_sends_and_answers_as_httpx_does() -> None:
    """The same call both ways: the same request on the wire (the client's headers, the request hook's id, the query),
    and the same answer — status, headers and the body decoded by its Content-Encoding (a 4xx is an answer, not an
    error: reading it is the role client's)."""
    body = gzip.compress(b'{"error": {"code": "nope"}}')
    requests: list[bytes] = []

    async def answer(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests.append(request)
        head = b"HTTP/1.1 409 Conflict\r\ncontent-encoding: gzip\r\ncontent-length: %d\r\n\r\n" % len(body)
        writer.write(head + body)
        await writer.drain()

    async def both(url: str) -> list[tuple[int, str, bytes, str]]:
        REQUEST_ID.set("req-1")
        answers = []
        async with async_client(url, token="t", timeout=10.0) as client:
            assert isinstance(client, PooledAsyncClient)
            json = {"content-type": "application/json"}
            for response in (
                await client.post("/v1/x", content=b"{}", params={"a": 1}, headers=json),
                await client.read_whole("POST", f"{url}/v1/x", content=b"{}", params={"a": 1}, headers=json),
            ):
                answers.append(
                    (response.status_code, response.reason_phrase, response.content, response.request.url.path)
                )
        return answers

    (httpx_way, short_way), seen = asyncio.run(_serving(answer, both))
    assert seen == 2 and httpx_way == short_way == (409, "Conflict", b'{"error": {"code": "nope"}}', "/v1/x")

    def heads(request: bytes) -> set[bytes]:
        lines = request.split(b"\r\n\r\n")[0].lower().split(b"\r\n")
        return set(lines)

    assert heads(requests[0]) == heads(requests[1])
    assert {b"post /v1/x?a=1 http/1.1", b"authorization: bearer t", b"x-request-id: req-1"} <= heads(requests[1])


def test_the_short_way_retries_a_refused_connection_until_the_role_listens() -> None:
    async def run() -> object:
        with socket.socket() as held:  # bound, not yet listening: refused until the "restarted" role listens
            held.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{held.getsockname()[1]}"

            async def listen_later() -> asyncio.Server:
                await asyncio.sleep(0.5)
                return await asyncio.start_server(_answer_ok, sock=held)

            later = asyncio.create_task(listen_later())
            async with async_client(url, token=None, timeout=10.0, connect_retry_s=30) as client:
                assert isinstance(client, PooledAsyncClient)
                response = await client.read_whole("GET", f"{url}/ready", headers={})
            (await later).close()
            return response.status_code, response.json()

    assert asyncio.run(run()) == (200, {"ok": True})


async def _answer_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _read_request(reader)
    body = b'{"ok": true}'
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    writer.close()


@pytest.mark.parametrize("way", WAYS)
def test_a_slow_but_steady_body_is_read_past_the_bound_on_the_head(way: str) -> None:
    """The call's bound (connect + write + read: 3 s under a 1 s timeout) ends at the answer's head; its body is
    bounded by each read alone, both ways: 12 bytes, one every 0.3 s, 3.6 s in all (a stall of the loop under 0.7 s
    still reads each in time)."""

    async def trickle(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 12\r\n\r\n")
        await writer.drain()
        for byte in b'{"a":"xxxx"}':
            await asyncio.sleep(0.3)
            writer.write(bytes([byte]))
            await writer.drain()

    result, seen = asyncio.run(_serving(trickle, _post(way, timeout=1.0)))
    assert result == (200, {"a": "xxxx"}) and seen == 1


def test_a_closed_client_refuses_the_short_way_as_httpx_does() -> None:
    async def run() -> None:
        client = async_client("http://127.0.0.1:9", token=None, timeout=1.0)
        assert isinstance(client, PooledAsyncClient)
        await client.aclose()
        with pytest.raises(RuntimeError, match="client has been closed"):
            await client.read_whole("GET", "http://127.0.0.1:9/", headers={})

    asyncio.run(run())
