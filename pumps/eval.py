"""Eval pump: held-out evaluation of the policy while training flows (no drain).

At the first policy version, every `eval.every_steps` versions and at the final one, a round sends
one eval request per held-out prompt to the generation workers' priority lane. A point is reported
for version v only if every result was served by v; results of another version are re-issued
(`eval/reissued`). A failed request is re-issued up to `eval.max_retries` times, then the round is
abandoned (`eval/failed`); dead or shrunk workers' requests are re-issued uncharged. Eval touches
neither storage, the ledgers nor admission: training goes on while a round runs.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from single_controller.config.schema import eval_max_new_tokens
from single_controller.deadlines import DeadlineExceeded, within
from single_controller.protocols import GenerationFailed, GenerationWorkerDied, generate
from single_controller.state import RunState
from single_controller.types import GenerationRequest, GenerationResult, Prompt, SamplingParams

PUMP = "eval"


def eval_sampling(state: RunState, stop_token_ids: tuple[int, ...]) -> SamplingParams:
    e = state.cfg.eval
    return SamplingParams(e.num_samples, e.temperature, e.top_p, eval_max_new_tokens(state.cfg), stop_token_ids)


def reward_part_means(parts: Iterable[Mapping[str, Sequence[float | None]]], prefix: str) -> dict[str, float]:
    """`<prefix>reward/<name>/mean` per reward function: the mean of its values over the groups'
    completions where it applied (not None); a function that applied to none is left out."""
    values: dict[str, list[float]] = {}
    for group in parts:
        for name, vs in group.items():
            values.setdefault(name, []).extend(v for v in vs if v is not None)
    return {f"{prefix}reward/{name}/mean": math.fsum(vs) / len(vs) for name, vs in values.items() if vs}


def eval_metrics(results: Sequence[GenerationResult], success_reward: float) -> dict[str, float]:
    """Scores of one round, one result per prompt, each with k = num_samples rewards.

    accuracy: fraction of all completions with reward >= success_reward; pass@k: fraction of prompts
    with at least one such completion; tokens: response tokens of the counted completions; and each
    reward function's mean (`eval/reward/<name>/mean`, with `reward.functions`).
    """
    rewards = [r for res in results for r in res.rewards]  # [P*k]
    k = len(results[0].rewards)
    return {
        "eval/accuracy": sum(r >= success_reward for r in rewards) / len(rewards),
        "eval/reward_mean": math.fsum(rewards) / len(rewards),
        f"eval/pass@{k}": sum(any(r >= success_reward for r in res.rewards) for res in results) / len(results),
        "eval/tokens": float(sum(n for res in results for n in res.response_lengths)),
        "eval/prompts": float(len(results)),
        **reward_part_means((res.reward_parts for res in results), "eval/"),
    }


@dataclass(frozen=True)
class EvalPoint:
    version: int  # every result of the point was served by exactly this policy version
    metrics: dict[str, float]  # eval_metrics(...) of the round
    seconds: float  # first request issued -> last result accepted
    reissued: int  # requests re-issued because another version served them
    failures: int  # failed attempts that were re-issued
    t_end: float


@dataclass(frozen=True)
class EvalStatistics:
    rounds: int  # points reported
    failed: int  # rounds abandoned after eval.max_retries failures of one request
    requests: int  # eval requests issued (re-issues included)
    reissued: int  # re-issued because another policy version served them
    request_failures: int  # GenerationFailed / deadline, over all rounds
    in_progress: bool
    evaluating_version: int | None  # target version of the round in progress
    num_samples: int  # k of pass@k
    last: EvalPoint | None
    last_failure: str | None


@dataclass
class EvalTracker:
    """Counters of the eval pump, read by `statistics()` (never by the pump's logic)."""

    num_samples: int
    rounds: int = 0
    failed: int = 0
    requests: int = 0
    reissued: int = 0
    request_failures: int = 0
    evaluating_version: int | None = None
    last: EvalPoint | None = None
    last_failure: str | None = None
    points: list[EvalPoint] = field(default_factory=list)

    def statistics(self) -> EvalStatistics:
        return EvalStatistics(
            self.rounds,
            self.failed,
            self.requests,
            self.reissued,
            self.request_failures,
            self.evaluating_version is not None,
            self.evaluating_version,
            self.num_samples,
            self.last,
            self.last_failure,
        )


async def eval_pump(
    state: RunState,
    prompts: Sequence[Prompt],
    tracker: EvalTracker,
    on_point: Callable[[EvalPoint], None],
    *,
    stop_token_ids: tuple[int, ...] = (),
) -> None:
    cfg = state.cfg.eval
    clk = state.pumps[PUMP]
    sampling = eval_sampling(state, stop_token_ids)
    evaluated: int | None = None  # the last version a point was reported (or a round abandoned) for
    due = 0
    try:
        while True:
            # Exits: training and weight sync have finished and the final version has been evaluated;
            # or the run was interrupted.
            # Idle between rounds is the schedule, not a stall: this wait is not billed to the pump's
            # clock (whose current wait feeds the stall alert); only waits for eval results are.
            await state.changed.wait_until(functools.partial(_round_due, state, due))
            if state.stop.abandon_open_step or (_training_over(state) and evaluated == state.versions.served):
                break  # (an interrupt: the run stops on its last finished step, without a last eval)
            point = await _round(state, prompts, sampling, tracker, clk.iterations)
            clk.iterations += 1
            evaluated = point.version if point is not None else state.versions.served
            due = (evaluated // cfg.every_steps + 1) * cfg.every_steps
            if point is not None:
                tracker.points.append(point)
                tracker.last = point
                tracker.rounds += 1
                on_point(point)
    finally:
        tracker.evaluating_version = None
        clk.finished = True
        state.notify()


def _round_due(state: RunState, due: int) -> bool:
    """Version `due` is out, no newer one can come, or the run was interrupted."""
    return state.versions.served >= due or _training_over(state) or state.stop.abandon_open_step


def _training_over(state: RunState) -> bool:
    """No weight update can come any more: the policy version is final."""
    return state.stop.train_done and state.pumps["weight_sync"].finished


async def _round(
    state: RunState, prompts: Sequence[Prompt], sampling: SamplingParams, tracker: EvalTracker, index: int
) -> EvalPoint | None:
    """Evaluate until every prompt has a result served by one version; None if abandoned."""
    t0 = state.clock()
    rnd = _Round(state, prompts, sampling, tracker, index)
    tracker.evaluating_version = rnd.target
    try:
        async with asyncio.TaskGroup() as requests:
            rnd.start(requests)
            abandoned = await _collect(state, rnd)
            for task in rnd.pending:
                task.cancel()  # abandoned: the other requests are not needed (eval stores nothing)
    finally:
        tracker.reissued += rnd.reissued
        tracker.evaluating_version = None
    if abandoned == "interrupted":
        return None
    if abandoned is not None:
        tracker.failed += 1
        tracker.last_failure = abandoned
        state.pumps[PUMP].errors += 1
        return None
    return rnd.point(t0)


async def _collect(state: RunState, rnd: _Round) -> str | None:
    """Take the round's results as they come; returns why the round was abandoned, if it was."""
    interrupted = asyncio.ensure_future(state.changed.wait_until(lambda: state.stop.abandon_open_step))
    try:
        while rnd.pending:
            # Exits: every prompt has a result served by the round's target (nothing pending); a
            # request failed more than eval.max_retries times (abandoned); an interrupt.
            waiting = asyncio.wait([*rnd.pending, interrupted], return_when=asyncio.FIRST_COMPLETED)
            done, _ = await state.waiting(waiting, PUMP, "eval results")
            if interrupted.done():
                return "interrupted"
            abandoned = None
            for task in done:
                # (a bug raised inside _request propagates from `result()`)
                abandoned = rnd.take(rnd.pending.pop(task), task.result()) or abandoned
            if abandoned is not None:
                return abandoned
        return None
    finally:
        interrupted.cancel()


class _Round:
    """One eval round: its requests in flight and the results accepted so far."""

    def __init__(
        self, state: RunState, prompts: Sequence[Prompt], sampling: SamplingParams, tracker: EvalTracker, index: int
    ) -> None:
        self.state, self.prompts, self.sampling, self.tracker, self.index = state, prompts, sampling, tracker, index
        self.target = state.versions.served  # the version the round measures
        self.accepted: dict[int, GenerationResult] = {}  # prompt index -> result served by `target`
        self.attempts = [0] * len(prompts)
        self.failures = [0] * len(prompts)
        self.reissued = 0
        self.pending: dict[asyncio.Task, int] = {}  # request -> prompt index
        self.requests: asyncio.TaskGroup | None = None

    def start(self, requests: asyncio.TaskGroup) -> None:
        self.requests = requests
        for i in range(len(self.prompts)):
            self.issue(i)

    def issue(self, i: int) -> None:
        p = self.prompts[i]
        req = GenerationRequest(f"eval{self.index}-{p.prompt_id}-a{self.attempts[i]}", p, self.sampling, eval=True)
        route = i + self.attempts[i]  # a re-issue goes to the next worker
        self.attempts[i] += 1
        self.tracker.requests += 1
        assert self.requests is not None, "issue() before start()"
        self.pending[self.requests.create_task(_request(self.state, req, route), name=req.group_id)] = i

    def take(self, i: int, outcome: GenerationResult | Exception) -> str | None:
        """Account prompt `i`'s outcome (accept it, or issue the request again); returns why the
        round is abandoned, if this outcome abandons it."""
        if isinstance(outcome, (GenerationWorkerDied, WorkerShrunk)):
            self.issue(i)  # not the request's fault: the worker is out of routing now
            return None
        if isinstance(outcome, Exception):
            self.failures[i] += 1
            self.tracker.request_failures += 1
            if self.failures[i] > self.state.cfg.eval.max_retries:
                return f"eval request for {self.prompts[i].prompt_id} failed {self.failures[i]} times: {outcome}"
            self.issue(i)
            return None
        version = outcome.version_end if outcome.version_start == outcome.version_end else None
        if version is None or version < self.target:
            self.reissued += 1
            self.issue(i)  # served (partly) by weights this round no longer measures
            return None
        if version > self.target:  # a weight update landed mid-round: measure the newer version
            self.target = self.tracker.evaluating_version = version
            for j in list(self.accepted):
                del self.accepted[j]
                self.reissued += 1
                self.issue(j)
        self.accepted[i] = outcome
        return None

    def point(self, t0: float) -> EvalPoint:
        results = [self.accepted[i] for i in range(len(self.prompts))]
        if any(r.version_start != self.target or r.version_end != self.target for r in results):
            raise AssertionError(f"eval round {self.index} would report v{self.target} with results of other versions")
        metrics = eval_metrics(results, self.state.cfg.task.success_reward)
        now = self.state.clock()
        return EvalPoint(self.target, metrics, now - t0, self.reissued, sum(self.failures), now)


class WorkerShrunk(GenerationFailed):
    """The worker serving an eval request was shrunk out of the run (`elastic.shrink`): the request
    was withdrawn from it, and goes again elsewhere without charging its retries."""


async def _unless_shrunk(state: RunState, worker, call: Awaitable[GenerationResult]) -> GenerationResult:
    """`call`'s result, unless `worker` is shrunk first: then the call is cancelled (which withdraws
    the request from the worker) and `WorkerShrunk` raised. A shrink waits for this before the
    worker sleeps (`RunState.eval_load`): an eval request never holds a slot the pool took back."""
    serving = asyncio.ensure_future(call)
    shrunk = asyncio.ensure_future(state.changed.wait_until(lambda: worker.name in state.elastic.out))
    try:
        await asyncio.wait([serving, shrunk], return_when=asyncio.FIRST_COMPLETED)
    finally:
        shrunk.cancel()
        if not serving.done():
            serving.cancel()
            await asyncio.wait([serving])  # withdrawn (`protocols.generate`) before the shrink goes on
    if serving.cancelled():
        raise WorkerShrunk(f"generation worker {worker.name} was shrunk while it served this eval request")
    return serving.result()


async def _request(state: RunState, req: GenerationRequest, route: int) -> GenerationResult | Exception:
    """One eval request to routable worker `route` (mod their number); a generation failure or a
    missed deadline is returned, not raised (a dead worker is also taken out of routing)."""
    # A dead worker may be restarting (by the rollout pump, which restarts no one once it has exited).
    await state.changed.wait_until(lambda: bool(state.routable()) or state.stop.rollout_done)
    routable = state.routable()
    if not routable:
        return GenerationFailed(f"no generation worker can serve eval request {req.group_id}: {state.health.down}")
    worker = routable[route % len(routable)]
    t0 = state.clock()
    state.eval_load[worker.name] += 1
    try:
        result = await _unless_shrunk(
            state,
            worker,
            within(
                generate(worker, req),
                state.cfg.timeouts.generate_s,
                f"generation worker {worker.name}: eval generate({req.group_id})",
            ),
        )
    except GenerationWorkerDied as e:
        state.worker_down(worker, str(e))
        return e
    except (GenerationFailed, DeadlineExceeded) as e:
        return e
    finally:
        state.eval_load[worker.name] -= 1
        state.notify()  # (a shrink waits for the worker's eval requests to be gone)
        state.pumps[PUMP].busy_s += state.clock() - t0  # worker-seconds, summed over concurrent requests (as rollout's)
    if result.group_id != req.group_id:
        raise RuntimeError(
            f"generation worker {worker.name} answered {result.group_id} for eval request {req.group_id}"
        )
    if len(result.rewards) != req.sampling.n:
        raise RuntimeError(
            f"generation worker {worker.name} returned {len(result.rewards)} rewards for n={req.sampling.n} "
            f"({req.group_id})"
        )
    return result
