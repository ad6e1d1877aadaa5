"""Group-granular replay ledger and the exactly-once prompt ledger: state, no asyncio.

Group lifecycle (one group = one attempt at one prompt = G rows in storage):

    RESERVED --commit--> COMMITTED --mark_ready--> READY --select--> SELECTED --mark_trained--> TRAINED
        \\                    \\                       \\
         +--drop(reason)------+--drop(reason)---------+--evict(reason)--> DROPPED / EVICTED

A group holds a capacity slot from `reserve` until `release`, called only once its rows are cleared:
capacity counts resident rows. Every group has a target step; `next_target_step()` is the earliest
step still short of `groups_per_step` live groups, so a dropped group is refilled for its own step.
The prompt ledger gives every prompt taken exactly one fate (trained in step k, or dropped / evicted
with a reason); settling twice raises. Its only I/O is the optional history file of settled prompts.
"""

from __future__ import annotations

import collections
import enum
import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from replay.storage import row_keys
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

    # Members are singletons: hash by identity (C), not by name (`Enum.__hash__`, Python). The
    # ledger's indexes are keyed by state, ~6 lookups per transition, 4 transitions per group.
    __hash__ = object.__hash__


TERMINAL = frozenset({GroupState.TRAINED, GroupState.DROPPED, GroupState.EVICTED})
LIVE_EXCLUDED = frozenset({GroupState.DROPPED, GroupState.EVICTED})

RETAIN_RELEASED = 1_000  # released (terminal, rows cleared) groups kept queryable, newest first out last

ReadyKey = tuple[int, int]  # (target_step, version): every READY group of one key is alike to the sampler


