"""SGLang's routed_experts wire form, and capture hooks that record one routing per forward."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest
import torch

from encoders.architectures import load_thinker
from encoders.embedded_model import init_model
from encoders.routing import RoutingCapture, decode_routed_experts, encode_routed_experts, is_moe, moe_routers


def test_the_wire_form_is_sglangs() -> None:
    routes = np.arange(5 * 3 * 2, dtype=np.int32).reshape(5, 3, 2)
    encoded = encode_routed_experts(torch.from_numpy(routes))
    # What SGLang's extract_routed_experts_from_meta_info decodes: flat int32 from base64.
    assert (np.frombuffer(base64.b64decode(encoded), np.int32).reshape(-1, 3, 2) == routes).all()
    assert (decode_routed_experts(encoded, 3, 2) == routes).all()
    with pytest.raises(ValueError, match="not rows of 4 layers"):
        decode_routed_experts(encoded, 4, 2)


def test_capture_records_every_forward(tiny_model: Path, tmp_path: Path) -> None:
    assert not is_moe(load_thinker(tiny_model))  # the dense default: nothing to capture
    model = load_thinker(init_model(tmp_path / "moe", arch="qwen3-omni-moe")).eval()
    assert sorted(moe_routers(model)) == [0, 1, 2]
    capture = RoutingCapture(model)
    with torch.no_grad(), capture.recording() as rows:
        model(input_ids=torch.arange(3, 10)[None])
        model(input_ids=torch.arange(3, 5)[None])
    assert [tuple(r.shape) for r in rows] == [(7, 3, 2), (2, 3, 2)]
    with torch.no_grad():  # outside `recording`: nothing kept
        model(input_ids=torch.arange(3, 10)[None])
    capture.close()
    assert all(not r._forward_hooks for r in capture.routers.values())
