"""The GRPO loss against values derived by hand (in the comments)."""

import math

import pytest
import torch

from single_controller.algorithm.losses import grpo_loss
from single_controller.types import LossConfig

L = math.log
# Two rows, two positions; row 1's second position is padding holding junk that must not leak.
MASK = torch.tensor([[True, True], [True, False]])
ADV = torch.tensor([1.0, -2.0])


def T64(values):
    return torch.tensor(values, dtype=torch.float64)


def _logp(values):
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def test_ppo_against_generation_logprobs_token_level():
    # is_truncation = 0: ratio = pi / pi_gen, clip 0.2.
    # (0,0): r = .5/.4 = 1.25, A = 1  -> min(1.25, 1.2) = 1.2 (clipped) -> -1.2, d/dlogp = 0
    # (0,1): r = 1,             A = 1  -> -1,                          d/dlogp = -r*A = -1
    # (1,0): r = .4/.2 = 2,     A = -2 -> min(-4, -2.4) = -4 -> +4,    d/dlogp = -r*A = 4
    # token sum = -1.2 - 1 + 4 = 1.8 over 3 tokens, 2 sequences; 1 token clipped.
    logp = _logp([[L(0.5), L(0.2)], [L(0.4), 50.0]])
    gen = T64([[L(0.4), L(0.2)], [L(0.2), -50.0]])
    out = grpo_loss(logp, gen, ADV, MASK, LossConfig(level="token", clip_eps=0.2, is_truncation=0.0))
    assert out.loss_sum.item() == pytest.approx(1.8, rel=1e-12)
    assert (out.num_tokens, out.num_sequences) == (3, 2)
    assert out.token_stats["clipped"] == 1
    out.loss_sum.backward()
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -1.0], [4.0, 0.0]], dtype=torch.float64), atol=1e-12)


def test_sequence_level_divides_each_row_by_its_tokens():
    # Same per-token losses: row 0 = (-1.2 - 1) / 2 = -1.1, row 1 = 4 / 1 = 4 -> 2.9.
    logp = _logp([[L(0.5), L(0.2)], [L(0.4), 0.0]])
    gen = T64([[L(0.4), L(0.2)], [L(0.2), 0.0]])
    out = grpo_loss(logp, gen, ADV, MASK, LossConfig(level="sequence", clip_eps=0.2, is_truncation=0.0))
    assert out.loss_sum.item() == pytest.approx(2.9, rel=1e-12)
    out.loss_sum.backward()
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -0.5], [4.0, 0.0]], dtype=torch.float64), atol=1e-12)


def test_truncated_importance_weights_and_kl():
    # is_truncation = 2: old = logp (detached), ratio = 1, w = min(pi_old / pi_gen, 2):
    # (0,0): w = .5/.4 = 1.25 -> -1.25 ; (0,1): w = 1 -> -1 ; (1,0): w = min(.6/.2 = 3, 2) = 2, A = -2 -> +4
    # pg sum = 1.75; d/dlogp = -w*A = [-1.25, -1, 4]; is_weight sum 4.25; 1 truncated token.
    # KL (k3) to ref, delta = ref - logp: (0,0) 0 -> 0; (0,1) log 2 -> 2 - log 2 - 1 = 0.306853;
    # (1,0) log .5 -> .5 + log 2 - 1 = 0.193147; sum 0.5; loss += 0.1 * 0.5 = 1.8.
    # d kl/dlogp = 1 - e^delta: [0, -1, 0.5] * 0.1.
    logp = _logp([[L(0.5), L(0.2)], [L(0.6), 7.0]])
    gen = T64([[L(0.4), L(0.2)], [L(0.2), -9.0]])
    ref = T64([[L(0.5), L(0.4)], [L(0.3), 3.0]])
    out = grpo_loss(logp, gen, ADV, MASK, LossConfig(is_truncation=2.0, kl_coef=0.1), ref_logprobs=ref)
    assert out.loss_sum.item() == pytest.approx(1.8, rel=1e-12)
    assert out.token_stats["is_weight"] == pytest.approx(4.25, rel=1e-12)
    assert out.token_stats["is_truncated"] == 1
    assert out.token_stats["kl"] == pytest.approx(0.5, rel=1e-12)
    assert out.token_stats["clipped"] == 0  # ratio == 1 inside one step
    out.loss_sum.backward()
    want = torch.tensor([[-1.25, -1.0 - 0.1], [4.0 + 0.05, 0.0]], dtype=torch.float64)
    assert torch.allclose(logp.grad, want, atol=1e-12)


def test_old_logprobs_make_the_clip_bind_in_decoupled_mode():
    # old given: ratio = pi / pi_old. (0,0): pi .5, old .4 -> r 1.25 clipped to 1.2, w = old/gen = .4/.4 = 1
    # -> -1.2 with zero gradient. Single token (mask), A = 1.
    logp = _logp([[L(0.5)]])
    out = grpo_loss(
        logp,
        T64([[L(0.4)]]),
        torch.tensor([1.0]),
        torch.tensor([[True]]),
        LossConfig(is_truncation=2.0, clip_eps=0.2),
        old_logprobs=T64([[L(0.4)]]),
    )
    assert out.loss_sum.item() == pytest.approx(-1.2, rel=1e-12)
    out.loss_sum.backward()
    assert logp.grad.item() == 0.0


def test_errors():
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="loss level"):
        grpo_loss(x, x, torch.zeros(1), torch.ones(1, 1, dtype=torch.bool), LossConfig(level="batch"))
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(x, x, torch.zeros(1), torch.ones(1, 1, dtype=torch.bool), LossConfig(kl_coef=0.1))


def test_mismatch_stats_by_hand():
    from single_controller.algorithm.losses import mismatch_stats

    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, 0.0]])
    gen = torch.tensor([[-1.5, -2.0, -1.0], [-0.25, -9.0, 0.0]])
    same = torch.tensor([[True, True, False], [True, False, False]])  # token (0,2) and (1,1): other weights
    # d = logp - gen on the counted tokens: 0.5, 0.0, -0.25
    got = mismatch_stats(logp, gen, same)
    assert got["mm_tokens"] == 3
    assert got["mm_abs"] == pytest.approx(0.75)
    # k3 = e^d - 1 - d: (e^0.5 - 1.5) + 0 + (e^-0.25 - 0.75) = 0.148721 + 0.028801
    assert got["mm_kl"] == pytest.approx(math.exp(0.5) - 1.5 + math.exp(-0.25) - 0.75, rel=1e-12)
