"""The GRPO policy loss: a pure function returning a raw masked SUM (normalizer 1) plus counts.

The split train API needs sums: microbatches add d(sum)/dθ, the ranks all-reduce gradients and
counts once, and the trainer scales by 1/N (global tokens or sequences, `level`); because the sum is
linear, any chunking of a step gives the gradient of the full-batch mean. Per token, with advantage
A, current logprobs `logp`, generation logprobs `gen`, step-start logprobs `old` (default
`logp.detach()`: one optimizer step per RL step, so ratio == 1 in value):

  is_truncation > 0:  w = min(exp(old - gen), is_truncation) (detached),  ratio = exp(logp - old)
  is_truncation == 0: w = 1,                                              ratio = exp(logp - gen)
  pg   = -w * min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps) * A)
  kl   = exp(ref - logp) - (ref - logp) - 1      (k3, only when kl_coef > 0)
  loss = pg + kl_coef * kl;  summed over valid tokens ("token"), or per row divided by its tokens ("sequence")
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from single_controller.types import LossConfig

LOSS_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class LossOutput:
    loss_sum: torch.Tensor  # scalar, differentiable
    num_tokens: int  # valid (masked-in) tokens
    num_sequences: int  # rows with at least one valid token
    # Sums over valid tokens (divide by num_tokens for means): clipped, is_weight, is_truncated, kl, gen_gap.
    token_stats: dict[str, float] = field(default_factory=dict)


def grpo_loss(
    logprobs: torch.Tensor,  # [B, T] current policy, differentiable
    gen_logprobs: torch.Tensor,  # [B, T] policy that generated the tokens
    advantages: torch.Tensor,  # [B]
    mask: torch.Tensor,  # [B, T] bool, True = trained token
    cfg: LossConfig,
    *,
    old_logprobs: torch.Tensor | None = None,  # [B, T] default: logprobs.detach()
    ref_logprobs: torch.Tensor | None = None,  # [B, T] reference policy, needed when kl_coef > 0
) -> LossOutput:
    if cfg.level not in LOSS_LEVELS:
        raise ValueError(f"loss level must be one of {LOSS_LEVELS}, got {cfg.level!r}")
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    mask = mask.bool()
    zeros = torch.zeros_like(logprobs)
    # Padding may hold anything: zero it before exp() so no inf * 0 = nan leaks into the sums.
    logp = torch.where(mask, logprobs, zeros)  # [B, T]
    gen = torch.where(mask, gen_logprobs.to(logp.dtype), zeros)  # [B, T]
    old = logp.detach() if old_logprobs is None else torch.where(mask, old_logprobs.to(logp.dtype), zeros)
    adv = advantages.to(logp.dtype)[:, None]  # [B, 1]

    if cfg.is_truncation > 0:
        raw_w = torch.exp(old - gen)  # [B, T]
        w = raw_w.clamp(max=cfg.is_truncation)
        ratio = torch.exp(logp - old)
    else:
        raw_w = w = torch.ones_like(logp)
        ratio = torch.exp(logp - gen)
    clipped_ratio = ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps)
    unclipped, clipped = ratio * adv, clipped_ratio * adv  # [B, T]
    pg = -w * torch.minimum(unclipped, clipped)  # [B, T]
    per_token = pg
    kl = None
    if cfg.kl_coef > 0:
        assert ref_logprobs is not None  # checked on entry
        delta = torch.where(mask, ref_logprobs.to(logp.dtype), zeros) - logp
        kl = torch.exp(delta) - delta - 1  # [B, T]
        per_token = per_token + cfg.kl_coef * kl

    maskf = mask.to(logp.dtype)
    tokens_per_row = maskf.sum(1)  # [B]
    row_sums = (per_token * maskf).sum(1)  # [B]
    if cfg.level == "token":
        loss_sum = row_sums.sum()
    else:
        loss_sum = (row_sums / tokens_per_row.clamp(min=1)).sum()

    with torch.no_grad():
        stats = {
            "clipped": float(((clipped < unclipped) & mask).sum()),  # the clip bound the objective
            "is_weight": float((w * maskf).sum()),
            "is_truncated": float(((raw_w > w) & mask).sum()),
            "gen_gap": float(((old - gen).abs() * maskf).sum()),  # |log pi_old - log pi_gen|
            **({} if kl is None else {"kl": float((kl * maskf).sum())}),
        }
    return LossOutput(loss_sum, int(tokens_per_row.sum()), int((tokens_per_row > 0).sum()), stats)


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
