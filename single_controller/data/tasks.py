"""Synthetic verifiable tasks for the embedded CPU mode: a character tokenizer, datasets, rewards.

`TOKENIZER` has one character per token (PAD, BOS, EOS decode to `_`, `^`, `$`), so positional
rewards stay aligned. A task is `(num_prompts, num_digits, seed) -> list[Prompt]` registered in
`TASKS` (`lookup` and `guess` are the built-in environments' prompts). A fixed hash holds some digit
strings out (`is_held_out`) for every seed and task: training never draws them and the held-out sets
(`EVAL_DATASETS`) draw only them, so eval and training prompts are disjoint by construction. Also
`check_unique_prompt_ids` and `load_callable("module:function")`. Nothing here downloads anything.
"""

from __future__ import annotations

import hashlib
import importlib
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from single_controller.types import Prompt

PAD_CHAR, BOS_CHAR, EOS_CHAR = "_", "^", "$"
DIGITS = "0123456789"
_SYMBOLS = ">+-=:?"


class NoChatTemplate(ValueError):
    """A chat-message prompt (or `data.chat_template: true`) with a tokenizer that has no chat template."""


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

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return (self.eos_id,)

    @property
    def has_chat_template(self) -> bool:
        return False

    def render_chat(self, messages, add_generation_prompt: bool = True, tools=None) -> list[int]:
        raise NoChatTemplate(
            "the character tokenizer of the embedded model has no chat template: give string prompts with "
            "data.chat_template=false, or a model directory whose tokenizer has one (`sc-grpo init-model`)"
        )

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text)

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


HELD_OUT_BUCKETS = 10  # 1 digit string in 10 is held out for evaluation
_ENUMERATE_UP_TO = 100_000  # held-out sets of digit spaces up to this size are enumerated, not sampled


