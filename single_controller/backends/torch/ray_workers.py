"""The embedded torch backend on Ray: trainer-rank and generation actors, and their controller-side
adapters (`protocols.TrainerGroup`, `protocols.GenerationWorker`).

`CpuTrainerGroup` drives `TrainerRankActor`s: a gloo group met at rank 0's TCPStore
(`rank_calls.rendezvous`), each chunk split over ranks by tokens (`algorithm.dp_split`), each rank
reading its own rows; rank 0 `ray.put`s the weight buckets, so weights never pass through the
controller. Generation is `ActorGenerationClient` over a `GenerationActor`. `start_torch_generation` /
`start_torch_trainer` are the starters `backends.registry` names. Errors: `rank_calls`, `actor_client`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import ray

from single_controller.algorithm.dp_split import split_chunk
from single_controller.backends.common.actor_client import ActorGenerationClient, start_generation_clients
from single_controller.backends.common.actors import kill_all
from single_controller.backends.common.behind_finish import BehindFinish
from single_controller.backends.common.compute_turns import threads_per_process
from single_controller.backends.common.rank_calls import (
    CPU_BUNDLE,
    PREFETCH_GROUP,
    RANK_CONCURRENCY,
    RankPlacement,
    load_state_of,
    place_ranks,
    rank_call,
    rendezvous,
    stop_ranks,
    train_status_of,
)
from single_controller.backends.common.weight_broadcast import SyncLink, sync_link
from single_controller.backends.torch.generation import GenerationActor
from single_controller.backends.torch.trainer_actor import TrainerRankActor
from single_controller.config.schema import Config, rollout_max_new_tokens, run_reward
from single_controller.protocols import TrainerFailed, TrainStepStateError
from single_controller.types import LossConfig, StepResult, TrainChunk, TrainStatus, WeightsHandle


@dataclass(frozen=True)
class TrainerGroupStatistics:
    num_ranks: int
    rank_nodes: tuple[str, ...]  # Ray node id of each rank
    open_step: int | None
    steps_finished: int
    steps_aborted: int
    chunks_in_open_step: int
    bytes_read_open_step: int  # row bytes the ranks read for the open step
    bytes_read_total: int


class _Due(NamedTuple):
    """A call sent to every rank whose answers are not taken yet."""

    kind: Literal["begin", "microbatch"]
    what: str  # the call, as errors name it
    step: int
    refs: list  # one per rank


class CpuTrainerGroup:
    """`TrainerGroup` over `TrainerRankActor` handles (rank order); `rank_nodes` and `placement`
    (released at shutdown) come from `start_torch_trainer`.

    Calls are pipelined: a rank runs its calls one at a time in the order they were sent, so a call
    can be sent before the previous one's answer is back without changing what runs.
    `begin_train_step` and `train_microbatch` send their calls and return; each later call sends its
    own, then waits for the answers still due (in order), so an error is reported by the next call
    and names the call it came from. A finish can follow a microbatch this closely because a rank
    whose microbatch failed refuses the step's finish (`TrainerCore.mark_failed`; every rank learns
    it in the finish's first all-reduce) until the step is aborted. A successful finish of step s
    sends rank 0's `export_weights(s + 1)` at once, and `export_weights(s + 1)` takes that answer.
    Each saves a round trip between the controller and the ranks per step."""

    def __init__(
        self, rank_handles: Sequence[Any], *, rank_nodes: Sequence[dict] = (), placement: RankPlacement | None = None
    ):
        if not rank_handles:
            raise ValueError("need at least one trainer rank")
        self.ranks = list(rank_handles)
        self.rank_nodes = [dict(n) for n in rank_nodes]  # node_info() of each rank
        self.placement = placement
        self._step: int | None = None
        self._bytes_read = 0
        self._last_bytes = 0  # bytes read by the step finished last (a retried finish reports them again)
        self._chunks = 0
        self._counts = dict(steps_finished=0, steps_aborted=0, bytes_read_total=0)
        # calls sent and not answered yet, oldest first: a begin, microbatches
        self._due: list[_Due] = []
        self._export: tuple[int, Any] | None = None  # (version, ref) of an export sent after a finish
        self._finish = BehindFinish()  # the finish in flight and the next step's calls sent behind it
        self._draining: set[asyncio.Future] = set()

    def _drop_export(self) -> None:
        if self._export is not None:
            self._discard(self._export[1])
            self._export = None

    def _discard(self, ref: Any) -> None:
        """Let an answer nobody will use arrive (and its error, if any, be dropped quietly)."""

        async def drain() -> None:
            with contextlib.suppress(Exception):
                await ref

        task = asyncio.ensure_future(drain())
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)

    async def _answers(self, keep_last: bool = False) -> None:
        """Wait for the answers still due, oldest first (all but the newest with `keep_last`), and
        raise the first error; the answers after a failed one are drained quietly. A failed begin
        opened nothing on the ranks: the step is then no longer open here either."""
        while len(self._due) > (1 if keep_last else 0):
            due = self._due.pop(0)
            try:
                results = await rank_call(due.what, due.refs)
            except BaseException:
                for later in self._due:
                    for ref in later.refs:
                        self._discard(ref)
                self._due.clear()
                if due.kind == "begin" and self._step == due.step:
                    self._step = None
                raise
            if due.kind == "microbatch":
                nbytes = sum(results)
                self._bytes_read += nbytes
                self._counts["bytes_read_total"] += nbytes

    async def _answers_quietly(self) -> None:
        """`_answers`, for an abort or a status: what the earlier calls said no longer matters."""
        with contextlib.suppress(TrainerFailed, TrainStepStateError):
            await self._answers()

    def statistics(self) -> TrainerGroupStatistics:
        return TrainerGroupStatistics(
            num_ranks=len(self.ranks),
            rank_nodes=tuple(n["node_id"] for n in self.rank_nodes),
            open_step=self._step,
            chunks_in_open_step=self._chunks,
            bytes_read_open_step=self._bytes_read,
            **self._counts,
        )

    async def begin_train_step(self, step: int, loss: LossConfig) -> None:
        await self._answers()
        if self._step is not None:  # what the ranks would answer, said before anything is sent
            raise TrainStepStateError(f"begin_train_step({step}): step {self._step} is open")
        self._drop_export()  # the weights change from here on
        self._due.append(self._send_begin(step, loss))
        self._step, self._bytes_read, self._chunks = step, 0, 0

    async def train_microbatch(self, chunk: TrainChunk) -> None:
        if self._step != chunk.step:
            raise TrainStepStateError(f"train_microbatch for step {chunk.step}, but the open step is {self._step}")
        self._due.append(self._send_microbatch(chunk))
        self._chunks += 1
        # The earlier calls' answers; this microbatch's is taken by the next call (at most one
        # microbatch runs ahead of the controller's view).
        await self._answers(keep_last=True)

    def _send_begin(self, step: int, loss: LossConfig) -> _Due:
        return _Due(
            "begin", f"begin_train_step({step})", step, [r.begin_train_step.remote(step, loss) for r in self.ranks]
        )

    def _send_microbatch(self, chunk: TrainChunk) -> _Due:
        _check_lengths(chunk)
        split = split_chunk(chunk, len(self.ranks))  # one microbatch per rank, balanced by tokens
        refs = []
        for i, r in enumerate(self.ranks):
            keys = split.rank_keys(i)
            refs.append(
                r.train_microbatch_keys.remote(chunk.step, keys, list(chunk.fields), chunk.rank_advantages(keys))
            )
        return _Due("microbatch", f"train_microbatch(step={chunk.step}, chunk={chunk.chunk_index})", chunk.step, refs)

    async def prefetch(self, chunk: TrainChunk) -> None:
        """Each rank starts reading the rows it would get for this chunk (a hint; never blocks on the read)."""
        split = split_chunk(chunk, len(self.ranks))
        refs = [
            r.prefetch_keys.options(concurrency_group=PREFETCH_GROUP).remote(split.rank_keys(i), list(chunk.fields))
            for i, r in enumerate(self.ranks)
        ]
        await rank_call(f"prefetch(step={chunk.step})", refs)

    async def finish_train_step(self, step: int) -> StepResult:
        refs = [r.finish_train_step.remote(step) for r in self.ranks]
        # What the caller asks for next, sent now: rank 0 runs it right after its finish. If the finish
        # fails the step stays open there and this export fails too; it is then discarded.
        export = self.ranks[0].export_weights.remote(step + 1)
        self._finish.start(step)
        try:
            await self._answers()
            metrics = await rank_call(f"finish_train_step({step})", refs)
        except BaseException:
            # Also when cancelled (nothing here awaits). A next step sent behind this finish was begun
            # on the ranks only if the finish landed after all (after the caller's deadline): the
            # abort, queued behind it, undoes it.
            behind = self._finish.behind
            undo = [r.abort_train_step.remote(step + 1) for r in self.ranks] if behind else []
            for ref in [*refs, export, *(ref for due in behind for ref in due.refs), *undo]:
                self._discard(ref)
            raise
        finally:
            behind = self._finish.end()
        self._finished(step, export)
        if behind:  # the next step is open, its first chunk sent; their answers are due
            self._due += behind
            self._step, self._bytes_read, self._chunks = step + 1, 0, 1
        return StepResult(step=step, metrics={**metrics[0], "train/bytes_read": float(self._last_bytes)})

    async def begin_behind_finish(self, step: int, loss: LossConfig, chunk: TrainChunk) -> bool:
        """Begin `step` and send its first chunk now, behind the finish of `step - 1` in flight
        (`protocols.FinishAndBegin`): the ranks run them right after the finish and the export. If
        that finish succeeded already, this is a plain begin and microbatch. Returns whether they
        were sent."""
        _check_lengths(chunk)  # before anything is sent
        return await self._finish.begin(
            self,
            step,
            loss,
            chunk,
            idle=self._step is None,
            send_behind=lambda: [self._send_begin(step, loss), self._send_microbatch(chunk)],
        )

    def _finished(self, step: int, export: Any) -> None:
        self._export = (step + 1, export)
        self._finish.succeeded(step)
        if self._step == step:
            self._step = None
            self._counts["steps_finished"] += 1
            self._last_bytes = self._bytes_read

    async def abort_train_step(self, step: int) -> None:
        refs = [r.abort_train_step.remote(step) for r in self.ranks]
        self._drop_export()
        await self._answers_quietly()  # a begin that failed opened nothing: the abort is then a no-op on the ranks
        await rank_call(f"abort_train_step({step})", refs)
        if self._step == step:
            self._counts["steps_aborted"] += 1
            self._step = None

    async def train_status(self) -> TrainStatus:
        await self._answers_quietly()  # the status says where the ranks stand after them
        return await train_status_of(self.ranks)

    async def export_weights(self, version: int) -> WeightsHandle:
        sent, self._export = self._export, None
        if sent is not None and sent[0] == version:
            ref = sent[1]  # sent right behind the finish: the calls due since then ran after it
        else:
            if sent is not None:
                self._discard(sent[1])
            await self._answers()
            ref = self.ranks[0].export_weights.remote(version)
        (snapshot,) = await rank_call(f"export_weights({version})", [ref])
        return WeightsHandle(version=version, payload=snapshot, num_bytes=snapshot.manifest.num_bytes)

    async def save_checkpoint(self, directory: str) -> str:
        """Rank 0 writes its policy (safetensors + config.json, loadable as `model.checkpoint`); returns the path."""
        (path,) = await rank_call(f"save_checkpoint({directory})", [self.ranks[0].save_checkpoint.remote(directory)])
        return path

    async def save_state(self, directory: str) -> None:
        await rank_call(f"save_state({directory})", [r.save_state.remote(directory) for r in self.ranks])

    async def load_state(self, directory: str) -> int:
        self._drop_export()  # sent before these weights were loaded
        self._finish.finished_last = None
        return await load_state_of(self.ranks, directory)

    async def shutdown(self) -> None:
        await stop_ranks(self.ranks, self.placement)


def _check_lengths(chunk: TrainChunk) -> None:
    if len(chunk.seq_lengths) != len(chunk.row_keys):
        raise ValueError(f"chunk {chunk.chunk_index}: {len(chunk.seq_lengths)} lengths for {len(chunk.row_keys)} keys")


async def start_torch_generation(
    cfg: Config,
    storage_factory: Callable[[], Any],
    *,
    storage_ready: Awaitable[Any] | None = None,
    options: dict | None = None,
    sync: SyncLink | None = None,
) -> list[ActorGenerationClient]:
    """Start `backend.num_generation_workers` generation actors and connect them to storage (the
    `registry` starter contract). `options` go to `.options()` (default num_cpus=0, since
    TransferQueue may hold every logical CPU); `sync`: the weight-sync link (default: gloo, as torch
    generation holds its weights on the host)."""
    gen_cls = ray.remote(GenerationActor)

    def spawner(i: int) -> Callable[[], Any]:  # also what restarts a dead worker
        def spawn() -> Any:
            return gen_cls.options(**{"num_cpus": 0, **(options or {})}).remote(
                f"gen{i}",
                cfg.model,
                storage_factory,
                cfg.task.reward_fn,
                reward=run_reward(cfg),
                seed=cfg.seed * 1000 + i,
                sampling_seed=cfg.seed,  # a row's draws depend on its prompt and attempt, not on its worker
                torch_threads=threads_per_process(cfg.backend),
                max_batch_groups=cfg.rollout.max_batch_groups,
                env=cfg.env,
                max_new_tokens=rollout_max_new_tokens(cfg),
            )

        return spawn

    link = sync or sync_link(cfg.backend.trainer_device, "cpu", cfg.timeouts.weight_sync_s)
    return await start_generation_clients("gen", cfg.backend.num_generation_workers, spawner, storage_ready, sync=link)


async def start_torch_trainer(
    cfg: Config,
    storage_factory: Callable[[], Any],
    *,
    storage_ready: Awaitable[Any] | None = None,
    options: dict | None = None,
    dtype: str = "float32",
) -> CpuTrainerGroup:
    """Start `backend.num_trainer_ranks` trainer ranks where `backend.trainer_placement` puts them,
    join their gloo group at rank 0's address and build the policy (the `registry` starter contract)."""
    world = cfg.backend.num_trainer_ranks
    # ray.remote's typed overloads omit the concurrency_groups option (it is accepted at run time)
    rank_cls = ray.remote(concurrency_groups=RANK_CONCURRENCY)(TrainerRankActor)  # type: ignore[call-overload]
    cuda = cfg.backend.trainer_device == "cuda"
    res = {"num_cpus": 0, "num_gpus": 1} if cuda else {"num_cpus": 0}
    placement = await place_ranks(
        cfg.backend.trainer_placement, world, {"GPU": 1} if cuda else CPU_BUNDLE, cfg.timeouts.setup_s
    )
    ranks = [
        rank_cls.options(**{**res, **placement.options[r], **(options or {})}).remote(
            r, world, cfg, storage_factory, dtype
        )
        for r in range(world)
    ]
    group = CpuTrainerGroup(ranks, placement=placement)
    try:
        # The group and the policy (torch, the optimizer's first use of Dynamo: seconds of CPU) are
        # built while the storage service is still starting; only the storage client waits for it.
        addr, port = await rendezvous(ranks[0]) if world > 1 else (None, None)
        await rank_call("setup", [r.setup.remote(addr, port, cfg.timeouts.setup_s) for r in ranks])
        if storage_ready is not None:
            await storage_ready
        await rank_call("connect_storage", [r.connect_storage.remote() for r in ranks])
        group.rank_nodes = await rank_call("node_info", [r.node_info.remote() for r in ranks])
    except BaseException:
        await asyncio.shield(group.shutdown())
        raise
    return group


