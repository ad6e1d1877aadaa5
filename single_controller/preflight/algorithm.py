"""Rules for the loss (`train.loss_agg`, `policy_loss`, `is_correction`, thresholds, KL): the same
checks a trainer makes at `begin_train_step` (`algorithm.losses.loss_problems`), made before start-up
and named by config key. Each `rule(cfg) -> Problem | None`, in `rules.RULES`."""

from __future__ import annotations

from single_controller.algorithm.losses import FIELD_PATHS, loss_config, loss_problems
from single_controller.config.problems import Problem
from single_controller.config.schema import Config


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


RULES = (loss_settings_agree,)