def is_held_out(digits: str) -> bool:
    """The fixed train/eval split of the digit tasks (independent of seed, pool size and task)."""
    h = hashlib.blake2b(digits.encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % HELD_OUT_BUCKETS == 0


def _digit_prompt(prefix: str, i: int, digits: str, transform: Callable[[str], str]) -> Prompt:
    return Prompt(f"{prefix}{i:05d}", tuple(TOKENIZER.encode(BOS_CHAR + digits + ">")), transform(digits))


def _digit_prompts(num_prompts: int, num_digits: int, seed: int, transform: Callable[[str], str]) -> list[Prompt]:
    """Training prompts: random digit strings (with repeats), never a held-out one."""
    if num_prompts < 1 or num_digits < 1:
        raise ValueError(f"need num_prompts >= 1 and num_digits >= 1, got {num_prompts}, {num_digits}")
    rng = random.Random(seed)
    prompts: list[Prompt] = []
    while len(prompts) < num_prompts:
        digits = "".join(rng.choice("0123456789") for _ in range(num_digits))
        if not is_held_out(digits):
            prompts.append(_digit_prompt("p", len(prompts), digits, transform))
    return prompts


def _held_out_prompts(num_prompts: int, num_digits: int, seed: int, transform: Callable[[str], str]) -> list[Prompt]:
    """Eval prompts: distinct held-out digit strings in a seeded order (fewer if fewer exist)."""
    if num_prompts < 1 or num_digits < 1:
        raise ValueError(f"need num_prompts >= 1 and num_digits >= 1, got {num_prompts}, {num_digits}")
    chosen = _held_out_strings(num_prompts, num_digits, random.Random(seed))
    return [_digit_prompt("h", i, d, transform) for i, d in enumerate(chosen)]


def _held_out_strings(num_prompts: int, num_digits: int, rng: random.Random) -> list[str]:
    """Distinct held-out digit strings in the order `rng` gives (fewer if fewer exist)."""
    if 10**num_digits <= _ENUMERATE_UP_TO:
        pool = [s for s in (str(i).zfill(num_digits) for i in range(10**num_digits)) if is_held_out(s)]
        rng.shuffle(pool)
        chosen = pool[:num_prompts]
    else:  # a huge space: sample distinct held-out strings (about HELD_OUT_BUCKETS draws each)
        seen: set[str] = set()
        chosen = []
        while len(chosen) < num_prompts:
            digits = "".join(rng.choice("0123456789") for _ in range(num_digits))
            if digits not in seen and is_held_out(digits):
                seen.add(digits)
                chosen.append(digits)
    return chosen


def _reverse(d: str) -> str:
    return d[::-1]


def _copy(d: str) -> str:
    return d


def reverse_digits(num_prompts: int, num_digits: int, seed: int) -> list[Prompt]:
    """`^123>` -> `321`: exactly `num_digits` new tokens, no EOS needed."""
    return _digit_prompts(num_prompts, num_digits, seed, _reverse)


def copy_digits(num_prompts: int, num_digits: int, seed: int) -> list[Prompt]:
    """`^123>` -> `123`."""
    return _digit_prompts(num_prompts, num_digits, seed, _copy)


def reverse_digits_held_out(num_prompts: int, num_digits: int, seed: int) -> list[Prompt]:
    """The held-out split of `reverse_digits` (disjoint from every training pool)."""
    return _held_out_prompts(num_prompts, num_digits, seed, _reverse)


def copy_digits_held_out(num_prompts: int, num_digits: int, seed: int) -> list[Prompt]:
    """The held-out split of `copy_digits` (disjoint from every training pool)."""
    return _held_out_prompts(num_prompts, num_digits, seed, _copy)


# -- the prompts of the built-in environments (`single_controller/envs/builtin.py`, env.fn of the same name)
def _lookup_prompt(prefix: str, i: int, key: str, value: str) -> Prompt:
    return Prompt(f"{prefix}{i:05d}", tuple(TOKENIZER.encode(f"{BOS_CHAR}{key}>")), value)


def lookup(num_prompts: int, num_digits: int, seed: int) -> list[Prompt]:
    """`^K>` (K: a one-digit key) -> the key's secret `num_digits`-digit value, drawn from the seed per
    prompt (never a held-out value): only the `lookup` environment's tool tells it (`?K` -> `=VVV>`)."""
    if num_prompts < 1 or num_digits < 1:
        raise ValueError(f"need num_prompts >= 1 and num_digits >= 1, got {num_prompts}, {num_digits}")
    rng = random.Random(seed)
    prompts: list[Prompt] = []
    while len(prompts) < num_prompts:
        key, value = rng.choice(DIGITS), "".join(rng.choice(DIGITS) for _ in range(num_digits))
        if not is_held_out(value):
            prompts.append(_lookup_prompt("p", len(prompts), key, value))
    return prompts


def lookup_held_out(num_prompts: int, num_digits: int, seed: int) -> list[Prompt]:
    """The held-out split of `lookup`: distinct held-out values (fewer if fewer exist), seeded keys."""
    if num_prompts < 1 or num_digits < 1:
        raise ValueError(f"need num_prompts >= 1 and num_digits >= 1, got {num_prompts}, {num_digits}")
    rng = random.Random(seed)
    values = _held_out_strings(num_prompts, num_digits, rng)
    return [_lookup_prompt("h", i, rng.choice(DIGITS), v) for i, v in enumerate(values)]


def guess(num_prompts: int, num_digits: int, seed: int) -> list[Prompt]:
    """`^>` -> a secret digit drawn from the seed per prompt, found by playing the `guess` environment
    (`num_digits` is not used: the secret is one digit)."""
    if num_prompts < 1:
        raise ValueError(f"need num_prompts >= 1, got {num_prompts}")
    rng = random.Random(seed)
    ids = tuple(TOKENIZER.encode(BOS_CHAR + ">"))
    return [Prompt(f"p{i:05d}", ids, rng.choice(DIGITS)) for i in range(num_prompts)]


def guess_held_out(num_prompts: int, num_digits: int, seed: int) -> list[Prompt]:
    """The eval set of `guess`: every secret digit once, in a seeded order (at most 10 prompts). The
    prompt text is the same for every secret, so nothing is held out but the episodes: eval measures
    the search the policy learned, over each secret equally."""
    if num_prompts < 1:
        raise ValueError(f"need num_prompts >= 1, got {num_prompts}")
    secrets = list(DIGITS)
    random.Random(seed).shuffle(secrets)
    ids = tuple(TOKENIZER.encode(BOS_CHAR + ">"))
    return [Prompt(f"h{i:05d}", ids, d) for i, d in enumerate(secrets[:num_prompts])]


TASKS: dict[str, Callable[[int, int, int], list[Prompt]]] = {
    "reverse_digits": reverse_digits,
    "copy_digits": copy_digits,
    "lookup": lookup,
    "guess": guess,
}

# Held-out sets by name; `<task>.held_out` is the default eval set of task `<task>`.
EVAL_DATASETS: dict[str, Callable[[int, int, int], list[Prompt]]] = {
    "reverse_digits.held_out": reverse_digits_held_out,
    "copy_digits.held_out": copy_digits_held_out,
    "lookup.held_out": lookup_held_out,
    "guess.held_out": guess_held_out,
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
        hint = ""
        if isinstance(e, ModuleNotFoundError) and e.name and module_name.split(".")[0] == e.name.split(".")[0]:
            hint = (
                " (modules are imported from the current directory and the Python path: "
                "run from the directory that holds it, or add that to PYTHONPATH)"
            )
        raise ImportError(f"cannot import module {module_name!r} named in {spec!r}: {e}{hint}") from e
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(f"module {module_name!r} has no attribute {attr_path!r} (from {spec!r})") from None
    if not callable(obj):
        raise TypeError(f"{spec!r} resolves to a {type(obj).__name__}, which is not callable")
    return obj


def eval_dataset_name(task_name: str, dataset: str | None) -> str:
    """`eval.dataset`, or the task's held-out split when it is None."""
    return dataset if dataset is not None else f"{task_name}.held_out"


def load_eval_dataset(task_name: str, dataset: str | None) -> Callable[[int, int, int], list[Prompt]]:
    """A registered held-out set, or `module:function` with the task signature."""
    name = eval_dataset_name(task_name, dataset)
    if name in EVAL_DATASETS:
        return EVAL_DATASETS[name]
    if dataset is None:
        raise KeyError(
            f"task {task_name!r} has no registered held-out split; set eval.dataset to one of "
            f"{sorted(EVAL_DATASETS)} or to 'module:function'"
        )
    if ":" in name:
        return load_callable(name)
    raise KeyError(
        f"unknown eval dataset {name!r}: registered held-out sets are {sorted(EVAL_DATASETS)}, "
        "or give 'module:function'"
    )


def load_eval_prompts(cfg) -> list[Prompt]:
    """The eval prompts of a config (`eval.dataset`, `eval.num_prompts`, `task.num_digits`, `seed`)."""
    fn = load_eval_dataset(cfg.task.name, cfg.eval.dataset)
    prompts = list(fn(cfg.eval.num_prompts, cfg.task.num_digits, cfg.seed))[: cfg.eval.num_prompts]
    check_unique_prompt_ids(prompts, f"eval dataset {eval_dataset_name(cfg.task.name, cfg.eval.dataset)!r}")
    return prompts


def check_unique_prompt_ids(prompts: Sequence[Prompt], what: str) -> None:
    """Refuse a dataset in which two prompts share an id, naming the ids (the first ten): the
    exactly-once prompt ledger and the group ids (`<prompt id>-a<attempt>`) key on it."""
    counts = Counter(p.prompt_id for p in prompts)
    repeated = [(pid, n) for pid, n in counts.items() if n > 1]
    if repeated:
        named = ", ".join(f"{pid!r} ({n} times)" for pid, n in repeated[:10])
        more = f" and {len(repeated) - 10} more" if len(repeated) > 10 else ""
        raise ValueError(
            f"{what} has {len(repeated)} duplicated prompt id(s): {named}{more}; every prompt needs its own prompt_id"
        )


def load_task(name: str) -> Callable[[int, int, int], list[Prompt]]:
    """A registered task name, or `module:function` with the same signature."""
    if name in TASKS:
        return TASKS[name]
    if ":" in name:
        return load_callable(name)
    raise KeyError(f"unknown task {name!r}: registered tasks are {sorted(TASKS)}, or give 'module:function'")
