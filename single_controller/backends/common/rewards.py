"""Scoring a group's completions with the reward function, next to the tokens (every engine).

`score_group` calls the reward function once per completion and returns the G rewards as floats; a
reward function that raises, returns something that is not a number, or returns a non-finite value
fails that group alone with `RewardFailed`, naming the group, the completion and the cause, so the
worker answers its batch-mates as usual.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from single_controller.protocols import RewardFailed
from single_controller.types import Prompt


def score_group(
    reward_fn: Callable[[Prompt, str], float], prompt: Prompt, texts: Sequence[str], group_id: str, worker: str
) -> tuple[float, ...]:
    """rewards: [G], one per completion text; `RewardFailed` if any of them cannot be had."""
    rewards = []
    for i, text in enumerate(texts):
        try:
            r = float(reward_fn(prompt, text))
        except Exception as e:  # user code: its failure is this group's
            err = RewardFailed(
                f"{worker}: reward function failed on completion {i} of group {group_id}: {type(e).__name__}: {e}"
            )
            raise err from e
        if not math.isfinite(r):
            raise RewardFailed(f"{worker}: reward function gave {r} for completion {i} of group {group_id}")
        rewards.append(r)
    return tuple(rewards)
