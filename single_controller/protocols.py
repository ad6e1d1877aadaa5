"""Worker contracts the controller drives. Backends (simulated, embedded CPU, vLLM/Megatron) are
separate classes that satisfy these Protocols; the controller never imports a backend.

All methods are coroutines on the controller's event loop, but `GenerationWorker.submit`, which
returns a future. The controller puts a deadline on every call (see `single_controller.deadlines`),
so implementations need not time out themselves; a call it cancels (a deadline, an aborted rollout)
must write nothing more by the time it re-raises (a cancelled submission: by the time `withdraw`
returns).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

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


class GenerationFailed(RuntimeError):
    """A generation worker could not produce a group; the rollout pump retries or drops the prompt."""


class GenerationWorkerDied(GenerationFailed):
    """The worker process is gone: every request in flight on it fails, and so will new ones.

    The rollout pump takes the worker out of routing, re-dispatches its in-flight prompts without
    charging their retry budget, and restarts it (`Restartable`) before it takes work again."""


class RewardFailed(GenerationFailed):
    """The reward function failed for one group: it raised, or gave a reward that is not finite.

    It costs that group alone: the worker answers it with this error and its batch-mates with
    their results, storing no row of it. The rollout pump drops the group with reason
    `reward_failed` and does not retry its prompt (a deterministic reward error would fail again)."""


class EnvironmentFailed(GenerationFailed):
    """The environment failed one of a group's episodes more often than `env.max_attempts` allows
    (an error, a missed deadline, a broken contract). It costs that group alone: no row of it is
    stored; the rollout pump drops it with reason `env_failed` and counts it (never a zero reward)."""


class ContextFull(GenerationFailed):
    """A multi-turn group's episode had no room for one policy token: the prompt and the
    environment's first observation fill the model's positions. It costs that group alone: no row
    of it is stored; the rollout pump drops it with reason `context_full`, counts it and does not
    retry its prompt (the same prompt would fill the context again)."""


class TrainStepStateError(RuntimeError):
    """The split API was called out of order (begin twice, microbatch or finish with no step open)."""


class TrainerFailed(RuntimeError):
    """A trainer error inside a step; the train pump asks the trainer where it stands, then aborts
    the step and retries it (or takes the result of a finish that landed after all)."""


class TrainerStateLost(RuntimeError):
    """A trainer rank's optimizer step failed partway: its parameters are partly updated and there
    is no copy to restore them from (a step keeps none: an abort before the optimizer step only
    drops the gradients). The rank refuses every further step, abort and save until a checkpoint is
    loaded; the run stops (resume from the last checkpoint)."""


class TrainerRankDied(RuntimeError):
    """A trainer rank's process is gone: the open step is abandoned and the run stops with this
    error naming the rank (resume from the last checkpoint)."""


@runtime_checkable
class GenerationWorker(Protocol):
    """Samples a prompt group, scores it with the reward function next to the data, stores the rows
    under `request.row_keys`, and returns small columns (rewards, lengths, version stamps).

    Eval requests (`request.eval`, evaluation while training flows, see `pumps/eval.py`):
    * same sampling and reward function as rollouts; `sampling.temperature == 0` means greedy;
    * nothing is written to storage (the request has no row keys) and nothing else is kept;
    * served ahead of rollout requests still queued (a priority lane): an eval request waits at
      most for the batch in progress, never behind the rollout backlog;
    * the result is stamped like a rollout's: version_start / version_end are the policy versions
      of the weights that produced its first / last token. The controller reports an eval point for
      version v only if every result of it has version_start == version_end == v, and re-issues the
      others, so a worker that applies weights between batches (never inside one) needs nothing more;
    * a cancelled eval request may simply be dropped (there is nothing to clean up).

    A request is submitted, not awaited: `submit` queues it and returns its answer as a future (a
    `GenerationFailed` as its exception), so a thousand groups in flight are a thousand futures,
    not a thousand tasks (a task and a deadline scope per group cost the controller more CPU per
    group: `sc-grpo bench scale`, docs/performance.md). The controller cancels the future
    to cancel the request, then awaits `withdraw`; a worker never cancels it itself.
    `generate(worker, request)` below is the coroutine form, for callers that await one request.
    """

    name: str

    def submit(self, request: GenerationRequest) -> asyncio.Future[GenerationResult]:
        """Queue `request`; its result (or the `GenerationFailed` that ended it) as a future."""
        ...

    async def withdraw(self, request: GenerationRequest, future: asyncio.Future[GenerationResult]) -> None:
        """After the controller cancelled `future`: returns once the worker writes none of the
        request's rows (the controller clears its keys only then)."""
        ...

    async def update_weights(self, weights: WeightsHandle) -> None:
        """Apply a snapshot atomically: no request is served by a half-applied update."""
        ...

    async def in_flight(self) -> int:
        """Requests accepted and not yet returned."""
        ...


