"""The GRPO loss: a pure function returning a raw masked SUM plus counts (docs/algorithms.md).

The split train API needs sums: microbatches add d(sum)/dtheta, the ranks all-reduce gradients and
counts once, and the trainer divides by N = `loss_normalizer` once; every term below is local to a
row, so any chunking of a step by rows gives the gradient of the full-batch loss. Per token, with
current logprobs `logp`, generation logprobs `gen`, step-start logprobs `old` (default
`logp.detach()`: the parameters the step began with, one optimizer step per RL step):

  1. correction (`corrections.py`): w, keep from log rho = old - gen        (`train.is_correction`)
  2. surrogate (`policy_losses.py`): l_pg from r = pi / pi_base, with base = old, or gen when
     `ratio_to_gen` (`train.recompute_old_logprobs: false`)                 (`train.policy_loss`)
  3. l = l_pg + kl_coef * k(ref, logp), k one of                              (`train.kl_estimator`)
       k1 = log pi - log pi_ref,  k2 = (log pi - log pi_ref)^2 / 2,  k3 = pi_ref/pi - log(pi_ref/pi) - 1
  4. aggregation over the kept tokens                                         (`train.loss_agg`)
       token_mean               sum_rows sum_t l    / tokens
       seq_mean_token_mean      sum_rows mean_t l   / sequences
       seq_mean_token_sum       sum_rows sum_t l    / sequences
       seq_mean_token_sum_norm  sum_rows sum_t l    / (sequences * norm_tokens)   (Dr. GRPO)
     where tokens and sequences are the step's kept ones over every rank and chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from single_controller.algorithm.corrections import CORRECTIONS, MASKING, Correction, correct
from single_controller.algorithm.policy_losses import POLICY_LOSSES, Surrogate
from single_controller.types import LossConfig

LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


def _k1(delta: torch.Tensor) -> torch.Tensor:
    return -delta


def _k2(delta: torch.Tensor) -> torch.Tensor:
    return 0.5 * delta * delta


def _k3(delta: torch.Tensor) -> torch.Tensor:
    return torch.exp(delta) - delta - 1


# delta = log pi_ref - log pi [B, T] -> the estimator of KL(pi || pi_ref) on tokens sampled from pi
KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}

# The config key of each LossConfig field, for messages (`loss_problems`) and preflight.
FIELD_PATHS = {
    "agg": "train.loss_agg",
    "policy_loss": "train.policy_loss",
    "clip_low": "train.clip_eps_low",
    "clip_high": "train.clip_eps_high",
    "is_correction": "train.is_correction",
    "is_low": "train.is_threshold_low",
    "is_high": "train.is_threshold",
    "ratio_to_gen": "train.recompute_old_logprobs",
    "kl_coef": "train.kl_coef",
    "kl_estimator": "train.kl_estimator",
    "norm_tokens": "rollout.max_new_tokens",
}


@dataclass(frozen=True)
class LossOutput:
    loss_sum: torch.Tensor  # scalar, differentiable
    num_tokens: int  # kept tokens (valid, not dropped by a mask correction)
    num_sequences: int  # rows with at least one kept token
    # Sums over kept tokens (divide by num_tokens for means): clipped, clipped_low, clipped_high,
    # is_weight, is_truncated, gen_gap, kl and kl_k1..3 (with a reference); is_masked counts valid
    # tokens a mask correction dropped.
    token_stats: dict[str, float] = field(default_factory=dict)
    maxes: dict[str, float] = field(default_factory=dict)  # is_ratio_max: the largest raw importance ratio


def loss_problems(cfg: LossConfig) -> list[tuple[tuple[str, ...], str]]:
    """What is wrong with `cfg`: (its LossConfig fields, a message naming the config keys)."""
    out: list[tuple[tuple[str, ...], str]] = []
    for name, choices in (
        ("agg", LOSS_AGGS),
        ("policy_loss", tuple(POLICY_LOSSES)),
        ("is_correction", tuple(CORRECTIONS)),
        ("kl_estimator", tuple(KL_ESTIMATORS)),
    ):
        if getattr(cfg, name) not in choices:
            out.append(
                ((name,), f"{FIELD_PATHS[name]} must be one of {', '.join(choices)}, got {getattr(cfg, name)!r}")
            )
    if cfg.clip_low <= 0 or cfg.clip_high <= 0:
        out.append((("clip_low", "clip_high"), "train.clip_eps_low and train.clip_eps_high must be > 0"))
    if cfg.ratio_to_gen and cfg.is_correction != "none":
        out.append(
            (
                ("ratio_to_gen", "is_correction"),
                f"train.is_correction={cfg.is_correction} needs train.recompute_old_logprobs=true: without the "
                "step-start logprobs the ratio is taken against the generation ones, the importance ratio "
                "pi_old / pi_gen is 1 and there is nothing to correct (use train.is_correction=none)",
            )
        )
    out += _threshold_problems(cfg)
    if (cfg.agg == "seq_mean_token_sum_norm") != (cfg.norm_tokens > 0):
        out.append(
            (("agg", "norm_tokens"), "train.loss_agg=seq_mean_token_sum_norm (alone) needs a constant token count > 0")
        )
    if cfg.kl_coef < 0:
        out.append((("kl_coef",), f"train.kl_coef must be >= 0, got {cfg.kl_coef}"))
    return out


def _threshold_problems(cfg: LossConfig) -> list[tuple[tuple[str, ...], str]]:
    if cfg.is_correction == "none":
        return []
    if cfg.is_high <= 0:
        return [(("is_high",), f"train.is_threshold must be > 0 with train.is_correction={cfg.is_correction}")]
    if cfg.is_correction in MASKING and not cfg.is_low < 1 < cfg.is_high:
        return [
            (
                ("is_low", "is_high"),
                f"train.is_correction={cfg.is_correction} keeps importance ratios in [train.is_threshold_low, "
                f"train.is_threshold] = [{cfg.is_low}, {cfg.is_high}], which must hold 1 (an on-policy token)",
            )
        ]
    if cfg.is_correction not in MASKING and cfg.is_low != 0:
        return [
            (
                ("is_low", "is_correction"),
                f"train.is_threshold_low ({cfg.is_low}) bounds only the mask corrections (token_mask, "
                f"sequence_mask), not train.is_correction={cfg.is_correction}: leave it 0",
            )
        ]
    return []


def loss_normalizer(cfg: LossConfig, tokens: float, sequences: float) -> float:
    """N, what a step's raw loss sum (and its gradient) is divided by: `tokens` and `sequences` are
    the step's kept ones over every rank."""
    if cfg.agg == "token_mean":
        return tokens
    if cfg.agg == "seq_mean_token_sum_norm":
        return sequences * cfg.norm_tokens
    return sequences


