"""Prompts of the chat example (reverse digits as chat messages) rendered with a model directory's own
tokenizer and chat template: what parity tests feed a BPE/chat-template model."""

from __future__ import annotations

import json
import random
from pathlib import Path

from single_controller.data.tokenizer import load_tokenizer
from single_controller.types import Prompt

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "chat_model" / "train.jsonl"


def chat_prompts(model_dir: str | Path, n: int, seed: int = 0) -> list[Prompt]:
    """`n` rows of examples/chat_model/train.jsonl (seeded choice), through the model's chat template."""
    tok = load_tokenizer(str(model_dir))
    rows = [json.loads(line) for line in TRAIN.read_text().splitlines()]
    picked = random.Random(seed).sample(rows, n)
    return [Prompt(r["id"], tuple(tok.render_chat(r["prompt"])), r["answer"], r["prompt"]) for r in picked]
