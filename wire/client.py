"""The base of every role's client: one place for the token, timeouts, retries and reading an answer.

A role's client (`preprocess.client.PreprocessClient`, `engines.client.EngineClient`, …) names its routes and
records; everything a caller used to write by hand around ``httpx`` is here:

- the ``Authorization: Bearer`` token on every request (an ``httpx`` client of the caller's may be shared);
- retries with exponential backoff and full jitter, only where the call is safe to repeat (the caller gives
  ``retry_s`` for an idempotent route) and only for what a retry can mend: no connection, a timeout, a 5xx;
- one error per way a call can fail, each naming the role::

      RoleError
      ├── RoleUnavailable   no answer: a transport error, a timeout or a 5xx (``status`` when there was one)
      ├── RoleUnauthorized  401/403: the role refuses this caller's token (a configuration error)
      ├── RoleRefused       4xx: the role's ``{"error": {"code", "message", "item"?, "field"?}}`` kept whole
      └── AnswerMismatch    a 2xx whose body is not the route's record: the field at fault and the role

  so no caller meets a ``KeyError`` deep in its own code when a server's answer changes shape.

The sync and async clients share every decision (`_verdict`; `_Attempts`: whether to try again, how long to
wait first); only sleeping and sending differ. A role declares each route that is a record (or nothing) in and a
record out once, as a `Get` or a `Post` on a mixin both of its clients inherit: a method of the sync client, and
the same method giving a coroutine on the async one. Only routes with logic of their own (streams, an Arrow
answer) are methods written for each.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from inspect import Parameter, Signature
from types import MethodType, NoneType
from typing import Any, Generic, Literal, Protocol, Required, TypedDict, TypeVar, overload
from urllib.parse import quote

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError
from typing_extensions import TypeVarTuple, Unpack

from .backoff import Backoff
from .pooled_client import Params, PooledAsyncClient

__all__ = [
    "Acknowledged",
    "AnswerMismatch",
    "AsyncRoleClient",
    "CallOptions",
    "Get",
    "Post",
    "RoleClient",
    "RoleError",
    "RoleRefused",
    "RoleUnauthorized",
    "RoleUnavailable",
    "Route",
    "RouteKeywords",
    "read_answer",
    "read_json_line",
    "refusal_of",
]

T = TypeVar("T")
Http = TypeVar("Http", httpx.Client, httpx.AsyncClient)

_TOKEN_CODES = (None, "unauthorized", "forbidden", "invalid_token")  # a 403's codes that refuse the token
_RETRY_BACKOFF = Backoff(first_s=0.1, cap_s=5.0)  # an idempotent call's pauses (`wire.backoff`: full jitter)


class RoleError(Exception):
    """A call to ``role`` that did not give its answer; ``code`` is stable, ``status`` the HTTP status if any."""

    code = "role_error"

    def __init__(self, role: str, message: str, *, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.role, self.status = role, status
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self)


class RoleUnavailable(RoleError):
    """The role did not answer (transport error, timeout) or failed on its own (5xx)."""

    code = "role_unavailable"


class RoleUnauthorized(RoleError):
    """401/403: the role refuses the token this client sends."""

    code = "unauthorized"


class RoleRefused(RoleError):
    """A 4xx refusal, with the role's own ``code``, ``message`` and, when it names them, ``item`` and ``field``."""

    def __init__(
        self, role: str, message: str, *, status: int, code: str, item: int | None = None, field: str | None = None
    ) -> None:
        super().__init__(role, message, status=status, code=code)
        self.item, self.field = item, field


class AnswerMismatch(RoleError):
    """A 2xx answer that does not match the route's record; ``field`` is the path to the first field at fault."""

    code = "bad_answer"

    def __init__(self, role: str, message: str, *, field: str) -> None:
        super().__init__(role, message, code=self.code)
        self.field = field


class Acknowledged:
    """The answer of a route whose body says nothing more than its 2xx status."""


_ADAPTERS: dict[object, TypeAdapter[Any]] = {}
_JSON_OBJECT: TypeAdapter[dict[str, object]] = TypeAdapter(dict[str, object])


def _adapter(record: Any) -> TypeAdapter[Any]:
    """One TypeAdapter per record (building one costs more than validating most answers)."""
    adapter = _ADAPTERS.get(record)
    if adapter is None:
        adapter = _ADAPTERS[record] = TypeAdapter(record)
    return adapter


