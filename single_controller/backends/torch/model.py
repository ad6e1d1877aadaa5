"""Policies for the embedded torch backend: a pure-torch TinyGPT and an adapter for HF causal LMs.

`CausalPolicy`: `forward(input_ids) -> logits` (what the trainer uses) and `new_cache` /
`forward_cached` (one prefill, then a token at a time: what sampling uses), computing the same
function so generation and training logprobs agree to rounding. TinyGPT: pre-LayerNorm blocks,
learned positions, tied embeddings, saved as `model.safetensors` + `config.json`. `load_hf_policy`
wraps a Hugging Face model directory (`single_controller.data.hf_model`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.checkpoint import checkpoint

from single_controller.config.schema import ModelConfig

if TYPE_CHECKING:
    import transformers


@runtime_checkable
class CausalPolicy(Protocol):
    vocab_size: int
    max_seq_len: int

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def new_cache(self, batch_size: int, max_len: int | None = None) -> Any: ...

    def forward_cached(self, input_ids: torch.Tensor, cache: Any) -> torch.Tensor: ...


class KVCache:
    """Keys and values of every layer for the first `length` positions of `batch_size` rows."""

    def __init__(self, n_layers: int, batch_size: int, n_heads: int, max_len: int, head_dim: int, like: torch.Tensor):
        shape = (n_layers, batch_size, n_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=like.dtype, device=like.device)
        self.v = torch.zeros(shape, dtype=like.dtype, device=like.device)
        self.length = 0


class _Block(nn.Module):
    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        T = x.shape[1]  # x: [B, T, D]
        q, k, v = self._heads(x)  # [B, H, T, hd]
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            start = cache.length
            cache.k[layer, :, :, start : start + T] = k
            cache.v[layer, :, :, start : start + T] = v
            k = cache.k[layer, :, :, : start + T]  # [B, H, start+T, hd]
            v = cache.v[layer, :, :, : start + T]
            if T == 1:  # one new query attends to every cached position
                y = F.scaled_dot_product_attention(q, k, v)
            elif start == 0:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:  # chunk after a prefix: query i sees positions <= start + i
                allowed = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(diagonal=start)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self._out(x, y)

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, D = x.shape
        q, k, v = (
            t.view(B, T, self.n_heads, D // self.n_heads).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(D, -1)
        )
        return q, k, v

    def _out(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, D))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))

    def forward_shared(
        self, x: torch.Tensor, owner: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefixes x [U, P, D] and continuations y [B, S, D], row b continuing prefix owner[b]: the
        prefixes attend causally among themselves; a continuation to all of its prefix and causally
        to itself (what the whole sequences' forward computes, with each prefix computed once)."""
        qp, kp, vp = self._heads(x)  # [U, H, P, hd]
        qs, ks, vs = self._heads(y)  # [B, H, S, hd]
        P, S = x.shape[1], y.shape[1]
        k = torch.cat([kp.index_select(0, owner), ks], dim=2)  # [B, H, P+S, hd]
        v = torch.cat([vp.index_select(0, owner), vs], dim=2)
        allowed = torch.ones(S, P + S, dtype=torch.bool, device=y.device).tril(diagonal=P)
        x_out = self._out(x, F.scaled_dot_product_attention(qp, kp, vp, is_causal=True))
        return x_out, self._out(y, F.scaled_dot_product_attention(qs, k, v, attn_mask=allowed))


