"""Llama-, Qwen2-, Qwen3- and GPT-2-family models in megatron-core, with exact weight conversion to and
from Hugging Face.

`ModelSpec.from_hf_config` reads `config.json` by `model_type` and refuses, naming the field, what
this backend does not build (rope scaling, sliding windows, other biases...). `build_gpt` makes the
`GPTModel` (local spec: no Transformer Engine, no apex; whole logits on every TP rank; vocabulary
padded to a multiple of TP, the padding cut off by `MegatronPolicy`). `hf_to_megatron` gives one TP
rank's shard and `megatron_to_hf` reassembles HF tensors from every rank's: fused qkv regrouped per
query group, gate/up rows split per rank, row-parallel layers split along their input, norms whole,
GPT-2's Conv1D weights transposed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ARCHS = ("llama", "qwen2", "qwen3", "gpt2")


class UnsupportedModel(ValueError):
    """The HF config asks for something this Megatron backend does not build."""


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU (HF `gelu_new`): the tanh approximation."""
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": gelu_tanh, "gelu": F.gelu}
# HF GPT-2 `activation_function` -> ours (gelu_new and gelu_pytorch_tanh are the same function).
_GPT2_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu",
}


# What every refusal points to: the trainer that builds any causal LM transformers loads.
USE_FSDP = "backend.trainer=fsdp trains any Hugging Face causal LM transformers loads (docs/fsdp.md)"


def _refuse(problems: list[str]) -> None:
    if problems:
        raise UnsupportedModel(f"the Megatron backend cannot build this HF model: {'; '.join(problems)}. {USE_FSDP}")


@dataclass(frozen=True)
class ModelSpec:
    arch: str  # one of ARCHS
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    rope_theta: float | None  # llama, qwen2, qwen3; gpt2 learns absolute positions
    max_position_embeddings: int
    tie_word_embeddings: bool
    activation: str  # a key of _ACTIVATIONS
    qkv_bias: bool  # gpt2 (every linear biased), qwen2 (only q/k/v)
    qk_norm: bool  # qwen3: an RMSNorm over each query and key head

    @classmethod
    def from_hf_config(cls, cfg: Mapping) -> ModelSpec:
        model_type = cfg.get("model_type", "llama")
        if model_type in ("llama", "qwen2", "qwen3"):
            return cls._llama(cfg, model_type)
        if model_type == "gpt2":
            return cls._gpt2(cfg)
        raise UnsupportedModel(
            f"the Megatron backend cannot build this HF model: model_type is {model_type!r} "
            f"(supported: {', '.join(ARCHS)}). {USE_FSDP}"
        )

    @classmethod
    def _llama(cls, cfg: Mapping, model_type: str) -> ModelSpec:
        """Llama and the Qwen2/Qwen3 variants of its layout (`model_type`)."""
        problems = []
        if cfg.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act is {cfg.get('hidden_act')!r} (only 'silu')")
        if cfg.get("mlp_bias") or (model_type != "qwen2" and cfg.get("attention_bias")):
            problems.append(f"attention_bias/mlp_bias are set (only bias-free {model_type}; qwen2: q/k/v biases)")
        if cfg.get("use_sliding_window"):
            problems.append("use_sliding_window is set (only full attention)")
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
        if rope_type != "default":
            problems.append(f"rope type is {rope_type!r} (only 'default')")
        _refuse(problems)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            arch=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            activation="silu",
            qkv_bias=model_type == "qwen2",
            qk_norm=model_type == "qwen3",
        )

    @classmethod
    def _gpt2(cls, cfg: Mapping) -> ModelSpec:
        problems = []
        act = cfg.get("activation_function", "gelu_new")
        if act not in _GPT2_ACTIVATIONS:
            problems.append(f"activation_function is {act!r} (only {', '.join(_GPT2_ACTIVATIONS)})")
        if not cfg.get("scale_attn_weights", True):
            problems.append("scale_attn_weights is false (only 1/sqrt(head_dim) attention scaling)")
        if cfg.get("scale_attn_by_inverse_layer_idx"):
            problems.append("scale_attn_by_inverse_layer_idx is set")
        if cfg.get("add_cross_attention"):
            problems.append("add_cross_attention is set (decoder-only models only)")
        _refuse(problems)
        hidden = int(cfg.get("n_embd", cfg.get("hidden_size")))
        heads = int(cfg.get("n_head", cfg.get("num_attention_heads")))
        return cls(
            arch="gpt2",
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("n_inner") or 4 * hidden),  # HF: null means 4 * n_embd
            num_layers=int(cfg.get("n_layer", cfg.get("num_hidden_layers"))),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=hidden // heads,
            norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
            rope_theta=None,
            max_position_embeddings=int(cfg.get("n_positions", cfg.get("max_position_embeddings", 1024))),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),  # GPT2Config's default
            activation=_GPT2_ACTIVATIONS[act],
            qkv_bias=True,
            qk_norm=False,
        )

    def padded_vocab(self, tp: int) -> int:
        return math.ceil(self.vocab_size / tp) * tp

    def tp_problems(self, tp: int) -> list[str]:
        """Why this model cannot be split `tp` ways (empty: it can)."""
        out = []
        if self.num_heads % tp:
            out.append(f"tensor_parallel_size {tp} does not divide the model's {self.num_heads} attention heads")
        if self.num_kv_heads % tp and self.num_kv_heads != self.num_heads:  # (MHA: said above already)
            out.append(f"tensor_parallel_size {tp} does not divide the model's {self.num_kv_heads} key/value heads")
        if self.intermediate_size % tp:
            out.append(f"tensor_parallel_size {tp} does not divide the intermediate size {self.intermediate_size}")
        return out


