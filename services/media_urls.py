"""Where a role may fetch media from by URL: one rule for every role that takes ``http(s)`` media (the
preprocess role's ``url`` items, the engine role's SGLang ``image_data`` / ``video_data`` / ``audio_data``).

The settings (`MediaUrls`, mixed into each role's settings class, so the variables are the same in every
role):

- ``WEIR_ALLOW_URLS`` (default off): when off, every URL is refused (403 ``url_disabled``).
- ``WEIR_ALLOW_PRIVATE_URLS`` (default off): when off, every address the host resolves to must be public
  (``is_global``: no loopback, private, link-local, shared or reserved address) — 403 ``url_not_allowed``.
- ``WEIR_MEDIA_URL_HOSTS`` (optional, ``,``-separated ``host`` or ``host:port``): when set, the URL's host
  (and port) must also be on it — 403 ``url_not_allowed``. A test allows ``127.0.0.1:PORT`` with it
  together with ``WEIR_ALLOW_PRIVATE_URLS``.
- ``WEIR_MEDIA_URL_TIMEOUT_S``: each connect and read, and the whole fetch (redirects and body included).

The fetch (`fetch_url`): ``http(s)`` only (400 ``bad_url``); a GET with no proxy from the environment (the
checks name the host actually connected to); redirects followed by hand, at most `MAX_REDIRECTS`, each hop
checked against every rule above again; the body streamed and cut at the role's cap, counted after
decompression so a compressed bomb is cut too (413 ``media_too_large``); past the deadline 422
``url_timeout``; unresolvable, unreachable, not 2xx or too many redirects 422 ``url_fetch_failed``. The
roles only say where the error points (the item index or the field name) and which byte cap applies.

Known gap: the addresses are checked, then httpx resolves the name again to connect; a DNS server that
answers differently the second time (rebinding) is not stopped here. Deployments that enable URLs should
also restrict egress at the network layer. Name resolution for the check is not bounded by the timeout.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Callable, Sequence
from typing import Annotated
from urllib.parse import urljoin, urlsplit

import httpx
from pydantic import AfterValidator, BaseModel, BeforeValidator, Field
from pydantic_settings import NoDecode

from .errors import ApiError

__all__ = ["MAX_REDIRECTS", "MediaUrlHosts", "MediaUrls", "fetch_url", "host_allowed"]

MAX_REDIRECTS = 5
_DEFAULT_PORTS = {"http": 80, "https": 443}
_Error = Callable[[int, str, str], ApiError]  # builds a refusal pointing where the role says


def _split_hosts(value: object) -> object:
    return [h.strip() for h in value.split(",") if h.strip()] if isinstance(value, str) else value


def _check_hosts(hosts: list[str]) -> list[str]:
    out = []
    for entry in hosts:
        parts = urlsplit(f"//{entry}")
        try:
            port = parts.port
        except ValueError:
            port = None
            parts = urlsplit("//")  # an out-of-range port: refused below
        if not parts.hostname or parts.path or parts.query or parts.username is not None:
            raise ValueError(f"{entry!r} is not a host or host:port")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        out.append(host + (f":{port}" if port is not None else ""))
    return out


MediaUrlHosts = Annotated[list[str], NoDecode, BeforeValidator(_split_hosts), AfterValidator(_check_hosts)]
"""Hosts media URLs may name, ``,``-separated: ``host`` (any port) or ``host:port`` (that port only;
a URL without a port has its scheme's). Names compare case-insensitively; IPv6 as ``[::1]:8000``."""


class MediaUrls(BaseModel):
    """The URL rule's settings (``WEIR_*``); each role's settings class inherits them, and `fetch_url` takes
    the settings object itself."""

    allow_urls: bool = Field(False, description="fetch http(s) media URLs at all (off: 403 url_disabled)")
    allow_private_urls: bool = Field(
        False,
        description="let URLs reach non-public addresses (loopback, private, link-local); "
        "off: every address the host resolves to must be public (403 url_not_allowed)",
    )
    media_url_hosts: MediaUrlHosts = Field(
        [],
        description="when set, the only hosts media URLs may name, ','-separated: host (any port) or host:port "
        "(403 url_not_allowed); checked on top of the public-address rule",
    )
    media_url_timeout_s: float = Field(
        10.0,
        gt=0,
        description="a media URL's fetch (each connect and read, and all of it, redirects included) must "
        "finish within this many seconds (422 url_timeout)",
    )


def host_allowed(url: str, hosts: Sequence[str]) -> bool:
    """Whether ``url`` is ``http(s)`` to a host (and port) of ``hosts`` (`MediaUrlHosts`' form)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname:
        return False
    try:
        port = parts.port or _DEFAULT_PORTS[scheme]
    except ValueError:
        return False
    for entry in hosts:
        allowed = urlsplit(f"//{entry}")
        if allowed.hostname == parts.hostname and allowed.port in (None, port):
            return True
    return False


def _non_public(host: str, port: int) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The first non-public address ``host`` resolves to, or None; `OSError` when it does not resolve."""
    for info in socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP):
        address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if not address.is_global:
            return address
    return None


