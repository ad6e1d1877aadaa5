"""The Hugging Face model directory: the one model format every backend loads and saves.

A directory holds `config.json`, `*.safetensors` and the tokenizer files, as `save_pretrained`
writes them; weight snapshots use the checkpoint's own parameter names, so any trainer feeds any
generation backend. `init_model` writes a tiny random-init model of one of `ARCHS` offline (a BPE
with a chat template, or the digit tasks' character tokenizer); `model_dir_problems` lists what is
wrong with a directory without importing torch (`single_controller.preflight`); `save_hf_policy`
writes a policy back as a directory.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

CONFIG_FILE = "config.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)
# A tokenizer transformers can load: the fast tokenizer file, a SentencePiece model, or a BPE vocabulary.
TOKENIZER_SOURCES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# Head sizes vLLM's CPU attention backend runs (measured: head_dim 16 fails with "Unsupported CPU
# attention configuration"); any head size runs on a GPU.
# RoPE base for the tiny models: sequences here are ~10 tokens, and with Llama's 10000 most rotary
# dimensions barely turn over 10 positions, leaving the model little positional signal.
ROPE_THETA = 100.0
ARCHS = ("llama", "qwen2", "qwen3", "gpt2")
# `bpe`: a byte-level BPE with a chat template, as instruct models ship (`data.bpe`); `char`: the digit
# tasks' character tokenizer (what the built-in tasks and the embedded model speak).
TOKENIZER_KINDS = ("bpe", "char")
VLLM_CPU_HEAD_DIMS = frozenset({32, 64, 80, 96, 112, 128, *range(160, 513, 16)})


def vllm_cpu_head_dim_ok(head_dim: int) -> bool:
    return head_dim in VLLM_CPU_HEAD_DIMS


def read_config(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / CONFIG_FILE).read_text())


def head_dim_of(config: dict[str, Any]) -> int:
    if config.get("head_dim"):
        return int(config["head_dim"])
    hidden = config["hidden_size"] if "hidden_size" in config else config["n_embd"]
    heads = config["num_attention_heads"] if "num_attention_heads" in config else config["n_head"]
    return int(hidden) // int(heads)


def positions_of(config: dict[str, Any]) -> int:
    return int(config.get("max_position_embeddings", config.get("n_positions", 0)))


def model_dir_problems(path: str | Path, *, vllm_cpu: bool = False, min_positions: int = 0) -> list[str]:
    """Everything wrong with `path` as a run's model directory (empty: usable). `vllm_cpu`: also
    check that vLLM's CPU attention supports its head size; `min_positions`: the longest sequence."""
    p = Path(path)
    if not p.is_dir():
        return [f"model directory {str(p)!r} does not exist (create one with `sc-grpo init-model {p}`)"]
    out = []
    config = None
    if not (p / CONFIG_FILE).is_file():
        out.append(f"model directory {str(p)!r} has no {CONFIG_FILE}")
    else:
        try:
            config = read_config(p)
        except (OSError, ValueError) as e:
            out.append(f"{p / CONFIG_FILE} is not readable JSON: {e}")
    if not list(p.glob("*.safetensors")):
        out.append(f"model directory {str(p)!r} has no *.safetensors weights")
    tokens = None
    if not any((p / name).is_file() for name in TOKENIZER_SOURCES):
        out.append(
            f"model directory {str(p)!r} has no tokenizer ({' or '.join(TOKENIZER_SOURCES)}); every backend "
            "loads the tokenizer from the model directory (`sc-grpo init-model` writes one)"
        )
    elif (p / "tokenizer.json").is_file():
        try:
            tokens = tokenizer_json_size(p / "tokenizer.json")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            out.append(f"{p / 'tokenizer.json'} has no readable vocabulary: {e!r}")
    if config is not None:
        try:
            hd = head_dim_of(config)
            if vllm_cpu and not vllm_cpu_head_dim_ok(hd):
                out.append(
                    f"{p / CONFIG_FILE}: head_dim {hd} cannot run on vLLM's CPU attention (supported: 32, 64, "
                    "80, 96, 112, 128, 160..512 in steps of 16); use a model with head_dim 32, e.g. "
                    "hidden_size 64 with 2 attention heads"
                )
            if tokens is not None and int(config.get("vocab_size", 0)) < tokens:
                out.append(
                    f"{p / CONFIG_FILE}: vocab_size {config.get('vocab_size')} < the tokenizer's {tokens} tokens"
                )
            if positions_of(config) < min_positions:
                out.append(
                    f"{p / CONFIG_FILE}: {positions_of(config)} positions (max_position_embeddings) are "
                    f"fewer than the longest sequence ({min_positions} tokens)"
                )
        except (KeyError, TypeError, ValueError) as e:
            out.append(f"{p / CONFIG_FILE} lacks a field every backend needs: {e!r}")
    return out


