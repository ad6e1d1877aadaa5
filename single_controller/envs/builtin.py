"""The built-in environments (`env.fn: lookup` / `guess`), small enough for the embedded model to learn
from scratch with the character tokenizer (`$` ends every turn).

Both are deterministic given the episode's item (the G episodes of a group face the same task); the
secret is the prompt's `answer`. `lookup` (tool use): prompt `^K>`; a tool call `?K` is answered with
the key's value, any other turn is the final answer, rewarded 0.7 * digit match + 0.2 (the right call
was made) + 0.1 (a call was made):

    ^3>?3$=482>482$        turn 1 calls the tool, turn 2 answers: reward 1.0

`guess`: each turn guesses a digit, answered `+` / `-`, the right one ends with reward 1.0 (binary
search needs 4 turns); with `shaped=True` an unfinished step carries a closeness reward below 1.0.
"""

from __future__ import annotations

import hashlib
import re

from single_controller.envs.contract import Action, EpisodeItem, StepOutcome, ToolCall

LOOKUP_TOOL = "lookup"
NO_VALUE = ":>"  # the tool's answer to a call it cannot serve
NOT_A_GUESS = ":"
_DIGITS = re.compile(r"[0-9]+")


def digit_match(answer: str, text: str) -> float:
    """Fraction of positions where `text` equals `answer`, over the longer of the two: a missing or
    an extra character counts as a wrong position (`482` vs `4829`: 3/4)."""
    hits = sum(1 for a, t in zip(answer, text) if a == t)
    return hits / max(len(answer), len(text), 1)


def other_value(prompt_id: str, key: str, answer: str) -> str:
    """The value the tool gives for a key other than the prompt's: fixed per (prompt, key), as many
    digits as `answer`, never equal to it."""
    n = len(answer)
    digest = hashlib.blake2b(f"{prompt_id}:{key}".encode(), digest_size=8).digest()
    value = int.from_bytes(digest, "little") % 10**n
    text = str(value).zfill(n)
    return text if text != answer else str((value + 1) % 10**n).zfill(n)


def prompt_key(item: EpisodeItem) -> str:
    """The key of a `lookup` prompt: `item.columns["key"]`, else the digits of the prompt text `^K>`."""
    key = item.columns.get("key")
    if key is None:
        text = item.prompt if isinstance(item.prompt, str) else ""
        key = text.removeprefix("^").removesuffix(">")
    key = str(key)
    if not _DIGITS.fullmatch(key):
        raise ValueError(f"lookup: prompt {item.prompt_id} ({item.prompt!r}) is not `^KEY>` with a digit key")
    return key


def _digit_answer(item: EpisodeItem, env: str, length: int | None = None) -> str:
    answer = item.answer
    if not _DIGITS.fullmatch(answer) or (length is not None and len(answer) != length):
        size = "digits" if length is None else f"{length} digit(s)"
        raise ValueError(f"{env}: prompt {item.prompt_id} has answer {answer!r}, expected {size}")
    return answer


class LookupEnv:
    """One `lookup` episode: the secret value is behind a tool call."""

    def __init__(self) -> None:
        self.item: EpisodeItem | None = None
        self.key = ""
        self.answer = ""
        self.called_right_key = False
        self.calls = 0

    async def reset(self, item: EpisodeItem) -> str:
        self.item, self.key, self.answer = item, prompt_key(item), _digit_answer(item, "lookup")
        return ""  # the prompt `^K>` already invites the first turn

    async def step(self, action: Action) -> StepOutcome:
        if self.item is None:
            raise RuntimeError("lookup: step before reset")
        if action.tool_call is not None:
            self.calls += 1
            return StepOutcome(observation=self._call(action.tool_call))
        match = digit_match(self.answer, action.text)
        # in tenths, so the perfect episode's reward is exactly 1.0 (0.7 + 0.2 + 0.1 is not)
        reward = (7 * match + 2 * float(self.called_right_key) + float(self.calls > 0)) / 10
        info = {"match": match, "called_right_key": self.called_right_key, "tool_calls": self.calls}
        return StepOutcome(reward=reward, done=True, info=info)

    def _call(self, call: ToolCall) -> str:
        assert self.item is not None
        if call.error is not None or call.name != LOOKUP_TOOL:
            return NO_VALUE
        args = call.arguments
        key = args.get("key") if isinstance(args, dict) else args
        if not isinstance(key, str | int) or not _DIGITS.fullmatch(str(key)):
            return NO_VALUE
        key = str(key)
        if key == self.key:
            self.called_right_key = True
            return f"={self.answer}>"
        return f"={other_value(self.item.prompt_id, key, self.answer)}>"


class GuessEnv:
    """One `guess` episode: find the secret digit from `+` / `-` hints."""

    def __init__(self, shaped: bool = False) -> None:
        if not isinstance(shaped, bool):
            raise TypeError(f"guess: shaped must be true or false, got {shaped!r}")
        self.shaped = shaped
        self.secret: int | None = None
        self.guesses = 0

    async def reset(self, item: EpisodeItem) -> str:
        self.secret = int(_digit_answer(item, "guess", length=1))
        return ""  # the prompt `^>` already invites the first guess

    async def step(self, action: Action) -> StepOutcome:
        if self.secret is None:
            raise RuntimeError("guess: step before reset")
        text = action.text
        if len(text) != 1 or not _DIGITS.fullmatch(text):
            return StepOutcome(observation=NOT_A_GUESS, reward=0.0 if self.shaped else None)
        self.guesses += 1
        guess = int(text)
        if guess == self.secret:
            return StepOutcome(reward=1.0, done=True, info={"guesses": self.guesses})
        closeness = 0.5 * (1.0 - abs(guess - self.secret) / 9.0)
        return StepOutcome(observation="+" if self.secret > guess else "-", reward=closeness if self.shaped else None)
