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
    keep: list[tuple[GroupRecord, tuple[float, ...]]] = []
    for rec in batch:
        rewards = shaped_rewards(rec, state.cfg)
        advs = _advantages(rewards, cfg)
        if advs is None:
            await _drop_reward_failed(state, rec)
            continue
        state.counters.reward_failed_in_a_row = 0  # a group scored
        state.counters.env_failed_in_a_row = 0
        state.counters.context_full_in_a_row = 0
        if is_zero_variance(rewards):
            state.counters.zero_variance_groups += 1
            if cfg.drop_zero_variance and not state.stop.requested:
                dropped = state.counters.zero_variance_drops[rec.target_step]
                if dropped < cfg.max_zero_variance_drops_per_step:
                    state.counters.zero_variance_drops[rec.target_step] = dropped + 1
                    state.ledger.drop(rec.group_id, "zero_variance")
                    state.prompts.settle(rec.prompt.prompt_id, "dropped", reason="zero_variance")
                    await state.clear_groups([rec], f"storage clear of zero-variance group {rec.group_id}")
                    continue
                state.counters.zero_variance_kept += 1
        keep.append((rec, advs))
    if keep:
        for lp in logprob_passes:
            await lp.run([rec for rec, _ in keep])
        now = state.clock()
        for rec, advs in keep:
            state.ledger.mark_ready(rec.group_id, advs, now)
    clk.busy_s += state.clock() - t0
    state.notify()


def shaped_rewards(rec: GroupRecord, cfg: Config) -> tuple[float, ...]:
    """The rewards a group's advantages are taken from: as scored, plus the overlong punishment of
    each row's length (`reward.overlong_buffer`; none when it is 0)."""
    r = cfg.reward
    if r.overlong_buffer == 0:
        return rec.rewards
    budget = rollout_max_new_tokens(cfg)
    return tuple(
        x + overlong_penalty(n, budget, r.overlong_buffer, r.overlong_penalty)
        for x, n in zip(rec.rewards, rec.response_lengths, strict=True)
    )


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