def grpo_loss(
    logprobs: torch.Tensor,  # [B, T] current policy, differentiable
    gen_logprobs: torch.Tensor,  # [B, T] policy that generated the tokens
    advantages: torch.Tensor,  # [B]
    mask: torch.Tensor,  # [B, T] bool, True = trained token
    cfg: LossConfig,
    *,
    old_logprobs: torch.Tensor | None = None,  # [B, T] default: logprobs.detach()
    ref_logprobs: torch.Tensor | None = None,  # [B, T] reference policy, needed when kl_coef > 0
    entropy: torch.Tensor | None = None,  # [B, T] the policy's entropy per position, summed as a statistic
) -> LossOutput:
    problems = loss_problems(cfg)
    if problems:
        raise ValueError("; ".join(message for _, message in problems))
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    mask = mask.bool()
    # Padding may hold anything: zero it before exp() so no inf * 0 = nan leaks into the sums.
    logp = torch.where(mask, logprobs, 0.0)  # [B, T]
    gen = torch.where(mask, gen_logprobs.to(logp.dtype), 0.0)  # [B, T]
    old = logp.detach() if old_logprobs is None else torch.where(mask, old_logprobs.to(logp.dtype), 0.0)
    adv = advantages.to(logp.dtype)[:, None]  # [B, 1]

    fix = correct(cfg.is_correction, old - gen, mask, cfg.is_low, cfg.is_high)
    keep = fix.keep  # [B, T]
    base = gen if cfg.ratio_to_gen else old
    surrogate = POLICY_LOSSES[cfg.policy_loss](logp, base, adv, keep, cfg.clip_low, cfg.clip_high)
    per_token = fix.weight * surrogate.per_token  # [B, T]
    kls: dict[str, torch.Tensor] = {}
    if ref_logprobs is not None:
        delta = torch.where(keep, ref_logprobs.to(logp.dtype), 0.0) - torch.where(keep, logp, 0.0)  # [B, T]
        kls = {name: k(delta) for name, k in KL_ESTIMATORS.items()}
        if cfg.kl_coef > 0:
            per_token = per_token + cfg.kl_coef * kls[cfg.kl_estimator]

    keepf = keep.to(logp.dtype)
    tokens_per_row = keepf.sum(1)  # [B]
    row_sums = torch.where(keep, per_token, 0.0).sum(1)  # [B]
    if cfg.agg == "seq_mean_token_mean":
        loss_sum = (row_sums / tokens_per_row.clamp(min=1)).sum()
    else:
        loss_sum = row_sums.sum()
    stats = _token_stats(fix, surrogate, keep, mask, old - gen, kls, cfg, entropy)
    n_tokens, n_rows, ratio_max = int(stats.pop("tokens")), int(stats.pop("rows")), stats.pop("ratio_max")
    return LossOutput(loss_sum, n_tokens, n_rows, stats, {"is_ratio_max": ratio_max})