def refusal_of(response: httpx.Response) -> tuple[str | None, str, int | None, str | None]:
    """(code, message, item, field) of a role's ``{"error": {...}}`` body — whatever the body is (an OpenAI
    route's error object has the same keys; a proxy's HTML page gives no code and its first 200 characters)."""
    try:
        body = response.json()
    except ValueError:
        return None, response.text[:200], None, None
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):  # SGLang's weight refusals: {"success": false, "message": ...}
        message = body.get("message") if isinstance(body, dict) else None
        return None, message if isinstance(message, str) else response.text[:200], None, None
    code, item, field = error.get("code"), error.get("item"), error.get("field")
    return (
        code if isinstance(code, str) else None,
        str(error.get("message", "")),
        item if isinstance(item, int) else None,
        field if isinstance(field, str) else None,
    )


def _verdict(role: str, response: httpx.Response) -> None:
    """Raise the error a non-2xx answer means."""
    status = response.status_code
    if status < 400:
        return
    code, message, item, field = refusal_of(response)
    where = f"{response.request.method} {response.request.url.path}"
    # A 403 naming a reason of the request's own (the preprocess role's ``path_not_allowed``, ``url_disabled``) is
    # a refusal of that request, not of the token.
    if status == 401 or (status == 403 and code in _TOKEN_CODES):
        raise RoleUnauthorized(
            role, f"the {role} role refused this client's token on {where} (HTTP {status})", status=status
        )
    if status >= 500:
        failed = f"the {role} role failed on {where} (HTTP {status}): {message}"
        raise RoleUnavailable(role, failed, status=status, code=code)  # the role's own code, when it gave one
    raise RoleRefused(
        role, message or f"HTTP {status}", status=status, code=code or f"http_{status}", item=item, field=field
    )


def read_answer(role: str, response: httpx.Response, record: type[T]) -> T:
    """The ``response`` read through ``record`` (a pydantic model, a dataclass, a TypedDict; `Acknowledged`, or
    ``NoneType`` for None: the status checked, the body ignored); a refusal raised."""
    _verdict(role, response)
    if record is NoneType:  # nothing to read: the 2xx is the answer
        return None  # type: ignore[return-value]
    if record is Acknowledged:
        return Acknowledged()  # type: ignore[return-value]
    try:
        answer: T = _adapter(record).validate_json(response.content)
    except ValidationError as error:
        where = f"{response.request.method} {response.request.url.path}"
        raise _mismatch(role, f"the {role} role's answer to {where}", record, error) from None
    return answer


def _mismatch(role: str, what: str, record: object, error: ValidationError) -> AnswerMismatch:
    first = error.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or "(the body)"
    name = getattr(record, "__name__", str(record))
    return AnswerMismatch(role, f"{what} is not a {name}: {field}: {first['msg']}", field=field)


def read_json_line(role: str, line: str, record: type[T]) -> T:
    """One line of a role's NDJSON stream read through ``record``; an error line (``{"error": {...}}``, the 200
    already sent) raises `RoleRefused` with its code (``internal_error``: `RoleUnavailable`)."""
    adapter = _adapter(record)
    try:
        return adapter.validate_json(line)  # type: ignore[no-any-return]
    except ValidationError as error:
        failure = error
    try:
        body = _JSON_OBJECT.validate_json(line)
    except ValidationError:
        body = {}
    refusal = body.get("error")
    if isinstance(refusal, dict) and isinstance(refusal.get("code"), str):
        message = str(refusal.get("message", ""))
        if refusal["code"] == "internal_error":
            raise RoleUnavailable(role, f"the {role} role failed mid-stream: {message}", code="internal_error")
        raise RoleRefused(role, message, status=200, code=refusal["code"], item=refusal.get("item"))
    raise _mismatch(role, f"a line of the {role} role's stream", record, failure)


def _unavailable(role: str, method: str, path: str, error: httpx.TransportError) -> RoleUnavailable:
    return RoleUnavailable(role, f"the {role} role did not answer {method} {path}: {type(error).__name__}: {error}")