def fetch_url(
    url: str,
    urls: MediaUrls,
    max_bytes: int,
    *,
    item: int | None = None,
    field: str | None = None,
    transport: httpx.BaseTransport | None = None,
) -> bytes:
    """The body of ``url`` under the rule of ``urls`` (see the module's doc), at most ``max_bytes``.
    Errors are `ApiError` pointing at ``item`` or ``field``; ``transport`` is for tests."""
    prefix = f"{field}: " if field else ""

    def error(status: int, code: str, message: str) -> ApiError:
        return ApiError(status, code, prefix + message, item=item, field=field)

    if not urls.allow_urls:
        raise error(403, "url_disabled", "URL sources are disabled (WEIR_ALLOW_URLS)")
    first, shown = url, url if len(url) <= 200 else url[:200] + "..."
    deadline = time.monotonic() + urls.media_url_timeout_s  # a slow drip of bytes must not hold a thread for long
    # No proxy from the environment: the checks name the hosts actually connected to.
    with httpx.Client(
        timeout=urls.media_url_timeout_s, follow_redirects=False, trust_env=False, transport=transport
    ) as client:
        for _ in range(MAX_REDIRECTS + 1):
            where = "" if url == first else f" (redirected to {url[:200]!r})"
            _check(url, urls, f"{shown!r}{where}", error)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise error(422, "url_timeout", f"{shown!r} took over {urls.media_url_timeout_s} s")
            try:
                with client.stream("GET", url, timeout=remaining) as response:
                    if response.is_redirect and response.headers.get("location"):
                        url = urljoin(url, response.headers["location"])
                        continue
                    if not response.is_success:
                        raise error(422, "url_fetch_failed", f"{shown!r}{where} answered {response.status_code}")
                    return _capped(response, max_bytes, deadline, f"{shown!r}{where}", error)
            except httpx.TimeoutException:
                raise error(422, "url_timeout", f"{shown!r} took over {urls.media_url_timeout_s} s") from None
            except httpx.HTTPError as failure:
                raise error(422, "url_fetch_failed", f"{shown!r}{where} failed: {type(failure).__name__}") from None
    raise error(422, "url_fetch_failed", f"{shown!r} redirects more than {MAX_REDIRECTS} times")


def _check(url: str, urls: MediaUrls, shown: str, error: _Error) -> None:
    """One hop against every rule: http(s), the allowlist (when set), public addresses (unless allowed)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port or _DEFAULT_PORTS.get(scheme, 0)
    except ValueError:
        port = 0
    if scheme not in _DEFAULT_PORTS or not parts.hostname or not port:
        raise error(400, "bad_url", f"only http(s) URLs to a host are fetched, not {shown}")
    if urls.media_url_hosts and not host_allowed(url, urls.media_url_hosts):
        raise error(
            403,
            "url_not_allowed",
            f"{shown} is not on an allowed host (WEIR_MEDIA_URL_HOSTS: {', '.join(urls.media_url_hosts)})",
        )
    if urls.allow_private_urls:
        return
    try:
        address = _non_public(parts.hostname, port)
    except (OSError, UnicodeError, ValueError):
        raise error(422, "url_fetch_failed", f"{shown}: cannot resolve host {parts.hostname!r}") from None
    if address is not None:
        raise error(
            403,
            "url_not_allowed",
            f"{shown}: {parts.hostname!r} resolves to a non-public address ({address}; WEIR_ALLOW_PRIVATE_URLS)",
        )


def _capped(response: httpx.Response, max_bytes: int, deadline: float, shown: str, error: _Error) -> bytes:
    """The body, refused as soon as it passes ``max_bytes`` (counted decoded, so a compressed bomb is cut
    too) or the fetch passes its deadline."""
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes and "content-encoding" not in response.headers:
        raise error(413, "media_too_large", f"{shown} declares {declared} bytes, over {max_bytes}")
    body = bytearray()
    for chunk in response.iter_bytes():
        body += chunk
        if len(body) > max_bytes:
            raise error(413, "media_too_large", f"{shown} is over {max_bytes} bytes")
        if time.monotonic() > deadline:
            raise error(422, "url_timeout", f"{shown} took too long to send")
    return bytes(body)
