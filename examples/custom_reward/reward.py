"""A reward function of your own: positional credit for the reversed digits, minus a penalty for
every character that is not a digit (so the policy learns to stop emitting symbols first).

A reward function is `fn(prompt, response_text) -> float`. It runs inside the generation workers,
which import it by the `module:function` name in `task.reward_fn`; `sc-grpo` imports such names
from the current directory (here: the repository root) or the Python path.
"""

from __future__ import annotations

from single_controller.types import Prompt

NON_DIGIT_PENALTY = 0.5  # per character, relative to one right position


def digits_reward(prompt: Prompt, response_text: str) -> float:
    """(right positions - 0.5 * non-digit characters) / answer length; 1.0 exactly for the answer.
    A random policy scores below 0 on average (9 of the 19 tokens are not digits)."""
    answer = prompt.answer
    hits = sum(1 for a, r in zip(answer, response_text) if a == r)
    non_digits = sum(1 for ch in response_text if not ch.isdigit())
    return (hits - NON_DIGIT_PENALTY * non_digits) / len(answer)