def tokenizer_json_size(path: str | Path) -> int:
    """Token ids a `tokenizer.json` can produce: 1 + its largest id (vocabulary and added tokens)."""
    data = json.loads(Path(path).read_text())
    vocab = data["model"]["vocab"]
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))  # BPE/WordLevel, Unigram
    ids += [int(t["id"]) for t in data.get("added_tokens") or ()]
    return 1 + max(ids)


def write_tokenizer(directory: str | Path) -> None:
    """The tasks' character tokenizer as HF tokenizer files (each character one token, no merges)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from single_controller.data.tasks import BOS_CHAR, EOS_CHAR, PAD_CHAR, TOKENIZER

    vocab = {ch: i for i, ch in enumerate(TOKENIZER.alphabet)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS_CHAR, eos_token=EOS_CHAR, pad_token=PAD_CHAR, unk_token="?"
    )
    fast.save_pretrained(str(directory))


def init_model(
    directory: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    head_dim: int = 32,
    intermediate_size: int | None = None,
    num_kv_heads: int | None = None,
    max_positions: int = 32,
    seed: int = 0,
    init_std: float = 0.02,
    rope_theta: float = ROPE_THETA,
    arch: str = "llama",
    tokenizer: str = "char",
    vocab_size: int = 512,
    tie_embeddings: bool = False,
) -> Path:
    """Write a random-init causal LM (float32) and its tokenizer into `directory` (created; existing
    files are overwritten). Returns the directory. `tokenizer="char"`: the digit tasks' character
    tokenizer; `"bpe"`: a byte-level BPE of `vocab_size` tokens with a ChatML chat template
    (`data.bpe`), the same for every seed. `tie_embeddings`: the output head is the input embedding
    (`tie_word_embeddings`, as in Qwen2.5-0.5B, Qwen3-0.6B, Llama-3.2-1B and GPT-2), else a separate
    `lm_head.weight`. `intermediate_size`: the MLP's width (default 4 x hidden). `num_kv_heads`:
    grouped-query attention, as many key/value heads (they divide the query heads; default: as many
    as the query heads; the RoPE archs only).

    `arch` (one of `ARCHS`): `llama` LlamaForCausalLM (RoPE, RMSNorm, SwiGLU); `qwen2` Qwen2ForCausalLM
    (Llama's layout plus biases on q/k/v); `qwen3` Qwen3ForCausalLM (Llama's layout plus an RMSNorm
    of each query and key head, `q_norm`/`k_norm`, before RoPE; explicit `head_dim`); `gpt2`
    GPT2LMHeadModel (learned absolute positions, LayerNorm, GELU MLP), the architecture of the
    embedded TinyGPT."""
    import transformers

    if hidden_size % head_dim:
        raise ValueError(f"hidden_size {hidden_size} is not a multiple of head_dim {head_dim}")
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if tokenizer not in TOKENIZER_KINDS:
        raise ValueError(f"tokenizer must be one of {TOKENIZER_KINDS}, got {tokenizer!r}")
    heads = hidden_size // head_dim
    kv_heads = _kv_heads(heads, num_kv_heads, arch)
    sizes = _Sizes(
        hidden_size=hidden_size,
        num_layers=num_layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size or 4 * hidden_size,
        max_positions=max_positions,
        init_std=init_std,
        tie_embeddings=tie_embeddings,
    )
    vocab = _write_tokenizer_files(Path(directory), tokenizer, vocab_size)
    if arch == "gpt2":
        return _write(directory, _gpt2_config(sizes, vocab), transformers.GPT2LMHeadModel, seed)
    if arch == "qwen2":
        return _write(directory, _qwen2_config(sizes, vocab, rope_theta), transformers.Qwen2ForCausalLM, seed)
    if arch == "qwen3":
        return _write(directory, _qwen3_config(sizes, vocab, rope_theta), transformers.Qwen3ForCausalLM, seed)
    return _write(directory, _llama_config(sizes, vocab, rope_theta), transformers.LlamaForCausalLM, seed)


def _kv_heads(heads: int, num_kv_heads: int | None, arch: str) -> int:
    """The key/value heads of a new model: `num_kv_heads`, checked, or one per query head."""
    if num_kv_heads is None or num_kv_heads == heads:
        return heads
    if arch == "gpt2":
        raise ValueError(f"GPT-2 has one key/value head per query head ({heads}), not {num_kv_heads}")
    if num_kv_heads < 1 or heads % num_kv_heads:
        raise ValueError(f"{num_kv_heads} key/value heads do not divide the {heads} query heads")
    return num_kv_heads


def _write_tokenizer_files(out: Path, kind: str, vocab_size: int) -> VocabIds:
    """The tokenizer of a new model directory (written first); its size and special ids for the config."""
    out.mkdir(parents=True, exist_ok=True)
    if kind == "char":
        from single_controller.data.tasks import TOKENIZER

        write_tokenizer(out)
        return VocabIds(
            vocab_size=TOKENIZER.vocab_size,
            bos_token_id=TOKENIZER.bos_id,
            eos_token_id=TOKENIZER.eos_id,
            pad_token_id=TOKENIZER.pad_id,
        )
    from single_controller.data.bpe import EOS_TOKEN, PAD_TOKEN, write_bpe_tokenizer

    size = write_bpe_tokenizer(out, vocab_size, seed=0)  # the same tokenizer for every model seed
    ids = {t["content"]: int(t["id"]) for t in json.loads((out / "tokenizer.json").read_text())["added_tokens"]}
    return VocabIds(vocab_size=size, bos_token_id=None, eos_token_id=ids[EOS_TOKEN], pad_token_id=ids[PAD_TOKEN])


@dataclass(frozen=True)
class _Sizes:
    hidden_size: int
    num_layers: int
    heads: int  # query heads
    kv_heads: int  # key/value heads (grouped-query attention when fewer)
    head_dim: int
    intermediate_size: int
    max_positions: int
    init_std: float
    tie_embeddings: bool


class VocabIds(TypedDict):
    """The tokenizer's vocabulary size and special token ids, named as HF config fields."""

    vocab_size: int
    bos_token_id: int | None  # None: the tokenizer has no BOS (a ChatML BPE)
    eos_token_id: int
    pad_token_id: int