def _token_stats(
    fix: Correction,
    surrogate: Surrogate,
    keep: torch.Tensor,
    mask: torch.Tensor,
    log_rho: torch.Tensor,
    kls: dict[str, torch.Tensor],
    cfg: LossConfig,
    entropy: torch.Tensor | None,
) -> dict[str, float]:
    """The loss's statistics, sums over kept tokens (see `LossOutput.token_stats`), plus the kept
    `tokens` and `rows` and the `ratio_max`: read from the device in one transfer (one sync a pass)."""
    with torch.no_grad():

        def kept(x: torch.Tensor) -> torch.Tensor:
            return torch.where(keep, x.detach().to(torch.float64), 0.0).sum()

        sums = {
            "clipped": kept(surrogate.clipped_low | surrogate.clipped_high),
            "clipped_low": kept(surrogate.clipped_low),
            "clipped_high": kept(surrogate.clipped_high),
            "is_weight": kept(fix.weight),
            "is_truncated": kept(fix.capped),
            "is_masked": (mask & ~keep).sum(),
            "gen_gap": kept(log_rho.abs()),  # |log pi_old - log pi_gen|
            "tokens": keep.sum(),
            "rows": keep.any(dim=1).sum(),
            "ratio_max": fix.ratio_max,
        }
        if entropy is not None:
            sums["entropy"] = kept(entropy)
        if kls:
            sums["kl"] = kept(kls[cfg.kl_estimator])
            sums.update({f"kl_{name}": kept(k) for name, k in kls.items()})
        values = torch.stack([v.to(torch.float64) for v in sums.values()]).tolist()
    return dict(zip(sums, values))


def mismatch_stats(
    logprobs: torch.Tensor,  # [B, T] the trainer's recomputation (any grad state; read detached)
    gen_logprobs: torch.Tensor,  # [B, T] what the generation engine reported for the same tokens
    same_weights: torch.Tensor,  # [B, T] bool: valid tokens the engine sampled with the trainer's current weights
) -> dict[str, float]:
    """Training-inference mismatch sums over the tokens both sides computed with the same weights
    (where any difference is the engines', not staleness). With d = log pi_train - log pi_gen:

      mm_abs    = sum |d|                      (mean |delta logprob| once divided by mm_tokens)
      mm_kl     = sum exp(d) - 1 - d           (k3: unbiased, >= 0, estimates KL(pi_gen || pi_train)
                                                from tokens sampled by pi_gen)
      mm_tokens = number of such tokens
    """
    with torch.no_grad():
        m = same_weights.bool()
        d = torch.where(m, logprobs.detach().double() - gen_logprobs.double(), torch.zeros((), dtype=torch.float64))
        return {
            "mm_abs": float(d.abs().sum()),
            "mm_kl": float((torch.expm1(d) - d).sum()),
            "mm_tokens": float(m.sum()),
        }


def row_kl_sums(
    ref_logprobs: torch.Tensor,  # [B, T] the reference policy's logprobs of the sampled tokens
    gen_logprobs: torch.Tensor,  # [B, T] the sampling policy's (the engine's)
    mask: torch.Tensor,  # [B, T] bool: the row's policy tokens
    estimator: str,
) -> torch.Tensor:
    """Each row's KL to the reference for a penalty in its reward (`reward.kl_coef`): the sum over its
    policy tokens of the estimator `KL_ESTIMATORS[estimator]` of KL(pi_gen || pi_ref), with
    delta = log pi_ref - log pi_gen (tokens sampled from pi_gen). Returns [B] in float64."""
    m = mask.bool()
    delta = torch.where(m, ref_logprobs.double() - gen_logprobs.double(), torch.zeros((), dtype=torch.float64))
    return torch.where(m, KL_ESTIMATORS[estimator](delta), 0.0).sum(dim=1)
