"""The run's tokenizer: the model's own, loaded from the model directory, or the embedded character one.

`load_tokenizer(path)` is what every role uses: `tasks.TOKENIZER` for the embedded TinyGPT or a
directory in the digit tasks' vocabulary, else `HFTokenizer` around `AutoTokenizer` (offline). Both
speak `RunTokenizer` (`encode`, `encode_prompt`, `decode`, `render_chat`, `eos_ids` including
`generation_config.json`'s, `pad_id`, `vocab_size`). Token ids are the unit end to end: prompts are
rendered once on the controller, and workers only decode completions for the reward.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

from single_controller.data.tasks import NoChatTemplate

__all__ = ["HFTokenizer", "NoChatTemplate", "RunTokenizer", "is_char_tokenizer_dir", "load_tokenizer"]


class RunTokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def eos_ids(self) -> tuple[int, ...]: ...

    @property
    def has_chat_template(self) -> bool: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_prompt(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, tools: Any = None
    ) -> list[int]: ...


class HFTokenizer:
    """A Hugging Face tokenizer (`AutoTokenizer`, offline) seen as a `RunTokenizer`."""

    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        self.path = str(path)
        self.tok = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        eos = [] if self.tok.eos_token_id is None else [int(self.tok.eos_token_id)]
        gen_cfg = Path(path) / "generation_config.json"
        if gen_cfg.is_file():
            extra = json.loads(gen_cfg.read_text()).get("eos_token_id")
            eos += [int(e) for e in (extra if isinstance(extra, list) else [extra]) if e is not None]
        self._eos_ids = tuple(dict.fromkeys(eos))  # in order, once each
        pad = self.tok.pad_token_id
        self._pad_id = int(pad) if pad is not None else (self._eos_ids[0] if self._eos_ids else 0)

    @property
    def vocab_size(self) -> int:
        return len(self.tok)  # base vocabulary + added (special) tokens

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def encode_prompt(self, text: str) -> list[int]:
        """A raw (untemplated) prompt, with the special tokens the tokenizer adds itself (e.g. Llama's BOS)."""
        return list(self.tok(text, add_special_tokens=True)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=True))

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, tools: Any = None
    ) -> list[int]:
        """The template's text of `messages` as token ids; `tools` (JSON schemas: `env.tools`) reach
        the template as its `tools` variable."""
        if not self.has_chat_template:
            raise NoChatTemplate(
                f"the tokenizer in {self.path!r} has no chat template (tokenizer_config.json has no "
                "'chat_template'): give string prompts with data.chat_template=false, or use a model "
                "directory whose tokenizer has one (`sc-grpo init-model` writes one)"
            )
        text = self.tok.apply_chat_template(
            [dict(m) for m in messages],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            tools=list(tools) if tools else None,
        )
        return self.encode(str(text))  # the template writes the special tokens itself


def is_char_tokenizer_dir(path: str | Path) -> bool:
    """True when the directory's tokenizer.json is exactly the digit tasks' character vocabulary."""
    from single_controller.data.tasks import TOKENIZER

    try:
        vocab = json.loads((Path(path) / "tokenizer.json").read_text())["model"]["vocab"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return vocab == {ch: i for i, ch in enumerate(TOKENIZER.alphabet)}


@lru_cache(maxsize=8)
def load_tokenizer(path: str | None) -> RunTokenizer:
    """The tokenizer of model directory `path` (None: the embedded model's character tokenizer)."""
    from single_controller.data.tasks import TOKENIZER

    if path is None or is_char_tokenizer_dir(path):
        return TOKENIZER
    return HFTokenizer(path)


def is_char_tokenizer(tokenizer: RunTokenizer) -> bool:
    from single_controller.data.tasks import CharTokenizer

    return isinstance(tokenizer, CharTokenizer)
