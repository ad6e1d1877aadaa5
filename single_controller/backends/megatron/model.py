"""A Llama-family model in megatron-core and its exact weight conversion to and from Hugging Face.

`LlamaSpec.from_hf_config(config.json dict)` reads what the model needs (sizes, heads, GQA groups,
head_dim, RMSNorm eps, rope theta, tied or untied embeddings) and refuses what this backend does not
build (biases, rope scaling, non-SiLU activations), naming the field. `build_gpt(spec, tp, dtype)`
makes the `GPTModel` (local spec: no Transformer Engine, no apex): RMSNorm, SwiGLU MLP, RoPE
(rotate-half, like HF), causal attention, `parallel_output=False` so every TP rank sees whole logits.
The vocabulary is padded to a multiple of TP with zero rows; `MegatronPolicy` cuts the padding off
the logits, so padded rows never receive gradient.

Conversion works on plain name -> tensor dicts, HF names on one side and this rank's Megatron shard
on the other:
  hf_to_megatron(hf, spec, tp, tp_rank)  -> the state dict of TP rank `tp_rank` (every tensor exact)
  megatron_to_hf(shards, spec)           -> HF tensors from the state dicts of all TP ranks (rank order)
Layouts (per layer; q/k/v heads h, groups g = kv heads, d = head_dim, I = intermediate size):
  linear_qkv  [g * (h/g + 2) * d, H]: for each group its h/g query heads, then its key, then its value
  linear_fc1  [2 * I/tp, H] per rank: this rank's gate rows, then its up rows
  linear_proj, linear_fc2 split along the input dim; qkv, fc1, embedding, output layer along dim 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F


class UnsupportedModel(ValueError):
    """The HF config asks for something this Megatron Llama does not build."""


@dataclass(frozen=True)
class LlamaSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def from_hf_config(cls, cfg: Mapping) -> "LlamaSpec":
        problems = []
        if cfg.get("model_type", "llama") != "llama":
            problems.append(f"model_type is {cfg.get('model_type')!r} (only 'llama')")
        if cfg.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act is {cfg.get('hidden_act')!r} (only 'silu')")
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            problems.append("attention_bias/mlp_bias are set (only bias-free Llama)")
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
        if rope_type != "default":
            problems.append(f"rope type is {rope_type!r} (only 'default')")
        if problems:
            raise UnsupportedModel("the Megatron backend cannot build this HF model: " + "; ".join(problems))
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )

    def padded_vocab(self, tp: int) -> int:
        return math.ceil(self.vocab_size / tp) * tp

    def tp_problems(self, tp: int) -> list[str]:
        """Why this model cannot be split `tp` ways (empty: it can)."""
        out = []
        if self.num_heads % tp:
            out.append(f"tensor_parallel_size {tp} does not divide the model's {self.num_heads} attention heads")
        if self.num_kv_heads % tp:
            out.append(f"tensor_parallel_size {tp} does not divide the model's {self.num_kv_heads} key/value heads")
        if self.intermediate_size % tp:
            out.append(f"tensor_parallel_size {tp} does not divide the intermediate size {self.intermediate_size}")
        return out


def transformer_config(spec: LlamaSpec, tp: int, dtype: torch.dtype = torch.float32, cpu_init: bool = True):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.intermediate_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        params_dtype=dtype,
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
    )


def build_gpt(spec: LlamaSpec, tp: int, dtype: torch.dtype = torch.float32, cpu_init: bool = True):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config=transformer_config(spec, tp, dtype, cpu_init),
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=spec.padded_vocab(tp),
        max_sequence_length=spec.max_position_embeddings,
        parallel_output=False,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=spec.rope_theta,
    )


class MegatronPolicy:
    """input_ids [B, L] -> logits [B, L, V] through a (possibly DDP-wrapped) GPTModel: the callable
    `backends.cpu.model.token_logprobs` expects, so both trainers share the logprob code."""

    def __init__(self, module, vocab_size: int):
        self.module = module
        self.vocab_size = vocab_size

    def parameters(self):
        """The wrapped module's parameters (`token_logprobs` reads the device from the first)."""
        return self.module.parameters()

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        B, L = input_ids.shape
        position_ids = torch.arange(L).unsqueeze(0).expand(B, L)  # [B, L]
        logits = self.module(input_ids, position_ids, None)  # [B, L, V_padded], causal mask built inside
        return logits[..., : self.vocab_size]


# --- conversion --------------------------------------------------------------------------------