async def create_cpu_workers(
    cfg: Config,
    storage_factory: Callable[[], Any],
    *,
    storage_ready: Awaitable[Any] | None = None,
    generation_options: dict | None = None,
    trainer_options: dict | None = None,
    dtype: str = "float32",
    sync: SyncLink | None = None,
) -> tuple[list[ActorGenerationClient], CpuTrainerGroup]:
    """Both torch roles at once: every actor process is started before `storage_ready` is awaited,
    so their start-up overlaps the storage service's own; then version 0 (rank 0's init, or the
    configured model) is loaded into every generation worker."""
    ready = asyncio.ensure_future(storage_ready) if storage_ready is not None else None
    gen_task = asyncio.ensure_future(
        start_torch_generation(cfg, storage_factory, storage_ready=ready, options=generation_options, sync=sync)
    )
    trainer_task = asyncio.ensure_future(
        start_torch_trainer(cfg, storage_factory, storage_ready=ready, options=trainer_options, dtype=dtype)
    )
    await asyncio.wait([gen_task, trainer_task])
    clients = gen_task.result() if gen_task.exception() is None else []
    group = trainer_task.result() if trainer_task.exception() is None else None
    try:
        for t in (gen_task, trainer_task):
            t.result()  # raises the first starter's failure
        assert group is not None  # its starter succeeded: the line above raised otherwise
        handle = await group.export_weights(0)
        await asyncio.gather(*(c.update_weights(handle) for c in clients))
    except BaseException:
        await asyncio.shield(kill_all([c.actor for c in clients] + (list(group.ranks) if group else [])))
        raise
    return clients, group


async def shutdown_cpu_workers(clients: Sequence[ActorGenerationClient], group: CpuTrainerGroup) -> None:
    await kill_all([c.actor for c in clients] + list(group.ranks))


__all__ = [
    "TrainerRankActor",
    "CpuTrainerGroup",
    "create_cpu_workers",
    "start_torch_generation",
    "start_torch_trainer",
    "shutdown_cpu_workers",
]