class CallOptions(TypedDict, total=False):
    """What a call may give besides its route: a ``body`` (a record, or a mapping sent as JSON) or ``content``
    (bytes already encoded), query ``params``, this call's ``timeout_s`` and ``retry_s`` (the client's by default;
    give more only for an idempotent route)."""

    body: BaseModel | Mapping[str, object] | None
    content: bytes | None
    params: Params | None
    timeout_s: float | None
    retry_s: float | None


class _RequestArgs(TypedDict, total=False):
    headers: dict[str, str]
    content: bytes | None
    params: Params | None
    timeout: float


@dataclass
class _Attempts:
    """One call's attempts: what each sends, and whether (and how long) to wait before the next."""

    role: str
    method: str
    path: str
    url: str
    args: _RequestArgs
    deadline: float
    made: int = 0

    def pause_after(self, outcome: httpx.Response | httpx.TransportError) -> float | None:
        """The pause before another attempt, or None: ``outcome`` is the answer. Exponential backoff with full
        jitter: callers retrying together (every trainer rank after the data role restarts) spread out."""
        mendable = isinstance(outcome, httpx.TransportError) or outcome.status_code >= 500
        if not mendable or time.monotonic() >= self.deadline:
            return None
        self.made += 1
        return _RETRY_BACKOFF.pause(self.made)

    def settle(self, outcome: httpx.Response | httpx.TransportError) -> httpx.Response:
        """The last outcome as the 2xx answer, or the error it means."""
        if isinstance(outcome, httpx.TransportError):
            raise _unavailable(self.role, self.method, self.path, outcome) from None
        _verdict(self.role, outcome)
        return outcome


class _Base(Generic[Http]):
    role = "role"  # each client names its role; every error says it
    _http: type[Http]  # the kind of ``httpx`` client made when the caller shares none

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout_s: float = 30.0,
        retry_s: float = 0.0,
        http: Http | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self.retry_s = retry_s  # how long an idempotent call keeps retrying what a retry can mend
        self._owned = http is None
        self.http: Http = http if http is not None else self._http(timeout=timeout_s)

    def _attempts(self, method: str, path: str, options: CallOptions) -> _Attempts:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        body, content = options.get("body"), options.get("content")
        if isinstance(body, BaseModel):
            content = body.model_dump_json(exclude_unset=True, by_alias=True).encode()
        elif body is not None:
            content = _JSON_OBJECT.dump_json(dict(body))
        if content is not None:
            headers["Content-Type"] = "application/json"
        args = _RequestArgs(headers=headers, content=content, params=options.get("params"))
        if (timeout_s := options.get("timeout_s")) is not None:
            args["timeout"] = timeout_s
        retry_s = options.get("retry_s")
        deadline = time.monotonic() + (self.retry_s if retry_s is None else retry_s)
        return _Attempts(self.role, method, path, f"{self.url}{path}", args, deadline)


