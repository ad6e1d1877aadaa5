"""Bad Megatron configurations fail with one clear error before any process starts (issue 11,
acceptance 6): TP x DP against the rank count, TP against the model's heads, more ranks than the
cluster can place, CPU emulation where CUDA is visible, the megatron extra missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from single_controller.preflight.loader import ConfigError, environment_problems, load_config

ROOT = Path(__file__).resolve().parents[2]
CPU_CFG = str(ROOT / "configs/megatron_cpu.yaml")


def _model_dir(tmp_path: Path, heads: int, kv_heads: int | None = None) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_attention_heads": heads,
                "num_key_value_heads": kv_heads or heads,
                "hidden_size": 32 * heads,
                "intermediate_size": 128,
                "num_hidden_layers": 1,
                "vocab_size": 16,
            }
        )
    )
    return d


def _megatron_problems(cfg):
    return [
        p
        for p in environment_problems(cfg)
        if any(k.startswith("megatron.") or k == "backend.num_trainer_ranks" for k in p.paths)
    ]


def test_the_shipped_cpu_config_is_ready_on_this_machine():
    pytest.importorskip("megatron.core")
    cfg = load_config(CPU_CFG, [])
    assert (cfg.backend.trainer, cfg.megatron.data_parallel_size, cfg.megatron.cpu_emulation) == ("megatron", 2, True)
    if not torch.cuda.is_available():
        assert _megatron_problems(cfg) == []


def test_tp_times_dp_must_be_the_rank_count():
    with pytest.raises(ConfigError) as e:
        load_config(CPU_CFG, ["megatron.tensor_parallel_size=2"])  # 2 x 2 != 2 ranks
    (problem,) = e.value.problems
    expected = "megatron.tensor_parallel_size * megatron.data_parallel_size = 2 * 2 = 4"
    assert f"{expected} must equal backend.num_trainer_ranks = 2" in problem.message


def test_float16_is_refused_for_the_megatron_trainer_by_name_and_bfloat16_is_accepted():
    with pytest.raises(ConfigError) as e:
        load_config(CPU_CFG, ["model.dtype=float16"])
    (problem,) = e.value.problems
    assert problem.paths == ("backend.trainer", "model.dtype")
    assert "model.dtype=float16 with backend.trainer=megatron" in problem.message
    assert "use model.dtype=bfloat16" in problem.message
    assert load_config(CPU_CFG, ["model.dtype=bfloat16"]).model.dtype == "bfloat16"
    assert load_config(CPU_CFG, ["model.dtype=float16", "backend.trainer=torch"]).model.dtype == "float16"


def test_tp_must_divide_the_heads_of_the_model_directory(tmp_path):
    d = _model_dir(tmp_path, heads=6, kv_heads=3)
    cfg = load_config(
        CPU_CFG,
        [f"model.path={d}", "model.create=false", "megatron.tensor_parallel_size=2", "megatron.data_parallel_size=1"],
    )
    problems = [p for p in environment_problems(cfg) if "megatron.tensor_parallel_size" in p.paths]
    assert len(problems) == 1
    assert "does not divide the model's 3 key/value heads" in problems[0].message


def test_tp_must_divide_the_heads_of_the_model_create_writes():
    with pytest.raises(ConfigError) as e:
        load_config(
            CPU_CFG,
            [
                "model.n_heads=1",
                "megatron.tensor_parallel_size=2",
                "megatron.data_parallel_size=1",
                "model.path=/nonexistent/m",
            ],
        )
    assert any("does not divide the 1 attention heads" in p.message for p in e.value.problems)
    with pytest.raises(ConfigError) as e:  # the query heads divide, the key/value heads do not
        load_config(
            CPU_CFG,
            [
                "model.n_heads=2",
                "model.n_kv_heads=1",
                "megatron.tensor_parallel_size=2",
                "megatron.data_parallel_size=1",
                "model.path=/nonexistent/m",
            ],
        )
    assert any("and the 1 key/value heads" in p.message for p in e.value.problems), str(e.value)


def test_more_ranks_than_gpus_is_refused_before_start(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = load_config(CPU_CFG, ["megatron.cpu_emulation=false"])
    (problem,) = _megatron_problems(cfg)
    assert "2 megatron trainer rank(s) need 2 GPU(s) (one each), but the local cluster has 0" in problem.message


@pytest.mark.parametrize(
    "overrides, says",
    [
        # issue #54 trap 5: 8 GPUs all to Megatron leave the vLLM worker none
        (["backend.num_trainer_ranks=8", "megatron.data_parallel_size=8"], "the trainer alone takes every GPU"),
        (
            ["backend.num_trainer_ranks=7", "megatron.data_parallel_size=7", "backend.num_generation_workers=2"],
            "need 9 GPU(s)",
        ),
    ],
)
def test_every_roles_gpus_count_against_the_visible_ones(monkeypatch, overrides, says):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    gpu = ["megatron.cpu_emulation=false", "backend.generation=vllm", "vllm.device=cuda", "model.path=/m"]
    base = [*gpu, "megatron.tensor_parallel_size=1"]
    from single_controller.preflight.environment import roles_fit_the_gpus

    (problem,) = roles_fit_the_gpus(load_config(CPU_CFG, [*base, *overrides]))
    assert says in problem.message and "vLLM worker(s)" in problem.message, problem.message
    fits = load_config(CPU_CFG, [*base, "backend.num_trainer_ranks=7", "megatron.data_parallel_size=7"])
    assert roles_fit_the_gpus(fits) == []


def test_cpu_emulation_is_refused_where_cuda_is_visible(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = load_config(CPU_CFG, [])
    (problem,) = _megatron_problems(cfg)
    assert "megatron.cpu_emulation is for CPU-only machines, but 2 CUDA GPU(s) are visible" in problem.message


def test_missing_megatron_extra_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name.startswith("megatron") else real(name, *a)
    )
    cfg = load_config(CPU_CFG, [])
    problems = [p for p in environment_problems(cfg) if p.paths == ("backend.trainer",)]
    assert len(problems) == 1
    assert "megatron.core" in problems[0].message and "install the `megatron` extra" in problems[0].message
    assert _megatron_problems(cfg) == []  # nothing else is piled on


def test_megatron_needs_a_model_directory():
    cfg = load_config(None, ["backend.trainer=megatron", "megatron.cpu_emulation=true"])
    assert any(p.paths == ("model.path", "backend.trainer") for p in environment_problems(cfg))


def _gpt2_model_dir(tmp_path: Path, heads: int, **over) -> Path:
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "n_head": heads,
                "n_embd": 32 * heads,
                "n_inner": None,
                "n_layer": 1,
                "n_positions": 32,
                "vocab_size": 16,
                **over,
            }
        )
    )
    return d


def test_tp_must_divide_the_heads_of_a_gpt2_model_directory(tmp_path):
    d = _gpt2_model_dir(tmp_path, heads=3)
    cfg = load_config(
        CPU_CFG,
        [f"model.path={d}", "model.create=false", "megatron.tensor_parallel_size=2", "megatron.data_parallel_size=1"],
    )
    problems = [p for p in environment_problems(cfg) if "megatron.tensor_parallel_size" in p.paths]
    assert len(problems) == 1
    assert "does not divide the model's 3 attention heads" in problems[0].message


def test_an_unsupported_architecture_is_refused_naming_it(tmp_path):
    d = _model_dir(tmp_path, heads=2)
    (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), "model_type": "mistral"}))
    cfg = load_config(CPU_CFG, [f"model.path={d}", "model.create=false"])
    problems = [p for p in environment_problems(cfg) if p.paths == ("model.path", "backend.trainer")]
    assert len(problems) == 1
    assert "model_type is 'mistral' (supported: llama, qwen2, qwen3, gpt2)" in problems[0].message


def test_gpt2_spec_reads_the_hf_fields_and_refuses_what_it_does_not_build():
    from single_controller.backends.megatron.model import ModelSpec, UnsupportedModel

    base = {
        "model_type": "gpt2",
        "n_head": 2,
        "n_embd": 64,
        "n_inner": None,
        "n_layer": 2,
        "n_positions": 32,
        "vocab_size": 19,
    }
    spec = ModelSpec.from_hf_config(base)
    # HF GPT-2 defaults: n_inner null = 4 * n_embd, gelu_new, eps 1e-5, tied embeddings
    assert (spec.intermediate_size, spec.activation, spec.norm_eps, spec.tie_word_embeddings) == (
        256,
        "gelu_tanh",
        1e-5,
        True,
    )
    assert (spec.head_dim, spec.num_kv_heads, spec.max_position_embeddings, spec.rope_theta) == (32, 2, 32, None)
    assert ModelSpec.from_hf_config({**base, "tie_word_embeddings": False, "layer_norm_epsilon": 1e-6}).norm_eps == 1e-6
    with pytest.raises(UnsupportedModel, match="activation_function is 'relu'.*scale_attn_by_inverse_layer_idx"):
        ModelSpec.from_hf_config({**base, "activation_function": "relu", "scale_attn_by_inverse_layer_idx": True})


def test_qwen_specs_read_their_attention_extras_and_refuse_what_they_do_not_build():
    from single_controller.backends.megatron.model import ModelSpec, UnsupportedModel

    base = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "vocab_size": 19,
        "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"},
    }
    qwen2 = ModelSpec.from_hf_config({**base, "model_type": "qwen2", "use_sliding_window": False})
    assert (qwen2.arch, qwen2.qkv_bias, qwen2.qk_norm, qwen2.rope_theta) == ("qwen2", True, False, 100)
    assert qwen2.head_dim == 16  # hidden_size / heads: Qwen2 configs have no head_dim
    qwen3 = ModelSpec.from_hf_config({**base, "model_type": "qwen3", "head_dim": 32, "attention_bias": False})
    assert (qwen3.arch, qwen3.qkv_bias, qwen3.qk_norm) == ("qwen3", False, True)
    assert (qwen3.head_dim, qwen3.num_kv_heads) == (32, 2)  # heads wider than hidden_size / heads, as in Qwen3
    llama = ModelSpec.from_hf_config({**base, "model_type": "llama"})
    assert (llama.qkv_bias, llama.qk_norm) == (False, False)
    with pytest.raises(UnsupportedModel, match="attention_bias/mlp_bias are set.*use_sliding_window is set"):
        ModelSpec.from_hf_config({**base, "model_type": "qwen3", "attention_bias": True, "use_sliding_window": True})
    with pytest.raises(UnsupportedModel, match="use_sliding_window is set"):
        ModelSpec.from_hf_config({**base, "model_type": "qwen2", "use_sliding_window": True})
    with pytest.raises(UnsupportedModel, match="attention_bias/mlp_bias are set"):
        ModelSpec.from_hf_config({**base, "model_type": "llama", "attention_bias": True})


def test_a_llama3_rope_directory_is_refused_by_name_and_pointed_to_fsdp():
    """Llama 3.1/3.2's RoPE scaling: Megatron's spec builds only the default RoPE; the refusal names it
    and the trainer that takes it."""
    from single_controller.backends.megatron.model import ModelSpec, UnsupportedModel

    cfg = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "vocab_size": 19,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
    }
    with pytest.raises(UnsupportedModel, match=r"rope type is 'llama3' \(only 'default'\)\. backend.trainer=fsdp"):
        ModelSpec.from_hf_config(cfg)
    with pytest.raises(UnsupportedModel, match=r"model_type is 'mistral'.*backend.trainer=fsdp"):
        ModelSpec.from_hf_config({**cfg, "model_type": "mistral"})
