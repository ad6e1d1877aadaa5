"""Where a run's prompts come from: dataset files (`data.train_files`), or the task's generator.

First match: `data.reasoning_gym.task`, `data.train_files`, else `task.name`; eval: `data.eval_files`,
the reasoning-gym task's held-out items, else `eval.dataset` / the task's held-out split.
`train_prompts(cfg)` and `eval_prompts(cfg)` tokenize with the model's own tokenizer; a generated
task's prompts are already ids of the character tokenizer.
"""

from __future__ import annotations

import dataclasses

from single_controller.data.files import LoadedPrompts, file_prompts
from single_controller.data.tokenizer import load_tokenizer
from single_controller.types import Prompt


def data_limits(cfg):
    """`cfg.data` with `max_prompt_tokens` bounded by what the model holds: its positions less the
    most new tokens (a longer prompt could never be generated from)."""
    from single_controller.config.schema import eval_max_new_tokens, rollout_max_new_tokens

    if cfg.model.path is None:
        positions = cfg.model.max_seq_len
    else:
        from single_controller.data.hf_model import positions_of, read_config

        positions = positions_of(read_config(cfg.model.path)) or cfg.model.max_seq_len
    room = positions - max(rollout_max_new_tokens(cfg), eval_max_new_tokens(cfg) if cfg.eval.enabled else 0)
    limit = room if cfg.data.max_prompt_tokens is None else min(room, cfg.data.max_prompt_tokens)
    return dataclasses.replace(cfg.data, max_prompt_tokens=max(1, limit))


def train_prompts(cfg) -> LoadedPrompts:
    if cfg.data.reasoning_gym.task is not None:
        from single_controller.data.reasoning_gym_source import rg_prompts

        return rg_prompts(dataclasses.replace(cfg, data=data_limits(cfg)), load_tokenizer(cfg.model.path), "train")
    if cfg.data.train_files:
        tokenizer = load_tokenizer(cfg.model.path)
        return file_prompts(cfg.data.train_files, data_limits(cfg), tokenizer, "data.train_files", cfg.env.tools)
    from single_controller.data.tasks import check_unique_prompt_ids, load_task

    pool = list(load_task(cfg.task.name)(cfg.task.num_prompts, cfg.task.num_digits, cfg.seed))
    check_unique_prompt_ids(pool, f"task dataset {cfg.task.name!r}")  # the pool is finite: all at once
    return LoadedPrompts(pool, 0)


def eval_prompts(cfg) -> list[Prompt]:
    if cfg.data.reasoning_gym.task is not None and not cfg.data.eval_files:
        from single_controller.data.reasoning_gym_source import rg_prompts

        loaded = rg_prompts(dataclasses.replace(cfg, data=data_limits(cfg)), load_tokenizer(cfg.model.path), "eval")
        return loaded.prompts[: cfg.eval.num_prompts]
    if cfg.data.eval_files:
        tokenizer = load_tokenizer(cfg.model.path)
        loaded = file_prompts(cfg.data.eval_files, data_limits(cfg), tokenizer, "data.eval_files", cfg.env.tools)
        return loaded.prompts[: cfg.eval.num_prompts]
    from single_controller.data.tasks import load_eval_prompts

    return load_eval_prompts(cfg)
