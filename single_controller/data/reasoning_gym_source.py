"""reasoning-gym as a data source: any of its procedural tasks as training and held-out prompts.

`rg_prompts(cfg, split)` builds `data.reasoning_gym.size` items (eval: `eval_size` items, seed + 1)
with `reasoning_gym.create_dataset`, renders each through `template` and the chat template, and puts
the item in `Prompt.columns["entry"]` for the `reasoning_gym` reward (the task's own `score_answer`),
with `columns["extract"]`. An unknown task or a template field the items lack is refused by name.
"""

from __future__ import annotations

import difflib
from typing import Any

from single_controller.data.files import DatasetError, LoadedPrompts, render_prompt
from single_controller.data.tokenizer import RunTokenizer
from single_controller.types import Prompt


def task_names() -> list[str]:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise DatasetError(
            "data.reasoning_gym needs the reasoning-gym package (pip install 'sc-grpo[verifiers]')"
        ) from None

    return sorted(DATASETS)


def check_task(name: str) -> None:
    """Refuse an unknown task, naming the closest registered ones."""
    names = task_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else f" ({len(names)} tasks, e.g. {names[:5]})"
        raise DatasetError(f"data.reasoning_gym.task: unknown reasoning-gym task {name!r}{hint}")


def items(task: str, size: int, seed: int, config: dict[str, Any]) -> list[dict[str, Any]]:
    import reasoning_gym

    check_task(task)
    try:
        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **config)
    except (TypeError, ValueError, AssertionError) as e:  # an option the task does not take or allow
        raise DatasetError(f"data.reasoning_gym: task {task!r} refused config {config}: {e}") from None
    return [dict(dataset[i]) for i in range(size)]


def render(template: str, entry: dict[str, Any], where: str) -> str:
    try:
        return template.format(**entry)
    except (KeyError, IndexError, AttributeError) as e:
        fields = sorted(entry) + [f"metadata[{k}]" for k in sorted(entry.get("metadata") or {})]
        msg = f"{where}: data.reasoning_gym.template names {e}, which the item lacks; it has {fields}"
        raise DatasetError(msg) from None


def rg_prompts(cfg, tokenizer: RunTokenizer | None, split: str) -> LoadedPrompts:
    """The train or eval prompts of the configured task (`tokenizer=None`: checked, not rendered)."""
    r = cfg.data.reasoning_gym
    seed = (cfg.seed if r.seed is None else r.seed) + (1 if split == "eval" else 0)
    size = r.eval_size if split == "eval" else r.size
    limit, prompts, too_long = cfg.data.max_prompt_tokens, [], 0
    for i, entry in enumerate(items(r.task, size, seed, dict(r.config))):
        where = f"reasoning-gym {r.task} {split} item {i}"
        text = render(r.template, entry, where)
        ids = [] if tokenizer is None else render_prompt(text, cfg.data, tokenizer, where)
        if limit is not None and len(ids) > limit:
            if cfg.data.overlong_prompts == "error":
                raise DatasetError(
                    f"{where}: the prompt has {len(ids)} tokens, more than data.max_prompt_tokens={limit}"
                )
            too_long += 1
            continue
        columns = {"entry": entry, "extract": r.extract}
        prompts.append(Prompt(f"rg-{r.task}-{split}-{i:06d}", tuple(ids), str(entry["answer"]), text, columns))
    if not prompts:
        raise DatasetError(f"reasoning-gym {r.task} {split}: no prompt left ({too_long} longer than {limit} tokens)")
    return LoadedPrompts(prompts, too_long)
