"""Simulated backend: latency-scripted fake workers that satisfy the worker Protocols.

They run the whole control plane in milliseconds, in-process, on any row storage. The generation
worker is serial, writes real rows with deterministic rewards, stamps the version it serves and
serves eval requests in a priority lane (`sim_eval_rewards` depends on that version, so a test can
tell which weights produced an eval point). The trainer group checks the split-API state machine and
fetches every row it trains. `Faults` scripts generation failures and stalls, trainer failures, a
stall gate and failing or non-finite rewards.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import hashlib
import json
import os
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from replay.fetch import with_advantages
from replay.storage import RowStorage, column_nbytes
from single_controller.backends.common.behind_finish import BehindFinish
from single_controller.protocols import (
    ContextFull,
    EnvironmentFailed,
    GenerationFailed,
    GenerationWorkerDied,
    RewardFailed,
    TrainerFailed,
)
from single_controller.types import (
    GenerationRequest,
    GenerationResult,
    LossConfig,
    OffloadRecord,
    Prompt,
    StepResult,
    TrainChunk,
    TrainStatus,
    WeightsHandle,
)


@dataclass
class Faults:
    gen_fail: set[tuple[str, int]] = field(default_factory=set)  # (prompt_id, attempt) -> GenerationFailed
    gen_stall: set[tuple[str, int]] = field(default_factory=set)  # (prompt_id, attempt) -> never returns
    train_fail: set[tuple[int, int, int]] = field(default_factory=set)  # (step, chunk, attempt) -> TrainerFailed
    gate: asyncio.Event | None = None  # when set to an unset Event, generation blocks until it is set
    gen_delay: dict[tuple[str, int], float] = field(default_factory=dict)  # extra latency per attempt
    # replaces sim_rewards (e.g. all equal); one that raises fails its group alone (RewardFailed, or the
    # EnvironmentFailed or ContextFull it raises, as a worker playing episodes answers a group whose
    # environment failed or whose first observation filled the context)
    rewards: Callable[[str, int, int], tuple[float, ...]] | None = None
    # (prompt_id, attempt, G) -> each reward function's G values, as a worker with `reward.functions`
    # reports them beside the rewards (`GenerationResult.reward_parts`); None: none (the default reward)
    reward_parts: Callable[[str, int, int], Mapping[str, tuple[float | None, ...]]] | None = None
    die_after: dict[str, int] = field(default_factory=dict)  # worker name -> dies when this many groups were served
    restart_fails: set[str] = field(default_factory=set)  # worker names whose restart fails
    # worker name -> hangs (a stopped process: no answer to anything, not even a cancel) once this
    # many groups were served, until it is restarted (killed: everything it had fails)
    hang_after: dict[str, int] = field(default_factory=dict)
    wake_fails: set[str] = field(default_factory=set)  # worker names whose wake (an expand) fails


class SimMeter:
    """Time spent in the simulated workers' own code: every step of their coroutines and their timer
    callbacks (`meter_sim_workers`). A benchmark subtracts it from the process's CPU time to get the
    controller's: on one thread, a step that never blocks takes as much wall time as CPU time. The
    event loop's work of waking callers up is not in it: a real worker's answer costs that too.
    A metered call made inside another one (the trainer calling its own methods) counts once.

    The meter's own cost lands outside its readings, so a benchmark bills it to the controller: it
    is kept to one pair of clock readings per step, with no call layer of its own around the step
    (a metered call returns the awaitable that times its steps, not a coroutine wrapping it)."""

    __slots__ = ("seconds", "_inside")

    def __init__(self) -> None:
        self.seconds = 0.0
        self._inside = False


class _Metered:
    """Awaits `coro` as `await coro` would, with each of its steps timed by `meter` (a step inside
    another metered step is not timed again)."""

    __slots__ = ("_coro", "_meter")

    def __init__(self, coro, meter: SimMeter) -> None:
        self._coro, self._meter = coro, meter

    def __await__(self):
        coro, meter = self._coro, self._meter
        if meter._inside:
            # Awaited inside a metered step: the awaiting coroutine is metered, and every later
            # step of this one runs inside one of its steps, whose readings count it.
            return (yield from coro.__await__())
        clock = time.perf_counter
        value, error = None, None
        while True:
            meter._inside = True
            t0 = clock()
            try:
                yielded = coro.send(value) if error is None else coro.throw(error)
            except StopIteration as stop:
                return stop.value
            finally:
                meter.seconds += clock() - t0
                meter._inside = False
            try:
                value, error = (yield yielded), None
            except BaseException as e:  # a cancellation (or any error) thrown in: on to the inner coroutine
                value, error = None, e


def _metered_coroutine(fn, meter: SimMeter):
    """`fn` (a coroutine function) metered: a call returns an awaitable that times each step."""

    @functools.wraps(fn)
    def metered(*args, **kwargs):
        return _Metered(fn(*args, **kwargs), meter)

    return metered


def _metered_callback(fn, meter: SimMeter):
    """`fn` (an event-loop callback) metered: each call is timed, unless a metered step is
    already running (it then counts)."""

    @functools.wraps(fn)
    def metered(*args):
        if meter._inside:
            return fn(*args)
        meter._inside = True
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            meter.seconds += time.perf_counter() - t0
            meter._inside = False

    return metered


def sim_prompts(n: int | None = None, prompt_len: int = 5) -> Iterator[Prompt]:
    """Deterministic prompts p000000, p000001, ... (endless when n is None)."""
    tokens = [tuple((i + j) % 10 + 3 for j in range(prompt_len)) for i in range(10)]  # they repeat every 10
    i = 0
    while n is None or i < n:
        yield Prompt(f"p{i:06d}", tokens[i % 10], str(i))
        i += 1


def sim_rewards(prompt_id: str, attempt: int, group_size: int) -> tuple[float, ...]:
    """Deterministic rewards in [0, 1] from (prompt, attempt): the same data on every run."""
    out = []
    for i in range(group_size):
        h = hashlib.blake2b(f"{prompt_id}/{attempt}/{i}".encode(), digest_size=4).digest()
        out.append(int.from_bytes(h, "little") % 5 / 4.0)
    return tuple(out)


def sim_eval_rewards(prompt_id: str, version: int, n: int) -> tuple[float, ...]:
    """Deterministic eval rewards in {0, 0.25, ..., 1} of (prompt, serving version): every version
    scores differently, so a point mixing versions would not match the one it claims."""
    out = []
    for i in range(n):
        h = hashlib.blake2b(f"eval/{prompt_id}/{version}/{i}".encode(), digest_size=4).digest()
        out.append(int.from_bytes(h, "little") % 5 / 4.0)
    return tuple(out)


EVAL_LANE, ROLLOUT_LANE = 0, 1


class SimGenerationWorker:
    """A serial engine on a schedule: queued requests (eval lane first, FIFO within a lane) are
    served one at a time, each ending `group_s` after the previous one ended (or after it arrived,
    if the worker was idle), on one timer per request. A request's version is the worker's version
    when its compute starts; a weight update lands between two requests. With `group_s == 0` a
    request is served at once (there is nothing to wait for). A caller that stops waiting
    (cancelled) leaves its place in the queue; the request being computed still takes its time,
    as an engine's would.

    `max_batch > 1`: a batching engine, as the shipped clients are (`ActorGenerationClient` sends
    the requests of one event-loop tick as one `generate_many` call and hands their results back
    together). Requests that arrive in the same tick, and those queued while a batch computes, are
    served together, up to `max_batch` of one lane per batch: a batch takes the sum of its requests'
    times (the serial engine's throughput), starts at one version, and all its results come back at
    its end, on one timer.

    `submit` (what the rollout pump calls): a plain request (a rollout on a timed engine that
    writes no rows, with no fault scripted on this worker) joins the engine's queue as one future
    that its compute's end resolves with the result, nothing running for it in between; any other
    request runs `generate` as a task, whose future this is."""

    def __init__(
        self,
        name: str,
        storage: RowStorage,
        *,
        group_s: float = 0.0,
        faults: Faults | None = None,
        writes_rows: bool = True,
        keep_logs: bool = True,
        max_batch: int = 1,
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        self.name = name
        self.storage = storage
        self.group_s = group_s
        self.faults = faults or Faults()
        self.writes_rows = writes_rows
        self.version = 0
        logs = list if keep_logs else _Discard
        self.generated: list[str] = logs()
        self.evaluated: list[tuple[str, int]] = logs()  # (eval request id, version that served it)
        self._row_cache: dict[tuple[int, int], dict] = {}
        self._in_flight = 0
        self._rollout_n = 1  # rows of the last rollout group: an eval request costs its share of rows
        self.dead = False
        self._death: asyncio.Event | None = None  # created lazily on the running loop
        self._hung: asyncio.Future[None] | None = None  # while hung: resolved when it is killed (restarted)
        self.calls_while_dead = 0  # requests routed to this worker while it was dead
        self.asleep: int | None = None  # the sleep level while shrunk (`sleep`), None while awake
        self.weights_dropped = False  # by a sleep at level >= 1: nothing to serve until an update
        self.calls_while_asleep = 0  # requests routed to this worker while it slept
        self.sleeps: list[int] = []  # the level of every sleep, in order
        self.restarts = 0
        self._epoch = 0
        self._reset_engine()

    def _reset_engine(self) -> None:
        # Queued requests by lane (eval first): (request, future, arrival time); the future takes the
        # version the request is served at.
        self._lanes: tuple[collections.deque, collections.deque] = (collections.deque(), collections.deque())
        self._computing = False  # a request's compute is under way (its timer is set)
        self._started: dict[str, float] = {}  # group id -> when its work started (loop time), while under way
        self._free_at = 0.0  # when the work scheduled so far ends
        self._pending_update: tuple[int, asyncio.Future] | None = None
        self._epoch += 1  # the timer of a request computed before a restart is ignored

    def _died(self) -> asyncio.Event:
        if self._death is None:
            self._death = asyncio.Event()
        return self._death

    def _check_alive(self) -> None:
        if self.dead:
            self.calls_while_dead += 1
            raise GenerationWorkerDied(f"{self.name}: the worker process died")

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self._check_alive()
        if self.name not in self.faults.die_after:  # it cannot die mid-request: no death watch
            return await self._generate(request)
        death = asyncio.ensure_future(self._died().wait())
        work = asyncio.ensure_future(self._generate(request))
        try:
            await asyncio.wait([death, work], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.cancel()
            raise
        finally:
            death.cancel()
        if not work.done():  # died mid-request: like a killed process, the call fails
            work.cancel()
            raise GenerationWorkerDied(f"{self.name}: the worker process died while generating {request.group_id}")
        return work.result()

    def submit(self, request: GenerationRequest) -> asyncio.Future[GenerationResult]:
        if self.asleep is not None or self.weights_dropped:
            self.calls_while_asleep += 1
            failed: asyncio.Future[GenerationResult] = asyncio.get_running_loop().create_future()
            failed.set_exception(
                GenerationFailed(f"{self.name}: asleep (level {self.asleep}), or woken with no weights")
            )
            return failed
        f = self.faults
        scripted = (
            f.gate is not None
            or f.gen_fail
            or f.gen_stall
            or f.gen_delay
            or self.name in f.die_after
            or self.name in f.hang_after
        )
        if self.dead or request.eval or self.writes_rows or not self.group_s or scripted:
            return asyncio.ensure_future(self.generate(request))
        fut: asyncio.Future[GenerationResult] = asyncio.get_running_loop().create_future()
        self._in_flight += 1
        self._enqueue(request, fut, plain=True)
        return fut

    async def withdraw(self, request: GenerationRequest, future: asyncio.Future[GenerationResult]) -> None:
        """A plain request writes nothing; a request running `generate` writes nothing once its
        task has unwound. A hung worker answers nothing until it is killed (restarted)."""
        try:
            await self._unless_hung()
        except GenerationWorkerDied:
            return  # killed: it writes nothing more
        if not future.done():
            await asyncio.wait([future])

    async def _unless_hung(self) -> None:
        """Returns at once, unless the worker hangs: then it raises `GenerationWorkerDied` when the
        worker is killed (restarted), like every call of a stopped process that is then killed."""
        if self._hung is None:
            return
        await asyncio.shield(self._hung)  # a cancelled caller stops waiting; the worker stays hung
        raise GenerationWorkerDied(f"{self.name}: the hung worker process was killed")

    async def restart(self, weights: WeightsHandle | None) -> None:
        if self._hung is not None:  # killed first: everything the hung process had fails
            self._hung.set_result(None)
            self._hung = None
        if self.name in self.faults.restart_fails:
            raise GenerationFailed(f"{self.name}: restart failed")
        self.dead, self._death = False, None
        self.version = weights.version if weights is not None else 0
        self.asleep, self.weights_dropped = None, False  # a new process: awake, with `weights`
        self._reset_engine()
        self.restarts += 1

    async def _generate(self, request: GenerationRequest) -> GenerationResult:
        attempt = int(request.group_id.rsplit("-a", 1)[1])
        fault_key = (request.prompt.prompt_id, attempt)
        self._in_flight += 1
        try:
            await self._unless_hung()
            if self.faults.gate is not None or fault_key in self.faults.gen_stall or fault_key in self.faults.gen_delay:
                # a scripted wait is the engine at work on the request (a wedged or slow engine)
                self._started.setdefault(request.group_id, asyncio.get_running_loop().time())
            if self.faults.gate is not None:
                await self.faults.gate.wait()
            if fault_key in self.faults.gen_stall:
                await asyncio.Event().wait()  # a wedged engine: only the deadline ends this
            if fault_key in self.faults.gen_delay:
                await asyncio.sleep(self.faults.gen_delay[fault_key])  # out-of-order completion
            if not self.group_s:  # no compute to wait for: served now
                version = self._starts(request)
            else:
                served = asyncio.get_running_loop().create_future()
                self._enqueue(request, served, plain=False)
                version = await served
            if fault_key in self.faults.gen_fail:
                raise GenerationFailed(f"{self.name}: injected failure for {request.group_id}")
            if request.eval:  # scored, never stored
                rewards = sim_eval_rewards(request.prompt.prompt_id, version, request.sampling.n)
                self.evaluated.append((request.group_id, version))
                T = request.sampling.max_new_tokens
                return GenerationResult(
                    request.group_id,
                    rewards,
                    (T,) * request.sampling.n,
                    len(request.prompt.token_ids),
                    version,
                    version,
                )
            await self._unless_hung()  # hung while it computed: no answer
            result = await self._store(request, attempt, version)
            self.generated.append(request.group_id)
            if self.faults.hang_after.get(self.name) == len(self.generated) and not self.restarts:
                self._hung = asyncio.get_running_loop().create_future()
            if self.faults.die_after.get(self.name) == len(self.generated) and not self.restarts:
                self.dead = True  # every call in flight on it fails now, and every new one
                self._died().set()
            return result
        finally:
            self._in_flight -= 1
            self._started.pop(request.group_id, None)

    def _enqueue(self, request: GenerationRequest, served: asyncio.Future, *, plain: bool) -> None:
        """Queue `request` in its lane (`served`: resolved with the version it is served at, or with
        its result when `plain`) and start the engine if it is idle."""
        loop = asyncio.get_running_loop()
        self._lanes[EVAL_LANE if request.eval else ROLLOUT_LANE].append((request, served, loop.time(), plain))
        if not self._computing:
            if self.max_batch == 1:
                self._serve_next(loop)
            else:  # the rest of this tick's requests join the batch, as one generate_many call
                self._computing = True
                loop.call_soon(self._serve_scheduled, loop, self._epoch)

    def _result(self, request: GenerationRequest, attempt: int, version: int) -> GenerationResult:
        """What generating `request` at `version` answers: its rewards, G responses of the full length."""
        G, T = request.sampling.n, request.sampling.max_new_tokens
        try:
            rewards = (self.faults.rewards or sim_rewards)(request.prompt.prompt_id, attempt, G)
        except (EnvironmentFailed, ContextFull):  # a scripted episode failure: this group's alone
            raise
        except Exception as e:  # a scripted reward failure: this group's alone
            raise RewardFailed(f"{self.name}: reward function failed on group {request.group_id}: {e!r}") from e
        parts = self.faults.reward_parts(request.prompt.prompt_id, attempt, G) if self.faults.reward_parts else {}
        sample = (f"prompt {request.prompt.prompt_id}", f"completion 0 of {request.group_id}", rewards[0])
        return GenerationResult(
            request.group_id, rewards, (T,) * G, len(request.prompt.token_ids), version, version, parts, sample
        )

    def _starts(self, request: GenerationRequest) -> int:
        """`request`'s compute starts: returns the version it is served at."""
        if not request.eval:
            self._rollout_n = request.sampling.n
        return self.version

    def _serve_next(self, loop: asyncio.AbstractEventLoop, epoch: int | None = None) -> None:
        """Start the next batch (one request on a serial engine) of queued requests whose callers
        still wait, with a timer for its end."""
        if epoch is not None and epoch != self._epoch:  # scheduled before a restart
            return
        for lane in self._lanes:
            batch: list[tuple[asyncio.Future, GenerationRequest | None]] = []  # (future, the request if plain)
            started: list[GenerationRequest] = []
            cost, first_arrived = 0.0, None
            while lane and len(batch) < self.max_batch:
                request, served, arrived, plain = lane.popleft()
                if served.done():  # its caller stopped waiting
                    self._in_flight -= plain
                    continue
                version = self._starts(request)
                cost += self.group_s * (request.sampling.n / self._rollout_n if request.eval else 1.0)
                first_arrived = arrived if first_arrived is None else first_arrived
                batch.append((served, request if plain else None))
                started.append(request)
            if batch:
                assert first_arrived is not None  # set with the first request batched
                # timed against the worker's own schedule: a timer that fires late (they are
                # millisecond-grained) delays one batch, not every one after it
                start = max(self._free_at, first_arrived)
                for request in started:
                    self._started.setdefault(request.group_id, start)
                self._free_at = start + cost
                self._computing = True
                loop.call_at(self._free_at, self._served, loop, batch, version, self._epoch)
                return
        self._computing = False

    _serve_scheduled = _serve_next  # `_serve_next` as an event-loop callback (metered on its own)

    def _served(
        self,
        loop: asyncio.AbstractEventLoop,
        batch: list[tuple[asyncio.Future, GenerationRequest | None]],
        version: int,
        epoch: int,
    ) -> None:
        if epoch != self._epoch:  # computed by the process a restart replaced
            return
        for served, plain in batch:
            if plain is not None:  # a plain submission: its future takes the result itself
                self._in_flight -= 1
                self._started.pop(plain.group_id, None)
                if not served.done():
                    try:
                        result = self._result(plain, int(plain.group_id.rsplit("-a", 1)[1]), version)
                    except RewardFailed as e:
                        served.set_exception(e)
                        continue
                    self.generated.append(plain.group_id)
                    served.set_result(result)
            elif not served.done():
                served.set_result(version)
        self._computing = False
        self._apply_pending_update()
        self._serve_next(loop)

    async def _store(self, request: GenerationRequest, attempt: int, version: int) -> GenerationResult:
        result = self._result(request, attempt, version)
        if not self.writes_rows:
            return result
        G, T, rewards = request.sampling.n, request.sampling.max_new_tokens, result.rewards
        rows = self._rows(G, T)  # the storage copies what it keeps, so the same tensors serve every group
        prompt = torch.tensor(request.prompt.token_ids, dtype=torch.int64)
        versions = [torch.full((T,), version, dtype=torch.int64)] * G
        columns = {
            **rows,
            "prompt_ids": [prompt] * G,
            "token_versions": versions,
            "reward": torch.tensor(rewards, dtype=torch.float32),
        }
        tags = [{"group_id": request.group_id, "version_start": version, "version_end": version}] * G
        await self.storage.put_rows(request.row_keys, columns, tags)
        return result

    def _rows(self, G: int, T: int) -> dict:
        if (G, T) not in self._row_cache:
            self._row_cache[(G, T)] = {
                "response_ids": [torch.full((T,), i % 7 + 3, dtype=torch.int64) for i in range(G)],
                "gen_logprobs": [torch.full((T,), -1.0) for _ in range(G)],
                "response_mask": [torch.ones(T, dtype=torch.bool) for _ in range(G)],
            }
        return self._row_cache[(G, T)]

    async def update_weights(self, weights: WeightsHandle) -> None:
        """Applied between requests, like a real worker between batches: after the one being
        computed, ahead of those still queued."""
        self._check_alive()
        await self._unless_hung()
        if weights.version <= self.version and not self.weights_dropped:
            raise RuntimeError(f"{self.name}: weights v{weights.version} after v{self.version}")
        if self.asleep is not None and self.asleep > 0:
            raise GenerationFailed(
                f"{self.name}: update_weights(v{weights.version}) while asleep at level {self.asleep}"
            )
        self.weights_dropped = False
        if not self._computing:
            self.version = weights.version
            return
        applied = asyncio.get_running_loop().create_future()
        self._pending_update = (weights.version, applied)
        if self.name not in self.faults.die_after:  # it cannot die meanwhile: no death watch
            await applied
            return
        death = asyncio.ensure_future(self._died().wait())
        try:
            await asyncio.wait([applied, death], return_when=asyncio.FIRST_COMPLETED)
        finally:
            death.cancel()
        if not applied.done():
            raise GenerationWorkerDied(f"{self.name}: the worker process died before applying v{weights.version}")

    def _apply_pending_update(self) -> None:
        if self._pending_update is not None:
            (version, applied), self._pending_update = self._pending_update, None
            self.version = version
            if not applied.done():
                applied.set_result(None)

    async def in_flight(self) -> int:
        return self._in_flight

    async def running(self) -> dict[str, float]:
        """`protocols.ReportsRunning`: the requests of the batch being computed (one with a scripted
        gate, stall or delay: from the start of that wait), with how long each has run. A hung worker
        answers nothing; a dead one fails."""
        self._check_alive()
        await self._unless_hung()
        now = asyncio.get_running_loop().time()
        return {gid: max(0.0, now - t) for gid, t in self._started.items()}

    async def sleep(self, level: int) -> None:
        """Shrunk (`protocols.Sleepable`): level >= 1 drops the weights (the version is kept only to
        say which weights it had); every request routed to it meanwhile fails and is counted."""
        self._check_alive()
        self.asleep = max(level, self.asleep or 0)
        self.weights_dropped = self.weights_dropped or level >= 1
        self.sleeps.append(level)

    async def wake(self) -> None:
        self._check_alive()
        if self.name in self.faults.wake_fails:
            raise GenerationFailed(f"{self.name}: wake failed (scripted)")
        self.asleep = None

    async def policy_version(self) -> int | None:
        return None if self.weights_dropped else self.version


def _drop_outcome(task: asyncio.Task) -> None:
    """Nobody awaits this call any more: read its outcome so an error is not reported as unhandled."""
    if not task.cancelled():
        task.exception()


SIM_LOSS_STATISTICS = (
    "train/entropy",
    "train/clip_frac",
    "train/clip_frac_low",
    "train/clip_frac_high",
    "train/is_weight_max",
    "train/is_truncated_frac",
    "train/is_masked_frac",
)


def sim_reward_kl(key: str) -> float:
    """The sim trainer's KL to the reference of the row `key`: a fixed value in [0, 0.6], by key."""
    return (zlib.crc32(key.encode()) % 7) / 10


class SimTrainerGroup:
    """Like a Ray actor, every call runs to completion on the "remote" side even if the caller
    stops waiting (a deadline): calls execute one at a time as tasks the caller only awaits
    through `asyncio.shield`. So a finish that outlives its deadline still applies its step, and
    `train_status` (queued behind it) reports that it did. `begin_behind_finish` queues the next step's
    begin and first chunk behind a finish in flight; their errors are reported by the next call."""

    def __init__(
        self,
        storage: RowStorage,
        *,
        group_s: float = 0.0,
        finish_s: float = 0.0,
        faults: Faults | None = None,
        fetch_rows: bool = True,
        keep_logs: bool = True,
    ):
        self.keep_logs = keep_logs
        self.storage = storage
        self.group_s = group_s
        self.finish_s = finish_s
        self.faults = faults or Faults()
        self.fetch_rows = fetch_rows
        self.version = 0  # optimizer steps applied = the next step begin accepts
        self.optimizer_steps = 0
        self.offloaded: str | None = None  # `offload(what)` until `onload()`
        self.moves: list[tuple[str, int]] = []  # ("offload" | "onload", version then)
        self.implicit_onloads = 0
        self.trained: dict[int, list[str]] = {}  # step -> row keys, recorded at finish only
        self.updates: dict[int, list[tuple[str, ...]]] = {}  # step -> its updates' row keys (the last attempt)
        self._update = 0  # the open step's update under way (`train.updates_per_step`)
        self.reward_kl_calls: list[tuple[str, ...]] = []  # `reward_kl`'s keys, call by call
        self.attempts: dict[int, int] = {}
        self.aborts = 0
        self._open: list[str] | None = None
        self._step: int | None = None
        self._last: StepResult | None = None
        self.bytes_read = 0
        self._serial = asyncio.Lock()
        self._remote: set[asyncio.Task] = set()
        self._due: list[asyncio.Task] = []  # calls sent behind a finish, their answers not taken yet
        self._failed: str | None = None  # why a microbatch of the open step failed
        self.begun_behind_finish: list[int] = []  # steps begun behind a finish that succeeded
        self._finish = BehindFinish()  # the finish in flight and the next step's calls sent behind it
        self.meter: SimMeter | None = None  # set by `meter_sim_workers`

    def _send(self, coro) -> asyncio.Task:
        """Start `coro` as the remote side would: serially (in the order sent), and to completion
        whatever the caller does."""

        async def serially():
            async with self._serial:
                return await coro

        # metered as a whole: taking the lock in turn is the remote side's work too
        task = asyncio.ensure_future(serially() if self.meter is None else _Metered(serially(), self.meter))
        self._remote.add(task)
        task.add_done_callback(self._remote.discard)
        return task

    async def _call(self, coro, *, quiet: bool = False):
        task = self._send(coro)
        try:
            await self._answers(quiet)
        except BaseException:
            task.add_done_callback(_drop_outcome)
            raise
        return await asyncio.shield(task)

    async def _answers(self, quiet: bool = False) -> None:
        """The answers of calls sent behind a finish, oldest first: the first error is raised
        (`quiet`: dropped, for an abort or a status) and the rest are dropped."""
        due, self._due = self._due, []
        for i, task in enumerate(due):
            try:
                await asyncio.shield(task)
            except Exception:
                for later in due[i + 1 :]:
                    later.add_done_callback(_drop_outcome)
                if not quiet:
                    raise
                return

    async def begin_behind_finish(self, step: int, loss: LossConfig, chunk: TrainChunk) -> bool:
        return await self._finish.begin(
            self,
            step,
            loss,
            chunk,
            idle=self._open is None,
            send_behind=lambda: [self._send(self._begin(step)), self._send(self._microbatch(chunk))],
        )

    async def begin_train_step(self, step: int, loss: LossConfig) -> None:
        await self._call(self._begin(step))

    async def offload(self, what: str) -> OffloadRecord:
        """`train.offload` (`protocols.Offloadable`): records the move (`moves`); nothing to move."""
        if self._open is not None:
            raise RuntimeError(f"offload({what}) while step {self._step} is open")
        self.offloaded = what
        self.moves.append(("offload", self.version))
        return OffloadRecord("offload", 0, 0.0, 0)

    async def onload(self) -> OffloadRecord:
        self.offloaded = None
        self.moves.append(("onload", self.version))
        return OffloadRecord("onload", 0, 0.0, 0)

    async def _begin(self, step: int) -> None:
        if self.offloaded is not None:
            self.implicit_onloads += 1  # as the torch trainer does: a call that needs the state brings it back
            self.offloaded = None
        if self._open is not None:
            raise RuntimeError(f"begin_train_step({step}) while step {self._step} is open")
        if step != self.version:
            raise RuntimeError(f"begin_train_step({step}) but the trainer's next step is {self.version}")
        self._open, self._step, self.bytes_read, self._failed, self._update = [], step, 0, None, 0
        if self.keep_logs:
            self.updates[step] = [()]
        if not self.keep_logs:
            self.attempts.pop(step - 1, None)  # only the open step's attempts matter
        self.attempts[step] = self.attempts.get(step, -1) + 1

    async def reward_kl(self, keys: Sequence[str], seq_lengths: Sequence[int], estimator: str) -> tuple[float, ...]:
        """A made-up KL per row (`sim_reward_kl`); fails when the storage no longer holds a row, as a
        rank's read would."""
        if self.fetch_rows:
            await self.storage.get_rows(list(keys), ["response_ids"])
        self.reward_kl_calls.append(tuple(keys))
        return tuple(sim_reward_kl(k) for k in keys)

    async def train_microbatch(self, chunk: TrainChunk) -> None:
        await self._call(self._microbatch(chunk))

    async def _microbatch(self, chunk: TrainChunk) -> None:
        if self._open is None:
            raise RuntimeError("train_microbatch with no step open")
        if chunk.step != self._step:
            raise RuntimeError(f"chunk of step {chunk.step} in step {self._step}")
        if chunk.update not in (self._update, self._update + 1):  # as a real rank refuses it
            raise RuntimeError(f"chunk of update {chunk.update} while update {self._update} is under way")
        if chunk.update != self._update:
            self._update = chunk.update
            if self.keep_logs:
                self.updates[chunk.step].append(())
        try:
            await self._accumulate(chunk)
        except BaseException as e:
            # Partial gradients: the step's finish refuses until it is aborted (as a real rank's does).
            self._failed = self._failed or f"{type(e).__name__}: {e}"
            raise

    async def _accumulate(self, chunk: TrainChunk) -> None:
        if self.fetch_rows:
            rows = await self.storage.get_rows(chunk.row_keys, chunk.fields)
            self.bytes_read += sum(column_nbytes(col) for col in rows.values())
            if "advantage" not in with_advantages(rows, chunk.rank_advantages(chunk.row_keys)):
                raise RuntimeError(
                    f"chunk {chunk.chunk_index} of step {chunk.step}: no advantages (neither carried nor read)"
                )
        if self.group_s:
            n_groups = max(1, sum(k.endswith("_g0") for k in chunk.row_keys))  # a chunk holds whole groups
            await _busy(self, self.group_s * n_groups, asyncio.get_running_loop().time())  # simulated compute
        if (chunk.step, chunk.chunk_index, self.attempts[chunk.step]) in self.faults.train_fail:
            raise TrainerFailed(f"injected trainer failure in step {chunk.step} chunk {chunk.chunk_index}")
        assert self._open is not None  # `_microbatch` checked it, and calls run one at a time (`_send`)
        self._open.extend(chunk.row_keys)
        if self.keep_logs:
            self.updates[chunk.step][-1] += chunk.row_keys

    async def finish_train_step(self, step: int) -> StepResult:
        finish = self._send(self._finish_step(step))
        self._finish.start(step)
        try:
            await self._answers()
            result = await asyncio.shield(finish)
        except BaseException:
            # A next step sent behind: begun only if the finish landed after all; the abort undoes it.
            self._finish.finished_last = None
            undo = [self._send(self._abort(step + 1))] if self._finish.behind else []
            for task in [finish, *self._finish.behind, *undo]:
                task.add_done_callback(_drop_outcome)
            raise
        finally:
            behind = self._finish.end()
        self._finish.succeeded(step)
        if behind:
            self._due = behind
            if self.keep_logs:
                self.begun_behind_finish.append(step + 1)
        return result

    async def _finish_step(self, step: int) -> StepResult:
        if self._open is None and self._last is not None and self._last.step == step:
            return self._last  # a retried finish: the step was applied once already
        if self._open is None or self._step != step:
            raise RuntimeError(f"finish_train_step({step}) but the open step is {self._step}")
        if self._failed is not None:
            raise TrainerFailed(
                f"finish_train_step({step}): a microbatch of the step failed ({self._failed}); abort it"
            )
        if self.finish_s:
            await asyncio.sleep(self.finish_s)
        keys = self._open
        if len(set(keys)) != len(keys):
            raise RuntimeError(f"step {step} trained a row twice")
        if self.keep_logs:
            self.trained[step] = keys
        self._open = self._step = None
        self.version += 1
        self.optimizer_steps += 1
        # No policy, no loss: the statistics every real trainer reports (`split_step.step_metrics`) are 0.
        stats = dict.fromkeys(SIM_LOSS_STATISTICS, 0.0)
        self._last = StepResult(
            step,
            {"train/loss": 0.0, "train/rows": float(len(keys)), "train/bytes_read": float(self.bytes_read), **stats},
        )
        return self._last

    async def abort_train_step(self, step: int) -> None:
        await self._call(self._abort(step), quiet=True)

    async def _abort(self, step: int) -> None:
        if self._open is not None and self._step == step:
            self.aborts += 1
            self._open = self._step = None

    async def train_status(self) -> TrainStatus:
        return await self._call(self._status(), quiet=True)

    async def _status(self) -> TrainStatus:
        return TrainStatus(self.version, self._step, None if self._last is None else self._last.step)

    async def export_weights(self, version: int) -> WeightsHandle:
        if version != self.version:
            raise RuntimeError(f"export_weights(v{version}) but the trainer is at v{self.version}")
        return WeightsHandle(version, payload=None, num_bytes=0)

    async def save_state(self, directory: str) -> None:
        await self._call(self._save(directory))

    async def _save(self, directory: str) -> None:
        if self._open is not None:
            raise RuntimeError(f"save_state while step {self._step} is open")
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "sim_trainer.json"), "w", encoding="utf-8") as f:
            json.dump({"version": self.version, "optimizer_steps": self.optimizer_steps}, f)

    async def load_state(self, directory: str) -> int:
        with open(os.path.join(directory, "sim_trainer.json"), encoding="utf-8") as f:
            saved = json.load(f)
        self.version, self.optimizer_steps = saved["version"], saved["optimizer_steps"]
        self._open = self._step = self._last = None
        return self.version


