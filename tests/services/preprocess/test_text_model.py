"""The preprocess role serving a text model (no processor config): it starts, refuses every item by name, caches
nothing."""

from __future__ import annotations

import base64

from encoders.embedded_model import init_model
from preprocess import samples


def test_the_preprocess_role_of_a_text_model_refuses_media_and_caches_nothing(serve, tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = init_model(tmp_path / "qwen3", arch="qwen3")
    server, client = serve(model=model)
    png = base64.b64encode(samples.encode_image(samples.test_pattern(32, 32), "PNG")).decode()
    answer = client.post("/v1/preprocess", json={"items": [{"type": "image", "data": f"data:image/png;base64,{png}"}]})
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["code"] == "text_model" and "text model" in answer.json()["error"]["message"]
    assert server.store.stats().entries == 0
