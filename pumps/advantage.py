"""Advantage pump: committed groups -> (optional logprob passes) -> GRPO advantages -> ready.

Group-normalized advantages are computed from the rewards the controller already holds and stay on
the group records: they reach the trainer inside its train chunks (one float per row), never through
storage. Zero-variance groups are counted and, with `advantage.drop_zero_variance`, dropped and
refilled for their step (at most `advantage.max_zero_variance_drops_per_step` per step). A group
with non-finite rewards is dropped alone with reason `reward_failed`; the run goes on. With
`reward.overlong_buffer`, DAPO's overlong punishment of each row's length is added to its reward
first (`shaped_rewards`; the group record keeps the rewards as scored). Optional
`LogprobPass` objects (e.g. reference logprobs for a KL term) write their columns before `ready`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from replay.ledger import GroupRecord, GroupState
from single_controller.algorithm.advantages import grpo_advantages, is_zero_variance, overlong_penalty
from single_controller.config.schema import Config, rollout_max_new_tokens
from single_controller.deadlines import DeadlineExceeded, within
from single_controller.protocols import RewardKl, TrainerFailed
from single_controller.state import RunState

PUMP = "advantage"


class LogprobPass(Protocol):
    """Computes and stores extra per-token columns (e.g. reference logprobs) for these groups."""

    name: str

    async def run(self, groups: Sequence[GroupRecord]) -> None: ...


async def advantage_pump(state: RunState, logprob_passes: Sequence[LogprobPass] = ()) -> None:
    cfg = state.cfg.advantage
    clk = state.pumps[PUMP]
    try:
        while True:
            # Exits: the rollout pump is done and no committed group remains.
            await state.wait_until(
                lambda: state.ledger.count(GroupState.COMMITTED) > 0 or state.stop.rollout_done,
                PUMP,
                "committed groups",
            )
            batch = state.ledger.in_state(GroupState.COMMITTED)
            if not batch:
                break
            await _step(state, batch, logprob_passes, cfg)
            clk.iterations += 1
    finally:
        clk.finished = True
        state.notify()


async def _step(state: RunState, batch: list[GroupRecord], logprob_passes, cfg) -> None:
    clk = state.pumps[PUMP]
    t0 = state.clock()
    scored: list[GroupRecord] = []
    for rec in batch:
        if _advantages(rec.rewards, cfg) is None:
            await _drop_reward_failed(state, rec)
        else:
            scored.append(rec)
    if scored:
        for lp in logprob_passes:  # before the advantages: a pass may shape the rewards (reward.kl_coef)
            await lp.run(scored)
    keep: list[tuple[GroupRecord, tuple[float, ...]]] = []
    for rec in scored:
        if rec.state is not GroupState.COMMITTED:
            continue  # settled meanwhile (the run ended while a pass ran)
        rewards = shaped_rewards(rec, state.cfg)
        advs = _advantages(rewards, cfg)
        if advs is None:
            await _drop_reward_failed(state, rec)
            continue
        state.counters.reward_failed_in_a_row = 0  # a group scored
        state.counters.env_failed_in_a_row = 0
        state.counters.context_full_in_a_row = 0
        if is_zero_variance(rewards) and await _dropped_zero_variance(state, rec, cfg):
            continue
        keep.append((rec, advs))
    now = state.clock()
    for rec, advs in keep:
        state.ledger.mark_ready(rec.group_id, advs, now)
    clk.busy_s += state.clock() - t0
    state.notify()


async def _dropped_zero_variance(state: RunState, rec: GroupRecord, cfg) -> bool:
    """Count a zero-variance group; drop it (True) while `advantage.drop_zero_variance` allows."""
    state.counters.zero_variance_groups += 1
    if not cfg.drop_zero_variance or state.stop.requested:
        return False
    dropped = state.counters.zero_variance_drops[rec.target_step]
    if dropped >= cfg.max_zero_variance_drops_per_step:
        state.counters.zero_variance_kept += 1
        return False
    state.counters.zero_variance_drops[rec.target_step] = dropped + 1
    state.ledger.drop(rec.group_id, "zero_variance")
    state.prompts.settle(rec.prompt.prompt_id, "dropped", reason="zero_variance")
    await state.clear_groups([rec], f"storage clear of zero-variance group {rec.group_id}")
    return True


def shaped_rewards(rec: GroupRecord, cfg: Config) -> tuple[float, ...]:
    """The rewards a group's advantages are taken from: as scored, plus the overlong punishment of
    each row's length (`reward.overlong_buffer`), minus `reward.kl_coef` x each row's KL to the
    reference (`RewardKlPass`); the scored rewards when neither is on."""
    r = cfg.reward
    rewards = rec.rewards
    if r.overlong_buffer:
        budget = rollout_max_new_tokens(cfg)
        rewards = tuple(
            x + overlong_penalty(n, budget, r.overlong_buffer, r.overlong_penalty)
            for x, n in zip(rewards, rec.response_lengths, strict=True)
        )
    if r.kl_coef:
        rewards = tuple(x - r.kl_coef * kl for x, kl in zip(rewards, rec.reward_kl, strict=True))
    return rewards


class RewardKlFailed(RuntimeError):
    """The trainer could not measure committed groups' KL to the reference after every retry."""