def sim_workers(
    storage: RowStorage,
    *,
    num_generators: int = 1,
    gen_group_s: float = 0.0,
    train_group_s: float = 0.0,
    faults: Faults | None = None,
    trainer_reads_rows: bool = True,
    workers_write_rows: bool = True,
    keep_logs: bool = True,
    meter: SimMeter | None = None,
    gen_max_batch: int = 1,
) -> tuple[Sequence[SimGenerationWorker], SimTrainerGroup]:
    """For benchmarks of the controller alone: `trainer_reads_rows=False` / `workers_write_rows=False`
    skip the row reads and writes the fake workers would otherwise do on the controller's own thread
    (real workers do them in their own processes; the trainer must not read rows nobody wrote), and
    `keep_logs=False` drops the per-group logs tests read (a long benchmark run keeps memory flat), and
    `meter` adds the time spent in the workers' own code to it (`meter_sim_workers`);
    `gen_max_batch > 1` makes the generation workers batching engines (`SimGenerationWorker`)."""
    faults = faults or Faults()
    gens = [
        SimGenerationWorker(
            f"sim-gen-{i}",
            storage,
            group_s=gen_group_s,
            faults=faults,
            writes_rows=workers_write_rows,
            keep_logs=keep_logs,
            max_batch=gen_max_batch,
        )
        for i in range(num_generators)
    ]
    trainer = SimTrainerGroup(
        storage, group_s=train_group_s, faults=faults, fetch_rows=trainer_reads_rows, keep_logs=keep_logs
    )
    if meter is not None:
        meter_sim_workers(gens, trainer, meter)
    return gens, trainer