class RoleClient(_Base[httpx.Client]):
    """A synchronous client of one role. ``http``: an ``httpx.Client`` of the caller's to share (its pool and
    limits); closed by `close` only when this client made it."""

    _http = httpx.Client

    def call(self, method: str, path: str, answer: type[T], **options: Unpack[CallOptions]) -> T:
        """``method path`` → its answer read through the record ``answer`` (`Acknowledged`, or ``NoneType`` for
        None: the status checked, the body ignored)."""
        return read_answer(self.role, self.send(method, path, **options), answer)

    def send(self, method: str, path: str, **options: Unpack[CallOptions]) -> httpx.Response:
        """``method path`` → its 2xx answer, unread (an answer that is not JSON: an Arrow stream); every failure
        raised as `call`'s are."""
        attempts = self._attempts(method, path, options)
        while True:
            try:
                outcome: httpx.Response | httpx.TransportError = self.http.request(
                    method, attempts.url, **attempts.args
                )
            except httpx.TransportError as error:
                outcome = error
            if (pause := attempts.pause_after(outcome)) is None:
                return attempts.settle(outcome)
            time.sleep(pause)

    @contextmanager
    def stream(self, method: str, path: str, **options: Unpack[CallOptions]) -> Iterator[Iterator[str]]:
        """The answer's lines as they come (a refusal raised before the first; never retried)."""
        attempts = self._attempts(method, path, options)
        try:
            with self.http.stream(method, attempts.url, **attempts.args) as response:
                if response.status_code >= 400:
                    response.read()
                yield attempts.settle(response).iter_lines()
        except httpx.TransportError as error:
            raise _unavailable(self.role, method, path, error) from None

    def close(self) -> None:
        if self._owned:
            self.http.close()

    def __enter__(self: T) -> T:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncRoleClient(_Base[httpx.AsyncClient]):
    """The asynchronous twin of `RoleClient` (``http``: an ``httpx.AsyncClient`` to share)."""

    _http = httpx.AsyncClient

    async def call(self, method: str, path: str, answer: type[T], **options: Unpack[CallOptions]) -> T:
        """As `RoleClient.call`."""
        return read_answer(self.role, await self.send(method, path, **options), answer)

    async def send(self, method: str, path: str, **options: Unpack[CallOptions]) -> httpx.Response:
        """As `RoleClient.send`; through a `PooledAsyncClient` (every role's), by its short way for an answer read
        whole (`wire.pooled_client`)."""
        attempts = self._attempts(method, path, options)
        pooled = self.http if isinstance(self.http, PooledAsyncClient) else None
        while True:
            try:
                outcome: httpx.Response | httpx.TransportError = await (
                    pooled.read_whole(method, attempts.url, **attempts.args)
                    if pooled is not None
                    else self.http.request(method, attempts.url, **attempts.args)
                )
            except httpx.TransportError as error:
                outcome = error
            if (pause := attempts.pause_after(outcome)) is None:
                return attempts.settle(outcome)
            await asyncio.sleep(pause)

    @asynccontextmanager
    async def stream(self, method: str, path: str, **options: Unpack[CallOptions]) -> AsyncIterator[AsyncIterator[str]]:
        """As `RoleClient.stream`."""
        attempts = self._attempts(method, path, options)
        try:
            async with self.http.stream(method, attempts.url, **attempts.args) as response:
                if response.status_code >= 400:
                    await response.aread()
                yield attempts.settle(response).aiter_lines()
        except httpx.TransportError as error:
            raise _unavailable(self.role, method, path, error) from None

    async def aclose(self) -> None:
        if self._owned:
            await self.http.aclose()

    async def __aenter__(self: T) -> T:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


# -- routes: each declared once, on a mixin both of a role's clients inherit ------------------------------------

A = TypeVar("A")
B = TypeVar("B")
R = TypeVar("R", covariant=True)
Args = TypeVarTuple("Args")
_Option = Literal["timeout_s", "retry_s"]


class _RouteOptions(TypedDict, total=False):
    """The keywords a route's call may give: those its route ``takes``."""

    timeout_s: float | None
    retry_s: float | None


class _Bound(Protocol[R, *Args]):
    """A route on a client: its argument (if any) and keywords → the answer (on an async client: a coroutine)."""

    def __call__(self, *args: *Args, **options: Unpack[_RouteOptions]) -> R: ...


