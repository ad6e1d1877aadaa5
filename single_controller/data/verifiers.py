"""Built-in reward functions, named in `reward.functions` by the keys of `BUILTINS`.

Each is batched (`data/rewards.py`). `math_verify`: 1.0 when the completion's final answer equals the
`answer` column mathematically (the `math-verify` package; its SIGALRM timeouts are off in the reward
pool's threads, where `reward.timeout_s` is the deadline), None when the gold answer does not parse.
`reasoning_gym`: the task's own `score_answer` on the extracted answer. `positional_match`,
`exact_match`: the digit tasks' rewards. `BUILTIN_PACKAGES` names what a built-in needs beyond the
defaults, so a config naming one is refused where it is missing.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def math_verify(prompts: Sequence[Any], completions: Sequence[str], answer: Sequence[str], **_: Any) -> list:
    """[G] 1.0 / 0.0 per completion; None for all when the gold answer does not parse."""
    from math_verify import parse, verify

    out: list[float | None] = []
    for gold_text, text in zip(answer, completions):
        gold = parse(f"${gold_text}$", parsing_timeout=None) or parse(gold_text, parsing_timeout=None)
        if not gold:
            out.append(None)
            continue
        pred = parse(text, parsing_timeout=None) if text.strip() else []
        out.append(float(bool(pred) and verify(gold, pred, timeout_seconds=None)))
    return out


def extract_answer(completion: str, how: str = "answer_tag") -> str:
    """The scored part of a completion, stripped: `answer_tag` the text inside the last
    `<answer>...</answer>` (the whole completion without one), `last_line` its last non-empty line,
    `full` all of it (`data.reasoning_gym.extract`)."""
    if how == "answer_tag":
        tags = _ANSWER_TAG.findall(completion)
        return (tags[-1] if tags else completion).strip()
    if how == "last_line":
        lines = [line for line in completion.splitlines() if line.strip()]
        return lines[-1].strip() if lines else ""
    if how == "full":
        return completion.strip()
    raise ValueError(f"unknown answer extraction {how!r} (answer_tag, last_line, full)")


@functools.cache
def _score_answer_fn(source_dataset: str) -> Callable[[str, Mapping[str, Any]], float]:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(source_dataset)


def reasoning_gym(prompts: Sequence[Any], completions: Sequence[str], **columns: Any) -> list:
    """[G] each completion's answer scored by its item's reasoning-gym task. The item is the `entry`
    column (what `data.reasoning_gym` puts there), else the `metadata` column (a dataset file holding
    whole items); the `extract` column, when there, says how the answer is cut out (else `answer_tag`)."""
    entries = columns.get("entry") or columns.get("metadata")
    if entries is None:
        raise ValueError("the reasoning_gym reward needs an 'entry' (or 'metadata') column holding reasoning-gym items")
    extract = columns.get("extract") or ["answer_tag"] * len(completions)
    out = []
    for entry, how, text in zip(entries, extract, completions):
        if not isinstance(entry, Mapping) or "source_dataset" not in entry.get("metadata", {}):
            raise ValueError(
                "the reasoning_gym reward needs a reasoning-gym item "
                f"({{'question', 'answer', 'metadata': {{'source_dataset', ...}}}}), got {entry!r:.200}"
            )
        score = _score_answer_fn(entry["metadata"]["source_dataset"])
        out.append(float(score(extract_answer(text, how), entry)))
    return out


def positional_match(prompts: Sequence[Any], completions: Sequence[str], answer: Sequence[str], **_: Any) -> list:
    """[G] the fraction of the answer's positions each completion gets right."""
    out = []
    for gold, text in zip(answer, completions):
        if not gold:
            raise ValueError("positional_match needs a non-empty answer to score against")
        out.append(sum(1 for a, r in zip(gold, text) if a == r) / len(gold))
    return out


def exact_match(prompts: Sequence[Any], completions: Sequence[str], answer: Sequence[str], **_: Any) -> list:
    """[G] 1.0 where the completion is exactly the answer, else 0.0."""
    return [float(text == gold) for gold, text in zip(answer, completions)]


BUILTINS: dict[str, Callable[..., list]] = {
    "math_verify": math_verify,
    "reasoning_gym": reasoning_gym,
    "positional_match": positional_match,
    "exact_match": exact_match,
}

# built-in name -> (module it imports, the distribution that provides it)
BUILTIN_PACKAGES: dict[str, tuple[str, str]] = {
    "math_verify": ("math_verify", "math-verify"),
    "reasoning_gym": ("reasoning_gym", "reasoning-gym"),
}
