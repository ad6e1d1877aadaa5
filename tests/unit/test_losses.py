"""The GRPO loss menu against values derived by hand (in the comments): aggregations, policy losses,
clip-higher, off-policy corrections, KL estimators, and the refusals of settings that do not agree."""

import math

import pytest
import torch

from single_controller.algorithm.losses import grpo_loss, loss_normalizer, loss_problems
from single_controller.types import LossConfig

L = math.log
# Two rows, two positions; row 1's second position is padding holding junk that must not leak.
MASK = torch.tensor([[True, True], [True, False]])
ADV = torch.tensor([1.0, -2.0])
# The ratio against the generation logprobs, no correction: the form the first tests compute by hand.
TO_GEN = LossConfig(is_correction="none", ratio_to_gen=True)


def T64(values):
    return torch.tensor(values, dtype=torch.float64)


def _logp(values):
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def _grad_is(logp, want):
    assert torch.allclose(logp.grad, T64(want), atol=1e-12), logp.grad


def _cfg(**kw):
    return LossConfig(**{**TO_GEN.__dict__, **kw})


def test_ppo_against_generation_logprobs_token_mean():
    # ratio = pi / pi_gen, clip 0.2.
    # (0,0): r = .5/.4 = 1.25, A = 1  -> min(1.25, 1.2) = 1.2 (clipped above) -> -1.2, d/dlogp = 0
    # (0,1): r = 1,             A = 1  -> -1,                          d/dlogp = -r*A = -1
    # (1,0): r = .4/.2 = 2,     A = -2 -> min(-4, -2.4) = -4 -> +4,    d/dlogp = -r*A = 4
    # token sum = -1.2 - 1 + 4 = 1.8 over 3 tokens, 2 sequences; 1 token clipped (above).
    logp = _logp([[L(0.5), L(0.2)], [L(0.4), 50.0]])
    gen = T64([[L(0.4), L(0.2)], [L(0.2), -50.0]])
    cfg = _cfg(agg="token_mean")
    out = grpo_loss(logp, gen, ADV, MASK, cfg)
    assert out.loss_sum.item() == pytest.approx(1.8, rel=1e-12)
    assert (out.num_tokens, out.num_sequences) == (3, 2)
    assert loss_normalizer(cfg, 3, 2) == 3
    stats = out.token_stats
    assert (stats["clipped"], stats["clipped_high"], stats["clipped_low"]) == (1, 1, 0)
    out.loss_sum.backward()
    _grad_is(logp, [[0.0, -1.0], [4.0, 0.0]])


@pytest.mark.parametrize(
    "agg, loss_sum, grad, normalizer",
    [
        # each row's mean: row 0 = (-1.2 - 1) / 2 = -1.1, row 1 = 4 / 1 = 4 -> 2.9; N = 2 sequences
        ("seq_mean_token_mean", 2.9, [[0.0, -0.5], [4.0, 0.0]], 2),
        # each row's sum: -2.2 + 4 = 1.8; N = 2 sequences
        ("seq_mean_token_sum", 1.8, [[0.0, -1.0], [4.0, 0.0]], 2),
        # Dr. GRPO: the sum, N = 2 sequences x 4 tokens (a constant, not the rows' lengths)
        ("seq_mean_token_sum_norm", 1.8, [[0.0, -1.0], [4.0, 0.0]], 8),
    ],
)
def test_aggregations(agg, loss_sum, grad, normalizer):
    logp = _logp([[L(0.5), L(0.2)], [L(0.4), 0.0]])
    gen = T64([[L(0.4), L(0.2)], [L(0.2), 0.0]])
    cfg = _cfg(agg=agg, norm_tokens=4 if agg == "seq_mean_token_sum_norm" else 0)
    out = grpo_loss(logp, gen, ADV, MASK, cfg)
    assert out.loss_sum.item() == pytest.approx(loss_sum, rel=1e-12)
    assert loss_normalizer(cfg, out.num_tokens, out.num_sequences) == normalizer
    out.loss_sum.backward()
    _grad_is(logp, grad)


