"""GRPO group-normalized advantages (pure, plain Python: a group is a handful of floats).

    advantages = (r - mean(r)) / (std(r) + eps)      std over the group (population, as in GRPO)

Without `normalize_std` only the mean is subtracted. A group whose rewards are all equal carries no
learning signal (`is_zero_variance`): the advantage pump counts it and may drop it.
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