def _layer_names(i: int) -> dict[str, str]:
    """Megatron -> HF names of layer i's tensors that map one to one (norms)."""
    m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
    return {
        m + "self_attention.linear_qkv.layer_norm_weight": h + "input_layernorm.weight",
        m + "input_layernorm.weight": h + "input_layernorm.weight",
        m + "pre_mlp_layernorm.weight": h + "post_attention_layernorm.weight",
        m + "mlp.linear_fc1.layer_norm_weight": h + "post_attention_layernorm.weight",
    }


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def hf_to_megatron(hf: Mapping[str, torch.Tensor], spec: LlamaSpec, tp: int, tp_rank: int, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The Megatron tensors named `names` (this rank's state-dict keys) for TP rank `tp_rank`."""
    g, d, H = spec.num_kv_heads, spec.head_dim, spec.hidden_size
    qpg = spec.num_heads // g  # query heads per group
    V = spec.padded_vocab(tp)

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp, dim=0)[tp_rank]

    def cols(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp, dim=1)[tp_rank]

    out: dict[str, torch.Tensor] = {}
    for name in names:
        if name.endswith("._extra_state"):
            continue
        if name == "embedding.word_embeddings.weight":
            out[name] = rows(_pad_rows(hf["model.embed_tokens.weight"], V))
        elif name == "output_layer.weight":
            key = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
            out[name] = rows(_pad_rows(hf[key], V))
        elif name == "decoder.final_layernorm.weight":
            out[name] = hf["model.norm.weight"]
        else:
            parts = name.split(".")
            if parts[:2] != ["decoder", "layers"]:
                raise KeyError(f"no HF tensor for Megatron parameter {name}")
            i = int(parts[2])
            h = f"model.layers.{i}."
            rest = ".".join(parts[3:])
            if name in _layer_names(i):
                out[name] = hf[_layer_names(i)[name]]
            elif rest == "self_attention.linear_qkv.weight":
                q = hf[h + "self_attn.q_proj.weight"].view(g, qpg * d, H)
                k = hf[h + "self_attn.k_proj.weight"].view(g, d, H)
                v = hf[h + "self_attn.v_proj.weight"].view(g, d, H)
                out[name] = rows(torch.cat([q, k, v], dim=1).reshape(-1, H))
            elif rest == "self_attention.linear_proj.weight":
                out[name] = cols(hf[h + "self_attn.o_proj.weight"])
            elif rest == "mlp.linear_fc1.weight":
                out[name] = torch.cat([rows(hf[h + "mlp.gate_proj.weight"]), rows(hf[h + "mlp.up_proj.weight"])])
            elif rest == "mlp.linear_fc2.weight":
                out[name] = cols(hf[h + "mlp.down_proj.weight"])
            else:
                raise KeyError(f"no HF tensor for Megatron parameter {name}")
        out[name] = out[name].contiguous()
    return out


def megatron_to_hf(shards: Sequence[Mapping[str, torch.Tensor]], spec: LlamaSpec) -> dict[str, torch.Tensor]:
    """HF tensors from every TP rank's Megatron tensors (`shards[r]`: rank r's), padding removed."""
    tp = len(shards)
    g, d, H = spec.num_kv_heads, spec.head_dim, spec.hidden_size
    qpg = spec.num_heads // g
    first = shards[0]

    def cat_rows(name: str) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=0)

    def cat_cols(name: str) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=1)

    out: dict[str, torch.Tensor] = {}
    out["model.embed_tokens.weight"] = cat_rows("embedding.word_embeddings.weight")[: spec.vocab_size]
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = cat_rows("output_layer.weight")[: spec.vocab_size]
    out["model.norm.weight"] = first["decoder.final_layernorm.weight"]
    for i in range(spec.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        for mname, hname in _layer_names(i).items():
            if mname in first:
                out[hname] = first[mname]
        qkv = cat_rows(m + "self_attention.linear_qkv.weight").view(g, (qpg + 2) * d, H)
        q, k, v = qkv.split([qpg * d, d, d], dim=1)
        out[h + "self_attn.q_proj.weight"] = q.reshape(-1, H)
        out[h + "self_attn.k_proj.weight"] = k.reshape(-1, H)
        out[h + "self_attn.v_proj.weight"] = v.reshape(-1, H)
        out[h + "self_attn.o_proj.weight"] = cat_cols(m + "self_attention.linear_proj.weight")
        gate_up = [s[m + "mlp.linear_fc1.weight"].chunk(2, dim=0) for s in shards]
        out[h + "mlp.gate_proj.weight"] = torch.cat([gu[0] for gu in gate_up])
        out[h + "mlp.up_proj.weight"] = torch.cat([gu[1] for gu in gate_up])
        out[h + "mlp.down_proj.weight"] = cat_cols(m + "mlp.linear_fc2.weight")
    return {k: v.contiguous() for k, v in out.items()}


def hf_names(spec: LlamaSpec) -> list[str]:
    """Every HF tensor name of this model, in HF's parameter order."""
    names = ["model.embed_tokens.weight"]
    for i in range(spec.num_layers):
        h = f"model.layers.{i}."
        names += [h + n for n in (
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
            "input_layernorm.weight", "post_attention_layernorm.weight",
        )]
    names.append("model.norm.weight")
    if not spec.tie_word_embeddings:
        names.append("lm_head.weight")
    return names
