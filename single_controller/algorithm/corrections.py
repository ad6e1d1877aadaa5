"""Off-policy corrections: how far the tokens' sampler (the generation engine, at the policy version
that produced them) may be from the policy the ratio is taken against, and what to do about it.

With log rho = log pi_old - log pi_gen per token (pi_old: the step-start policy; pi_gen: what the
engine reported when it sampled), each correction gives a detached weight `w` [B, T] and the tokens
that keep a loss, `keep` [B, T] (a subset of the valid tokens):

  none               w = 1
  token_truncate     w = min(rho, high)                             TIS (Yao et al. 2025)
  token_mask         w = rho, tokens with rho outside [low, high] dropped   MIS / IcePop
  sequence_truncate  w = min(rho_seq, high) on every token of the row,  rho_seq = prod_t rho_t
  sequence_mask      w = rho_seq, rows with rho_seq outside [low, high] dropped

A dropped token carries no loss and is not counted (the normalizer, `loss_agg`, excludes it).
Pure torch, no side effects; `w` and the statistics never carry gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Correction:
    weight: torch.Tensor  # [B, T] detached; 0 where not kept
    keep: torch.Tensor  # [B, T] bool: valid tokens that keep a loss
    capped: torch.Tensor  # [B, T] bool: kept tokens whose weight was truncated
    ratio_max: torch.Tensor  # 0-d: the largest raw importance ratio (token or sequence level) among valid tokens


CorrectionFn = Callable[[torch.Tensor, torch.Tensor, float, float], Correction]


def _none(log_rho: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> Correction:
    rho = _raw(log_rho, mask)
    return Correction(mask.to(log_rho.dtype), mask, torch.zeros_like(mask), _max(rho, mask))


def _token_truncate(log_rho: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> Correction:
    rho = _raw(log_rho, mask)  # [B, T]
    return Correction(torch.where(mask, rho.clamp(max=high), 0.0), mask, mask & (rho > high), _max(rho, mask))


def _token_mask(log_rho: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> Correction:
    rho = _raw(log_rho, mask)  # [B, T]
    keep = mask & (rho >= low) & (rho <= high)
    return Correction(torch.where(keep, rho, 0.0), keep, torch.zeros_like(mask), _max(rho, mask))


def _sequence_truncate(log_rho: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> Correction:
    rho = _sequence_rho(log_rho, mask)  # [B, 1]
    weight = torch.where(mask, rho.clamp(max=high), 0.0)  # [B, T]
    return Correction(weight, mask, mask & (rho > high), _max(rho.expand_as(mask), mask))


def _sequence_mask(log_rho: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> Correction:
    rho = _sequence_rho(log_rho, mask)  # [B, 1]
    keep = mask & (rho >= low) & (rho <= high)
    return Correction(torch.where(keep, rho, 0.0), keep, torch.zeros_like(mask), _max(rho.expand_as(mask), mask))


def _raw(log_rho: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """rho [B, T], 1 on padding (whatever it holds)."""
    return torch.exp(torch.where(mask, log_rho.detach(), 0.0))


def _sequence_rho(log_rho: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The product of a row's valid token ratios [B, 1] (inf past the float range: truncated or masked)."""
    return torch.exp(torch.where(mask, log_rho.detach(), 0.0).sum(1, keepdim=True))


def _max(rho: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """0-d, 0 without a valid token; stays on the device (read with the loss's other statistics)."""
    return torch.cat([torch.where(mask, rho, 0.0).reshape(-1), rho.new_zeros(1)]).max()


CORRECTIONS: dict[str, CorrectionFn] = {
    "none": _none,
    "token_truncate": _token_truncate,
    "token_mask": _token_mask,
    "sequence_truncate": _sequence_truncate,
    "sequence_mask": _sequence_mask,
}
# The corrections that drop tokens (they use the lower bound too).
MASKING = ("token_mask", "sequence_mask")


def correct(name: str, log_rho: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> Correction:
    """`log_rho` [B, T] (log pi_old - log pi_gen), `mask` [B, T] bool -> the correction `name`."""
    return CORRECTIONS[name](log_rho, mask, low, high)