def test_clip_higher_bounds_each_side_separately():
    # Range [1 - 0.1, 1 + 0.3] = [0.9, 1.3]. Row 0 (A = 1): r = 1.25 -> -1.25 (inside; symmetric 0.2 would clip
    # it), d = -1.25; r = 1.4 -> clipped above to 1.3 -> -1.3, d = 0. Row 1 (A = -1): r = 0.85 -> min(-0.85, -0.9)
    # = -0.9 (clipped below) -> +0.9, d = 0; r = 1.1 -> +1.1, d = -r*A = 1.1. Sum -1.25 - 1.3 + 0.9 + 1.1 = -0.55.
    gen = T64([[L(0.4), L(0.25)], [L(0.4), L(0.5)]])
    logp = _logp([[L(0.5), L(0.35)], [L(0.34), L(0.55)]])
    out = grpo_loss(logp, gen, T64([1.0, -1.0]), torch.ones(2, 2, dtype=torch.bool), _cfg(clip_low=0.1, clip_high=0.3))
    assert out.loss_sum.item() == pytest.approx(-0.55, rel=1e-12)
    assert (out.token_stats["clipped_low"], out.token_stats["clipped_high"]) == (1, 1)
    out.loss_sum.backward()
    _grad_is(logp, [[-1.25, 0.0], [0.0, 1.1]])


def test_gspo_clips_the_sequence_ratio():
    # Row 0 (A = 1): log r = (log 1.2, log 0.9) -> s = exp(mean) = sqrt(1.08) = 1.0392305, inside [0.8, 1.2]:
    # each token -s; the row's mean -s; d/dlogp_t = -s * (1/2) (the sequence ratio's gradient, split over tokens).
    # Row 1 (A = 1): log r = (log 1.5, log 1.5) -> s = 1.5, clipped to 1.2: -1.2 per token, zero gradient.
    s = math.sqrt(1.08)
    gen = T64([[L(0.5), L(0.5)], [L(0.2), L(0.2)]])
    logp = _logp([[L(0.6), L(0.45)], [L(0.3), L(0.3)]])
    out = grpo_loss(
        logp,
        gen,
        T64([1.0, 1.0]),
        torch.ones(2, 2, dtype=torch.bool),
        _cfg(policy_loss="gspo", agg="seq_mean_token_mean"),
    )
    assert out.loss_sum.item() == pytest.approx(-s - 1.2, rel=1e-12)
    assert (out.token_stats["clipped_high"], out.token_stats["clipped_low"]) == (2, 0)
    out.loss_sum.backward()
    _grad_is(logp, [[-s / 2, -s / 2], [0.0, 0.0]])


def test_cispo_weights_the_logprob_by_the_clipped_ratio():
    # Row 0 (A = 1): r = .5/.4 = 1.25 -> w = 1.2 (clipped above); r = .1/.2 = .5 -> w = .8 (clipped below).
    # l = -w A log pi: -1.2 log .5 - .8 log .1; d/dlogp = -w A = (-1.2, -.8).
    # Row 1 (A = -2): r = .4/.2 = 2 -> w = 1.2 (clipped above): l = 2.4 log .4; d/dlogp = 2.4.
    logp = _logp([[L(0.5), L(0.1)], [L(0.4), 3.0]])
    gen = T64([[L(0.4), L(0.2)], [L(0.2), 3.0]])
    out = grpo_loss(logp, gen, ADV, MASK, _cfg(policy_loss="cispo"))
    want = -1.2 * L(0.5) - 0.8 * L(0.1) + 2.4 * L(0.4)
    assert out.loss_sum.item() == pytest.approx(want, rel=1e-12)
    assert (out.token_stats["clipped_high"], out.token_stats["clipped_low"]) == (2, 1)
    out.loss_sum.backward()
    _grad_is(logp, [[-1.2, -0.8], [2.4, 0.0]])


# Corrections: old = logp (detached, one update per step), so the ratio is 1 in value and each token's loss
# is -w A with gradient -w A. rho = pi_old / pi_gen: row 0 (A = 1) (1.25, 3.0), row 1 (A = -2) (0.4, padding).
RHO_LOGP = [[L(0.5), L(0.6)], [L(0.2), 9.0]]
RHO_GEN = [[L(0.4), L(0.2)], [L(0.5), -9.0]]


