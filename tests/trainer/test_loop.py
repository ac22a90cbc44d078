"""The RL loop against the real stack: async and colocate modes train, publish and bound staleness."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

import preprocess as pp
from launcher.stack import LocalStack
from tests.ports import free_stack_base
from trainer.loop import LoopConfig, run_loop
from trainer.reference import ReferenceTrainer

ROWS = [
    {"messages": [{"role": "user", "content": "Say yes."}], "reward": {"type": "exact_match", "answer": "yes"}},
    {"messages": [{"role": "user", "content": "2 + 2 = ?"}], "reward": {"type": "math", "answer": "4"}},
]


@pytest.mark.integration
def test_async_and_colocate_loops(tmp_path: Path) -> None:
    stack = LocalStack(home=tmp_path / "weir", engines=1, base_port=free_stack_base())
    urls = stack.start()
    try:
        trainer = ReferenceTrainer(
            tmp_path / "weir" / "model", features=pp.FeatureStore(tmp_path / "weir" / "cache", 1 << 30), lr=1e-4
        )
        seen: list[dict[str, object]] = []
        base = {"n": 4, "max_new_tokens": 6, "groups_per_step": 2, "urls": urls, "max_tokens_per_batch": 512}
        base["token"] = stack.token
        records = run_loop(
            trainer, ROWS, LoopConfig(mode="async", steps=3, out=tmp_path / "async", **base), on_step=seen.append
        )
        assert [r["step"] for r in records] == [1, 2, 3] and seen == records
        assert trainer.policy_version == 3
        auth = {"Authorization": f"Bearer {stack.token}"}
        (engine,) = (url for name, url in urls.items() if name.startswith("engine"))
        assert httpx.get(f"{engine}/model_info", headers=auth).json()["weight_version"] == "3"
        assert all(r["tokens"] > 0 and r["samples"] > 0 for r in records)
        lines = (tmp_path / "async" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
        colocate = run_loop(trainer, ROWS, LoopConfig(mode="colocate", steps=2, out=tmp_path / "colo", **base))
        assert [r["mode"] for r in colocate] == ["colocate"] * 2
        assert trainer.policy_version >= 4
    finally:
        stack.stop()


def test_group_ids_carry_their_row_for_regeneration() -> None:
    from trainer.driver import group_id as _group_id
    from trainer.driver import row_of as _row_of

    assert _row_of(_group_id(17)) == 17 and _row_of("someone-else's-id") is None and _row_of("r-x") is None
