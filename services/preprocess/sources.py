"""Where a request's media bytes may come from: inline base64 / data URI, a path, or a URL.

Safe by default: paths only under the configured roots (after resolving symlinks, so ``..`` and
links cannot escape); URLs off unless enabled, then http(s) only, every address the host resolves
to public unless private targets are allowed, redirects followed by hand and checked at each hop,
a size cap and a timeout.

Known gap: the address is checked, then httpx resolves the name again to connect; a DNS server
that answers differently the second time (rebinding) is not stopped here. Deployments that
enable URLs should also restrict egress at the network layer.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import socket
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import httpx

from ..errors import ApiError
from ..media_roots import locate

__all__ = ["decode_inline", "fetch_url", "read_path"]

_MAX_REDIRECTS = 3


def decode_inline(data: str, index: int, max_bytes: int) -> bytes:
    """Base64 or a ``data:<mime>;base64,<payload>`` URI."""
    payload = data
    if data.startswith("data:"):
        header, sep, payload = data.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ApiError(
                400, "bad_data_uri", "data URIs must be of the form data:<mime>;base64,<payload>", item=index
            )
    if len(payload) > (max_bytes * 4) // 3 + 8:
        raise ApiError(413, "media_too_large", f"the item is over the limit of {max_bytes} bytes", item=index)
    try:
        raw = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, "bad_base64", "the item's data is not valid base64", item=index) from None
    return raw


def read_path(path: str, roots: list[Path], index: int, max_bytes: int) -> bytes:
    """A file under one of ``roots``; relative paths are taken relative to each root in turn."""
    if not roots:
        raise ApiError(403, "path_not_allowed", "paths are disabled: no media roots are configured", item=index)
    found = locate(path, roots)
    if found.file is not None:
        size = found.file.stat().st_size
        if size > max_bytes:
            raise ApiError(413, "media_too_large", f"{path!r} is {size} bytes, over {max_bytes}", item=index)
        return found.file.read_bytes()
    if found.inside:
        raise ApiError(404, "media_not_found", f"no file at {path!r} under the media roots", item=index)
    raise ApiError(403, "path_not_allowed", f"{path!r} is outside the configured media roots", item=index)


def _check_host(host: str, port: int, allow_private: bool, index: int) -> None:
    try:
        infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        raise ApiError(422, "url_fetch_failed", f"cannot resolve host {host!r}", item=index) from None
    for info in infos:
        address = ipaddress.ip_address(info[4][0])
        if not allow_private and not address.is_global:
            raise ApiError(403, "url_not_allowed", f"{host!r} resolves to a non-public address ({address})", item=index)


def fetch_url(
    url: str,
    *,
    index: int,
    enabled: bool,
    allow_private: bool,
    max_bytes: int,
    timeout_s: float,
) -> bytes:
    if not enabled:
        raise ApiError(403, "url_disabled", "URL sources are disabled (WEIR_ALLOW_URLS)", item=index)
    with httpx.Client(timeout=timeout_s, follow_redirects=False) as client:
        for _ in range(_MAX_REDIRECTS + 1):
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ApiError(400, "bad_url", f"only http(s) URLs are accepted, got {url[:100]!r}", item=index)
            _check_host(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80), allow_private, index)
            try:
                with client.stream("GET", url) as response:
                    if response.is_redirect and "location" in response.headers:
                        url = urljoin(url, response.headers["location"])
                        continue
                    if response.status_code != 200:
                        raise ApiError(
                            422, "url_fetch_failed", f"GET {url[:100]} answered {response.status_code}", item=index
                        )
                    declared = int(response.headers.get("content-length") or 0)
                    if declared > max_bytes:
                        raise ApiError(413, "media_too_large", f"the URL declares {declared} bytes", item=index)
                    chunks, size = [], 0
                    for chunk in response.iter_bytes():
                        size += len(chunk)
                        if size > max_bytes:
                            raise ApiError(413, "media_too_large", f"the URL is over {max_bytes} bytes", item=index)
                        chunks.append(chunk)
                    return b"".join(chunks)
            except httpx.TimeoutException:
                raise ApiError(
                    422, "url_timeout", f"GET {url[:100]} timed out after {timeout_s} s", item=index
                ) from None
            except httpx.HTTPError as exc:
                raise ApiError(422, "url_fetch_failed", f"GET {url[:100]} failed: {exc}", item=index) from None
    raise ApiError(422, "url_fetch_failed", f"more than {_MAX_REDIRECTS} redirects", item=index)
