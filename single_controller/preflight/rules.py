"""Rules a configuration must follow beyond each field's own type, choices and bounds.

Each rule is `rule(cfg) -> Problem | None`, named after what it demands; `RULES` is the table
`load_config` runs, in order. A rule's `Problem.paths` names every field it reads, so its finding is
left out when one of them was already rejected. The table also checks that what a config names
resolves (task, reward, checkpoint, eval dataset), so a typo fails before Ray starts; what the
machine must have is `preflight.environment`'s, checked only by `sc-grpo run`.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from pathlib import Path

from single_controller.config.problems import Problem
from single_controller.config.schema import (
    Config,
    env_enabled,
    eval_max_new_tokens,
    prompts_from_data,
    required_capacity,
    rollout_max_new_tokens,
)
from single_controller.preflight import algorithm, colocation

__all__ = ["DIGIT_TASKS", "RULES", "Rule", "rule_problems"]

Rule = Callable[[Config], Problem | None]

# Generation backends that play multi-turn episodes (`env`).
EPISODE_ENGINES: tuple[str, ...] = ("torch", "vllm")

# Generation backends whose workers sleep and wake (`single_controller/elastic.py`): a pool's.
ELASTIC_ENGINES: tuple[str, ...] = ("torch", "vllm", "sim")

# Built-in tasks whose prompt is the digits plus two marker tokens (so its length is num_digits + 2).
DIGIT_TASKS: tuple[str, ...] = ("reverse_digits", "copy_digits")


# ---------------------------------------------------------------- single fields, beyond their type


def reward_fn_is_module_function(cfg: Config) -> Problem | None:
    if ":" in cfg.task.reward_fn:
        return None
    return Problem(("task.reward_fn",), f"task.reward_fn must be 'module:function', got {cfg.task.reward_fn!r}")


def run_name_is_a_file_name(cfg: Config) -> Problem | None:
    name = cfg.run.name
    if name and "/" not in name and name not in (".", ".."):
        return None
    return Problem(("run.name",), f"run.name must be a non-empty file name, got {name!r}")


# ---------------------------------------------------------------- backends and storage


def sim_is_both_roles_or_neither(cfg: Config) -> Problem | None:
    b = cfg.backend
    if (b.generation == "sim") == (b.trainer == "sim"):
        return None
    return Problem(
        ("backend.generation", "backend.trainer"),
        f"backend.generation={b.generation} with backend.trainer={b.trainer}: the sim backend runs both roles "
        "in-process and cannot be mixed with Ray workers; set both to sim, or neither",
    )


def memory_storage_needs_sim(cfg: Config) -> Problem | None:
    if cfg.storage.kind != "memory" or cfg.backend.generation == "sim":
        return None
    return Problem(
        ("storage.kind", "backend.generation"),
        f"storage.kind=memory works only with the sim backends (got backend.generation={cfg.backend.generation}): "
        "real workers run in other processes and cannot read the controller's memory; use storage.kind=tq",
    )


def spread_needs_a_cluster(cfg: Config) -> Problem | None:
    b = cfg.backend
    if b.trainer_placement != "spread" or b.num_trainer_ranks <= 1 or cfg.ray.address is not None:
        return None
    return Problem(
        ("backend.trainer_placement", "ray.address"),
        f"backend.trainer_placement=spread puts each of the {b.num_trainer_ranks} trainer ranks on its own "
        "node, but without ray.address the run starts a one-node local Ray; attach to a cluster "
        "(ray.address=HEAD_IP:PORT) or use backend.trainer_placement=pack",
    )


# ---------------------------------------------------------------- the model


def one_source_of_initial_weights(cfg: Config) -> Problem | None:
    m = cfg.model
    if m.path is None or m.checkpoint is None:
        return None
    return Problem(
        ("model.path", "model.checkpoint"),
        f"model.path ({m.path!r}) and model.checkpoint ({m.checkpoint!r}) both name the initial "
        "weights; a Hugging Face model directory (model.path) or an embedded TinyGPT checkpoint, not both",
    )


def create_needs_a_path(cfg: Config) -> Problem | None:
    if not cfg.model.create or cfg.model.path is not None:
        return None
    return Problem(("model.create", "model.path"), "model.create=true needs model.path (where to write the model)")


def heads_divide_the_hidden_size(cfg: Config) -> Problem | None:
    m = cfg.model
    if m.d_model % m.n_heads == 0:
        return None
    return Problem(
        ("model.d_model", "model.n_heads"),
        f"model.d_model ({m.d_model}) must be divisible by model.n_heads ({m.n_heads})",
    )


def created_sizes_are_for_a_created_model(cfg: Config) -> Problem | None:
    """`model.n_kv_heads` and `model.d_ff` shape the model `model.create` writes: key/value heads
    divide the query heads, and GPT-2 has one per query head; the embedded TinyGPT takes neither."""
    m = cfg.model
    if m.n_kv_heads is None and m.d_ff is None:
        return None
    if m.path is None or not m.create:
        return Problem(
            ("model.n_kv_heads", "model.d_ff", "model.create"),
            "model.n_kv_heads and model.d_ff shape the model model.create writes into model.path; an existing "
            "model directory has its own, and the embedded TinyGPT (model.path: null) has one key/value head "
            "per query head and a 4 x d_model MLP",
        )
    if m.n_kv_heads is None or m.n_kv_heads == m.n_heads:
        return None
    if m.arch == "gpt2":
        return Problem(("model.n_kv_heads", "model.arch"), "a GPT-2 model has one key/value head per query head")
    if m.n_heads % m.n_kv_heads:
        return Problem(
            ("model.n_kv_heads", "model.n_heads"),
            f"model.n_kv_heads ({m.n_kv_heads}) must divide model.n_heads ({m.n_heads})",
        )
    return None


def sequences_fit_the_model(cfg: Config) -> Problem | None:
    """A digit task's longest sequence (prompt + new tokens, eval's included when on) fits max_seq_len."""
    if cfg.task.name not in DIGIT_TASKS or prompts_from_data(cfg):
        return None
    new = rollout_max_new_tokens(cfg)
    longest = cfg.task.num_digits + 2 + max(new, eval_max_new_tokens(cfg) if cfg.eval.enabled else 0)
    if cfg.model.max_seq_len >= longest:
        return None
    return Problem(
        ("model.max_seq_len", "task.num_digits", "rollout.max_new_tokens"),
        f"model.max_seq_len ({cfg.model.max_seq_len}) is shorter than the longest sequence: "
        f"a {cfg.task.name} prompt has task.num_digits + 2 = {cfg.task.num_digits + 2} tokens, "
        f"plus the most new tokens (rollout.max_new_tokens = {new}, or "
        f"eval.max_new_tokens when eval is on) gives {longest}",
    )


# ---------------------------------------------------------------- vLLM


def vllm_needs_a_model_directory(cfg: Config) -> Problem | None:
    if cfg.backend.generation != "vllm" or cfg.model.path is not None:
        return None
    return Problem(
        ("backend.generation", "model.path"),
        "backend.generation=vllm needs model.path: vLLM loads a Hugging Face model directory "
        "(write a tiny one with `sc-grpo init-model DIR`, or set model.create=true)",
    )


def vllm_samples_the_full_distribution(cfg: Config) -> Problem | None:
    top_p = cfg.rollout.top_p
    if cfg.backend.generation != "vllm" or top_p == 1.0:
        return None
    return Problem(
        ("backend.generation", "rollout.top_p"),
        f"rollout.top_p={top_p} with backend.generation=vllm: vLLM reports the logprobs of the "
        "top-p-truncated distribution, the trainer recomputes the full tempered one, so every "
        "importance ratio would be off; use rollout.top_p=1.0",
    )


def vllm_sleeps_only_on_a_gpu(cfg: Config) -> Problem | None:
    """Levels 1 and 2 are vLLM's sleep mode (`backends/vllm/sleep.py`: the engine starts with it on
    `cuda`); vLLM refuses it on the CPU, where a shrink only takes the worker out of routing."""
    level = cfg.rollout.sleep_level
    if cfg.backend.generation != "vllm" or cfg.vllm.device != "cpu" or level == 0:
        return None
    return Problem(
        ("backend.generation", "vllm.device", "rollout.sleep_level"),
        f"rollout.sleep_level={level} with vLLM on the CPU: vLLM's sleep mode is CUDA/ROCm only, so a shrunk "
        "vLLM worker on the CPU can only leave routing (rollout.sleep_level=0)",
    )


def vllm_fits_a_group(cfg: Config) -> Problem | None:
    g, seqs = cfg.rollout.group_size, cfg.vllm.max_num_seqs
    if cfg.backend.generation != "vllm" or g <= seqs:
        return None
    return Problem(
        ("rollout.group_size", "vllm.max_num_seqs"),
        f"rollout.group_size ({g}) exceeds vllm.max_num_seqs ({seqs}): "
        "the engine could never run one group's completions together",
    )


# ---------------------------------------------------------------- the lookahead, the buffer and the steps


def capacity_holds_the_lookahead(cfg: Config) -> Problem | None:
    need, cap = required_capacity(cfg), cfg.buffer.capacity_groups
    if cap is None or cap >= need:
        return None
    L, groups = cfg.sampler.max_lookahead_versions, cfg.train.groups_per_step
    return Problem(
        ("buffer.capacity_groups", "sampler.max_lookahead_versions", "train.groups_per_step"),
        f"buffer.capacity_groups ({cap}) is less than the {need} groups the lookahead needs: "
        f"with L = sampler.max_lookahead_versions = {L}, groups for the "
        f"steps v .. v+L can be resident at once, so (L+1) * train.groups_per_step = "
        f"({L}+1) * {groups} = {need} slots are needed; "
        f"with fewer the rollout pump would deadlock waiting for a refill. "
        f"Set it to at least {need}, or to null to derive it",
    )


def staleness_bound_covers_the_lookahead(cfg: Config) -> Problem | None:
    s = cfg.sampler
    if s.max_staleness_versions >= s.max_lookahead_versions:
        return None
    return Problem(
        ("sampler.max_staleness_versions", "sampler.max_lookahead_versions"),
        f"sampler.max_staleness_versions ({s.max_staleness_versions}) is less than "
        f"sampler.max_lookahead_versions ({s.max_lookahead_versions}): the lookahead gate "
        "starts rollouts up to L versions before they are trained, so they reach staleness "
        "up to L; a smaller bound could evict everything the gate admits",
    )


def a_step_fills_a_chunk(cfg: Config) -> Problem | None:
    t = cfg.train
    if t.min_groups_per_chunk <= t.groups_per_step:
        return None
    return Problem(
        ("train.min_groups_per_chunk", "train.groups_per_step"),
        f"train.min_groups_per_chunk ({t.min_groups_per_chunk}) exceeds "
        f"train.groups_per_step ({t.groups_per_step}): a step would never have a full chunk",
    )


def a_chunk_feeds_every_rank(cfg: Config) -> Problem | None:
    chunk, g, ranks = cfg.train.min_groups_per_chunk, cfg.rollout.group_size, cfg.backend.num_trainer_ranks
    if chunk * g >= ranks:
        return None
    return Problem(
        ("train.min_groups_per_chunk", "rollout.group_size", "backend.num_trainer_ranks"),
        f"each of the {ranks} trainer ranks (backend.num_trainer_ranks) needs at least one row "
        f"per chunk, but a chunk may hold only train.min_groups_per_chunk * rollout.group_size "
        f"= {chunk} * {g} = {chunk * g} rows",
    )


def a_decaying_lr_has_steps_to_decay_over(cfg: Config) -> Problem | None:
    t, steps = cfg.train, cfg.run.max_steps
    if t.lr_schedule == "constant" or steps >= t.warmup_steps + 2:
        return None
    return Problem(
        ("train.lr_schedule", "train.warmup_steps", "run.max_steps"),
        f"train.lr_schedule={t.lr_schedule} decays the lr from train.lr at step train.warmup_steps "
        f"({t.warmup_steps}) to train.min_lr_ratio * train.lr at the last step, run.max_steps - 1: its horizon is "
        f"run.max_steps, which must be at least train.warmup_steps + 2 = {t.warmup_steps + 2} (got {steps}); "
        "raise run.max_steps, or use train.lr_schedule=constant",
    )


# ---------------------------------------------------------------- Megatron's layout


def megatron_layout_is_the_rank_count(cfg: Config) -> Problem | None:
    mg, ranks = cfg.megatron, cfg.backend.num_trainer_ranks
    tp, dp = mg.tensor_parallel_size, mg.data_parallel_size
    if cfg.backend.trainer != "megatron" or tp * dp == ranks:
        return None
    return Problem(
        ("megatron.tensor_parallel_size", "megatron.data_parallel_size", "backend.num_trainer_ranks"),
        f"megatron.tensor_parallel_size * megatron.data_parallel_size = {tp} * {dp} = {tp * dp} must equal "
        f"backend.num_trainer_ranks = {ranks} (one Megatron rank per trainer actor)",
    )


def megatron_has_no_float16(cfg: Config) -> Problem | None:
    """Megatron trains in float32 or bfloat16 (Float16Module over float32 main parameters). float16
    would need loss scaling: Megatron's schedules multiply the loss by the optimizer's grad scaler and
    the optimizer skips a step whose gradients overflowed; the split API's own backward does neither,
    and a skipped step would break its one-step-per-finish contract."""
    if cfg.backend.trainer != "megatron" or cfg.model.dtype != "float16":
        return None
    return Problem(
        ("backend.trainer", "model.dtype"),
        "model.dtype=float16 with backend.trainer=megatron: the Megatron trainer computes in float32 or "
        "bfloat16 (float16 needs loss scaling with skipped steps on overflow, not wired into the split "
        "train API); use model.dtype=bfloat16 (same 16-bit weights and compute, float32 exponent range) "
        "or backend.trainer=torch",
    )


def distributed_optimizer_needs_data_parallel(cfg: Config) -> Problem | None:
    mg = cfg.megatron
    if cfg.backend.trainer != "megatron" or not mg.distributed_optimizer or mg.data_parallel_size != 1:
        return None
    return Problem(
        ("megatron.distributed_optimizer", "megatron.data_parallel_size"),
        "megatron.distributed_optimizer shards optimizer state over data-parallel ranks; with "
        "megatron.data_parallel_size = 1 there is nothing to shard: set it to false",
    )


def tensor_parallel_divides_the_heads_created(cfg: Config) -> Problem | None:
    """The heads of the model `model.create` is about to write (an existing one is checked at run)."""
    tp, m = cfg.megatron.tensor_parallel_size, cfg.model
    writes = m.path is not None and m.create and not Path(m.path).exists()
    kv_heads = m.n_kv_heads or m.n_heads
    if cfg.backend.trainer != "megatron" or tp == 1 or not writes or m.n_heads % tp == kv_heads % tp == 0:
        return None
    return Problem(
        ("megatron.tensor_parallel_size", "model.n_heads", "model.n_kv_heads"),
        f"megatron.tensor_parallel_size = {tp} does not divide the {m.n_heads} attention heads (model.n_heads) "
        f"and the {kv_heads} key/value heads (model.n_kv_heads) of the model model.create writes",
    )


# ---------------------------------------------------------------- evaluation


def pass_at_k_needs_sampling(cfg: Config) -> Problem | None:
    e = cfg.eval
    if e.num_samples == 1 or e.temperature != 0:
        return None
    return Problem(
        ("eval.num_samples", "eval.temperature"),
        f"eval.num_samples = {e.num_samples} with eval.temperature = 0 (greedy): greedy samples of "
        "a prompt are all the same, so pass@k would equal accuracy; set eval.temperature > 0 "
        "or eval.num_samples = 1",
    )


def eval_dataset_yields_prompts(cfg: Config) -> Problem | None:
    """The eval dataset resolves (when named, or when eval is on) and, when eval is on, yields prompts
    with distinct ids."""
    from single_controller.data.tasks import check_unique_prompt_ids, eval_dataset_name, load_eval_dataset

    e = cfg.eval
    if cfg.data.eval_files or (not e.enabled and e.dataset is None):
        # files are checked with the machine (`environment.dataset_files`); the default split only with eval on
        return None
    name = eval_dataset_name(cfg.task.name, e.dataset)
    paths = ("eval.dataset",) if e.dataset is not None else ("eval.dataset", "task.name")
    try:
        fn = load_eval_dataset(cfg.task.name, e.dataset)
    except (KeyError, ImportError, ValueError, TypeError) as err:
        msg = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
        return Problem(paths, f"eval.dataset: {msg}")
    if not e.enabled:
        return None
    try:
        prompts = list(fn(e.num_prompts, cfg.task.num_digits, cfg.seed))[: e.num_prompts]
    except Exception as err:  # user code: report it as a config problem, with its cause
        return Problem(paths, f"eval.dataset {name!r} failed to load: {type(err).__name__}: {err}")
    try:
        check_unique_prompt_ids(prompts, f"eval.dataset {name!r}")
    except ValueError as err:
        return Problem(paths, str(err))
    if prompts:
        return None
    return Problem(
        paths,
        f"eval.dataset {name!r} gave no prompts (eval.num_prompts = {e.num_prompts}, "
        f"task.num_digits = {cfg.task.num_digits}): there is nothing to evaluate on",
    )


# ---------------------------------------------------------------- what the config names resolves


def task_resolves(cfg: Config) -> Problem | None:
    from single_controller.data.tasks import TASKS, load_task

    name = cfg.task.name
    try:
        load_task(name)
    except (KeyError, ImportError, TypeError, ValueError) as e:
        msg = str(e.args[0]) if e.args else str(e)
        if name not in TASKS and ":" not in name:
            close = difflib.get_close_matches(name, sorted(TASKS), n=1)
            msg += f"; did you mean {close[0]!r}?" if close else ""
        return Problem(("task.name",), f"task.name: {msg}")
    return None


def reward_fn_resolves(cfg: Config) -> Problem | None:
    from single_controller.data.rewards import reward_form
    from single_controller.data.tasks import load_callable

    if ":" not in cfg.task.reward_fn:
        return None  # reward_fn_is_module_function says so
    try:
        reward_form(load_callable(cfg.task.reward_fn))
    except (ImportError, TypeError, ValueError) as e:
        return Problem(("task.reward_fn",), f"task.reward_fn: {e}")
    return None


def data_prompts_set_their_new_tokens(cfg: Config) -> Problem | None:
    if cfg.rollout.max_new_tokens is not None or not prompts_from_data(cfg):
        return None
    return Problem(
        ("rollout.max_new_tokens",),
        "rollout.max_new_tokens is null, which only the generated digit tasks resolve (to task.num_digits); "
        "prompts from data.train_files or data.reasoning_gym need the completion budget set, e.g. 256",
    )


def one_source_of_prompts(cfg: Config) -> Problem | None:
    d = cfg.data
    if not (d.train_files and d.reasoning_gym.task is not None):
        return None
    return Problem(
        ("data.train_files", "data.reasoning_gym.task"),
        "data.train_files and data.reasoning_gym.task both name the training prompts: keep one",
    )


def reward_functions_resolve(cfg: Config) -> Problem | None:
    """Every function of `reward.functions` imports, is a reward function of a known form, and has a
    name of its own."""
    from single_controller.data.rewards import builtin_names, function_problems

    problems = function_problems(cfg.reward.functions)
    if not problems:
        return None
    message = "; ".join(problems)
    if builtin_names() not in message:
        message += f" (built-in reward functions: {builtin_names()})"
    return Problem(("reward.functions",), message)


# ---------------------------------------------------------------- multi-turn environments


def env_has_one_transport(cfg: Config) -> Problem | None:
    if cfg.env.fn is None or cfg.env.url is None:
        return None
    return Problem(
        ("env.fn", "env.url"), "env.fn and env.url are both set: an environment runs in-process or over HTTP"
    )


def env_resolves(cfg: Config) -> Problem | None:
    """`env.fn` imports and is a class of the environment contract (`envs/contract.py`)."""
    if cfg.env.fn is None:
        return None
    from single_controller.envs.contract import EnvContractError
    from single_controller.envs.inprocess import check_env

    try:
        check_env(dataclasses.replace(cfg.env, url=None))
    except EnvContractError as e:
        return Problem(("env.fn", "env.args"), str(e))
    return None


def env_scores_its_episodes(cfg: Config) -> Problem | None:
    if not env_enabled(cfg.env) or not cfg.reward.functions:
        return None
    return Problem(
        ("env.fn", "env.url", "reward.functions"),
        "reward.functions with an environment: an episode's reward is what the environment's final step "
        "gives; score in the environment's step (it sees every action) and leave reward.functions empty",
    )


def env_needs_an_episode_engine(cfg: Config) -> Problem | None:
    if not env_enabled(cfg.env) or cfg.backend.generation in EPISODE_ENGINES:
        return None
    return Problem(
        ("env.fn", "env.url", "backend.generation"),
        f"backend.generation={cfg.backend.generation} cannot play multi-turn episodes; use one of "
        f"{', '.join(EPISODE_ENGINES)}",
    )


def checkpoint_exists(cfg: Config) -> Problem | None:
    ckpt = cfg.model.checkpoint
    if ckpt is None or (Path(ckpt) / "config.json").is_file():
        return None
    what = "does not exist" if not Path(ckpt).exists() else "has no config.json"
    return Problem(
        ("model.checkpoint",),
        f"model.checkpoint: {ckpt} {what} (expected a directory written by a run's checkpoint/)",
    )


def pool_slots_are_consistent(cfg: Config) -> Problem | None:
    p, b = cfg.pool, cfg.backend
    if not p.enabled:
        return None
    paths = ("pool.gen_slots", "pool.train_slots", "pool.overlap", "backend.num_generation_workers")
    why = _pool_slot_problem(p.gen_slots, p.train_slots, p.overlap, b.num_generation_workers)
    return Problem(paths, why) if why else None


def _pool_slot_problem(gen: tuple[int, ...], train: tuple[int, ...], overlap: str, workers: int) -> str | None:
    if not gen or not train:
        return "a run in a pool needs pool.gen_slots and pool.train_slots (the slots it generates and trains on)"
    if any(s < 0 for s in (*gen, *train)) or len(set(gen)) < len(gen) or len(set(train)) < len(train):
        return f"pool slots are distinct non-negative numbers: gen_slots {list(gen)}, train_slots {list(train)}"
    if len(gen) != workers:
        return (
            f"pool.gen_slots has {len(gen)} slot(s), one per generation worker, but "
            f"backend.num_generation_workers={workers}"
        )
    if overlap == "partial" and not set(train) <= set(gen):
        return (
            f"pool.overlap=partial: the train slots {sorted(set(train) - set(gen))} are not among the run's "
            f"generation slots {list(gen)} (partial overlap trains on slots whose workers sleep meanwhile)"
        )
    if overlap == "none" and set(train) & set(gen):
        return f"pool.overlap=none: the train slots {sorted(set(train) & set(gen))} are generation slots too"
    return None


def pool_attach_needs_a_cluster(cfg: Config) -> Problem | None:
    p = cfg.pool
    if not (p.enabled and p.attach) or (cfg.backend.generation != "sim" and cfg.ray.address is not None):
        return None
    return Problem(
        ("pool.attach", "ray.address", "backend.generation"),
        "pool.attach=true joins the pool `sc-grpo pool serve` serves on a Ray cluster: it needs ray.address "
        "(that cluster) and a Ray backend (not sim)",
    )


def pool_needs_elastic_workers(cfg: Config) -> Problem | None:
    if not cfg.pool.enabled or cfg.backend.generation in ELASTIC_ENGINES:
        return None
    return Problem(
        ("pool.enabled", "backend.generation"),
        f"backend.generation={cfg.backend.generation} cannot shrink and expand its workers; a pool needs one "
        f"of: {', '.join(ELASTIC_ENGINES)}",
    )


RULES: tuple[Rule, ...] = (
    reward_fn_is_module_function,
    run_name_is_a_file_name,
    sim_is_both_roles_or_neither,
    memory_storage_needs_sim,
    spread_needs_a_cluster,
    one_source_of_initial_weights,
    create_needs_a_path,
    vllm_needs_a_model_directory,
    vllm_samples_the_full_distribution,
    vllm_fits_a_group,
    vllm_sleeps_only_on_a_gpu,
    heads_divide_the_hidden_size,
    created_sizes_are_for_a_created_model,
    capacity_holds_the_lookahead,
    staleness_bound_covers_the_lookahead,
    a_step_fills_a_chunk,
    a_chunk_feeds_every_rank,
    a_decaying_lr_has_steps_to_decay_over,
    megatron_layout_is_the_rank_count,
    megatron_has_no_float16,
    *colocation.RULES,
    *algorithm.RULES,
    distributed_optimizer_needs_data_parallel,
    tensor_parallel_divides_the_heads_created,
    pass_at_k_needs_sampling,
    eval_dataset_yields_prompts,
    sequences_fit_the_model,
    task_resolves,
    reward_fn_resolves,
    reward_functions_resolve,
    checkpoint_exists,
    env_has_one_transport,
    env_resolves,
    env_scores_its_episodes,
    env_needs_an_episode_engine,
    one_source_of_prompts,
    data_prompts_set_their_new_tokens,
    pool_slots_are_consistent,
    pool_needs_elastic_workers,
    pool_attach_needs_a_cluster,
)


def rule_problems(cfg: Config, rules: tuple[Rule, ...] = RULES) -> list[Problem]:
    """What every rule finds wrong with `cfg`, in the table's order."""
    return [p for rule in rules if (p := rule(cfg)) is not None]