class Route(Generic[A, *Args]):
    """One route of a role, declared once (`Get`, `Post`) on a mixin both of its clients inherit: on a `RoleClient`
    a method that gives the answer read through ``answer`` (``NoneType``: nothing read, the method gives None), on
    an `AsyncRoleClient` a method that gives a coroutine of it.

    The method's argument, if the route has one (of type ``body``), fills the ``{name}`` the path names, or else
    is the body, named ``arg`` (``default()`` when left out: an argument that may be left out). ``takes``: the
    keywords a call may give (``timeout_s``, ``retry_s``); ``retry_s``: the route's own (0.0: never repeated),
    else the client's. ``doc``: the method's docstring, shown by ``help()`` with its signature."""

    def __init__(
        self,
        method: str,
        path: str,
        body: type[object] | None,
        answer: type[A],
        *,
        doc: str,
        arg: str = "request",
        default: Callable[[], object] | None = None,
        takes: tuple[_Option, ...] = (),
        retry_s: float | None = None,
    ) -> None:
        self.method, self.path, self.answer, self.default, self.retry_s = method, path, answer, default, retry_s
        self.name, self.__doc__ = "route", doc  # the name its class gives it (`__set_name__`)
        named = re.search(r"{(\w+)}", path)  # a path parameter: the argument goes there
        self.in_path, self.arg = named is not None, None
        parameters = [Parameter("self", Parameter.POSITIONAL_OR_KEYWORD)]
        if body is not None:
            self.arg = named[1] if named else arg
            given = Parameter(self.arg, Parameter.POSITIONAL_OR_KEYWORD, annotation=body)
            parameters.append(given if default is None else given.replace(default=None, annotation=body | None))
        parameters += [Parameter(name, Parameter.KEYWORD_ONLY, default=None, annotation=float | None) for name in takes]
        self.signature = Signature(parameters, return_annotation=None if answer is NoneType else answer)

        def call(client: RoleClient, *args: object, **options: object) -> A:
            path, given = self._request(client, args, options)
            return client.call(method, path, answer, **given)

        async def call_async(client: AsyncRoleClient, *args: object, **options: object) -> A:
            path, given = self._request(client, args, options)
            return await client.call(method, path, answer, **given)

        self.sync, self.asynchronous = call, call_async

    def _request(self, client: object, args: tuple[object, ...], options: dict[str, object]) -> tuple[str, CallOptions]:
        """The call's path and options; a call the route's signature refuses raises its TypeError."""
        try:
            given = self.signature.bind(client, *args, **options).arguments
        except TypeError as error:
            raise TypeError(f"{self.name}(): {error}") from None
        call = CallOptions(timeout_s=given.get("timeout_s"), retry_s=given.get("retry_s", self.retry_s))
        if self.arg is None:
            return self.path, call
        if self.in_path:
            return self.path.format(**{self.arg: quote(str(given[self.arg]), safe="")}), call  # one path segment
        body = given.get(self.arg)
        if body is None and self.default is not None:
            body = self.default()
        call["body"] = body
        return self.path, call

    def __set_name__(self, owner: type[object], name: str) -> None:
        self.name = name
        for function in (self.sync, self.asynchronous):
            function.__name__, function.__qualname__ = name, f"{owner.__qualname__}.{name}"
            function.__module__, function.__doc__ = owner.__module__, self.__doc__
            vars(function)["__signature__"] = self.signature  # what help() and inspect show

    @overload
    def __get__(
        self, client: None, owner: type[AsyncRoleClient]
    ) -> Callable[[AsyncRoleClient, *Args], Coroutine[object, object, A]]: ...
    @overload
    def __get__(self, client: None, owner: type[object]) -> Callable[[RoleClient, *Args], A]: ...
    @overload
    def __get__(self, client: AsyncRoleClient, owner: type[object]) -> _Bound[Coroutine[object, object, A], *Args]: ...
    @overload
    def __get__(self, client: RoleClient, owner: type[object]) -> _Bound[A, *Args]: ...
    def __get__(self, client: object, owner: type[object]) -> object:
        # On the class: the function itself, called with a client first (``EngineClient.flush_cache(client)``).
        function = self.asynchronous if issubclass(owner, AsyncRoleClient) else self.sync
        return function if client is None else MethodType(function, client)


class RouteKeywords(TypedDict, total=False):
    """`Route`'s keywords that a role's routes may share, given as ``**`` to `Get` and `Post` (`Get` has no
    argument to name)."""

    arg: str
    takes: tuple[_Option, ...]
    retry_s: float | None


class _Declared(RouteKeywords, total=False):
    doc: Required[str]


class Get(Route[A]):
    """``GET path``: a route with no argument (see `Route`)."""

    def __init__(self, path: str, answer: type[A], **route: Unpack[_Declared]) -> None:
        super().__init__("GET", path, None, answer, **route)


class Post(Route[A, *Args]):
    """``POST path``: with no argument (``body`` None), a body record, a body ``default()`` makes when left out, or
    a path parameter (see `Route`)."""

    @overload
    def __init__(self: Post[A], path: str, body: None, answer: type[A], **route: Unpack[_Declared]) -> None: ...
    @overload
    def __init__(self: Post[A, B], path: str, body: type[B], answer: type[A], **route: Unpack[_Declared]) -> None: ...
    @overload
    def __init__(  # an argument that may be left out: at most one (a variadic type cannot say so)
        self: Post[A, *tuple[B | None, ...]],
        path: str,
        body: type[B],
        answer: type[A],
        *,
        default: Callable[[], B],
        **route: Unpack[_Declared],
    ) -> None: ...
    def __init__(
        self,
        path: str,
        body: type[object] | None,
        answer: type[A],
        *,
        default: Callable[[], object] | None = None,
        **route: Unpack[_Declared],
    ) -> None:
        super().__init__("POST", path, body, answer, default=default, **route)
