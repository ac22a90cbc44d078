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

from wire.client import AsyncRoleClient, Get, Post, RoleClient

from .api import EncodeRequest, EncodeResponse, EncoderReady, WeightsRequest, WeightsResponse

__all__ = ["AsyncEncoderClient", "EncoderClient"]


class _EncoderRoutes:
    role = "encoder"

    encode = Post(
        "/v1/encode",
        EncodeRequest,
        EncodeResponse,
        doc="An embedding key per feature key, in request order (each unique item computed once per version).",
    )
    update_weights = Post(
        "/v1/weights",
        WeightsRequest,
        WeightsResponse,
        takes=("timeout_s",),
        doc="""Load the towers' weights from ``request.model_path``; later encodes are cached under the new version.
        ``timeout_s``: this call's own (loading a checkpoint may take longer than an encode).""",
    )
    ready = Get(
        "/readyz",
        EncoderReady,
        doc="``/readyz``: the role can work now, with its weights version (a 503, not ready, is `RoleUnavailable`).",
    )


class EncoderClient(_EncoderRoutes, RoleClient):
    """The encoder role, synchronously."""


class AsyncEncoderClient(_EncoderRoutes, AsyncRoleClient):
    """The encoder role, asynchronously: the methods of `EncoderClient`, awaited."""
