"""Group-granular replay ledger and the exactly-once prompt ledger. Pure state, no I/O, no asyncio.

Group lifecycle (one group = one attempt at one prompt = G rows in storage):

    RESERVED --commit--> COMMITTED --mark_ready--> READY --select--> SELECTED --mark_trained--> TRAINED
        \\                    \\                       \\
         +--drop(reason)------+--drop(reason)---------+--evict(reason)--> DROPPED / EVICTED

TRAINED, DROPPED and EVICTED are terminal. A group holds a capacity slot from `reserve` until
`release`, which the caller invokes only after the group's rows are cleared from storage: capacity
counts rows still resident, not groups still waiting to be selected.

Step accounting: every group is reserved for a target step. `live(s)` counts the groups of step s
that are not dropped or evicted; a step needs `groups_per_step` of them. `next_target_step()` is the
earliest step still short of groups, so a dropped group is refilled for the step it was meant for.

The prompt ledger records, for every prompt taken from the dataloader, its attempts (group ids)
and exactly one fate: trained in step k, or dropped / evicted with a reason. Settling a prompt twice
raises; `unsettled()` lists prompts still without a fate.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

from single_controller.types import GenerationResult, Prompt


class LedgerError(RuntimeError):
    """An illegal transition: a bug in the caller, never a data condition."""


class CapacityError(LedgerError):
    """`reserve` with every slot taken; callers wait for `has_capacity()` first."""


class GroupState(enum.Enum):
    RESERVED = "reserved"  # dispatched to a generation worker, rows not yet stored
    COMMITTED = "committed"  # rows stored, rewards known
    READY = "ready"  # advantages written: trainable
    SELECTED = "selected"  # handed to the trainer in the current step
    TRAINED = "trained"
    DROPPED = "dropped"
    EVICTED = "evicted"


TERMINAL = frozenset({GroupState.TRAINED, GroupState.DROPPED, GroupState.EVICTED})
LIVE_EXCLUDED = frozenset({GroupState.DROPPED, GroupState.EVICTED})


@dataclass
class GroupRecord:
    group_id: str
    prompt: Prompt
    attempt: int
    seq: int  # dispatch order over the run
    target_step: int
    version_reserved: int  # policy version when dispatched
    t_reserved: float
    state: GroupState = GroupState.RESERVED
    resident: bool = True  # holds a capacity slot until its rows are cleared
    version_start: int | None = None
    version_end: int | None = None
    rewards: tuple[float, ...] = ()
    response_lengths: tuple[int, ...] = ()
    prompt_length: int = 0
    advantages: tuple[float, ...] = ()
    trained_step: int | None = None
    reason: str | None = None
    abort_reason: str | None = None  # set before cancelling an in-flight attempt on purpose
    t_committed: float | None = None
    t_ready: float | None = None
    t_selected: float | None = None

    @property
    def version(self) -> int:
        """The version staleness is measured from: the oldest weights that touched the group."""
        return self.version_start if self.version_start is not None else self.version_reserved

    def seq_lengths(self) -> tuple[int, ...]:
        return tuple(self.prompt_length + n for n in self.response_lengths)


@dataclass(frozen=True)
class LedgerStatistics:
    capacity: int
    resident: int  # groups holding a slot (rows possibly in storage)
    by_state: dict[str, int]  # non-terminal groups by state, plus terminal-but-resident as "clearing"
    reserved_total: int
    trained_total: int
    dropped_by_reason: dict[str, int]
    evicted_by_reason: dict[str, int]
    in_flight_by_version: dict[int, int]  # RESERVED groups by the policy version they started on
    oldest_ready_t: float | None  # t_ready of the oldest READY group (monotonic clock), None if none


class GroupLedger:
    def __init__(self, *, capacity: int, group_size: int, groups_per_step: int, max_steps: int, first_step: int = 0):
        if capacity < 1 or group_size < 1 or groups_per_step < 1:
            raise ValueError("capacity, group_size and groups_per_step must be >= 1")
        self.capacity = capacity
        self.group_size = group_size
        self.groups_per_step = groups_per_step
        self.max_steps = max_steps
        self._groups: dict[str, GroupRecord] = {}
        self._active: dict[str, GroupRecord] = {}  # resident groups (non-terminal, or terminal awaiting clear)
        self._live_by_step: Counter[int] = Counter()
        self._min_short_step = first_step  # steps before it are done (a resumed run)
        self._seq = 0
        self._trained = 0
        self._dropped: Counter[str] = Counter()
        self._evicted: Counter[str] = Counter()

    # -- queries -----------------------------------------------------------------------------
    def __getitem__(self, group_id: str) -> GroupRecord:
        return self._groups[group_id]

    def resident(self) -> int:
        return len(self._active)

    def has_capacity(self) -> bool:
        return len(self._active) < self.capacity

    def in_state(self, state: GroupState) -> list[GroupRecord]:
        """Active groups in `state`, in dispatch order."""
        return [g for g in self._active.values() if g.state is state]

    def count(self, state: GroupState) -> int:
        return sum(1 for g in self._active.values() if g.state is state)

    def live(self, step: int) -> int:
        return self._live_by_step[step]

    def next_target_step(self) -> int | None:
        """The earliest step still short of groups, or None when every step < max_steps is full."""
        s = self._min_short_step
        while s < self.max_steps and self._live_by_step[s] >= self.groups_per_step:
            s += 1
        self._min_short_step = s
        return s if s < self.max_steps else None

    def all_records(self) -> Iterable[GroupRecord]:
        return self._groups.values()

    # -- transitions ---------------------------------------------------------------------------
    def reserve(self, prompt: Prompt, *, attempt: int, target_step: int, policy_version: int, now: float) -> GroupRecord:
        if not self.has_capacity():
            raise CapacityError(f"all {self.capacity} group slots are resident")
        if not 0 <= target_step < self.max_steps:
            raise LedgerError(f"target step {target_step} outside [0, {self.max_steps})")
        group_id = f"{prompt.prompt_id}-a{attempt}"
        if group_id in self._groups:
            raise LedgerError(f"group {group_id} reserved twice")
        rec = GroupRecord(group_id, prompt, attempt, self._seq, target_step, policy_version, now)
        self._seq += 1
        self._groups[group_id] = self._active[group_id] = rec
        self._live_by_step[target_step] += 1
        return rec

    def commit(self, group_id: str, result: GenerationResult, now: float) -> GroupRecord:
        rec = self._expect(group_id, GroupState.RESERVED, "commit")
        if len(result.rewards) != self.group_size or len(result.response_lengths) != self.group_size:
            raise LedgerError(
                f"group {group_id}: {len(result.rewards)} rewards / {len(result.response_lengths)} lengths "
                f"for group size {self.group_size}"
            )
        rec.state, rec.t_committed = GroupState.COMMITTED, now
        rec.rewards, rec.response_lengths = tuple(result.rewards), tuple(result.response_lengths)
        rec.prompt_length = result.prompt_length
        rec.version_start, rec.version_end = result.version_start, result.version_end
        return rec

    def mark_ready(self, group_id: str, advantages: tuple[float, ...], now: float) -> GroupRecord:
        rec = self._expect(group_id, GroupState.COMMITTED, "mark_ready")
        rec.state, rec.advantages, rec.t_ready = GroupState.READY, tuple(advantages), now
        return rec

    def select(self, group_ids: Iterable[str], step: int, now: float) -> list[GroupRecord]:
        recs = [self._expect(g, GroupState.READY, "select") for g in group_ids]
        for rec in recs:
            rec.state, rec.trained_step, rec.t_selected = GroupState.SELECTED, step, now
        return recs

    def mark_trained(self, group_id: str, step: int) -> GroupRecord:
        rec = self._expect(group_id, GroupState.SELECTED, "mark_trained")
        if rec.trained_step != step:
            raise LedgerError(f"group {group_id} selected for step {rec.trained_step}, trained in {step}")
        rec.state = GroupState.TRAINED
        self._trained += 1
        return rec

    def drop(self, group_id: str, reason: str) -> GroupRecord:
        """Any non-terminal group; SELECTED only when its step is abandoned (the run is failing)."""
        rec = self._groups[group_id]
        if rec.state in TERMINAL:
            raise LedgerError(f"drop({group_id}): already {rec.state.value}")
        self._leave_step(rec)
        rec.state, rec.reason = GroupState.DROPPED, reason
        self._dropped[reason] += 1
        return rec

    def evict(self, group_id: str, reason: str) -> GroupRecord:
        rec = self._expect(group_id, GroupState.READY, "evict")
        self._leave_step(rec)
        rec.state, rec.reason = GroupState.EVICTED, reason
        self._evicted[reason] += 1
        return rec

    def release(self, group_id: str) -> None:
        """The group's rows are cleared from storage: free its slot."""
        rec = self._groups[group_id]
        if rec.state not in TERMINAL:
            raise LedgerError(f"release({group_id}) in state {rec.state.value}: rows may still be needed")
        if not rec.resident:
            raise LedgerError(f"release({group_id}) twice")
        rec.resident = False
        del self._active[group_id]

    def _expect(self, group_id: str, state: GroupState, op: str) -> GroupRecord:
        rec = self._groups.get(group_id)
        if rec is None:
            raise LedgerError(f"{op}({group_id}): unknown group")
        if rec.state is not state:
            raise LedgerError(f"{op}({group_id}): state {rec.state.value}, expected {state.value}")
        return rec

    def _leave_step(self, rec: GroupRecord) -> None:
        self._live_by_step[rec.target_step] -= 1
        self._min_short_step = min(self._min_short_step, rec.target_step)

    def statistics(self) -> LedgerStatistics:
        by_state: Counter[str] = Counter()
        in_flight: Counter[int] = Counter()
        oldest_ready = None
        for g in self._active.values():
            by_state["clearing" if g.state in TERMINAL else g.state.value] += 1
            if g.state is GroupState.RESERVED:
                in_flight[g.version_reserved] += 1
            elif g.state is GroupState.READY and (oldest_ready is None or g.t_ready < oldest_ready):
                oldest_ready = g.t_ready
        for s in ("reserved", "committed", "ready", "selected", "clearing"):
            by_state.setdefault(s, 0)
        return LedgerStatistics(
            capacity=self.capacity,
            resident=len(self._active),
            by_state=dict(by_state),
            reserved_total=self._seq,
            trained_total=self._trained,
            dropped_by_reason=dict(self._dropped),
            evicted_by_reason=dict(self._evicted),
            in_flight_by_version=dict(in_flight),
            oldest_ready_t=oldest_ready,
        )