def transformer_config(
    spec: ModelSpec, tp: int, dtype: torch.dtype = torch.float32, cpu_init: bool = True, recompute: bool = False
):
    """`recompute` (`train.gradient_checkpointing`): full activation recompute, one layer at a time (each
    layer's input is kept, everything inside it is recomputed in the backward pass)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    gpt2 = spec.arch == "gpt2"
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.intermediate_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        normalization="LayerNorm" if gpt2 else "RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        gated_linear_unit=not gpt2,
        activation_func=_ACTIVATIONS[spec.activation],
        add_bias_linear=gpt2,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,  # also what makes finalize_model_grads sum its grads over TP ranks
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,  # 16-bit: the trainer wraps the model in Float16Module
        fp16=dtype == torch.float16,
        use_cpu_initialization=cpu_init,
        # The weights come from the HF checkpoint, but Megatron marks TP-sharded weights
        # (`tensor_model_parallel`, which the TP-aware grad norm reads) only while initializing them.
        perform_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        calculate_per_token_loss=True,  # DDP sums gradients; the trainer scales by 1/N once
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
    )


def build_gpt(
    spec: ModelSpec, tp: int, dtype: torch.dtype = torch.float32, cpu_init: bool = True, recompute: bool = False
):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    gpt2 = spec.arch == "gpt2"
    extra = {} if gpt2 else {"rotary_base": spec.rope_theta}
    model = GPTModel(
        config=transformer_config(spec, tp, dtype, cpu_init, recompute),
        transformer_layer_spec=get_gpt_layer_local_spec(
            normalization="LayerNorm" if gpt2 else "RMSNorm", qk_layernorm=spec.qk_norm
        ),
        vocab_size=spec.padded_vocab(tp),
        max_sequence_length=spec.max_position_embeddings,
        parallel_output=False,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="learned_absolute" if gpt2 else "rope",
        **extra,
    )
    if not cpu_init:
        # Megatron builds its parallel layers on the current GPU, but plain torch modules (the
        # local spec's torch norms, the learned position embedding) on the CPU; Megatron's own
        # training loop moves the model with `.cuda()` after building it, and so do we.
        model.cuda(torch.cuda.current_device())
    return model


class MegatronPolicy:
    """input_ids [B, L] -> logits [B, L, V] through a (possibly DDP-wrapped) GPTModel: the callable
    `backends.cpu.model.token_logprobs` expects, so both trainers share the logprob code."""

    def __init__(self, module, vocab_size: int):
        self.module = module
        self.vocab_size = vocab_size

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """The wrapped module's parameters (`token_logprobs` reads the device from the first)."""
        return self.module.parameters()

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        B, L = input_ids.shape
        position_ids = torch.arange(L).unsqueeze(0).expand(B, L)  # [B, L]
        logits = self.module(input_ids, position_ids, None)  # [B, L, V_padded], causal mask built inside
        return logits[..., : self.vocab_size]


# --- conversion --------------------------------------------------------------------------------


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """Megatron's per-group interleaved [q_group; k; v] rows from HF's q [h*d, ...], k, v [g*d, ...]
    (weights [., H] or biases [.])."""
    g, d = spec.num_kv_heads, spec.head_dim
    qpg = spec.num_heads // g
    tail = q.shape[1:]
    return torch.cat([q.reshape(g, qpg * d, *tail), k.reshape(g, d, *tail), v.reshape(g, d, *tail)], dim=1).reshape(
        -1, *tail
    )


