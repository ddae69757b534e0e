"""N-gram prompt-lookup drafter for speculative decoding (host side, no model)."""

from __future__ import annotations

from collections.abc import Sequence


def propose_ngram(tokens: Sequence[int], k: int, *, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to ``k`` draft tokens: what followed the latest earlier match of the suffix.

    Tries suffix lengths from ``max_ngram`` down to ``min_ngram``; for the first
    length whose suffix occurs earlier in ``tokens``, returns the (up to ``k``)
    tokens that followed its most recent earlier occurrence. ``[]`` if none.
    """
    if k <= 0:
        return []
    n_tok = len(tokens)
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        suffix = list(tokens[n_tok - n:])
        for start in range(n_tok - n - 1, -1, -1):
            if list(tokens[start:start + n]) == suffix:
                follow = list(tokens[start + n:start + n + k])
                if follow:
                    return follow
    return []
