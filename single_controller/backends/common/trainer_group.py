"""The controller's side of a trainer: one `protocols.TrainerGroup` over trainer rank actors, for
every engine (torch, Megatron).

`RankTrainerGroup` fans each split-API call out to the ranks and keeps the step's bookkeeping (open
step, chunks, bytes read). What differs by engine is given, not subclassed: `data_ranks` (the
data-parallel rank of each actor: a chunk is split over data-parallel ranks by tokens, and the ranks
of one tensor-parallel group get the same rows), `export_args` (what `export_weights` takes after
the version) and `collective_io` (whether every rank takes part in an export and a checkpoint, or
rank 0 alone).

The pipelining lives here and nowhere else on the trainer's side: calls are sent without waiting for
the previous answer, the weights of step s + 1 are asked for right behind the finish of step s,
and the next step's begin and first chunk can go out behind a finish in flight
(`begin_behind_finish`, `protocols.FinishAndBegin`, kept by `behind_finish.BehindFinish`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from replay.storage import REWARD_KL_FIELDS
from single_controller.algorithm.dp_split import dp_split, split_chunk
from single_controller.backends.common.behind_finish import BehindFinish
from single_controller.backends.common.rank_calls import (
    PREFETCH_GROUP,
    RankPlacement,
    load_state_of,
    rank_call,
    stop_ranks,
    train_status_of,
)
from single_controller.protocols import TrainerFailed, TrainStepStateError
from single_controller.types import LossConfig, OffloadRecord, StepResult, TrainChunk, TrainStatus, WeightsHandle


@dataclass(frozen=True)
class TrainerGroupStatistics:
    num_ranks: int
    rank_nodes: tuple[str, ...]  # Ray node id of each rank
    data_parallel_size: int
    tensor_parallel_size: int
    open_step: int | None
    steps_finished: int
    steps_aborted: int
    chunks_in_open_step: int
    bytes_read_open_step: int  # row bytes the ranks read for the open step
    bytes_read_total: int


class _SentCall(NamedTuple):
    """A call sent to every rank whose answers are not taken yet."""

    kind: Literal["begin", "microbatch"]
    what: str  # the call, as errors name it
    step: int
    refs: list  # one per rank


class RankTrainerGroup:
    """`TrainerGroup` over trainer rank actor handles in rank order; `rank_nodes` (node_info() of
    each rank) and `placement` (released at shutdown) come from the engine's starter. `data_ranks`:
    each rank's data-parallel rank (default: every rank is one); `tensor_parallel_size`: ranks per
    data-parallel rank, for the statistics.

    Calls are pipelined: a rank runs its calls one at a time in the order they were sent, so a call
    can be sent before the previous one's answer is back without changing what runs.
    `begin_train_step` and `train_microbatch` send their calls and return; each later call sends its
    own, then waits for the answers still due (in order), so an error is reported by the next call
    and names the call it came from. A finish can follow a microbatch this closely because a rank
    whose microbatch failed refuses the step's finish (`TrainerCore.mark_failed`; every rank learns
    it in the finish's first all-reduce) until the step is aborted. A successful finish of step s
    sends `export_weights(s + 1)` at once (to rank 0, or to every rank with `collective_io`), and
    `export_weights(s + 1)` takes that answer. Each saves a round trip between the controller and the
    ranks per step."""

    def __init__(
        self,
        rank_handles: Sequence[Any],
        *,
        data_ranks: Sequence[int] | None = None,
        tensor_parallel_size: int = 1,
        export_args: tuple = (),
        collective_io: bool = False,
        rank_nodes: Sequence[dict] = (),
        placement: RankPlacement | None = None,
    ):
        if not rank_handles:
            raise ValueError("need at least one trainer rank")
        self.ranks = list(rank_handles)
        self.data_ranks = list(range(len(self.ranks)) if data_ranks is None else data_ranks)
        if len(self.data_ranks) != len(self.ranks):
            raise ValueError(f"{len(self.data_ranks)} data-parallel ranks given for {len(self.ranks)} ranks")
        self.dp, self.tp = max(self.data_ranks) + 1, tensor_parallel_size
        self.export_args = export_args  # what export_weights takes after the version
        self.collective_io = collective_io  # every rank takes part in an export and a checkpoint
        self.rank_nodes = [dict(n) for n in rank_nodes]  # node_info() of each rank
        self.placement = placement
        self._step: int | None = None
        self._bytes_read = 0
        self._last_bytes = 0  # bytes read by the step finished last (a retried finish reports them again)
        self._chunks = 0
        self._counts = dict(steps_finished=0, steps_aborted=0, bytes_read_total=0)
        # calls sent and not answered yet, oldest first: a begin, microbatches
        self._due: list[_SentCall] = []
        self._export: tuple[int, list] | None = None  # (version, refs) of an export sent after a finish
        self._finish = BehindFinish()  # the finish in flight and the next step's calls sent behind it
        self._draining: set[asyncio.Future] = set()

    def _drop_export(self) -> None:
        if self._export is not None:
            for ref in self._export[1]:
                self._discard(ref)
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
            data_parallel_size=self.dp,
            tensor_parallel_size=self.tp,
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

    def _send_begin(self, step: int, loss: LossConfig) -> _SentCall:
        return _SentCall(
            "begin", f"begin_train_step({step})", step, [r.begin_train_step.remote(step, loss) for r in self.ranks]
        )

    def _send_microbatch(self, chunk: TrainChunk) -> _SentCall:
        _check_lengths(chunk)
        split = split_chunk(chunk, self.dp)  # one microbatch per data-parallel rank, balanced by tokens
        refs = []
        for r, d in zip(self.ranks, self.data_ranks):
            keys = split.rank_keys(d)
            refs.append(
                r.train_microbatch_keys.remote(
                    chunk.step, keys, list(chunk.fields), chunk.rank_advantages(keys), chunk.update
                )
            )
        return _SentCall(
            "microbatch", f"train_microbatch(step={chunk.step}, chunk={chunk.chunk_index})", chunk.step, refs
        )

    async def reward_kl(self, keys: Sequence[str], seq_lengths: Sequence[int], estimator: str) -> tuple[float, ...]:
        """Each row's KL to the reference policy (`reward.kl_coef`), in `keys` order: the rows split
        over the data-parallel ranks by tokens (as a chunk's), every rank called in the order of the
        other calls (beside an open step: the reference never trains)."""
        split = dp_split(tuple(keys), tuple(seq_lengths), self.dp)
        shares = [split.rank_keys(d) for d in self.data_ranks]
        refs = [r.reward_kl_keys.remote(mine, list(REWARD_KL_FIELDS), estimator) for r, mine in zip(self.ranks, shares)]
        per_rank = await rank_call(f"reward_kl({len(keys)} rows)", refs)
        kl: dict[str, float] = {}
        for mine, values in zip(shares, per_rank):
            kl.update(zip(mine, values, strict=True))
        return tuple(kl[k] for k in keys)

    async def prefetch(self, chunk: TrainChunk) -> None:
        """Each rank starts reading the rows it would get for this chunk (a hint; never blocks on the read)."""
        split = split_chunk(chunk, self.dp)
        refs = [
            r.prefetch_keys.options(concurrency_group=PREFETCH_GROUP).remote(split.rank_keys(d), list(chunk.fields))
            for r, d in zip(self.ranks, self.data_ranks)
        ]
        await rank_call(f"prefetch(step={chunk.step})", refs)

    async def finish_train_step(self, step: int) -> StepResult:
        refs = [r.finish_train_step.remote(step) for r in self.ranks]
        # What the caller asks for next, sent now: the ranks run it right after their finish. If the
        # finish fails the step stays open there and this export fails too; it is then discarded.
        export = self._send_export(step + 1)
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
            for ref in [*refs, *export, *(ref for due in behind for ref in due.refs), *undo]:
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

    def _finished(self, step: int, export: list) -> None:
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

    def _io_ranks(self) -> list[Any]:
        """The ranks an export or a checkpoint is asked of: all of them, or rank 0 alone."""
        return self.ranks if self.collective_io else self.ranks[:1]

    def _send_export(self, version: int) -> list:
        return [r.export_weights.remote(version, *self.export_args) for r in self._io_ranks()]

    async def export_weights(self, version: int) -> WeightsHandle:
        sent, self._export = self._export, None
        if sent is not None and sent[0] == version:
            refs = sent[1]  # sent right behind the finish: the calls due since then ran after it
        else:
            if sent is not None:
                for ref in sent[1]:
                    self._discard(ref)
            await self._answers()
            refs = self._send_export(version)
        snapshot = (await rank_call(f"export_weights({version})", refs))[0]  # rank 0's answer
        return WeightsHandle(version=version, payload=snapshot, num_bytes=snapshot.manifest.num_bytes)

    async def save_checkpoint(self, directory: str) -> str:
        """The policy, loadable as `model.checkpoint` (rank 0 writes it; with `collective_io` every
        rank takes part); returns the path."""
        refs = [r.save_checkpoint.remote(directory) for r in self._io_ranks()]
        return (await rank_call(f"save_checkpoint({directory})", refs))[0]

    async def save_state(self, directory: str) -> None:
        await rank_call(f"save_state({directory})", [r.save_state.remote(directory) for r in self.ranks])

    async def load_state(self, directory: str) -> int:
        self._drop_export()  # sent before these weights were loaded
        self._finish.finished_last = None
        return await load_state_of(self.ranks, directory)

    async def offload(self, what: str) -> OffloadRecord:
        """`train.offload` on every rank, between steps: what they moved in all, and the slowest's time."""
        return _summed(await rank_call(f"offload({what})", [r.offload.remote(what) for r in self.ranks]))

    async def onload(self) -> OffloadRecord:
        return _summed(await rank_call("onload", [r.onload.remote() for r in self.ranks]))

    async def shutdown(self) -> None:
        await stop_ranks(self.ranks, self.placement)


def _summed(records: list[OffloadRecord]) -> OffloadRecord:
    return OffloadRecord(
        records[0].direction,
        sum(r.num_bytes for r in records),
        max(r.seconds for r in records),
        max(r.device_allocated_bytes for r in records),
    )


def _check_lengths(chunk: TrainChunk) -> None:
    if len(chunk.seq_lengths) != len(chunk.row_keys):
        raise ValueError(f"chunk {chunk.chunk_index}: {len(chunk.seq_lengths)} lengths for {len(chunk.row_keys)} keys")