def _unpack_qkv(qkv: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `_pack_qkv` on the whole (all TP ranks' rows) tensor."""
    g, d = spec.num_kv_heads, spec.head_dim
    qpg = spec.num_heads // g
    tail = qkv.shape[1:]
    q, k, v = qkv.reshape(g, (qpg + 2) * d, *tail).split([qpg * d, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


@dataclass(frozen=True)
class _Names:
    """HF names of one architecture: global tensors, and per layer the tensors that map one to one
    (`layer_same`: Megatron suffix -> HF suffix) plus the HF suffixes of the reshaped ones."""

    embed: str
    positions: str | None
    final_norm: str  # weight name; bias by replacing "weight"
    layer_prefix: str
    layer_same: tuple[tuple[str, str], ...]


_LLAMA = _Names(
    embed="model.embed_tokens.weight",
    positions=None,
    final_norm="model.norm.weight",
    layer_prefix="model.layers.",
    layer_same=(
        ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
        ("input_layernorm.weight", "input_layernorm.weight"),
        ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
        ("mlp.linear_fc1.layer_norm_weight", "post_attention_layernorm.weight"),
    ),
)
# Qwen3's per-head q/k RMSNorms: one [head_dim] gain shared by every head, so whole on every TP rank
_QWEN3 = _Names(
    embed=_LLAMA.embed,
    positions=None,
    final_norm=_LLAMA.final_norm,
    layer_prefix=_LLAMA.layer_prefix,
    layer_same=(
        *_LLAMA.layer_same,
        ("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
        ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
    ),
)
_GPT2 = _Names(
    embed="transformer.wte.weight",
    positions="transformer.wpe.weight",
    final_norm="transformer.ln_f.weight",
    layer_prefix="transformer.h.",
    layer_same=(
        ("self_attention.linear_qkv.layer_norm_weight", "ln_1.weight"),
        ("self_attention.linear_qkv.layer_norm_bias", "ln_1.bias"),
        ("input_layernorm.weight", "ln_1.weight"),
        ("input_layernorm.bias", "ln_1.bias"),
        ("pre_mlp_layernorm.weight", "ln_2.weight"),
        ("pre_mlp_layernorm.bias", "ln_2.bias"),
        ("mlp.linear_fc1.layer_norm_weight", "ln_2.weight"),
        ("mlp.linear_fc1.layer_norm_bias", "ln_2.bias"),
        ("self_attention.linear_proj.bias", "attn.c_proj.bias"),  # whole on every TP rank
        ("mlp.linear_fc2.bias", "mlp.c_proj.bias"),
    ),
)


def _names(spec: ModelSpec) -> _Names:
    return {"gpt2": _GPT2, "qwen3": _QWEN3}.get(spec.arch, _LLAMA)


class _Shard:
    """TP rank `tp_rank`'s part of a tensor split over `tp` ranks."""

    def __init__(self, tp: int, tp_rank: int):
        self.tp, self.tp_rank = tp, tp_rank

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        return t.chunk(self.tp, dim=0)[self.tp_rank]

    def cols(self, t: torch.Tensor) -> torch.Tensor:
        return t.chunk(self.tp, dim=1)[self.tp_rank]


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor], spec: ModelSpec, tp: int, tp_rank: int, names: Sequence[str]
) -> dict[str, torch.Tensor]:
    """The Megatron tensors named `names` (this rank's state-dict keys) for TP rank `tp_rank`."""
    V = spec.padded_vocab(tp)
    N = _names(spec)
    shard = _Shard(tp, tp_rank)
    out: dict[str, torch.Tensor] = {}
    for name in names:
        if name.endswith("._extra_state"):
            continue
        if name == "embedding.word_embeddings.weight":
            t = shard.rows(_pad_rows(hf[N.embed], V))
        elif name == "embedding.position_embeddings.weight" and N.positions:
            t = hf[N.positions]
        elif name == "output_layer.weight":
            t = shard.rows(_pad_rows(hf[N.embed if spec.tie_word_embeddings else "lm_head.weight"], V))
        elif name == "decoder.final_layernorm.weight":
            t = hf[N.final_norm]
        elif name == "decoder.final_layernorm.bias" and spec.arch == "gpt2":
            t = hf[N.final_norm[: -len("weight")] + "bias"]
        else:
            parts = name.split(".")
            if parts[:2] != ["decoder", "layers"]:
                raise KeyError(f"no HF tensor for Megatron parameter {name}")
            t = _layer_tensor(hf, spec, shard, int(parts[2]), ".".join(parts[3:]))
        out[name] = t.contiguous()
    return out


def _layer_tensor(hf: Mapping[str, torch.Tensor], spec: ModelSpec, shard: _Shard, i: int, rest: str) -> torch.Tensor:
    """This rank's shard of Megatron parameter `decoder.layers.{i}.{rest}`, from the HF tensors."""
    N = _names(spec)
    h = f"{N.layer_prefix}{i}."
    same = dict(N.layer_same)
    if rest in same:
        return hf[h + same[rest]]
    if spec.arch == "gpt2":
        H = spec.hidden_size
        if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            w = hf[h + "attn.c_attn." + rest.rsplit(".", 1)[1]]
            w = w.t() if w.dim() == 2 else w  # Conv1D [H, 3H] -> [3H, H]
            q, k, v = w.split([H, H, H], dim=0)
            return shard.rows(_pack_qkv(q, k, v, spec))
        if rest == "self_attention.linear_proj.weight":
            return shard.cols(hf[h + "attn.c_proj.weight"].t())
        if rest == "mlp.linear_fc1.weight":
            return shard.rows(hf[h + "mlp.c_fc.weight"].t())
        if rest == "mlp.linear_fc1.bias":
            return shard.rows(hf[h + "mlp.c_fc.bias"])
        if rest == "mlp.linear_fc2.weight":
            return shard.cols(hf[h + "mlp.c_proj.weight"].t())
    else:
        if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):  # (bias: qwen2)
            a, kind = h + "self_attn.", rest.rsplit(".", 1)[1]
            q, k, v = (hf[f"{a}{x}_proj.{kind}"] for x in "qkv")
            return shard.rows(_pack_qkv(q, k, v, spec))
        if rest == "self_attention.linear_proj.weight":
            return shard.cols(hf[h + "self_attn.o_proj.weight"])
        if rest == "mlp.linear_fc1.weight":
            return torch.cat([shard.rows(hf[h + "mlp.gate_proj.weight"]), shard.rows(hf[h + "mlp.up_proj.weight"])])
        if rest == "mlp.linear_fc2.weight":
            return shard.cols(hf[h + "mlp.down_proj.weight"])
    raise KeyError(f"no HF tensor for Megatron parameter decoder.layers.{i}.{rest}")


def megatron_to_hf(shards: Sequence[Mapping[str, torch.Tensor]], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """HF tensors from every TP rank's Megatron tensors (`shards[r]`: rank r's), padding removed."""
    N = _names(spec)
    gpt2 = spec.arch == "gpt2"
    first = shards[0]

    def cat_rows(name: str) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=0)

    def cat_cols(name: str) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=1)

    out: dict[str, torch.Tensor] = {}
    out[N.embed] = cat_rows("embedding.word_embeddings.weight")[: spec.vocab_size]
    if N.positions:
        out[N.positions] = first["embedding.position_embeddings.weight"]
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = cat_rows("output_layer.weight")[: spec.vocab_size]
    out[N.final_norm] = first["decoder.final_layernorm.weight"]
    if gpt2:
        out[N.final_norm[: -len("weight")] + "bias"] = first["decoder.final_layernorm.bias"]
    for i in range(spec.num_layers):
        m, h = f"decoder.layers.{i}.", f"{N.layer_prefix}{i}."
        for mname, hname in N.layer_same:
            if m + mname in first:
                out[h + hname] = first[m + mname]
        q, k, v = _unpack_qkv(cat_rows(m + "self_attention.linear_qkv.weight"), spec)
        if gpt2:
            out[h + "attn.c_attn.weight"] = torch.cat([q, k, v]).t()
            qb, kb, vb = _unpack_qkv(cat_rows(m + "self_attention.linear_qkv.bias"), spec)
            out[h + "attn.c_attn.bias"] = torch.cat([qb, kb, vb])
            out[h + "attn.c_proj.weight"] = cat_cols(m + "self_attention.linear_proj.weight").t()
            out[h + "mlp.c_fc.weight"] = cat_rows(m + "mlp.linear_fc1.weight").t()
            out[h + "mlp.c_fc.bias"] = cat_rows(m + "mlp.linear_fc1.bias")
            out[h + "mlp.c_proj.weight"] = cat_cols(m + "mlp.linear_fc2.weight").t()
            continue
        out[h + "self_attn.q_proj.weight"] = q
        out[h + "self_attn.k_proj.weight"] = k
        out[h + "self_attn.v_proj.weight"] = v
        if spec.qkv_bias:
            for x, b in zip("qkv", _unpack_qkv(cat_rows(m + "self_attention.linear_qkv.bias"), spec)):
                out[f"{h}self_attn.{x}_proj.bias"] = b
        out[h + "self_attn.o_proj.weight"] = cat_cols(m + "self_attention.linear_proj.weight")
        gate_up = [s[m + "mlp.linear_fc1.weight"].chunk(2, dim=0) for s in shards]
        out[h + "mlp.gate_proj.weight"] = torch.cat([gu[0] for gu in gate_up])
        out[h + "mlp.up_proj.weight"] = torch.cat([gu[1] for gu in gate_up])
        out[h + "mlp.down_proj.weight"] = cat_cols(m + "mlp.linear_fc2.weight")
    return {k: v.contiguous() for k, v in out.items()}
