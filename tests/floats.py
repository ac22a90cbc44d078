"""Comparing the log-probs of two separate forward passes: ids exact, floats within `LOGPROB_ATOL`.

What is moved is compared bit for bit (weights exported, loaded, published: ``torch.equal``); what is computed
twice is not. Two forward passes over bit-equal weights may take different kernels — oneDNN and MKL choose by
the CPU's instruction set, the thread count and the operands' memory alignment (a tensor read from a
safetensors mmap is aligned differently from one copied into a parameter) — and so sum in another order.
In fp32 (unit roundoff 2**-24, about 6e-8) a reduction of length n is off by at most about n x 6e-8 of the sum
of its terms' magnitudes; through the tiny models' few layers and a log-softmax that comes to a few 1e-7 on a
log-prob of magnitude 1-10 (seen: 4.8e-7 between an engine on a folder and one given the same weights by
``update_weights``, on a 2-core AVX2 EPYC). ``LOGPROB_ATOL = 1e-5`` is twenty times that, and a thousand times
below what any weight change the tests make moves a log-prob by (1e-2 and more).
"""

from __future__ import annotations

from typing import Any

LOGPROB_ATOL = 1e-5


def logprobs_close(got: Any, want: Any, atol: float = LOGPROB_ATOL) -> bool:
    """``got`` and ``want`` have the same shape (lists, tuples, dicts), equal ids, texts and ``None`` s, and
    every float within ``atol`` — for SGLang's ``[logprob, token_id, text]`` lists as for plain lists."""
    if isinstance(got, float) or isinstance(want, float):
        numbers = (int, float)
        if isinstance(got, bool) or isinstance(want, bool) or not isinstance(got, numbers):
            return False
        return isinstance(want, numbers) and abs(got - want) <= atol
    if isinstance(got, list | tuple):
        return (
            type(got) is type(want)
            and len(got) == len(want)
            and all(logprobs_close(a, b, atol) for a, b in zip(got, want, strict=True))
        )
    if isinstance(got, dict):
        return (
            isinstance(want, dict)
            and got.keys() == want.keys()
            and all(logprobs_close(got[k], want[k], atol) for k in got)
        )
    return bool(got == want)
