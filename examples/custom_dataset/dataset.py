"""A prompt dataset of your own, read from a JSON Lines file: two-digit additions (`^12+34=` -> `46`).

A dataset is a function `(num_prompts, num_digits, seed) -> list[Prompt]` named by `task.name` as
`module:function`; the controller calls it once and cycles through the list in epochs, reshuffled
each epoch. Prompts are token ids of the tasks' character tokenizer (`single_controller.data.tasks.
TOKENIZER`: the digits, `+-=:?>` and PAD/BOS/EOS), which every backend's model uses.
Each line of the file: {"id": "add-0000", "prompt": "12+34=", "answer": "46"}.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from single_controller.data.tasks import BOS_CHAR, TOKENIZER
from single_controller.types import Prompt

PROMPTS_FILE = Path(__file__).with_name("prompts.jsonl")


def load_prompts(path: str | Path) -> list[Prompt]:
    """Every line of a JSON Lines file as a Prompt; a bad line is an error naming the file and line."""
    prompts, seen = [], set()
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            prompt = Prompt(str(rec["id"]), tuple(TOKENIZER.encode(BOS_CHAR + rec["prompt"])), str(rec["answer"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: {e}") from None
        if prompt.prompt_id in seen:
            raise ValueError(f"{path}:{n}: prompt id {prompt.prompt_id!r} appears twice")
        seen.add(prompt.prompt_id)
        prompts.append(prompt)
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def addition_prompts(num_prompts: int, num_digits: int, seed: int) -> list[Prompt]:
    """The file's prompts in a seeded order, at most `num_prompts` (task.num_prompts); `num_digits`
    is for the built-in digit tasks and unused here."""
    prompts = load_prompts(PROMPTS_FILE)
    random.Random(seed).shuffle(prompts)
    return prompts[:num_prompts]
