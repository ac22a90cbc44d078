"""The preprocess role's client: what the rollout role (and a script) calls to preprocess or plan media.

    from preprocess.api import MediaItem, PreprocessRequest
    from preprocess.client import PreprocessClient

    with PreprocessClient("http://127.0.0.1:8101", token=token) as preprocess:
        answer = preprocess.preprocess(PreprocessRequest(items=[MediaItem(type="image", path="cat.png")]))
        print([(item.key, item.num_tokens) for item in answer.items])

`AsyncPreprocessClient` has the same methods, awaited. Requests and answers are `preprocess.api` records: an
answer of another shape raises `wire.client.AnswerMismatch` naming the field, a refusal `RoleRefused` with the
role's code and the item at fault (``item``). Features are served as Arrow streams (``GET /v1/features/{key}``)
and read by content key from any replica (`services.cluster.peers`), not through this client.
"""

from __future__ import annotations

from wire.client import AsyncRoleClient, Get, Post, RoleClient

from .api import PlanResponse, PreprocessReady, PreprocessRequest, PreprocessResponse

__all__ = ["AsyncPreprocessClient", "PreprocessClient"]


class _PreprocessRoutes:
    role = "preprocess"

    preprocess = Post(
        "/v1/preprocess",
        PreprocessRequest,
        PreprocessResponse,
        doc="Each item decoded, tokenized and cached: its cache key, grid and token count (request order).",
    )
    plan = Post(
        "/v1/plan",
        PreprocessRequest,
        PlanResponse,
        doc="Token counts and grids from the items' headers only: nothing decoded or cached (no keys).",
    )
    ready = Get(
        "/readyz", PreprocessReady, doc="``/readyz``: the role can work now (a 503, not ready, is `RoleUnavailable`)."
    )


class PreprocessClient(_PreprocessRoutes, RoleClient):
    """The preprocess role, synchronously."""


class AsyncPreprocessClient(_PreprocessRoutes, AsyncRoleClient):
    """The preprocess role, asynchronously: the methods of `PreprocessClient`, awaited."""
