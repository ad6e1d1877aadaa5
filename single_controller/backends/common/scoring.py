"""Scoring groups of completions with the run's reward functions, next to the tokens (every engine).

`RewardScorer.score_groups(groups)` answers each group with its `Scored` (G rewards, each function's
values, a sample) or its `RewardFailed`. The default per-completion `task.reward_fn` runs in the
caller's thread; `reward.functions` run per (group, function) in a pool of `reward.max_workers`
threads under `reward.timeout_s` (a late call is abandoned and a fresh pool serves the rest). The
reward is the weighted sum of the values that are not None. A function that raises, misses its
deadline or returns a bad value fails that group alone, naming the function and the cause.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from single_controller.config.schema import RewardConfig
from single_controller.data.rewards import BUILTINS, RewardFn, reward_functions
from single_controller.protocols import RewardFailed
from single_controller.types import Prompt


def score_group(
    reward_fn: Callable[[Prompt, str], float], prompt: Prompt, texts: Sequence[str], group_id: str, worker: str
) -> tuple[float, ...]:
    """rewards: [G], one per completion text; `RewardFailed` if any of them cannot be had."""
    rewards = []
    for i, text in enumerate(texts):
        try:
            r = float(reward_fn(prompt, text))
        except Exception as e:  # user code: its failure is this group's
            err = RewardFailed(
                f"{worker}: reward function failed on completion {i} of group {group_id}: {type(e).__name__}: {e}"
            )
            raise err from e
        if not math.isfinite(r):
            raise RewardFailed(f"{worker}: reward function gave {r} for completion {i} of group {group_id}")
        rewards.append(r)
    return tuple(rewards)


@dataclass(frozen=True)
class GroupToScore:
    prompt: Prompt
    texts: Sequence[str]  # [G] decoded completions (without a final stop token)
    completion_ids: Sequence[Any]  # [G] generated token ids of each completion (lists or 1-d tensors)
    group_id: str


@dataclass(frozen=True)
class Scored:
    rewards: tuple[float, ...]  # [G] the weighted totals
    parts: Mapping[str, tuple[float | None, ...]] = field(default_factory=dict)  # name -> [G]; empty: the default
    sample: tuple[str, str, float] | None = None  # (prompt text, completion 0, its reward)


class _AtCompletion(Exception):
    """A per-completion (legacy-form) function failed on completion `index`."""

    def __init__(self, index: int, cause: BaseException):
        super().__init__(index, cause)
        self.index, self.cause = index, cause


def _call(f: RewardFn, prompt: Prompt, kwargs: dict[str, list]) -> Any:
    """One function on one group, in a pool thread: its raw answer."""
    if f.form == "legacy":
        out = []
        for i, text in enumerate(kwargs["completions"]):
            try:
                value = f.fn(prompt, text)
                out.append(asyncio.run(value) if inspect.iscoroutine(value) else value)
            except Exception as e:
                raise _AtCompletion(i, e) from e
        return out
    value = f.fn(**kwargs)
    return asyncio.run(value) if inspect.iscoroutine(value) else value


def finite(v: Any) -> float | None:
    """`v` as a finite float (a number, numpy's or torch's included); None if it is not one."""
    if isinstance(v, (str, bytes)):
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


@dataclass
class _Pending:
    """One (group, function) call: submitted, then its outcome (values or the error message)."""

    group: int
    f: RewardFn
    prompt: Prompt
    kwargs: dict[str, list]
    deadline: float = 0.0
    values: tuple[float | None, ...] | None = None
    error: str | None = None
    cause: BaseException | None = None


class RewardScorer:
    def __init__(
        self,
        functions: Sequence[RewardFn],
        *,
        worker: str,
        decode: Callable[[Sequence[int]], str],
        inline: bool = False,
        timeout_s: float = 30.0,
        max_workers: int = 4,
        trl_completions: bool = False,
    ):
        if inline and (len(functions) != 1 or functions[0].form != "legacy"):
            raise ValueError("only one per-completion reward function can be called inline")
        self.functions, self.worker, self.decode, self.inline = tuple(functions), worker, decode, inline
        self.timeout_s, self.max_workers = timeout_s, max_workers
        self.trl_completions = trl_completions  # `reward.trl_completions`
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # one batch at a time: it alone bounds the calls running at once
        self.timeouts = 0  # calls abandoned at their deadline (each replaced the pool)

    @classmethod
    def from_config(
        cls, reward: RewardConfig | None, legacy: str | Callable, *, worker: str, decode: Callable[[Sequence[int]], str]
    ) -> RewardScorer:
        reward = reward or RewardConfig()
        functions = reward_functions(reward.functions, legacy)
        f = functions[0]
        inline = not reward.functions and f.form == "legacy" and not inspect.iscoroutinefunction(f.fn)
        return cls(
            functions,
            worker=worker,
            decode=decode,
            inline=inline,
            timeout_s=reward.timeout_s,
            max_workers=reward.max_workers,
            trl_completions=reward.trl_completions,
        )

    def close(self) -> None:
        """Stop the pool (calls running finish in their threads; nothing waits for them)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def score(self, group: GroupToScore) -> Scored:
        """One group's `Scored`; raises its `RewardFailed`."""
        (out,) = self.score_groups([group])
        if isinstance(out, RewardFailed):
            raise out
        return out

    def score_groups(self, groups: Sequence[GroupToScore]) -> list[Scored | RewardFailed]:
        """One entry per group: its `Scored`, or the `RewardFailed` that ends it alone."""
        if self.inline:
            return [self._inline(g) for g in groups]
        calls = [_Pending(i, f, g.prompt, self._arguments(g, f)) for i, g in enumerate(groups) for f in self.functions]
        with self._lock:
            self._run(calls)
        by_group: list[list[_Pending]] = [[] for _ in groups]
        for c in calls:
            by_group[c.group].append(c)
        return [self._total(g, cs) for g, cs in zip(groups, by_group)]

    # -- the default: inline ---------------------------------------------------------------------
    def _inline(self, g: GroupToScore) -> Scored | RewardFailed:
        try:
            rewards = score_group(self.functions[0].fn, g.prompt, g.texts, g.group_id, self.worker)
        except RewardFailed as e:
            return e
        return Scored(rewards, {}, self._sample(g, rewards))

    def _sample(self, g: GroupToScore, rewards: tuple[float, ...]) -> tuple[str, str, float] | None:
        if not g.texts:
            return None
        raw = g.prompt.raw_prompt
        return (raw if isinstance(raw, str) else self.decode(g.prompt.token_ids), g.texts[0], rewards[0])

    def _completions(self, g: GroupToScore, f: RewardFn) -> list:
        conversational = isinstance(g.prompt.raw_prompt, list)
        if self.trl_completions and conversational and f.form == "batched" and f.spec not in BUILTINS:
            return [[{"role": "assistant", "content": t}] for t in g.texts]
        return list(g.texts)

    # -- the pool ----------------------------------------------------------------------------------
    def _arguments(self, g: GroupToScore, f: RewardFn) -> dict[str, list]:
        """The keyword arguments of one batched call of `f`: every value a list over the G completions
        (a dataset column named like one of the arguments given here is shadowed by it). With
        `trl_completions`, a user function of a chat prompt gets each completion as TRL gives it."""
        n, p = len(g.texts), g.prompt
        prompt = p.raw_prompt if p.raw_prompt is not None else self.decode(p.token_ids)
        kwargs: dict[str, list] = {k: [v] * n for k, v in p.columns.items()}
        kwargs.update(
            prompts=[prompt] * n,
            completions=self._completions(g, f),
            answer=[p.answer] * n,
            completion_ids=[ids.tolist() if hasattr(ids, "tolist") else list(ids) for ids in g.completion_ids],
            prompt_id=[p.prompt_id] * n,
        )
        return kwargs

    def _submit(self, c: _Pending) -> concurrent.futures.Future:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.max_workers, thread_name_prefix="reward")
        c.deadline = time.monotonic() + self.timeout_s
        # every function gets lists of its own: one that changes its arguments cannot change another's
        kwargs = {k: list(v) for k, v in c.kwargs.items()}
        return self._pool.submit(_call, c.f, c.prompt, kwargs)

    def _run(self, calls: list[_Pending]) -> None:
        """Run every call, at most `max_workers` at once, each within its deadline."""
        queued = list(reversed(calls))
        running: dict[concurrent.futures.Future, _Pending] = {}
        while queued or running:
            while queued and len(running) < self.max_workers:
                c = queued.pop()
                running[self._submit(c)] = c
            wait_s = max(0.0, min(c.deadline for c in running.values()) - time.monotonic())
            done, _ = concurrent.futures.wait(running, timeout=wait_s, return_when=concurrent.futures.FIRST_COMPLETED)
            for fut in done:
                self._settle(running.pop(fut), fut)
            now = time.monotonic()
            for fut, c in list(running.items()):
                if c.deadline <= now and not fut.done():
                    del running[fut]
                    c.error = f"did not finish within reward.timeout_s = {self.timeout_s:g}s (abandoned in its thread)"
                    self._abandon_pool()

    def _abandon_pool(self) -> None:
        """A call is stuck in one of the pool's threads: later calls go to a fresh pool."""
        self.timeouts += 1
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def _settle(self, c: _Pending, fut: concurrent.futures.Future) -> None:
        n = len(c.kwargs["completions"])
        try:
            out = fut.result()
        except _AtCompletion as e:
            c.error, c.cause = f"raised on completion {e.index}: {type(e.cause).__name__}: {e.cause}", e.cause
            return
        except Exception as e:  # user code: its failure is this group's
            c.error, c.cause = f"raised: {type(e).__name__}: {e}", e
            return
        if isinstance(out, (str, bytes, Mapping)) or not isinstance(out, Sequence):
            c.error = f"returned {type(out).__name__} {out!r:.80}, not a list of {n} values (one per completion)"
            return
        if len(out) != n:
            c.error = f"returned {len(out)} values for {n} completions"
            return
        values: list[float | None] = []
        for i, v in enumerate(out):
            if v is None:
                values.append(None)
                continue
            x = finite(v)
            if x is None:
                c.error = f"gave {v!r:.80} for completion {i} (not a finite number or None)"
                return
            values.append(x)
        c.values = tuple(values)

    def _total(self, g: GroupToScore, calls: list[_Pending]) -> Scored | RewardFailed:
        parts: dict[str, tuple[float | None, ...]] = {}
        for c in calls:
            if c.values is None:
                where = f"{self.worker}: reward function {c.f.name!r} ({c.f.spec}) on group {g.group_id}"
                err = RewardFailed(f"{where} {c.error}")
                err.__cause__ = c.cause
                return err
            parts[c.f.name] = c.values
        weights = [c.f.weight for c in calls]
        rewards = []
        for i in range(len(g.texts)):
            r = math.fsum(w * x for w, v in zip(weights, parts.values()) if (x := v[i]) is not None)
            if not math.isfinite(r):
                return RewardFailed(
                    f"{self.worker}: the weighted reward of completion {i} of group {g.group_id} is {r}"
                )
            rewards.append(r)
        return Scored(tuple(rewards), parts, self._sample(g, tuple(rewards)))
