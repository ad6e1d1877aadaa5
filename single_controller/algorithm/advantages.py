"""GRPO group-normalized advantages (pure, plain Python: a group is a handful of floats).

    advantages = (r - mean(r)) / (std(r) + eps)      std over the group (population, as in GRPO)

Without `normalize_std` only the mean is subtracted. A group whose rewards are all equal carries no
learning signal (`is_zero_variance`): the advantage pump counts it and may drop it. DAPO's soft
overlong punishment (`overlong_penalty`) is added to a reward before its group's advantages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def grpo_advantages(rewards: Sequence[float], *, normalize_std: bool, eps: float) -> tuple[float, ...]:
    """rewards: [G] -> advantages: [G]"""
    G = len(rewards)
    mean = math.fsum(rewards) / G
    centered = [r - mean for r in rewards]  # [G]
    if not normalize_std:
        return tuple(centered)
    scale = math.sqrt(math.fsum(c * c for c in centered) / G) + eps
    return tuple(c / scale for c in centered)


def is_zero_variance(rewards: Sequence[float]) -> bool:
    return max(rewards) - min(rewards) == 0.0


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment of a completion of `length` tokens (<= 0):

        0                                          length <= max_new_tokens - buffer
        penalty * (max_new_tokens - buffer - length) / buffer      in the buffer (to -penalty at the budget)
        -penalty                                   length > max_new_tokens

    `buffer` 0: no punishment."""
    start = max_new_tokens - buffer
    if buffer <= 0 or length <= start:
        return 0.0
    return -penalty if length > max_new_tokens else penalty * (start - length) / buffer