def _gpt2_config(sizes: _Sizes, vocab: VocabIds) -> Any:
    import transformers

    # torch_dtype: transformers >= 4.40 reads it (newer ones as `dtype`)
    return transformers.GPT2Config(
        n_embd=sizes.hidden_size,
        n_layer=sizes.num_layers,
        n_head=sizes.heads,
        n_inner=sizes.intermediate_size,
        n_positions=sizes.max_positions,
        initializer_range=sizes.init_std,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=sizes.tie_embeddings,
        torch_dtype="float32",
        **vocab,
    )


def _rope_fields(sizes: _Sizes, vocab: VocabIds, rope_theta: float) -> dict[str, Any]:
    """The config fields Llama, Qwen2 and Qwen3 share.
    torch_dtype, rope_theta: transformers >= 4.40 reads them (newer ones into `dtype`, `rope_parameters`)."""
    return dict(
        hidden_size=sizes.hidden_size,
        intermediate_size=sizes.intermediate_size,
        num_hidden_layers=sizes.num_layers,
        num_attention_heads=sizes.heads,
        num_key_value_heads=sizes.kv_heads,
        max_position_embeddings=sizes.max_positions,
        initializer_range=sizes.init_std,
        tie_word_embeddings=sizes.tie_embeddings,
        rope_theta=rope_theta,
        torch_dtype="float32",
        **vocab,
    )


