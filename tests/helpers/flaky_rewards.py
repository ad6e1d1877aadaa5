"""A reward function that fails for some prompts, for the bad-reward end-to-end test
(`task.reward_fn=tests.helpers.flaky_rewards:positional_match_or_fail`): for 1 prompt in 20 it raises,
for another 1 in 20 it returns NaN, for the rest it is the built-in positional match."""

from __future__ import annotations

import zlib

from single_controller.data.tasks import positional_match_reward
from single_controller.types import Prompt


def positional_match_or_fail(prompt: Prompt, response_text: str) -> float:
    kind = zlib.crc32(prompt.prompt_id.encode()) % 20
    if kind == 0:
        raise ValueError(f"the reward function cannot score prompt {prompt.prompt_id}")
    if kind == 1:
        return float("nan")
    return positional_match_reward(prompt, response_text)