@runtime_checkable
class ReportsRunning(Protocol):
    """Optional capability of a GenerationWorker: which requests it is working on now. The rollout
    pump's deadline (`timeouts.generate_s`) then measures a request's own work, not the time it
    queued in the worker or was held for newer weights; without it, the time since dispatch."""

    async def running(self) -> Mapping[str, float]:
        """Group id -> seconds its work has been under way, for each request being worked on (in a
        batch being sampled, in the engine, its episodes being played); queued and held ones are absent."""
        ...


class VersionGated(Protocol):
    """Optional capability of a GenerationWorker (`honours_min_version = True`): it serves a request
    only with weights of `request.min_version` or newer, holding it until such weights are applied,
    whatever order the request and the update arrive in.

    With every routable worker VersionGated, the weight sync reopens admission as soon as it has
    sent the snapshot, instead of once every worker has applied it: the new version's rollouts are
    already queued in the workers when the weights land, and start at once (without it, the
    update's answer, the controller's admission and the requests' own trip all come first)."""

    honours_min_version: bool


def version_gated(worker: object) -> bool:
    return getattr(worker, "honours_min_version", False) is True


async def generate(worker: GenerationWorker, request: GenerationRequest) -> GenerationResult:
    """One request, awaited: `submit`, and when the caller is cancelled, `withdraw` before it
    re-raises (so a cancelled call writes nothing more, as every cancelled call here)."""
    future = worker.submit(request)
    try:
        return await future
    except asyncio.CancelledError:
        future.cancel()
        await worker.withdraw(request, future)
        raise


class SubmitsByTask:
    """`submit` and `withdraw` for a generation worker written as one coroutine, `generate(request)`
    (a test double, a user's own worker): each request runs as a task, whose end is its withdrawal
    (a cancelled `generate` writes nothing more by the time it re-raises)."""

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        raise NotImplementedError

    def submit(self, request: GenerationRequest) -> asyncio.Future[GenerationResult]:
        return asyncio.ensure_future(self.generate(request))

    async def withdraw(self, request: GenerationRequest, future: asyncio.Future[GenerationResult]) -> None:
        if not future.done():
            await asyncio.wait([future])


@runtime_checkable
class TrainerGroup(Protocol):
    """The split train API over all data-parallel ranks: one optimizer step per RL step.

    begin -> train_microbatch* -> finish, or begin -> train_microbatch* -> abort (which restores
    parameters and optimizer state exactly). Every call names its step, because a remote call can
    outlive the caller's deadline and a blind retry would apply the optimizer step twice:

    * `begin_train_step(step)` refuses unless `step` is the trainer's next step and none is open;
    * `train_microbatch(chunk)` refuses unless `chunk.step` is the open step;
    * `finish_train_step(step)` on the open step applies it; on the step finished last it returns
      the recorded result again (no second optimizer step);
    * `abort_train_step(step)` on the open step restores it; otherwise it does nothing (an abort
      never undoes a finished step);
    * `train_status()` says where the trainer stands, so after a deadline the controller decides
      from facts instead of retrying blindly.
    """

    async def begin_train_step(self, step: int, loss: LossConfig) -> None: ...

    async def train_microbatch(self, chunk: TrainChunk) -> None: ...

    async def finish_train_step(self, step: int) -> StepResult: ...

    async def abort_train_step(self, step: int) -> None: ...

    async def train_status(self) -> TrainStatus: ...

    async def export_weights(self, version: int) -> WeightsHandle:
        """Publish the current weights (after `finish_train_step`) as a versioned snapshot."""
        ...