def _llama_config(sizes: _Sizes, vocab: VocabIds, rope_theta: float) -> Any:
    import transformers

    return transformers.LlamaConfig(head_dim=sizes.head_dim, **_rope_fields(sizes, vocab, rope_theta))


def _qwen2_config(sizes: _Sizes, vocab: VocabIds, rope_theta: float) -> Any:
    """Qwen2 always has q/k/v biases (no config field), and its head size is hidden_size / heads: its
    configs have no `head_dim` (vLLM's Qwen2 ignores one)."""
    import transformers

    if sizes.hidden_size != sizes.heads * sizes.head_dim:
        raise ValueError(
            f"a Qwen2 head is hidden_size / heads = {sizes.hidden_size} / {sizes.heads}, not head_dim {sizes.head_dim}"
        )
    return transformers.Qwen2Config(**_rope_fields(sizes, vocab, rope_theta))


def _qwen3_config(sizes: _Sizes, vocab: VocabIds, rope_theta: float) -> Any:
    """Qwen3: no q/k/v biases (`attention_bias`), an RMSNorm per query/key head, explicit `head_dim`."""
    import transformers

    fields = _rope_fields(sizes, vocab, rope_theta)
    return transformers.Qwen3Config(head_dim=sizes.head_dim, attention_bias=False, **fields)


def _write(directory: str | Path, config: Any, model_cls: Any, seed: int) -> Path:
    import torch

    out = Path(directory)  # its tokenizer is there already (`_write_tokenizer_files`)
    with torch.random.fork_rng(devices=[]):  # the caller's global RNG is left as it was
        torch.manual_seed(seed)
        model = model_cls(config).float()
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def created_tokenizer(kind: str, data_files: bool) -> str:
    """`model.tokenizer` resolved: `auto` is `bpe` for prompts from dataset files, else `char` (the
    built-in digit tasks speak the character tokenizer)."""
    if kind != "auto":
        return kind
    return "bpe" if data_files else "char"


def prepare_model_dir(model_cfg, seed: int, data_files: bool = False) -> bool:
    """Write the model `model.create` asks for when `model.path` does not exist yet (into a temporary
    sibling first, then renamed: a crash never leaves a half-written directory). True if written."""
    if model_cfg.path is None or not model_cfg.create or Path(model_cfg.path).exists():
        return False
    target = Path(model_cfg.path)
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    init_model(
        tmp,
        hidden_size=model_cfg.d_model,
        num_layers=model_cfg.n_layers,
        head_dim=model_cfg.d_model // model_cfg.n_heads,
        intermediate_size=model_cfg.d_ff,
        num_kv_heads=model_cfg.n_kv_heads,
        max_positions=model_cfg.max_seq_len,
        seed=seed,
        init_std=model_cfg.init_std,
        arch=model_cfg.arch,
        tokenizer=created_tokenizer(model_cfg.tokenizer, bool(data_files)),
        vocab_size=model_cfg.tokenizer_vocab_size,
        tie_embeddings=model_cfg.tie_embeddings,
    )
    tmp.rename(target)
    return True


