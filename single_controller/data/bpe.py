"""A real-format tokenizer for tiny models, trained offline: byte-level BPE with a ChatML chat template.

`write_bpe_tokenizer(directory, vocab_size, seed)` trains a byte-level BPE on a generated corpus
(nothing downloaded), digits split one per token, with `<|endoftext|>` (padding), `<|im_start|>` and
`<|im_end|>` (end of turn), and writes what `save_pretrained` writes for an instruct model, loadable
offline by `AutoTokenizer`. `vocab_size` counts 256 bytes + 3 specials + merges (259: no merges);
the same size gives the same tokenizer every time.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)

# ChatML, as Qwen2/Qwen3 instruct models write it (without tools).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_WORDS = (
    "the of and to in is was for on that with as by at from it be this are or an have not which one had "
    "but all were they their there been has when who will more no if out so said what up its about into "
    "than them can only other new some could time these two may then do first any my now such like our "
    "over man me even most made after also did many before must through back years where much your way "
    "well down should because each just those people how too little state good very make world still "
    "own see men work long get here between both life being under never day same another know while last "
    "might us great old year off come since against go came right used take three reverse digits number "
    "answer question spell word letters backward sum count sort list copy add subtract multiply divide "
    "solve problem step think cat dog sun map top red blue green tree book game play read write open"
).split()
_SYSTEM = ("You are a helpful assistant.", "Answer with the result only.", "Think step by step.")


def corpus(seed: int = 0, lines: int = 3000) -> list[str]:
    """Generated training text: sentences, numbers and chat turns (deterministic for a seed)."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12)))
        number = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 8)))
        sentence = words.capitalize() + rng.choice((".", "?", "!", ":", ",")) + " " + number
        if rng.random() < 0.3:
            sentence = (
                f"<|im_start|>system\n{rng.choice(_SYSTEM)}<|im_end|>\n<|im_start|>user\n{sentence}<|im_end|>\n"
                f"<|im_start|>assistant\n{number[::-1]}<|im_end|>\n"
            )
        out.append(sentence)
    return out


def write_bpe_tokenizer(directory: str | Path, vocab_size: int = 512, seed: int = 0) -> int:
    """Train and save the tokenizer into `directory`; returns its size (ids 0 .. size-1)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB:
        raise ValueError(f"a byte-level BPE needs vocab_size >= {MIN_VOCAB} (256 bytes + 3 special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
    )
    fast.save_pretrained(str(directory))
    _write_configs(Path(directory))
    return len(fast)


def _write_configs(out: Path) -> None:
    """The chat template and special tokens in `tokenizer_config.json` + `special_tokens_map.json`, as
    released instruct models carry them (transformers 4.x reads both; 5.x reads them too)."""
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    extra = [t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)]
    cfg.update(
        tokenizer_class="PreTrainedTokenizerFast",  # loadable by transformers 4.x as well
        chat_template=CHAT_TEMPLATE,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=extra,
        model_max_length=1 << 20,
    )
    cfg.pop("extra_special_tokens", None)
    cfg.pop("backend", None)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)  # one place for the template
    specials = {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "additional_special_tokens": extra}
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