# ---------------------------------------------------------------------------------------------
@dataclass
class PromptRecord:
    prompt: Prompt
    order: int  # position in which it was taken from the dataloader
    attempts: list[str] = field(default_factory=list)
    uncharged: int = 0  # attempts lost through no fault of the prompt (a worker died): not retries
    fate: str | None = None  # "trained" | "dropped" | "evicted"
    step: int | None = None  # for "trained"
    reason: str | None = None  # for "dropped" / "evicted"


@dataclass(frozen=True)
class PromptLedgerStatistics:
    taken: int
    settled: int
    trained: int
    dropped_by_reason: dict[str, int]
    evicted_by_reason: dict[str, int]
    retries: int  # attempts beyond the first, over all prompts


class PromptLedger:
    """Exactly-once record of every prompt taken from the dataloader."""

    def __init__(self) -> None:
        self._prompts: dict[str, PromptRecord] = {}

    def take(self, prompt: Prompt) -> PromptRecord:
        if prompt.prompt_id in self._prompts:
            raise LedgerError(f"prompt {prompt.prompt_id} taken from the dataloader twice")
        rec = PromptRecord(prompt, len(self._prompts))
        self._prompts[prompt.prompt_id] = rec
        return rec

    def __getitem__(self, prompt_id: str) -> PromptRecord:
        return self._prompts[prompt_id]

    def __len__(self) -> int:
        return len(self._prompts)

    def add_attempt(self, prompt_id: str, group_id: str) -> None:
        rec = self._prompts[prompt_id]
        if rec.fate is not None:
            raise LedgerError(f"prompt {prompt_id} already {rec.fate}; no new attempt allowed")
        rec.attempts.append(group_id)

    def settle(self, prompt_id: str, fate: str, *, step: int | None = None, reason: str | None = None) -> None:
        if fate not in ("trained", "dropped", "evicted"):
            raise ValueError(f"unknown fate {fate!r}")
        rec = self._prompts[prompt_id]
        if rec.fate is not None:
            raise LedgerError(
                f"prompt {prompt_id} settled twice: already {rec.fate}"
                f"{f' in step {rec.step}' if rec.step is not None else ''}, now {fate}"
            )
        if fate == "trained" and step is None:
            raise ValueError("a trained prompt needs its step")
        rec.fate, rec.step, rec.reason = fate, step, reason

    def charged_attempts(self, prompt_id: str) -> int:
        """Attempts that count against the retry budget."""
        rec = self._prompts[prompt_id]
        return len(rec.attempts) - rec.uncharged

    def unsettled(self) -> list[str]:
        return [pid for pid, r in self._prompts.items() if r.fate is None]

    def records(self) -> Iterable[PromptRecord]:
        return self._prompts.values()

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form (for checkpoints and post-mortems)."""
        return {
            "prompts": [
                {
                    "prompt_id": r.prompt.prompt_id,
                    "token_ids": list(r.prompt.token_ids),
                    "answer": r.prompt.answer,
                    "order": r.order,
                    "attempts": list(r.attempts),
                    "uncharged": r.uncharged,
                    "fate": r.fate,
                    "step": r.step,
                    "reason": r.reason,
                }
                for r in self._prompts.values()
            ]
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PromptLedger":
        led = cls()
        for d in sorted(data["prompts"], key=lambda d: d["order"]):
            rec = led.take(Prompt(d["prompt_id"], tuple(d["token_ids"]), d["answer"]))
            rec.attempts = list(d["attempts"])
            rec.uncharged = d.get("uncharged", 0)
            rec.fate, rec.step, rec.reason = d["fate"], d["step"], d["reason"]
        return led

    def statistics(self) -> PromptLedgerStatistics:
        settled = trained = retries = 0
        dropped: Counter[str] = Counter()
        evicted: Counter[str] = Counter()
        for r in self._prompts.values():
            retries += max(0, len(r.attempts) - 1)
            if r.fate is None:
                continue
            settled += 1
            if r.fate == "trained":
                trained += 1
            elif r.fate == "dropped":
                dropped[r.reason or "?"] += 1
            else:
                evicted[r.reason or "?"] += 1
        return PromptLedgerStatistics(len(self._prompts), settled, trained, dict(dropped), dict(evicted), retries)
