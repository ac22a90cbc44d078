"""The engine role's `/generate` with SGLang's constrained decoding keys: the output follows the grammar
(the tiny model is random, so valid JSON is the grammar's doing), and a bad grammar is a 400 naming its field."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import pytest

from encoders.embedded_model import init_model
from services.engine.app import create_app
from services.engine.settings import EngineSettings
from tests.services.conftest import RunningServer

PROMPT = "<|im_start|>user\nGive me a JSON object.<|im_end|>\n<|im_start|>assistant\n"
SCHEMA = {
    "type": "object",
    "properties": {"count": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["count", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    root = tmp_path_factory.mktemp("engine-grammar")
    settings = EngineSettings(
        model=init_model(root / "model"), cache_dir=root / "cache", embedding_cache_dir=root / "emb", max_running=4
    )
    with RunningServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def test_generate_with_a_json_schema_returns_json_that_validates(client: httpx.Client) -> None:
    sampling = {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 256, "sampling_seed": 5, "n": 3}
    answer = client.post("/generate", json={"text": PROMPT, "sampling_params": sampling, "return_logprob": True})
    assert answer.status_code == 200, answer.text
    outputs = answer.json()
    assert isinstance(outputs, list) and len(outputs) == 3
    for out in outputs:
        jsonschema.validate(json.loads(out["text"]), SCHEMA)
        meta = out["meta_info"]
        assert meta["finish_reason"]["type"] == "stop" and meta["finish_reason"]["matched"] == out["output_ids"][-1]
        assert len(meta["output_token_logprobs"]) == len(out["output_ids"])
    assert len({o["text"] for o in outputs}) > 1


@pytest.mark.parametrize(
    ("sampling", "code", "field"),
    [
        ({"json_schema": '{"type": "nope"}'}, "bad_grammar", "sampling_params.json_schema"),
        ({"json_schema": "{not json"}, "bad_grammar", "sampling_params.json_schema"),
        ({"regex": "[0-9"}, "bad_grammar", "sampling_params.regex"),
        ({"json_schema": "{}", "regex": "a"}, "bad_sampling_params", "sampling_params.regex"),
    ],
)
def test_a_bad_grammar_is_a_400_naming_its_field(
    client: httpx.Client, sampling: dict[str, str], code: str, field: str
) -> None:
    refused = client.post("/generate", json={"text": PROMPT, "sampling_params": sampling})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == code and error["field"] == field
