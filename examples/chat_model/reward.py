"""A batched reward for the chat example, in TRL's signature: one call per group.

`fn(prompts, completions, **columns) -> list[float | None]`: `prompts` are the dataset's prompts (here
lists of chat messages), `completions` the decoded completions (special tokens such as `<|im_end|>`
left out), and every dataset column comes by name, as a list over the group (`answer` here).
"""

from __future__ import annotations


def reversed_digits(prompts, completions, answer, **kwargs) -> list[float]:
    """Fraction of the answer's positions the completion gets right."""
    return [sum(a == c for a, c in zip(gold, text)) / len(gold) for gold, text in zip(answer, completions)]


def digits_only(prompts, completions, answer, **kwargs) -> list[float]:
    """Format: the share of the answer's positions that hold a digit (any digit)."""
    return [sum(ch.isdigit() for ch in text[: len(gold)]) / len(gold) for gold, text in zip(answer, completions)]