class TinyGPT(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int, seed: int | None = 0):
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError(f"d_model {cfg.d_model} is not divisible by n_heads {cfg.n_heads}")
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.max_seq_len = cfg.max_seq_len
        self.tok_emb = nn.Embedding(vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg.d_model, cfg.n_heads) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.checkpoint_blocks = False  # recompute blocks in backward (`enable_gradient_checkpointing`)
        if seed is not None:
            self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Normal(0, init_std) weights and embeddings, zero biases, unit LayerNorms; the global RNG is untouched."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.startswith("ln") or ".ln" in name:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).mul_(self.cfg.init_std).to(p.dtype))

    def _run(self, input_ids: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        B, T = input_ids.shape
        start = 0 if cache is None else cache.length
        limit = self.max_seq_len if cache is None else cache.k.shape[3]
        if start + T > limit:
            raise ValueError(
                f"sequence of {start + T} tokens exceeds max_seq_len {self.max_seq_len} (or the cache's length {limit})"
            )
        pos = torch.arange(start, start + T, device=input_ids.device)
        x = self.tok_emb(input_ids) + self.pos_emb(pos)  # [B, T, D]
        recompute = self.checkpoint_blocks and cache is None and torch.is_grad_enabled()
        for i, block in enumerate(self.blocks):
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x, cache, i)
        if cache is not None:
            cache.length += T
        return F.linear(self.ln_f(x), self.tok_emb.weight)  # [B, T, V]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._run(input_ids, None)

    def forward_shared_prefix(
        self, prefix_ids: torch.Tensor, owner: torch.Tensor, suffix_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of prefixes [U, P] and of their continuations [B, S] (row b continues prefix
        `owner[b]`), each prefix run once: (logits [U, P, V], logits [B, S, V]); see
        `algorithm.logprobs.token_logprobs(share_prefixes=True)`."""
        P, S = prefix_ids.shape[1], suffix_ids.shape[1]
        if P + S > self.max_seq_len:
            raise ValueError(f"sequence of {P + S} tokens exceeds max_seq_len {self.max_seq_len}")
        dev = prefix_ids.device
        x = self.tok_emb(prefix_ids) + self.pos_emb(torch.arange(P, device=dev))
        y = self.tok_emb(suffix_ids) + self.pos_emb(torch.arange(P, P + S, device=dev))
        for block in self.blocks:
            assert isinstance(block, _Block)
            x, y = block.forward_shared(x, owner, y)
        return F.linear(self.ln_f(x), self.tok_emb.weight), F.linear(self.ln_f(y), self.tok_emb.weight)

    @property
    def shares_prefixes(self) -> bool:
        """Whether `forward_shared_prefix` may be used now (not with recomputed blocks)."""
        return not self.checkpoint_blocks

    def new_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        """A cache for `max_len` positions (default max_seq_len)."""
        length = self.max_seq_len if max_len is None else min(max_len, self.max_seq_len)
        ref = self.tok_emb.weight
        return KVCache(
            len(self.blocks), batch_size, self.cfg.n_heads, length, self.cfg.d_model // self.cfg.n_heads, ref
        )

    def forward_cached(self, input_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        return self._run(input_ids, cache)

    def expand_cache(self, cache: KVCache, owner: torch.Tensor) -> KVCache:
        """A cache whose row b is a copy of `cache`'s row owner[b] (prompts prefilled once, `sampling.sample`)."""
        out = KVCache.__new__(KVCache)
        out.k, out.v, out.length = cache.k.index_select(1, owner), cache.v.index_select(1, owner), cache.length
        return out


def _dynamic_cache() -> type:
    from transformers.cache_utils import DynamicCache

    return DynamicCache


class _HFCache:
    """Holds the `past_key_values` an HF model returned, to pass back on the next call."""

    def __init__(self) -> None:
        self.past: Any = None


class HFCausalLMPolicy(nn.Module):
    """Adapts a `transformers` causal LM (anything called as `model(input_ids=..., past_key_values=...,
    use_cache=...)` returning `.logits` and `.past_key_values`) to `CausalPolicy`. Rows of a batch
    must share their prompt length (no padding, positions inferred from the cache length), which is
    how the generation core batches them."""

    def __init__(self, hf_model: transformers.PreTrainedModel):
        super().__init__()
        self.model = hf_model
        self.vocab_size = int(hf_model.config.vocab_size)
        self.max_seq_len = int(hf_model.config.max_position_embeddings)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits

    def new_cache(self, batch_size: int, max_len: int | None = None) -> _HFCache:
        return _HFCache()

    def forward_shared_prefix(
        self, prefix_ids: torch.Tensor, owner: torch.Tensor, suffix_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `TinyGPT.forward_shared_prefix`: the prefixes' keys and values (the model's own cache,
        differentiable) are gathered per continuation row, which then runs after them."""
        first = self.model(input_ids=prefix_ids, use_cache=True)
        cache = first.past_key_values
        # row b gets prefix owner[b]'s keys and values (by indexing: autograd flows back to the prefix)
        cache.batch_select_indices(owner)
        rest = self.model(input_ids=suffix_ids, past_key_values=cache, use_cache=True)
        return first.logits, rest.logits

    @property
    def shares_prefixes(self) -> bool:
        """Not with gradient checkpointing (HF turns the cache off then), nor without the cache API."""
        return not getattr(self.model, "is_gradient_checkpointing", False) and hasattr(
            _dynamic_cache(), "batch_select_indices"
        )

    def forward_cached(self, input_ids: torch.Tensor, cache: _HFCache) -> torch.Tensor:
        out = self.model(input_ids=input_ids, past_key_values=cache.past, use_cache=True)
        cache.past = out.past_key_values
        return out.logits

    def expand_cache(self, cache: _HFCache, owner: torch.Tensor) -> _HFCache:
        """As `TinyGPT.expand_cache` (the model's own cache, rows selected in place)."""
        cache.past.batch_select_indices(owner)
        return cache


# --- save / load ------------------------------------------------------------------------------

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


def save_tinygpt(model: TinyGPT, directory: str | Path) -> Path:
    """Write `model.safetensors` and `config.json` (ModelConfig fields + vocab_size) into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(directory / WEIGHTS_FILE))
    write_tinygpt_config(model, directory)
    return directory


def write_tinygpt_config(model: TinyGPT, directory: str | Path) -> None:
    """`config.json` of a saved TinyGPT: its ModelConfig fields and vocab_size."""
    meta = {"architecture": "TinyGPT", "vocab_size": model.vocab_size, **dataclasses.asdict(model.cfg)}
    meta["checkpoint"] = None
    for k in ("path", "create", "arch"):
        meta.pop(k, None)
    Path(directory, CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model directory's safetensors file(s): `model.safetensors`, or the files
    `model.safetensors.index.json` names."""
    directory = Path(directory)
    index = directory / f"{WEIGHTS_FILE}.index.json"
    if not index.is_file():
        return load_file(str(directory / WEIGHTS_FILE))
    state: dict[str, torch.Tensor] = {}
    for name in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        state.update(load_file(str(directory / name)))
    return state


def load_tinygpt(directory: str | Path) -> TinyGPT:
    """Rebuild a TinyGPT from `save_tinygpt` output (architecture from config.json, weights exact)."""
    directory = Path(directory)
    meta = json.loads((directory / CONFIG_FILE).read_text())
    if meta.pop("architecture", None) != "TinyGPT":
        raise ValueError(f"{directory / CONFIG_FILE} does not describe a TinyGPT")
    vocab_size = meta.pop("vocab_size")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = ModelConfig(**{k: v for k, v in meta.items() if k in fields and k != "checkpoint"})
    model = TinyGPT(cfg, vocab_size, seed=None)
    state = read_weights(directory)
    dtype = next(iter(state.values())).dtype
    model.to(dtype).load_state_dict(state, strict=True)
    return model


def enable_gradient_checkpointing(policy: nn.Module) -> None:
    """Recompute each transformer layer's activations in the backward pass (`train.gradient_checkpointing`):
    a TinyGPT per block (`torch.utils.checkpoint`), an HF model by its own `gradient_checkpointing_enable`.
    HF checkpoints a layer only while that layer is in training mode, and the trainer keeps its models in
    eval mode (no dropout: its logprobs must be the generation's), so only the layers' own flag is set:
    their dropout modules stay off."""
    if isinstance(policy, TinyGPT):
        policy.checkpoint_blocks = True
        return
    if not isinstance(policy, HFCausalLMPolicy):
        raise TypeError(f"gradient checkpointing: no way to enable it on a {type(policy).__name__}")
    from transformers.modeling_layers import GradientCheckpointingLayer

    policy.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = [m for m in policy.model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers or not all(m.gradient_checkpointing for m in layers):
        raise RuntimeError(f"gradient checkpointing: {type(policy.model).__name__} has no checkpointed layer")
    for m in layers:
        m.training = True  # this module's flag only (not .train(): that would turn dropout on below it)


def state_module(policy: nn.Module) -> nn.Module:
    """The module whose parameter names are the checkpoint's names (what weight snapshots carry): the
    wrapped transformers model of an `HFCausalLMPolicy`, the policy itself otherwise."""
    return policy.model if isinstance(policy, HFCausalLMPolicy) else policy


def load_hf_policy(path: str | Path, dtype: torch.dtype | None = None) -> HFCausalLMPolicy:
    """The model directory's causal LM as a `CausalPolicy` (float32 unless `dtype` is given)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or torch.float32)
    return HFCausalLMPolicy(model.eval())


def build_policy(cfg: ModelConfig, vocab_size: int, seed: int) -> nn.Module:
    """The initial policy: the Hugging Face model directory `cfg.path` if set, else a TinyGPT."""
    if cfg.path is not None:
        policy = load_hf_policy(cfg.path)
        if policy.vocab_size < vocab_size:
            raise ValueError(f"model {cfg.path} has vocab_size {policy.vocab_size} < the tokenizer's {vocab_size}")
        return policy
    return build_tinygpt(cfg, vocab_size, seed)


def save_policy(policy: nn.Module, directory: str | Path, cfg: ModelConfig) -> Path:
    """An HF policy as a model directory (tokenizer copied from `cfg.path`), a TinyGPT as its checkpoint."""
    if isinstance(policy, HFCausalLMPolicy):
        from single_controller.data.hf_model import save_hf_policy

        assert cfg.path is not None  # an HF policy is the model directory `cfg.path` (`build_policy`)
        return save_hf_policy(policy, directory, cfg.path)
    assert isinstance(policy, TinyGPT)  # `build_policy`'s other kind
    return save_tinygpt(policy, directory)


def build_tinygpt(cfg: ModelConfig, vocab_size: int, seed: int) -> TinyGPT:
    """The initial policy: `cfg.checkpoint` if set (its config must match `cfg`), else a seeded random init."""
    if cfg.checkpoint is None:
        return TinyGPT(cfg, vocab_size, seed=seed)
    model = load_tinygpt(cfg.checkpoint)
    want = dataclasses.replace(
        cfg,
        checkpoint=None,
        path=None,
        create=False,
        arch=ModelConfig.arch,
        tokenizer=ModelConfig.tokenizer,
        tokenizer_vocab_size=ModelConfig.tokenizer_vocab_size,
    )
    if model.cfg != want or model.vocab_size != vocab_size:
        raise ValueError(
            f"checkpoint {cfg.checkpoint} has {model.cfg} (vocab {model.vocab_size}); "
            f"config asks for {want} (vocab {vocab_size})"
        )
    return model.float()
