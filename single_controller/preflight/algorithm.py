"""The loss a config names (`loss_config`: what the train pump hands every `begin_train_step`) and
its rule: the checks a trainer makes at `begin_train_step` (`algorithm.losses.loss_problems`), made
before start-up and named by config key. Each `rule(cfg) -> Problem | None`, in `rules.RULES`."""

from __future__ import annotations

from single_controller.algorithm.losses import FIELD_PATHS, loss_problems
from single_controller.config.problems import Problem
from single_controller.config.schema import Config, rollout_max_new_tokens
from single_controller.types import LossConfig


def loss_config(cfg: Config) -> LossConfig:
    """The loss a run's `train.*` settings name (what the train pump hands every `begin_train_step`)."""
    t = cfg.train
    return LossConfig(
        agg=t.loss_agg,
        policy_loss=t.policy_loss,
        clip_low=t.clip_eps if t.clip_eps_low is None else t.clip_eps_low,
        clip_high=t.clip_eps if t.clip_eps_high is None else t.clip_eps_high,
        is_correction=t.is_correction,
        is_low=t.is_threshold_low,
        is_high=t.is_threshold,
        ratio_to_gen=not t.recompute_old_logprobs,
        kl_coef=t.kl_coef,
        kl_estimator=t.kl_estimator,
        norm_tokens=rollout_max_new_tokens(cfg) if t.loss_agg == "seq_mean_token_sum_norm" else 0,
    )


def loss_settings_agree(cfg: Config) -> Problem | None:
    found = loss_problems(loss_config(cfg))
    if not found:
        return None
    paths: list[str] = []
    for fields_, _ in found:
        paths += [_path(cfg, f) for f in fields_ if _path(cfg, f) not in paths]
    return Problem(tuple(paths), "; ".join(message for _, message in found))


def _path(cfg: Config, field: str) -> str:
    """The config key a LossConfig field came from (a clip side left null comes from train.clip_eps)."""
    if (
        field == "clip_low"
        and cfg.train.clip_eps_low is None
        or field == "clip_high"
        and cfg.train.clip_eps_high is None
    ):
        return "train.clip_eps"
    return FIELD_PATHS[field]


def the_ratio_can_move(cfg: Config) -> Problem | None:
    """With one optimizer step per RL step and the ratio taken against the step's start, the ratio is
    1 in value: no clip binds, and gspo and cispo have ppo_clip's gradient. A setting that only acts
    through the ratio would change nothing; refused rather than silently ignored. With several
    updates per step the later ones' ratio moves."""
    t = cfg.train
    if not t.recompute_old_logprobs or t.updates_per_step > 1:
        return None
    acting = [f"train.policy_loss={t.policy_loss}"] if t.policy_loss != "ppo_clip" else []
    acting += [f"train.{k}" for k in ("clip_eps_low", "clip_eps_high") if getattr(t, k) is not None]
    if not acting:
        return None
    return Problem(
        ("train.recompute_old_logprobs", "train.policy_loss", "train.clip_eps_low", "train.clip_eps_high"),
        f"{', '.join(acting)} acts through the ratio pi / pi_base, which is 1 in value here: with one update per "
        "step the ratio is taken against the step's own start (train.recompute_old_logprobs=true), so no clip "
        "binds and gspo and cispo have ppo_clip's gradient. Take the ratio against the generation logprobs "
        "(train.recompute_old_logprobs=false train.is_correction=none), train in several updates per step "
        "(train.updates_per_step), or leave the setting out",
    )


def overlong_penalty_fits(cfg: Config) -> Problem | None:
    """DAPO's overlong buffer lies inside the completion budget, and only single-turn completions have
    the length it is defined on (an episode's length also counts the environment's tokens)."""
    buffer = cfg.reward.overlong_buffer
    if buffer == 0:
        return None
    if cfg.env.fn is not None or cfg.env.url is not None:
        return Problem(
            ("reward.overlong_buffer", "env.fn", "env.url"),
            "reward.overlong_buffer is defined on a single completion's length (rollout.max_new_tokens); an "
            "episode's length also counts the environment's tokens. Use train.mask_truncated for episodes cut short",
        )
    budget = rollout_max_new_tokens(cfg)
    if buffer >= budget:
        return Problem(
            ("reward.overlong_buffer", "rollout.max_new_tokens"),
            f"reward.overlong_buffer={buffer} must be below rollout.max_new_tokens={budget}: the punishment "
            "ramps over the buffer's last tokens of the budget",
        )
    return None


def updates_divide_the_step(cfg: Config) -> Problem | None:
    """A step's groups split evenly into its updates."""
    t = cfg.train
    if t.groups_per_step % t.updates_per_step == 0:
        return None
    return Problem(
        ("train.updates_per_step", "train.groups_per_step"),
        f"train.updates_per_step={t.updates_per_step} must divide train.groups_per_step={t.groups_per_step}: "
        "each update trains groups_per_step / updates_per_step groups",
    )


def reward_kl_can_be_measured(cfg: Config) -> Problem | None:
    """The KL in the reward is measured by the trainer beside training, before a step's groups are
    ready; where the trainer computes only in its turn on the device (colocated in turns, or in a
    pool), it would wait for a turn that comes only once those groups are ready."""
    if cfg.reward.kl_coef == 0:
        return None
    turns = cfg.backend.colocate and cfg.backend.colocate_form == "turns"
    if not (turns or cfg.pool.enabled):
        return None
    where = "backend.colocate_form=turns" if turns else "pool.enabled"
    return Problem(
        ("reward.kl_coef", "backend.colocate_form" if turns else "pool.enabled"),
        f"reward.kl_coef is measured by the trainer while generation runs, which {where} does not allow (the "
        "trainer computes only in its turn, and that turn waits for these groups). Use train.kl_coef (the KL in "
        "the loss) there",
    )


RULES = (
    loss_settings_agree,
    the_ratio_can_move,
    overlong_penalty_fits,
    updates_divide_the_step,
    reward_kl_can_be_measured,
)
