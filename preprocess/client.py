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

from wire.client import AsyncRoleClient, RoleClient

from .api import PlanResponse, PreprocessReady, PreprocessRequest, PreprocessResponse

__all__ = ["AsyncPreprocessClient", "PreprocessClient"]


class PreprocessClient(RoleClient):
    role = "preprocess"

    def preprocess(self, request: PreprocessRequest) -> PreprocessResponse:
        """Each item decoded, tokenized and cached: its cache key, grid and token count (request order)."""
        return self.call("POST", "/v1/preprocess", PreprocessResponse, body=request)

    def plan(self, request: PreprocessRequest) -> PlanResponse:
        """Token counts and grids from the items' headers only: nothing decoded or cached (no keys)."""
        return self.call("POST", "/v1/plan", PlanResponse, body=request)

    def ready(self) -> PreprocessReady:
        """``/readyz``: the role can work now (a 503, not ready, is `RoleUnavailable`)."""
        return self.call("GET", "/readyz", PreprocessReady)


class AsyncPreprocessClient(AsyncRoleClient):
    role = "preprocess"

    async def preprocess(self, request: PreprocessRequest) -> PreprocessResponse:
        return await self.call("POST", "/v1/preprocess", PreprocessResponse, body=request)

    async def plan(self, request: PreprocessRequest) -> PlanResponse:
        return await self.call("POST", "/v1/plan", PlanResponse, body=request)

    async def ready(self) -> PreprocessReady:
        return await self.call("GET", "/readyz", PreprocessReady)