class RewardKlPass:
    """`reward.kl_coef`: each committed group's rows' KL to the reference policy, measured by the
    trainer (`protocols.RewardKl`: a no-grad forward of its reference, beside training) and kept on
    the group record, where `shaped_rewards` takes it. A trainer error or a missed deadline is
    retried `train.max_step_retries` times before the run fails (`RewardKlFailed`)."""

    name = "reward_kl"

    def __init__(self, state: RunState):
        self.state = state

    async def run(self, groups: Sequence[GroupRecord]) -> None:
        state = self.state
        trainer = state.workers.trainer
        if not isinstance(trainer, RewardKl):
            raise RewardKlFailed(
                f"reward.kl_coef needs a trainer that measures KL to its reference; {trainer!r} cannot"
            )
        keys = [k for g in groups for k in g.keys]
        lengths = [n for g in groups for n in g.seq_lengths]
        what = f"trainer.reward_kl({len(groups)} groups, {groups[0].group_id}...)"
        tries = state.cfg.train.max_step_retries + 1
        for attempt in range(1, tries + 1):
            try:
                call = trainer.reward_kl(keys, lengths, state.cfg.reward.kl_estimator)
                kl = await state.waiting(within(call, state.cfg.timeouts.train_call_s, what), PUMP, "reward KL")
                break
            except (TrainerFailed, DeadlineExceeded) as e:
                if attempt == tries:
                    raise RewardKlFailed(f"{what} failed {tries} times; last error: {e}") from e
        at = 0
        for g in groups:
            g.reward_kl = tuple(kl[at : at + len(g.keys)])
            at += len(g.keys)


def _advantages(rewards: tuple[float, ...], cfg) -> tuple[float, ...] | None:
    """The group's advantages, or None if its rewards give no finite ones."""
    if not all(math.isfinite(r) for r in rewards):
        return None
    try:
        advs = grpo_advantages(rewards, normalize_std=cfg.normalize_std, eps=cfg.eps)
    except OverflowError:  # math.fsum of rewards near the float range
        return None
    return advs if all(math.isfinite(a) for a in advs) else None


async def _drop_reward_failed(state: RunState, rec: GroupRecord) -> None:
    """Drop a committed group whose rewards give no finite advantages, alone."""
    state.ledger.drop(rec.group_id, "reward_failed")
    state.prompts.settle(rec.prompt.prompt_id, "dropped", reason="reward_failed")
    await state.clear_groups([rec], f"storage clear of {rec.group_id} (its rewards are not finite)")
    state.reward_failed(rec.group_id, f"rewards {list(rec.rewards)} give no finite advantages")