def save_hf_policy(policy, directory: str | Path, source: str | Path) -> Path:
    """Write `policy` (an HFCausalLMPolicy) as a model directory, with the tokenizer files of `source`."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    policy.model.save_pretrained(str(out), safe_serialization=True)
    copy_tokenizer_files(source, out)
    return out


def copy_tokenizer_files(source: str | Path, directory: str | Path) -> None:
    """The tokenizer files of model directory `source` (those it has), into `directory`."""
    for name in (*TOKENIZER_FILES, "tokenizer.model", "vocab.json", "merges.txt"):
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, Path(directory) / name)


def _init_model_parser() -> Any:
    import argparse

    parser = argparse.ArgumentParser(
        prog="sc-grpo init-model",
        description="Write a tiny random-init causal LM (--arch: LlamaForCausalLM, Qwen2ForCausalLM, "
        "Qwen3ForCausalLM or GPT2LMHeadModel) and its tokenizer into DIR (a Hugging "
        "Face model directory, loadable offline by transformers and vLLM).",
    )
    parser.add_argument("dir", metavar="DIR")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32, help="32 or more for vLLM's CPU attention")
    parser.add_argument("--intermediate-size", type=int, default=None, help="the MLP's width (default 4 x hidden)")
    parser.add_argument(
        "--num-kv-heads",
        type=int,
        default=None,
        help="grouped-query attention: key/value heads, dividing the query heads (default: one per query head; "
        "RoPE archs only)",
    )
    parser.add_argument("--max-positions", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rope-theta", type=float, default=ROPE_THETA, help="RoPE archs (llama, qwen2, qwen3) only")
    parser.add_argument(
        "--arch",
        choices=ARCHS,
        default="llama",
        help="llama (RoPE, RMSNorm, SwiGLU), qwen2 (llama + q/k/v biases), qwen3 (llama + per-head q/k RMSNorm), "
        "gpt2 (learned positions, LayerNorm, GELU)",
    )
    parser.add_argument(
        "--tokenizer",
        choices=TOKENIZER_KINDS,
        default="bpe",
        help="bpe: byte-level BPE, digits split, ChatML chat template (default); char: the digit tasks' "
        "character tokenizer (what the built-in tasks need)",
    )
    parser.add_argument("--vocab-size", type=int, default=512, help="bpe only: 259 = no merges (letters split)")
    parser.add_argument(
        "--tie-embeddings",
        action="store_true",
        help="the output head is the input embedding (tie_word_embeddings, as small Qwen/Llama models have)",
    )
    return parser


def main_init_model(argv: list[str] | None = None) -> int:
    """`sc-grpo init-model DIR`: write a tiny random-init Llama, Qwen2, Qwen3 or GPT-2 + its tokenizer."""
    parser = _init_model_parser()
    args = parser.parse_args(argv)
    sizes = (args.hidden_size, args.num_layers, args.head_dim, args.max_positions)
    if min(sizes) < 1 or min(args.intermediate_size or 1, args.num_kv_heads or 1) < 1:
        parser.error("--hidden-size, --num-layers, --head-dim, --max-positions and the optional sizes must be positive")
    if args.hidden_size % args.head_dim:
        parser.error(
            f"--hidden-size {args.hidden_size} is not a multiple of --head-dim {args.head_dim} "
            f"(e.g. --hidden-size {max(1, round(args.hidden_size / args.head_dim)) * args.head_dim})"
        )
    try:
        _kv_heads(args.hidden_size // args.head_dim, args.num_kv_heads, args.arch)
    except ValueError as e:
        parser.error(f"--num-kv-heads: {e}")
    path = init_model(
        args.dir,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate_size,
        num_kv_heads=args.num_kv_heads,
        max_positions=args.max_positions,
        seed=args.seed,
        rope_theta=args.rope_theta,
        arch=args.arch,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        tie_embeddings=args.tie_embeddings,
    )
    cfg = read_config(path)
    hidden = cfg["hidden_size"] if "hidden_size" in cfg else cfg["n_embd"]
    layers = cfg.get("num_hidden_layers", cfg.get("n_layer"))
    heads = hidden // head_dim_of(cfg)
    kv_heads = cfg.get("num_key_value_heads", heads)
    print(
        f"sc-grpo: wrote {path}: {cfg['architectures'][0]} hidden {hidden}, {layers} layers, "
        f"{heads} heads of {head_dim_of(cfg)}"
        + (f" ({kv_heads} key/value)" if kv_heads != heads else "")
        + f", MLP {cfg.get('intermediate_size', cfg.get('n_inner'))}, vocab {cfg['vocab_size']}"
        + (", tied embeddings" if cfg.get("tie_word_embeddings") else "")
    )
    return 0
