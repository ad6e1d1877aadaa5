"""A shaping reward beside reasoning-gym's own scorer (TRL's batched signature, one call per group).

spell_backward's `score_answer` is lenient (case-insensitive, partial credit by similarity), which a
random-init model exploits before it learns the task; this term pays for each letter in its place,
as written, and counts a completion's extra letters against it.
"""

from __future__ import annotations


def letters_in_place(prompts, completions, answer, **kwargs) -> list[float]:
    out = []
    for gold, text in zip(answer, completions):
        out.append(sum(a == c for a, c in zip(gold, text)) / max(len(gold), len(text), 1))
    return out
