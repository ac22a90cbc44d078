"""Cutting shares: oldest first, within the token budget, balanced across ranks, too-long sequences reported."""

from __future__ import annotations

import pytest

from experience.packing import WaitingSample, cut


def candidates(*tokens: int) -> list[WaitingSample]:
    return [WaitingSample(sample_id=f"g{i}/0", group_id=f"g{i}", tokens=n, version=0) for i, n in enumerate(tokens)]


def test_one_rank_takes_the_oldest_within_its_budget() -> None:
    result = cut(candidates(5, 5, 5, 1), world_size=1, max_tokens=12)
    assert [s.sample_ids for s in result.shares] == [["g0/0", "g1/0"]]  # the third would overflow: stop there
    assert result.shares[0].tokens == 10 and result.too_long == []


def test_ranks_are_balanced_largest_first_onto_the_lightest() -> None:
    result = cut(candidates(10, 9, 8, 3, 2, 1), world_size=2, max_tokens=40)
    loads = sorted(s.tokens for s in result.shares)
    assert loads == [16, 17] and sum(len(s.samples) for s in result.shares) == 6
    assert {s.rank for s in result.shares} == {0, 1}


def test_too_long_sequences_are_reported_not_served() -> None:
    result = cut(candidates(50, 4, 60), world_size=1, max_tokens=10)
    assert [c.sample_id for c in result.too_long] == ["g0/0", "g2/0"]
    assert [s.sample_ids for s in result.shares] == [["g1/0"]]


def test_max_samples_caps_each_rank_and_empty_ranks_get_no_share() -> None:
    result = cut(candidates(1, 1, 1, 1, 1), world_size=2, max_tokens=100, max_samples=2)
    assert [len(s.samples) for s in result.shares] == [2, 2]
    assert cut(candidates(3), world_size=4, max_tokens=10).shares[0].rank == 0
    assert len(cut(candidates(3), world_size=4, max_tokens=10).shares) == 1
    assert cut([], world_size=1, max_tokens=10).shares == []
    with pytest.raises(ValueError):
        cut(candidates(1), world_size=0, max_tokens=10)
