"""The in-flight bounds: admitted work is held for its block and released after it, even on error."""

from __future__ import annotations

import pytest

from rollout.admission import Admission
from rollout.errors import Overloaded, WorkTooLarge


def test_work_within_the_bounds_is_held_then_released() -> None:
    admission = Admission(max_media_tokens=100, max_bytes=1000)
    with admission.admit(media_tokens=60, nbytes=10):
        with admission.admit(media_tokens=40, nbytes=990):
            assert (admission.media_tokens, admission.bytes) == (100, 1000)
        assert (admission.media_tokens, admission.bytes) == (60, 10)
    assert (admission.media_tokens, admission.bytes) == (0, 0)


def test_over_the_bound_now_is_overloaded_and_changes_nothing() -> None:
    admission = Admission(max_media_tokens=100, max_bytes=1000)
    with admission.admit(media_tokens=60):
        with pytest.raises(Overloaded) as refused, admission.admit(media_tokens=41):
            pass
        assert refused.value.code == "overloaded" and refused.value.retry_after_s >= 1
        with pytest.raises(Overloaded), admission.admit(nbytes=1001 - 1, media_tokens=50):
            pass
        assert admission.media_tokens == 60 and admission.bytes == 0


def test_work_that_can_never_fit_is_too_large_not_overloaded() -> None:
    admission = Admission(max_media_tokens=100, max_bytes=1000)
    with pytest.raises(WorkTooLarge) as refused, admission.admit(media_tokens=101):
        pass
    assert refused.value.code == "work_too_large"
    with pytest.raises(WorkTooLarge), admission.admit(nbytes=1001):
        pass


def test_released_when_the_work_fails() -> None:
    admission = Admission(max_media_tokens=100, max_bytes=1000)
    with pytest.raises(RuntimeError), admission.admit(media_tokens=100, nbytes=1000):
        raise RuntimeError("the work failed")
    assert (admission.media_tokens, admission.bytes) == (0, 0)


def test_bounds_and_amounts_are_checked() -> None:
    with pytest.raises(ValueError):
        Admission(max_media_tokens=0, max_bytes=1)
    with pytest.raises(ValueError), Admission(max_media_tokens=1, max_bytes=1).admit(media_tokens=-1):
        pass
