"""Policy losses: per-token surrogate losses of the current policy (`train.policy_loss`).

With log r = log pi - log pi_base per token (pi_base: the step-start policy, or with
`train.recompute_old_logprobs: false` the generation policy), advantage A per row, clip bounds
[1 - eps_low, 1 + eps_high] and the correction's detached weight w:

  ppo_clip  l = -w * min(r A, clip(r) A)                               PPO (Schulman et al. 2017);
                                                                       eps_low != eps_high: DAPO's clip-higher
  gspo      l = -w * min(s A, clip(s) A),  s = sg(s_seq) * pi / sg(pi),
            s_seq = exp(mean_t log r) over the row's kept tokens       GSPO (Zheng et al. 2025), token form:
                                                                       the value and gradient of the sequence ratio
  cispo     l = -w * sg(clip(r)) * A * log pi                          CISPO (MiniMax-M1, 2025)

Each returns the per-token loss [B, T] and where the clip bound the objective, split low and high:
ppo_clip / gspo: clipped below when A < 0 and r < 1 - eps_low, above when A > 0 and r > 1 + eps_high
(the min chose the clipped term); cispo: wherever its weight was clipped, whatever A.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Surrogate:
    per_token: torch.Tensor  # [B, T] differentiable; anything on tokens not kept
    clipped_low: torch.Tensor  # [B, T] bool
    clipped_high: torch.Tensor  # [B, T] bool


# (logp [B, T], base [B, T], adv [B, 1], keep [B, T] bool, eps_low, eps_high) -> Surrogate
PolicyLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, float], Surrogate]


def _clip_min(ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float) -> Surrogate:
    """-min(ratio A, clip(ratio) A) and where the clipped term won."""
    unclipped, clipped = ratio * adv, ratio.clamp(1 - low, 1 + high) * adv  # [B, T]
    won = (clipped < unclipped).detach()
    below = won & (adv < 0).expand_as(won)
    return Surrogate(-torch.minimum(unclipped, clipped), below, won & ~below)


def ppo_clip(
    logp: torch.Tensor, base: torch.Tensor, adv: torch.Tensor, keep: torch.Tensor, low: float, high: float
) -> Surrogate:
    return _clip_min(torch.exp(logp - base), adv, low, high)


def gspo(
    logp: torch.Tensor, base: torch.Tensor, adv: torch.Tensor, keep: torch.Tensor, low: float, high: float
) -> Surrogate:
    keepf = keep.to(logp.dtype)
    log_r = torch.where(keep, logp - base, 0.0)  # [B, T]
    seq_log_r = (log_r * keepf).sum(1, keepdim=True) / keepf.sum(1, keepdim=True).clamp(min=1)  # [B, 1]
    # The sequence ratio's value on every token, with each token's own gradient path.
    s = torch.exp(seq_log_r.detach() + logp - logp.detach())  # [B, T]
    return _clip_min(s, adv, low, high)


def cispo(
    logp: torch.Tensor, base: torch.Tensor, adv: torch.Tensor, keep: torch.Tensor, low: float, high: float
) -> Surrogate:
    ratio = torch.exp(logp - base).detach()  # [B, T]
    weight = ratio.clamp(1 - low, 1 + high)
    return Surrogate(-weight * adv * logp, ratio < 1 - low, ratio > 1 + high)


POLICY_LOSSES: dict[str, PolicyLossFn] = {"ppo_clip": ppo_clip, "gspo": gspo, "cispo": cispo}