@pytest.mark.parametrize(
    "correction, low, high, loss_sum, grad, counts, extra",
    [
        # w = 1: -1 - 1 + 2 = 0
        ("none", 0.0, 2.0, 0.0, [[-1, -1], [2, 0]], (3, 2), {"is_weight": 3.0}),
        # w = min(rho, 2) = (1.25, 2, 0.4): -1.25 - 2 + 0.8 = -2.45; one token truncated
        ("token_truncate", 0.0, 2.0, -2.45, [[-1.25, -2], [0.8, 0]], (3, 2), {"is_truncated": 1, "is_weight": 3.65}),
        # keep rho in [0.5, 2]: only (0,0), w = 1.25: -1.25; two tokens dropped, row 1 gone
        ("token_mask", 0.5, 2.0, -1.25, [[-1.25, 0], [0, 0]], (1, 1), {"is_masked": 2, "is_weight": 1.25}),
        # rho_seq: row 0 1.25 * 3 = 3.75 -> 2 on both tokens; row 1 0.4: -2 - 2 + 0.8 = -3.2; 2 tokens truncated
        ("sequence_truncate", 0.0, 2.0, -3.2, [[-2, -2], [0.8, 0]], (3, 2), {"is_truncated": 2}),
        # keep rho_seq in [0.5, 4]: row 0 (3.75) kept, w = 3.75 per token: -7.5; row 1 (0.4) dropped
        ("sequence_mask", 0.5, 4.0, -7.5, [[-3.75, -3.75], [0, 0]], (2, 1), {"is_masked": 1}),
    ],
)
def test_off_policy_corrections(correction, low, high, loss_sum, grad, counts, extra):
    logp = _logp(RHO_LOGP)
    cfg = LossConfig(is_correction=correction, is_low=low, is_high=high)
    out = grpo_loss(logp, T64(RHO_GEN), ADV, MASK, cfg)
    assert out.loss_sum.item() == pytest.approx(loss_sum, rel=1e-12, abs=1e-12)
    assert (out.num_tokens, out.num_sequences) == counts
    for key, value in extra.items():
        assert out.token_stats[key] == pytest.approx(value, rel=1e-12), key
    sequence_level = correction.startswith("sequence")
    assert out.maxes["is_ratio_max"] == pytest.approx(3.75 if sequence_level else 3.0, rel=1e-12)
    out.loss_sum.backward()
    _grad_is(logp, grad)


def test_old_logprobs_make_the_clip_bind_in_decoupled_mode():
    # old given: ratio = pi / pi_old. pi .5, old .4 -> r 1.25 clipped to 1.2, w = min(old/gen, 2) = .4/.4 = 1
    # -> -1.2 with zero gradient. Single token (mask), A = 1.
    logp = _logp([[L(0.5)]])
    out = grpo_loss(
        logp, T64([[L(0.4)]]), T64([1.0]), torch.tensor([[True]]), LossConfig(), old_logprobs=T64([[L(0.4)]])
    )
    assert out.loss_sum.item() == pytest.approx(-1.2, rel=1e-12)
    out.loss_sum.backward()
    assert logp.grad.item() == 0.0


@pytest.mark.parametrize(
    "estimator, value, grad",
    [
        # delta = log pi_ref - log pi = (log 2, log 0.5) on the two tokens; A = 0: the KL term alone.
        ("k1", 0.0, [1.0, 1.0]),  # -delta: -log 2 + log 2 = 0; d/dlogp = 1
        ("k2", L(2) ** 2, [-L(2), L(2)]),  # delta^2 / 2 summed: (log 2)^2; d/dlogp = -delta
        ("k3", 0.5, [-1.0, 0.5]),  # (2 - log 2 - 1) + (.5 + log 2 - 1) = 0.5; d/dlogp = 1 - e^delta
    ],
)
def test_kl_estimators(estimator, value, grad):
    logp = _logp([[L(0.25), L(0.5)]])
    ref = T64([[L(0.5), L(0.25)]])
    cfg = LossConfig(kl_coef=1.0, kl_estimator=estimator)
    out = grpo_loss(logp, logp.detach(), T64([0.0]), torch.ones(1, 2, dtype=torch.bool), cfg, ref_logprobs=ref)
    assert out.loss_sum.item() == pytest.approx(value, rel=1e-12, abs=1e-12)
    assert out.token_stats["kl"] == pytest.approx(value, rel=1e-12, abs=1e-12)
    # every estimator is reported, whichever the penalty uses
    assert out.token_stats["kl_k3"] == pytest.approx(0.5, rel=1e-12)
    assert out.token_stats["kl_k2"] == pytest.approx(L(2) ** 2, rel=1e-12)
    out.loss_sum.backward()
    _grad_is(logp, [grad])


