"""The staleness rules of asynchronous GRPO, on version stamps only (pure).

A group is stamped with the policy version that started it (`version`) and the step it was
dispatched for (`target_step`). With lookahead L and staleness bound S:

    admit     a rollout for step s may start         iff  s <= policy_version + L
    staleness of a group trained at step t            =   t - version
    eligible  at step t                               iff  staleness <= S  and (in order: target_step == t)
    evictable at step t                               iff  staleness >  S  or  (in order: target_step < t)
    abort in flight at a sync before step t           iff  earliest - version_reserved > S,
              earliest = max(t, target_step) in order, else t

`samplers.staleness.StalenessSampler` applies them to the ledger.
"""

from __future__ import annotations


def may_admit(target_step: int, policy_version: int, lookahead: int) -> bool:
    return target_step <= policy_version + lookahead


def eligible(target_step: int, version: int, train_step: int, *, max_staleness: int, in_order: bool) -> bool:
    if train_step - version > max_staleness:
        return False
    return target_step == train_step if in_order else True


def evictable(target_step: int, version: int, train_step: int, *, max_staleness: int, in_order: bool) -> bool:
    return train_step - version > max_staleness or (in_order and target_step < train_step)


def must_abort_in_flight(
    target_step: int, version_reserved: int, train_step: int, *, max_staleness: int, in_order: bool
) -> bool:
    earliest = max(train_step, target_step) if in_order else train_step
    return earliest - version_reserved > max_staleness
