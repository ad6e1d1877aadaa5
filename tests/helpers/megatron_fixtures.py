"""Shared pieces of the Megatron tests: a tiny HF Llama, Qwen2, Qwen3 or GPT-2 directory, random training rows, and
the comparison helpers. Not a test module (no test_ prefix)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

VOCAB = 19  # odd: TP=2 pads the vocabulary, so the padding path is exercised
REPO = str(Path(__file__).resolve().parents[2])


def hf_config(arch: str = "llama", **over):
    """A tiny config of `arch`: Llama with GQA (4 query heads, 2 key/value groups, head_dim 32, so the
    heads are wider than the hidden size), Qwen2 the same but head_dim = hidden / heads = 16 (its configs
    have no head_dim), Qwen3 the same as Llama, or GPT-2 (2 heads of 32, non-square n_inner); all untied,
    every size divisible by TP=2."""
    if arch == "gpt2":
        from transformers import GPT2Config

        kw = dict(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=2,
            n_inner=96,
            n_positions=64,
            layer_norm_epsilon=1e-5,
            tie_word_embeddings=False,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=1,
        )
        kw.update(over)
        return GPT2Config(**kw)
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    kw: dict = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        head_dim=32,
        tie_word_embeddings=False,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
    )
    if arch == "qwen2":
        del kw["head_dim"]
    kw.update(over)
    return {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch](**kw)


def make_hf_dir(directory: Path, seed: int = 0, arch: str = "llama", **over) -> Path:
    """A random-init causal LM of `arch` (see `hf_config`) saved with save_pretrained (float32).
    Weights and biases are drawn with std 0.2 (norm gains around 1), so logits are far from uniform,
    gradients are not tiny, and every bias is nonzero (a bias mapped to the wrong place shows)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(arch, **over)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("norm" in name or ".ln_" in name) and name.endswith("weight"):
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0, 0.2)
    model.save_pretrained(directory)
    return Path(directory)


def load_hf(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def make_rows(n: int, seed: int, hf_model=None) -> dict:
    """n training rows (TRAIN_FIELDS). gen_logprobs: the HF model's own logprobs plus noise (so the
    importance weights vary and some are truncated), or random when no model is given."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g) for _ in range(n)]
    responses = [torch.randint(0, VOCAB, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g) for _ in range(n)]
    masks = [torch.rand(len(r), generator=g) > 0.15 for r in responses]
    if hf_model is not None:
        from single_controller.algorithm.logprobs import token_logprobs
        from single_controller.backends.torch.model import HFCausalLMPolicy

        with torch.no_grad():
            lp, _ = token_logprobs(HFCausalLMPolicy(hf_model), prompts, responses)
        gens = [lp[i, : len(r)] + 0.3 * torch.randn(len(r), generator=g) for i, r in enumerate(responses)]
    else:
        gens = [-torch.rand(len(r), generator=g) * 3 for r in responses]
    return {
        "prompt_ids": prompts,
        "response_ids": responses,
        "gen_logprobs": [x.float() for x in gens],
        "response_mask": masks,
        "advantage": torch.randn(n, generator=g),
        "token_versions": [torch.zeros(len(r), dtype=torch.int64) for r in responses],
    }


def make_multi_turn_rows(seed: int, hf_model) -> dict:
    """12 multi-turn rows (3 groups of 4 sharing a prompt; `multi_turn_rows.multi_turn_rows`), gen_logprobs on
    policy tokens the HF model's own logprobs plus noise, as `make_rows`."""
    from single_controller.algorithm.logprobs import token_logprobs
    from single_controller.backends.torch.model import HFCausalLMPolicy
    from tests.helpers.multi_turn_rows import multi_turn_rows

    def logprobs_of(prompts, responses):
        return token_logprobs(HFCausalLMPolicy(hf_model), prompts, responses)[0]

    return multi_turn_rows(3, 4, seed, VOCAB, logprobs_of=logprobs_of)


def take(rows: dict, idx) -> dict:
    idx = list(idx)
    return {k: (v[idx] if torch.is_tensor(v) else [v[i] for i in idx]) for k, v in rows.items()}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def ray_init():
    import ray

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": f"{REPO}:{REPO}/tests", "OMP_NUM_THREADS": "1"}},
    )


def filled_storage(n: int, seed: int):
    """An in-memory row storage holding `make_rows(n, seed)` under keys r0..r{n-1}: built identically
    in every rank actor (a storage_factory), so ranks really read their rows by key."""
    from replay.storage import InMemoryRowStorage

    rows = make_rows(n, seed)
    storage = InMemoryRowStorage()
    storage.put_rows_sync([f"r{i}" for i in range(n)], rows)
    return storage