@dataclass(slots=True)
class GroupRecord:
    group_id: str
    prompt: Prompt
    attempt: int
    seq: int  # dispatch order over the run
    target_step: int
    version_reserved: int  # policy version when dispatched
    t_reserved: float
    keys: tuple[str, ...] = ()  # its rows' keys in storage (`row_keys`), made once at reserve
    state: GroupState = GroupState.RESERVED
    resident: bool = True  # holds a capacity slot until its rows are cleared
    version_start: int | None = None
    version_end: int | None = None
    rewards: tuple[float, ...] = ()
    reward_parts: Mapping[str, tuple[float | None, ...]] = field(default_factory=dict)  # per reward function
    sample: tuple[str, str, float] | None = None  # one completion as text, for the logs
    episode_stats: Mapping[str, float] = field(default_factory=dict)  # multi-turn: sums over its episodes
    response_lengths: tuple[int, ...] = ()
    truncated: tuple[bool, ...] = ()  # [G] rows cut short (`GenerationResult.truncated`; () when not told)
    prompt_length: int = 0
    seq_lengths: tuple[int, ...] = ()  # prompt + response tokens per row (set at commit)
    advantages: tuple[float, ...] = ()
    reward_kl: tuple[float, ...] = ()  # [G] each row's KL to the reference (`reward.kl_coef`; () without)
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
        # Every query the pumps make while waiting is O(1) or O(keys), never a scan of the groups:
        # resident groups are indexed by state, READY ones also by (target step, version).
        self._groups: dict[str, GroupRecord] = {}  # resident + the last RETAIN_RELEASED released
        self._active: dict[str, GroupRecord] = {}  # resident groups (non-terminal, or terminal awaiting clear)
        self._by_state: dict[GroupState, dict[str, GroupRecord]] = {s: {} for s in GroupState}  # resident only
        self._ready: dict[ReadyKey, dict[str, GroupRecord]] = {}
        self._released: collections.deque[str] = collections.deque()  # released ids, oldest first
        # Groups counted toward each target step (all but dropped and evicted ones), kept only for
        # steps that still matter: from `_min_short_step` on, or with a group that can still leave
        # (`_open_by_step`: non-terminal groups per target step). Memory stays flat over a long run.
        self._live_by_step: Counter[int] = Counter()
        self._open_by_step: Counter[int] = Counter()
        self._min_short_step = first_step  # steps before it are done (a resumed run)
        self._seq = 0
        self.ready_marks = 0  # mark_ready calls so far: a cheap "something became READY" for waiters
        self._trained = 0
        self._dropped: Counter[str] = Counter()
        self._evicted: Counter[str] = Counter()

    # -- queries -----------------------------------------------------------------------------
    def __getitem__(self, group_id: str) -> GroupRecord:
        """A resident group, or one of the last `RETAIN_RELEASED` released (older ones are retired:
        their outcome lives on in the counters and the prompt ledger)."""
        return self._groups[group_id]

    def resident(self) -> int:
        return len(self._active)

    def has_capacity(self) -> bool:
        return len(self._active) < self.capacity

    def in_state(self, state: GroupState) -> list[GroupRecord]:
        """Resident groups in `state`, in dispatch order."""
        return sorted(self._by_state[state].values(), key=lambda g: g.seq)

    def count(self, state: GroupState) -> int:
        """Resident groups in `state` (O(1))."""
        return len(self._by_state[state])

    def ready_index(self) -> dict[ReadyKey, dict[str, GroupRecord]]:
        """READY groups by (target_step, version), for the sampler's per-key decisions (read only)."""
        return self._ready

    def ready_ids(self) -> Mapping[str, GroupRecord]:
        """READY groups by id (read only; `in` is O(1))."""
        return self._by_state[GroupState.READY]

    def active_records(self) -> Iterable[GroupRecord]:
        """Resident groups, in dispatch order of reservation."""
        return self._active.values()

    def live(self, step: int) -> int:
        return self._live_by_step[step]

    def next_target_step(self) -> int | None:
        """The earliest step still short of groups, or None when every step < max_steps is full."""
        s = self._min_short_step
        while s < self.max_steps and self._live_by_step[s] >= self.groups_per_step:
            if s not in self._open_by_step:
                del self._live_by_step[s]  # full, and no group of it can leave any more
            s += 1
        self._min_short_step = s
        return s if s < self.max_steps else None

    def all_records(self) -> Iterable[GroupRecord]:
        """Resident groups and the last `RETAIN_RELEASED` released ones."""
        return self._groups.values()

    # -- transitions ---------------------------------------------------------------------------
    def reserve(
        self, prompt: Prompt, *, attempt: int, target_step: int, policy_version: int, now: float
    ) -> GroupRecord:
        if not self.has_capacity():
            raise CapacityError(f"all {self.capacity} group slots are resident")
        if not 0 <= target_step < self.max_steps:
            raise LedgerError(f"target step {target_step} outside [0, {self.max_steps})")
        group_id = f"{prompt.prompt_id}-a{attempt}"
        if group_id in self._groups:
            raise LedgerError(f"group {group_id} reserved twice")
        rec = GroupRecord(
            group_id, prompt, attempt, self._seq, target_step, policy_version, now, row_keys(group_id, self.group_size)
        )
        self._seq += 1
        self._groups[group_id] = self._active[group_id] = self._by_state[GroupState.RESERVED][group_id] = rec
        self._live_by_step[target_step] += 1
        self._open_by_step[target_step] += 1
        return rec

    def commit(self, group_id: str, result: GenerationResult, now: float) -> GroupRecord:
        rec = self._expect(group_id, GroupState.RESERVED, "commit")
        if len(result.rewards) != self.group_size or len(result.response_lengths) != self.group_size:
            raise LedgerError(
                f"group {group_id}: {len(result.rewards)} rewards / {len(result.response_lengths)} lengths "
                f"for group size {self.group_size}"
            )
        rec.t_committed = now
        rec.rewards, rec.response_lengths = tuple(result.rewards), tuple(result.response_lengths)
        rec.truncated = tuple(result.truncated)
        rec.reward_parts, rec.sample, rec.episode_stats = result.reward_parts, result.sample, result.episode_stats
        rec.prompt_length = result.prompt_length
        rec.seq_lengths = tuple(result.prompt_length + n for n in rec.response_lengths)
        rec.version_start, rec.version_end = result.version_start, result.version_end
        self._move(rec, GroupState.COMMITTED)
        return rec

    def mark_ready(self, group_id: str, advantages: tuple[float, ...], now: float) -> GroupRecord:
        rec = self._expect(group_id, GroupState.COMMITTED, "mark_ready")
        rec.advantages, rec.t_ready = tuple(advantages), now
        self._move(rec, GroupState.READY)
        self.ready_marks += 1
        return rec

    def select(self, group_ids: Iterable[str], step: int, now: float) -> list[GroupRecord]:
        """Hand READY groups to the trainer for `step`: every group is checked before any moves."""
        recs = self._expect_all(group_ids, GroupState.READY, "select")
        for rec in recs:
            rec.trained_step, rec.t_selected = step, now
            self._move(rec, GroupState.SELECTED)
        return recs

    def mark_trained(self, group_id: str, step: int) -> GroupRecord:
        return self.mark_trained_many([group_id], step)[0]

    def mark_trained_many(self, group_ids: Iterable[str], step: int) -> list[GroupRecord]:
        """`mark_trained` of a finished step's groups: every group is checked before any moves, so a
        refused one changes nothing."""
        recs = self._expect_all(group_ids, GroupState.SELECTED, "mark_trained")
        for rec in recs:
            if rec.trained_step != step:
                raise LedgerError(f"group {rec.group_id} selected for step {rec.trained_step}, trained in {step}")
        for rec in recs:
            self._move(rec, GroupState.TRAINED)
        self._trained += len(recs)
        return recs

    def drop(self, group_id: str, reason: str) -> GroupRecord:
        """Any non-terminal group; SELECTED only when its step is abandoned (the run fails, or stops
        with the next step begun)."""
        rec = self._groups[group_id]
        if rec.state in TERMINAL:
            raise LedgerError(f"drop({group_id}): already {rec.state.value}")
        self._leave_step(rec)
        rec.reason = reason
        self._move(rec, GroupState.DROPPED)
        self._dropped[reason] += 1
        return rec

    def evict(self, group_id: str, reason: str) -> GroupRecord:
        rec = self._expect(group_id, GroupState.READY, "evict")
        self._leave_step(rec)
        rec.reason = reason
        self._move(rec, GroupState.EVICTED)
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
        del self._by_state[rec.state][group_id]
        self._released.append(group_id)
        while len(self._released) > RETAIN_RELEASED:  # retire the oldest: memory stays flat over a run
            del self._groups[self._released.popleft()]

    def _expect(self, group_id: str, state: GroupState, op: str) -> GroupRecord:
        rec = self._groups.get(group_id)
        if rec is None or rec.state is not state:
            self._refuse(group_id, state, op)
        return rec

    def _expect_all(self, group_ids: Iterable[str], state: GroupState, op: str) -> list[GroupRecord]:
        ids = list(group_ids)
        if len(set(ids)) != len(ids):
            raise LedgerError(f"{op}: a group is listed twice")
        return [self._expect(g, state, op) for g in ids]

    def _refuse(self, group_id: str, state: GroupState, op: str) -> NoReturn:
        rec = self._groups.get(group_id)
        if rec is None:
            raise LedgerError(f"{op}({group_id}): unknown group")
        raise LedgerError(f"{op}({group_id}): state {rec.state.value}, expected {state.value}")

    def _move(self, rec: GroupRecord, new: GroupState) -> None:
        """A transition: keeps the state and READY indexes and the per-step counts current."""
        old, gid = rec.state, rec.group_id
        del self._by_state[old][gid]
        self._by_state[new][gid] = rec
        if old is GroupState.READY:
            key = (rec.target_step, rec.version)
            bucket = self._ready[key]
            del bucket[gid]
            if not bucket:
                del self._ready[key]
        if new is GroupState.READY:
            self._ready.setdefault((rec.target_step, rec.version), {})[gid] = rec
        if new in TERMINAL and old not in TERMINAL:
            step = rec.target_step
            self._open_by_step[step] -= 1
            if self._open_by_step[step] <= 0:
                del self._open_by_step[step]
                if step < self._min_short_step:
                    self._live_by_step.pop(step, None)  # done: nothing of it can leave or be added
        rec.state = new

    def _leave_step(self, rec: GroupRecord) -> None:
        self._live_by_step[rec.target_step] -= 1
        self._min_short_step = min(self._min_short_step, rec.target_step)

    def statistics(self) -> LedgerStatistics:
        by_state = {s.value: len(self._by_state[s]) for s in GroupState if s not in TERMINAL}
        by_state["clearing"] = sum(len(self._by_state[s]) for s in TERMINAL)
        in_flight = Counter(g.version_reserved for g in self._by_state[GroupState.RESERVED].values())
        # each READY bucket is in mark_ready order, so its first group is its oldest
        oldest_ready = min((_t_ready(next(iter(b.values()))) for b in self._ready.values()), default=None)
        return LedgerStatistics(
            capacity=self.capacity,
            resident=len(self._active),
            by_state=by_state,
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
    """Exactly-once record of every prompt taken from the dataloader.

    In memory by default. With `history` (a file path), a prompt's record leaves memory when it is
    settled: it is appended to the file as one JSON line, so memory holds only the unsettled prompts
    (those in flight) whatever the length of the run, and a checkpoint saves those plus the file's
    length (`checkpoint_dict`); a resume cuts the file back to that length (`from_checkpoint`).
    `to_dict` is the whole ledger either way (file + memory), for the end-of-run record.

    A prompt id is taken once: `take` refuses an id taken before, settled or not, naming it (a
    dataloader that repeats an id would otherwise hold two records for one prompt once the first
    left memory). For that the ledger keeps the id of every prompt taken, records on disk included
    (a resume reads them back from the history file): one string per prompt, not its record.
    """

    def __init__(self, history: str | os.PathLike | None = None, *, append: bool = False) -> None:
        self._prompts: dict[str, PromptRecord] = {}  # every record, or (with a history file) the unsettled ones
        self._unsettled: dict[str, PromptRecord] = {}
        self._taken = 0
        self._ids: set[str] = set()  # every prompt id taken, also of the records in the history file
        self._history_path = history
        self._history = open(history, "a" if append else "w", encoding="utf-8") if history is not None else None
        # statistics, kept as the ledger changes (read on every step and every metrics scrape)
        self._trained = self._retries = 0
        self._dropped: Counter[str] = Counter()
        self._evicted: Counter[str] = Counter()

    def take(self, prompt: Prompt) -> PromptRecord:
        pid = prompt.prompt_id
        if pid in self._ids:
            prev = self._prompts.get(pid)
            was = "settled" if prev is None or prev.fate is not None else "still in flight"
            raise LedgerError(
                f"prompt {pid} taken from the dataloader twice (the first is {was}): the prompt source "
                "repeats a prompt id, and every prompt needs its own"
            )
        self._ids.add(pid)
        rec = PromptRecord(prompt, self._taken)
        self._taken += 1
        self._prompts[pid] = self._unsettled[pid] = rec
        return rec

    def __getitem__(self, prompt_id: str) -> PromptRecord:
        return self._prompts[prompt_id]

    def __len__(self) -> int:
        """Prompts taken so far."""
        return self._taken

    def add_attempt(self, prompt_id: str, group_id: str) -> None:
        rec = self._prompts[prompt_id]
        if rec.fate is not None:
            raise LedgerError(f"prompt {prompt_id} already {rec.fate}; no new attempt allowed")
        rec.attempts.append(group_id)
        self._retries += len(rec.attempts) > 1

    def settle(self, prompt_id: str, fate: str, *, step: int | None = None, reason: str | None = None) -> None:
        if fate not in ("trained", "dropped", "evicted"):
            raise ValueError(f"unknown fate {fate!r}")
        rec = self._prompts.get(prompt_id)
        if rec is None or rec.fate is not None:
            self._refuse_settle(prompt_id, rec, fate)
        if fate == "trained" and step is None:
            raise ValueError("a trained prompt needs its step")
        rec.fate, rec.step, rec.reason = fate, step, reason
        self._count_settled(rec)
        if self._history is not None:
            self._history.write(_history_line(rec))
            del self._prompts[prompt_id]

    def _refuse_settle(self, prompt_id: str, rec: PromptRecord | None, fate: str) -> NoReturn:
        """`settle` of a prompt never taken, settled before, or already written to the history file."""
        if rec is None:
            where = (
                "settled before (its record is in the history file) or never taken" if self._history else "never taken"
            )
            raise LedgerError(f"prompt {prompt_id} settled {fate}, but it was {where}")
        raise LedgerError(
            f"prompt {prompt_id} settled twice: already {rec.fate}"
            f"{f' in step {rec.step}' if rec.step is not None else ''}, now {fate}"
        )

    def settle_trained(self, prompt_ids: Iterable[str], step: int) -> None:
        """`settle(p, "trained", step=step)` for each of a finished step's prompts, with one write of
        their history lines (the train pump's case). A refused prompt raises as `settle` does; the
        ones before it stay settled, and their lines are written."""
        prompts, unsettled, settled = self._prompts, self._unsettled, []
        try:
            for pid in prompt_ids:
                rec = prompts.get(pid)
                if rec is None or rec.fate is not None:
                    self._refuse_settle(pid, rec, "trained")
                rec.fate, rec.step, rec.reason = "trained", step, None
                del unsettled[pid]
                self._trained += 1
                settled.append(rec)
        finally:
            if self._history is not None and settled:
                # a record leaves memory only once its line is written: a failed write loses none
                self._history.write("".join(_history_line(rec) for rec in settled))
                for rec in settled:
                    del prompts[rec.prompt.prompt_id]

    def _count_settled(self, rec: PromptRecord) -> None:
        del self._unsettled[rec.prompt.prompt_id]
        if rec.fate == "trained":
            self._trained += 1
        else:
            (self._dropped if rec.fate == "dropped" else self._evicted)[rec.reason or "?"] += 1

    def charged_attempts(self, prompt_id: str) -> int:
        """Attempts that count against the retry budget."""
        rec = self._prompts[prompt_id]
        return len(rec.attempts) - rec.uncharged

    def unsettled(self) -> list[str]:
        """Prompts without a fate yet, in the order they were taken."""
        return list(self._unsettled)

    def records(self) -> Iterable[PromptRecord]:
        """The records in memory: every one, or (with a history file) the unsettled ones."""
        return self._prompts.values()

    def write_json(self, path: str | os.PathLike[str]) -> int:
        """Write the whole ledger to `path` as `{"prompts": [...]}` (the end-of-run
        `prompt_ledger.json`), streamed: the history file's lines are copied as they are (the
        prompts settled, in the order they settled), then the records in memory; nothing is held
        whole, whatever the run's length. Written aside and renamed. Returns the prompts written."""
        tmp = f"{os.fspath(path)}.tmp"
        n = 0
        with open(tmp, "w", encoding="utf-8") as out:
            out.write('{"prompts": [\n')
            if self._history_path is not None:
                if self._history is not None:
                    self._history.flush()
                with open(self._history_path, encoding="utf-8") as f:
                    for line in f:
                        out.write(("" if n == 0 else ",\n") + line.rstrip("\n"))
                        n += 1
            for rec in self._prompts.values():
                out.write(("" if n == 0 else ",\n") + json.dumps(_record_dict(rec)))
                n += 1
            out.write("\n]}\n")
        os.replace(tmp, path)
        return n

    def to_dict(self) -> dict[str, Any]:
        """The whole ledger, JSON-serializable, in the order the prompts were taken (held whole in
        memory: the end of a run writes `write_json` instead)."""
        prompts = [_record_dict(r) for r in self._prompts.values()]
        if self._history_path is not None:
            if self._history is not None:
                self._history.flush()
            with open(self._history_path, encoding="utf-8") as f:
                prompts += [json.loads(line) for line in f]
            prompts.sort(key=lambda d: d["order"])
        return {"prompts": prompts}

    def checkpoint_dict(self) -> dict[str, Any]:
        """What a checkpoint saves: the whole ledger in memory; with a history file, the records in
        memory, the counters and the file's length, made durable first (fsync)."""
        if self._history is None:
            return self.to_dict()
        self._history.flush()
        os.fsync(self._history.fileno())
        return {
            "prompts": [_record_dict(r) for r in self._prompts.values()],
            "history_bytes": self._history.tell(),
            "taken": self._taken,
            # the history file's share (the records above count their own retries on load)
            "counters": {
                "trained": self._trained,
                "retries": self._retries - sum(max(0, len(r.attempts) - 1) for r in self._prompts.values()),
                "dropped": dict(self._dropped),
                "evicted": dict(self._evicted),
            },
        }

    @classmethod
    def from_dict(
        cls,
        data: dict[str, Any],
        history: str | os.PathLike | None = None,
        *,
        prompts: Mapping[str, Prompt] | None = None,
    ) -> PromptLedger:
        """From `to_dict` or `checkpoint_dict`. A checkpoint with a history file (`history_bytes`)
        needs that file: it is cut back to the checkpoint's length (what was settled after the
        checkpoint is forgotten, as the checkpoint's cut requires).

        A record keeps a prompt's id, token ids and answer, not its raw prompt and dataset columns:
        `prompts` gives the whole prompt of each unsettled record (`unsettled_prompt_ids`), resolved
        from the prompt source by id, so that a resumed prompt is the same prompt (a column-reading
        reward, an environment's item). Without it the records hold bare prompts (tests, reports)."""
        settled_ids: list[str] = []  # of the records in the history file, settled before the checkpoint
        if "history_bytes" in data:
            if history is None:
                raise ValueError("this prompt ledger was saved with a history file; pass its path")
            with open(history, "r+b") as f:
                size = f.seek(0, os.SEEK_END)
                if size < data["history_bytes"]:
                    raise LedgerError(
                        f"{history} holds {size} bytes, but the checkpoint counted {data['history_bytes']}: "
                        f"the prompt history was truncated or replaced after the checkpoint"
                    )
                f.truncate(data["history_bytes"])
                f.seek(0)
                settled_ids = [json.loads(line)["prompt_id"] for line in f]
        led = cls(history, append=True)
        led._ids.update(settled_ids)
        for d in sorted(data["prompts"], key=lambda d: d["order"]):
            whole = prompts.get(d["prompt_id"]) if prompts is not None and d["fate"] is None else None
            rec = PromptRecord(whole or Prompt(d["prompt_id"], tuple(d["token_ids"]), d["answer"]), d["order"])
            rec.attempts = list(d["attempts"])
            rec.uncharged = d.get("uncharged", 0)
            led._prompts[rec.prompt.prompt_id] = led._unsettled[rec.prompt.prompt_id] = rec
            led._ids.add(rec.prompt.prompt_id)
            led._retries += max(0, len(rec.attempts) - 1)
            if d["fate"] is not None:
                rec.fate, rec.step, rec.reason = d["fate"], d["step"], d["reason"]
                led._count_settled(rec)
        led._taken = data.get("taken", len(data["prompts"]))
        if "counters" in data:  # the settled prompts' share lives in the history file
            c = data["counters"]
            led._trained += c["trained"]
            led._retries += c["retries"]
            led._dropped.update(c["dropped"])
            led._evicted.update(c["evicted"])
        return led

    def close(self) -> None:
        if self._history is not None:
            self._history.close()
            self._history = None

    def statistics(self) -> PromptLedgerStatistics:
        taken = self._taken
        return PromptLedgerStatistics(
            taken, taken - len(self._unsettled), self._trained, dict(self._dropped), dict(self._evicted), self._retries
        )


def unsettled_prompt_ids(data: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """The prompts a saved ledger (`checkpoint_dict`) holds without a fate, by id: their token ids and
    answer, to resolve each from the prompt source before a resume (`PromptLedger.from_dict`)."""
    return {d["prompt_id"]: (tuple(d["token_ids"]), d["answer"]) for d in data["prompts"] if d["fate"] is None}


def _t_ready(rec: GroupRecord) -> float:
    assert rec.t_ready is not None, f"READY group {rec.group_id} has no t_ready"  # mark_ready sets it
    return rec.t_ready


def _history_line(r: PromptRecord) -> str:
    """One settled prompt as a line of the history file."""
    return json.dumps(_record_dict(r)) + "\n"


def _record_dict(r: PromptRecord) -> dict[str, Any]:
    return {
        "prompt_id": r.prompt.prompt_id,
        "token_ids": [int(t) for t in r.prompt.token_ids],
        "answer": r.prompt.answer,
        "order": r.order,
        "attempts": list(r.attempts),
        "uncharged": r.uncharged,
        "fate": r.fate,
        "step": r.step,
        "reason": r.reason,
    }
