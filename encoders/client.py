"""The encoder role's client: what the rollout role calls to encode media, and the trainer to publish tower weights.

    from encoders.api import EncodeRequest, WeightsRequest
    from encoders.client import EncoderClient

    with EncoderClient("http://127.0.0.1:8102", token=token) as encoder:
        answer = encoder.encode(EncodeRequest(feature_keys=[key]))
        print(answer.version, [item.embedding_key for item in answer.items])
        encoder.update_weights(WeightsRequest(model_path="/ckpt/step-10"))

`AsyncEncoderClient` has the same methods, awaited. Requests and answers are `encoders.api` records: an answer
of another shape raises `wire.client.AnswerMismatch` naming the field, a refusal `RoleRefused` with the role's
code (``features_not_found`` naming the item, ``bad_weights``). Embeddings are served as Arrow streams
(``GET /v1/embeddings/{key}``) and read by the engines from the shared cache, not through this client.
"""

from __future__ import annotations

from wire.client import AsyncRoleClient, RoleClient

from .api import EncodeRequest, EncodeResponse, EncoderReady, WeightsRequest, WeightsResponse

__all__ = ["AsyncEncoderClient", "EncoderClient"]


class EncoderClient(RoleClient):
    role = "encoder"

    def encode(self, request: EncodeRequest) -> EncodeResponse:
        """An embedding key per feature key, in request order (each unique item computed once per version)."""
        return self.call("POST", "/v1/encode", EncodeResponse, body=request)

    def update_weights(self, request: WeightsRequest, *, timeout_s: float | None = None) -> WeightsResponse:
        """Load the towers' weights from ``request.model_path``; later encodes are cached under the new version.
        ``timeout_s``: this call's own (loading a checkpoint may take longer than an encode)."""
        return self.call("POST", "/v1/weights", WeightsResponse, body=request, timeout_s=timeout_s)

    def ready(self) -> EncoderReady:
        """``/readyz``: the role can work now, with its weights version (a 503, not ready, is `RoleUnavailable`)."""
        return self.call("GET", "/readyz", EncoderReady)


class AsyncEncoderClient(AsyncRoleClient):
    role = "encoder"

    async def encode(self, request: EncodeRequest) -> EncodeResponse:
        return await self.call("POST", "/v1/encode", EncodeResponse, body=request)

    async def update_weights(self, request: WeightsRequest, *, timeout_s: float | None = None) -> WeightsResponse:
        return await self.call("POST", "/v1/weights", WeightsResponse, body=request, timeout_s=timeout_s)

    async def ready(self) -> EncoderReady:
        return await self.call("GET", "/readyz", EncoderReady)