@runtime_checkable
class Prefetching(Protocol):
    """Optional capability of a TrainerGroup that reads rows itself: read ahead on a hint."""

    async def prefetch(self, chunk: TrainChunk) -> None:
        """These rows will probably be trained soon; start reading them. Must return without
        waiting for the read, and must not change what a later `train_microbatch` computes."""
        ...


@runtime_checkable
class RewardKl(Protocol):
    """Optional capability of a TrainerGroup that keeps a reference policy: measure rows' KL to it,
    for a KL penalty in the reward (`reward.kl_coef`)."""

    async def reward_kl(self, keys: Sequence[str], seq_lengths: Sequence[int], estimator: str) -> tuple[float, ...]:
        """For each stored row of `keys` (prompt + response lengths `seq_lengths`), the sum over its
        policy tokens of `estimator` (k1 / k2 / k3) of KL(pi_gen || pi_ref), in `keys` order. May run
        while a train step is open; changes nothing a train step computes."""
        ...


@runtime_checkable
class FinishAndBegin(Protocol):
    """Optional capability of a TrainerGroup: begin the next step and send its first chunk while the
    previous step's finish is still in flight, so the trainer goes from one step to the next without
    waiting for the controller."""

    async def begin_behind_finish(self, step: int, loss: LossConfig, chunk: TrainChunk) -> bool:
        """Returns whether it sent anything, without waiting for the trainer. Called while
        `finish_train_step(step - 1)` is in flight (sent, not answered): `step` is begun and `chunk`
        (of `step`) trained right after that finish. When the finish succeeds, `step` is open with
        the chunk sent (an error of either is reported by the next call). When the finish fails or
        is cancelled, `step` is NOT open: if its begin ran after all (a finish that outlived the
        caller's deadline), it is aborted, so `train_status` then shows step `step - 1` finished or
        still open. After a finish that succeeded: a plain `begin_train_step` and
        `train_microbatch`. Otherwise nothing is sent (False)."""
        ...


@runtime_checkable
class Checkpointable(Protocol):
    """A TrainerGroup whose state can be saved and restored for resume: policy, optimizer state,
    RNG states and the next step. Called only between steps (no step open)."""

    async def save_state(self, directory: str) -> None: ...

    async def load_state(self, directory: str) -> int:
        """Restore what `save_state` wrote; returns the trainer's next step."""
        ...


@runtime_checkable
class Restartable(Protocol):
    """A GenerationWorker that can replace its dead process: `restart(weights)` starts a new one and
    applies `weights` before it takes work (the rollout pump routes nothing to it until then)."""

    async def restart(self, weights: WeightsHandle | None) -> None: ...


@runtime_checkable
class Sleepable(Protocol):
    """A GenerationWorker that can give its memory back while it is out of the run (an elastic
    shrink, `single_controller/elastic.py`), called only once it is out of routing with nothing in
    flight: `sleep(1)` frees its weights, `sleep(2)` its weights and caches; it then serves nothing
    (it keeps no weights that could be served stale). `wake()` takes its memory back; it serves only
    after an `update_weights`. `policy_version()`: the version of the weights it holds (None: none).
    Both are idempotent."""

    async def sleep(self, level: int) -> None: ...

    async def wake(self) -> None: ...

    async def policy_version(self) -> int | None: ...


@runtime_checkable
class Offloadable(Protocol):
    """A trainer that can move its state to host memory between steps (`train.offload`, colocated
    turns, `single_controller/device_turns.py`): `offload("optimizer" | "all")`, and `onload()` brings
    it back bit-exact. A trainer call that needs the state while it is out brings it back itself."""

    async def offload(self, what: str) -> OffloadRecord: ...

    async def onload(self) -> OffloadRecord: ...


@runtime_checkable
class RewardFunction(Protocol):
    """Scores one completion: `reward_fn(prompt, response_text) -> float` (the per-completion form;
    the batched form, fn(prompts, completions, **columns) -> list[float | None] once per group, is
    described in `data/rewards.py`). It runs inside the generation worker (next to the tokens, after
    detokenization); named in configs as `module:function`. One that raises or returns a non-finite
    value fails its group alone (`RewardFailed`)."""

    def __call__(self, prompt: Prompt, response_text: str) -> float: ...
