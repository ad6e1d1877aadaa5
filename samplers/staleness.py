"""The staleness sampler: one policy with orthogonal knobs, deciding from version stamps only.

Knobs (`SamplerConfig`; the rules are pure functions in `single_controller.algorithm.version_rules`):
admission `max_lookahead_versions` L (a rollout for step s starts only while s <= policy_version + L;
L = 0 is synchronous), selection `order` (`in_order`, `fifo`, `freshest`), eviction
`max_staleness_versions` S (`select` never returns a group above S, so select and evict never claim
the same group) and `abort_stale_in_flight`. `select` never waits, and its checks cost O(keys) of the
ledger's READY index (target step, version), never O(groups).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from replay.ledger import GroupRecord, ReadyKey
from single_controller.algorithm import version_rules as rules
from single_controller.config.schema import SamplerConfig

ORDERS = ("in_order", "fifo", "freshest")


@dataclass(frozen=True)
class SamplerStatistics:
    max_lookahead_versions: int
    max_staleness_versions: int
    trained_staleness: dict[int, int]  # staleness (versions) -> trained groups
    selected_total: int
    evicted_total: int
    aborted_in_flight_total: int


class StalenessSampler:
    def __init__(self, cfg: SamplerConfig):
        if cfg.order not in ORDERS:
            raise ValueError(f"sampler.order must be one of {ORDERS}, got {cfg.order!r}")
        if cfg.max_lookahead_versions < 0 or cfg.max_staleness_versions < 0:
            raise ValueError("sampler lookahead and staleness bounds must be >= 0")
        self.cfg = cfg
        self.lookahead = cfg.max_lookahead_versions
        self.max_staleness = cfg.max_staleness_versions
        self._trained_staleness: Counter[int] = Counter()
        self._selected = self._evicted = self._aborted = 0

    @property
    def in_order(self) -> bool:
        return self.cfg.order == "in_order"

    def required_capacity(self, groups_per_step: int) -> int:
        return (self.lookahead + 1) * groups_per_step

    def may_admit(self, target_step: int, policy_version: int) -> bool:
        return rules.may_admit(target_step, policy_version, self.lookahead)

    @staticmethod
    def staleness(group: GroupRecord, train_step: int) -> int:
        return train_step - group.version

    # The two rules (`algorithm.version_rules`), on a group's (target step, version).
    def _eligible_key(self, target_step: int, version: int, train_step: int) -> bool:
        return rules.eligible(
            target_step, version, train_step, max_staleness=self.max_staleness, in_order=self.in_order
        )

    def _evictable_key(self, target_step: int, version: int, train_step: int) -> bool:
        return rules.evictable(
            target_step, version, train_step, max_staleness=self.max_staleness, in_order=self.in_order
        )

    def select(self, ready: Sequence[GroupRecord], train_step: int, max_groups: int) -> list[GroupRecord]:
        """Ready groups step `train_step` may train now, best first, at most `max_groups`."""
        chosen = [g for g in ready if self._eligible_key(g.target_step, g.version, train_step)]
        if self.cfg.order == "freshest":
            chosen.sort(key=lambda g: (-g.version, g.seq))
        else:
            chosen.sort(key=lambda g: g.seq)
        return chosen[: max(0, max_groups)]

    def evictable(self, ready: Sequence[GroupRecord], train_step: int) -> list[GroupRecord]:
        """Ready groups that can never be trained from `train_step` on."""
        return [g for g in ready if self._evictable_key(g.target_step, g.version, train_step)]

    # -- the same decisions over the ledger's READY index (`GroupLedger.ready_index()`) ---------
    def selectable(self, index: Mapping[ReadyKey, Mapping[str, GroupRecord]], train_step: int) -> int:
        """How many READY groups step `train_step` may train now (O(keys))."""
        return sum(len(b) for (t, v), b in index.items() if self._eligible_key(t, v, train_step))

    def any_evictable(self, index: Mapping[ReadyKey, Mapping[str, GroupRecord]], train_step: int) -> bool:
        return any(self._evictable_key(t, v, train_step) for t, v in index)

    def select_from(
        self, index: Mapping[ReadyKey, Mapping[str, GroupRecord]], train_step: int, max_groups: int
    ) -> list[GroupRecord]:
        """`select` over the eligible keys only."""
        eligible = [g for (t, v), b in index.items() if self._eligible_key(t, v, train_step) for g in b.values()]
        return self.select(eligible, train_step, max_groups)

    def evictable_from(self, index: Mapping[ReadyKey, Mapping[str, GroupRecord]], train_step: int) -> list[GroupRecord]:
        stale = [g for (t, v), b in index.items() if self._evictable_key(t, v, train_step) for g in b.values()]
        return sorted(stale, key=lambda g: g.seq)

    @property
    def aborts_in_flight(self) -> bool:
        """Whether a weight sync may abort in-flight rollouts (`abort_stale_in_flight`); when not,
        `should_abort_in_flight` is False for every group, and a sync need not ask it."""
        return self.cfg.abort_stale_in_flight

    def should_abort_in_flight(self, group: GroupRecord, train_step: int) -> bool:
        """True if an in-flight group could only be trained above the staleness bound."""
        if not self.aborts_in_flight:
            return False
        return rules.must_abort_in_flight(
            group.target_step,
            group.version_reserved,
            train_step,
            max_staleness=self.max_staleness,
            in_order=self.in_order,
        )

    # -- bookkeeping for statistics ------------------------------------------------------------
    def record_selected(self, groups: Sequence[GroupRecord], train_step: int) -> None:
        self._selected += len(groups)
        for g in groups:
            self._trained_staleness[self.staleness(g, train_step)] += 1

    def record_evicted(self, n: int) -> None:
        self._evicted += n

    def record_aborted(self, n: int) -> None:
        self._aborted += n

    def statistics(self) -> SamplerStatistics:
        return SamplerStatistics(
            self.lookahead,
            self.max_staleness,
            dict(self._trained_staleness),
            self._selected,
            self._evicted,
            self._aborted,
        )