def test_entropy_is_summed_over_kept_tokens_only():
    entropy = T64([[1.0, 2.0], [4.0, 100.0]])  # (1,1) is padding
    out = grpo_loss(_logp(RHO_LOGP), T64(RHO_GEN), ADV, MASK, LossConfig(), entropy=entropy)
    assert out.token_stats["entropy"] == 7.0
    masked = LossConfig(is_correction="token_mask", is_low=0.5, is_high=2.0)  # keeps (0,0) alone
    assert grpo_loss(_logp(RHO_LOGP), T64(RHO_GEN), ADV, MASK, masked, entropy=entropy).token_stats["entropy"] == 1.0


@pytest.mark.parametrize(
    "cfg, says",
    [
        (LossConfig(agg="batch"), "train.loss_agg must be one of"),
        (LossConfig(policy_loss="grpo"), "train.policy_loss must be one of"),
        (LossConfig(ratio_to_gen=True), "needs train.recompute_old_logprobs=true"),
        (LossConfig(is_correction="token_mask", is_low=1.0), "which must hold 1"),
        (LossConfig(is_correction="token_truncate", is_low=0.5), "bounds only the mask corrections"),
        (LossConfig(agg="seq_mean_token_sum_norm"), "needs a constant token count"),
        (LossConfig(kl_estimator="k4"), "train.kl_estimator must be one of"),
    ],
)
def test_settings_that_do_not_agree_are_named(cfg, says):
    assert any(says in message for _, message in loss_problems(cfg))
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match=says.replace(".", r"\.")):
        grpo_loss(x, x, torch.zeros(1), torch.ones(1, 1, dtype=torch.bool), cfg)


def test_kl_needs_reference_logprobs():
    x = torch.zeros(1, 1)
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


@pytest.mark.parametrize(
    "length, want",
    [
        (10, 0.0),  # well inside the budget
        (12, 0.0),  # the buffer's start: max_new_tokens 16 - buffer 4
        (13, -0.5 * 1 / 4),  # penalty 0.5 x (12 - 13) / 4
        (15, -0.5 * 3 / 4),
        (16, -0.5),  # the budget itself: the whole penalty
        (17, -0.5),  # past it (an episode's context): no more than the whole penalty
    ],
)
def test_overlong_penalty_ramps_over_the_buffer(length, want):
    from single_controller.algorithm.advantages import overlong_penalty

    assert overlong_penalty(length, 16, 4, 0.5) == pytest.approx(want, abs=1e-15)
    assert overlong_penalty(length, 16, 0, 0.5) == 0.0  # buffer 0: off


def test_row_kl_sums_by_hand():
    """reward.kl_coef's per-row KL: sum over the row's policy tokens of the estimator, with
    d = log pi_ref - log pi_gen; masked tokens and padding count nothing."""
    from single_controller.algorithm.losses import row_kl_sums

    ref = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    gen = torch.tensor([[-1.5, -1.0, -9.0], [-0.5, -1.5, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    # d: row 0: 0.5, -1.0; row 1: 0.0, 1.0
    assert row_kl_sums(ref, gen, mask, "k1").tolist() == pytest.approx([-0.5 + 1.0, 0.0 - 1.0])
    assert row_kl_sums(ref, gen, mask, "k2").tolist() == pytest.approx([0.125 + 0.5, 0.0 + 0.5])
    k3 = [math.exp(0.5) - 0.5 - 1 + math.exp(-1.0) + 1.0 - 1, 0.0 + math.exp(1.0) - 1.0 - 1]
    assert row_kl_sums(ref, gen, mask, "k3").tolist() == pytest.approx(k3)