GENERATION_CALLS = ("generate", "update_weights", "in_flight", "restart", "sleep", "wake", "policy_version")
TRAINER_CALLS = (
    "begin_train_step",
    "train_microbatch",
    "finish_train_step",
    "abort_train_step",
    "train_status",
    "export_weights",
    "save_state",
    "load_state",
    "begin_behind_finish",
)


def meter_sim_workers(gens: Sequence[SimGenerationWorker], trainer: SimTrainerGroup, meter: SimMeter) -> None:
    """From now on, every call the controller makes on these workers, the trainer's calls run behind
    them, and the generation workers' timer callbacks add their time to `meter`."""
    for g in gens:
        for name in GENERATION_CALLS:
            setattr(g, name, _metered_coroutine(getattr(g, name), meter))
        # the worker schedules its timers as self._served (and a batching engine self._serve_scheduled): these
        for name in ("_served", "_serve_scheduled", "submit"):  # `submit` is a plain call, not a coroutine
            setattr(g, name, _metered_callback(getattr(g, name), meter))
    for name in TRAINER_CALLS:
        setattr(trainer, name, _metered_coroutine(getattr(trainer, name), meter))
    trainer.meter = meter


async def _busy(worker, seconds: float, arrived: float) -> None:
    """`seconds` of simulated compute on a serial worker, timed against the worker's own schedule:
    it ends `seconds` after the previous piece of work ended, or after the request `arrived` if the
    worker was idle then. A timer that fires late (the event loop's timers are millisecond-grained)
    delays one piece, not every piece after it: many sub-millisecond pieces add up to their total."""
    loop = asyncio.get_running_loop()
    start = max(getattr(worker, "_free_at", 0.0), arrived)
    worker._free_at = start + seconds
    await asyncio.sleep(max(0.0, worker._free_at - loop.time()))


class _Discard(list):
    """A log that keeps nothing (`keep_logs=False`)."""

    def append(self, item) -> None:
        pass
