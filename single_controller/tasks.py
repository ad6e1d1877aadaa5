"""Synthetic verifiable tasks for the embedded CPU mode: a character tokenizer, datasets, rewards.

Contract:
* `TOKENIZER` is a character-level tokenizer where every token is exactly one character, so a
  decoded response has one character per generated token (positional rewards stay aligned even
  when a policy samples special tokens: PAD, BOS and EOS decode to `_`, `^` and `$`).
* A task is a dataset function `(num_prompts, num_digits, seed) -> list[Prompt]`, registered in
  `TASKS` by name; `prompt_id`s are `p00000`, `p00001`, ... (unique within the list), and
  `Prompt.answer` is the exact expected response text.
* A reward function is `fn(prompt, response_text) -> float` (see `protocols.RewardFunction`).
* `load_callable("module:function")` resolves the `module:function` strings of the config.

Nothing here downloads anything.
"""

from __future__ import annotations

import importlib
import random
from dataclasses import dataclass
from typing import Callable, Sequence

from single_controller.types import Prompt

PAD_CHAR, BOS_CHAR, EOS_CHAR = "_", "^", "$"
_SYMBOLS = ">+-=:?"


@dataclass(frozen=True)
class CharTokenizer:
    """Maps each character of `alphabet` to its index; token i decodes to alphabet[i]."""

    alphabet: str

    def __post_init__(self) -> None:
        if len(set(self.alphabet)) != len(self.alphabet):
            raise ValueError(f"alphabet has repeated characters: {self.alphabet!r}")

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    @property
    def pad_id(self) -> int:
        return self.alphabet.index(PAD_CHAR)

    @property
    def bos_id(self) -> int:
        return self.alphabet.index(BOS_CHAR)

    @property
    def eos_id(self) -> int:
        return self.alphabet.index(EOS_CHAR)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.alphabet.index(ch) for ch in text]
        except ValueError:
            bad = sorted({ch for ch in text if ch not in self.alphabet})
            raise ValueError(f"characters {bad} are not in the vocabulary {self.alphabet!r}") from None

    def decode(self, ids: Sequence[int]) -> str:
        alphabet = self.alphabet
        return "".join([alphabet[i] for i in ids])


# PAD, BOS, EOS, the ten digits and a few symbols: 19 tokens.
TOKENIZER = CharTokenizer(PAD_CHAR + BOS_CHAR + EOS_CHAR + "0123456789" + _SYMBOLS)


def _digit_prompts(num_prompts: int, num_digits: int, seed: int, transform: Callable[[str], str]) -> list[Prompt]:
    if num_prompts < 1 or num_digits < 1:
        raise ValueError(f"need num_prompts >= 1 and num_digits >= 1, got {num_prompts}, {num_digits}")
    rng = random.Random(seed)
    prompts = []
    for i in range(num_prompts):
        digits = "".join(rng.choice("0123456789") for _ in range(num_digits))
        prompts.append(
            Prompt(
                prompt_id=f"p{i:05d}",
                token_ids=tuple(TOKENIZER.encode(BOS_CHAR + digits + ">")),
                answer=transform(digits),
            )
        )
    return prompts


def reverse_digits(num_prompts: int, num_digits: int, seed: int) -> list[Prompt]:
    """`^123>` -> `321`: exactly `num_digits` new tokens, no EOS needed."""
    return _digit_prompts(num_prompts, num_digits, seed, lambda d: d[::-1])


def copy_digits(num_prompts: int, num_digits: int, seed: int) -> list[Prompt]:
    """`^123>` -> `123`."""
    return _digit_prompts(num_prompts, num_digits, seed, lambda d: d)


TASKS: dict[str, Callable[[int, int, int], list[Prompt]]] = {
    "reverse_digits": reverse_digits,
    "copy_digits": copy_digits,
}


def positional_match_reward(prompt: Prompt, response_text: str) -> float:
    """Fraction of the answer's positions that the response gets right (characters beyond the
    answer's length are ignored; a short response scores its missing positions as wrong)."""
    answer = prompt.answer
    if not answer:
        raise ValueError(f"prompt {prompt.prompt_id} has no answer to score against")
    hits = sum(1 for a, r in zip(answer, response_text) if a == r)
    return hits / len(answer)


def exact_match_reward(prompt: Prompt, response_text: str) -> float:
    """1.0 when the response is exactly the answer, else 0.0."""
    return float(response_text == prompt.answer)


def load_callable(spec: str) -> Callable:
    """Resolve `"package.module:function"` (dots after the colon walk attributes)."""
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"expected 'module:function', got {spec!r}")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"cannot import module {module_name!r} named in {spec!r}: {e}") from e
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(f"module {module_name!r} has no attribute {attr_path!r} (from {spec!r})") from None
    if not callable(obj):
        raise TypeError(f"{spec!r} resolves to a {type(obj).__name__}, which is not callable")
    return obj


def load_task(name: str) -> Callable[[int, int, int], list[Prompt]]:
    """A registered task name, or `module:function` with the same signature."""
    if name in TASKS:
        return TASKS[name]
    if ":" in name:
        return load_callable(name)
    raise KeyError(f"unknown task {name!r}: registered tasks are {sorted(TASKS)}, or give 'module:function'")
