"""Trainer ranks on Ray, shared by every trainer backend: fan-out calls, placement, rendezvous.

`rank_call(what, refs)` awaits every rank in order and decides what a failure becomes: a dead rank
is `TrainerRankDied`; a failure a retry can fix (`RETRYABLE`) is `TrainerFailed` (the train pump
aborts and retries the step); the protocol errors a rank raises on purpose (`ON_PURPOSE`) are raised
as their own class, naming the rank; anything else (a bug) is raised as it is and fails the run.
`place_ranks` gives each rank's `.options()` for `backend.trainer_placement` (`spread`: a
STRICT_SPREAD placement group, refused with `TrainerPlacementError` when the cluster cannot).
`rendezvous` has rank 0 open a TCPStore on its node's registered IP, so ranks need not share a host.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import ray

from single_controller.backends.common.actors import first_line, kill_all
from single_controller.deadlines import DeadlineExceeded, within
from single_controller.protocols import TrainerFailed, TrainerRankDied, TrainerStateLost, TrainStepStateError
from single_controller.types import TrainStatus

if TYPE_CHECKING:
    from replay.fetch import RowPrefetcher
    from single_controller.backends.common.split_step import SplitStep

PLACEMENTS = ("pack", "spread")
# A rank actor runs its split-API calls one at a time, in order. Read-ahead hints (`prefetch_keys`)
# go to a concurrency group of their own, a second thread: a hint sent while a microbatch computes
# starts its read at once instead of queueing behind that microbatch, the finish and the export (the
# read then overlaps compute; queued, the next microbatch waited for it: docs/performance.md).
# Rank actors are built with `ray.remote(concurrency_groups=RANK_CONCURRENCY)` and
# `prefetch_keys` is called with `.options(concurrency_group=PREFETCH_GROUP)`; the method must be
# thread-safe (`replay.fetch.RowPrefetcher` is).
PREFETCH_GROUP = "prefetch"
# Weight-sync sends (`weight_broadcast.WeightSender`) get threads of their own too: a broadcast to the
# generation workers overlaps the next step's split-API calls. One thread per worker group sending at once.
SYNC_GROUP = "weight_sync"
SYNC_CONCURRENCY = 8
RANK_CONCURRENCY = {PREFETCH_GROUP: 1, SYNC_GROUP: SYNC_CONCURRENCY}
# A bundle needs some resource; trainer ranks on CPU ask Ray for none (TransferQueue may hold every
# logical CPU), so their spread bundles reserve this token share of a CPU.
CPU_BUNDLE = {"CPU": 0.01}


class TrainerPlacementError(RuntimeError):
    """The cluster cannot place the trainer ranks as `backend.trainer_placement` asks."""


# What a retry of the step can fix. `TrainerFailed`: the rank said so (its rows could not be read,
# a collective failed, the step's gradients are partial or not finite). `ActorUnavailableError`: Ray
# cannot reach the rank for now (its process is alive; a network blip, a restarting node).
# `ObjectLostError` (and its subclasses, e.g. a fetch that timed out) and `ObjectStoreFullError`: an
# object a call passed or returned is gone or did not fit, for now. Every other error of a rank (a
# `TypeError` in the loss, a `ValueError` of bad rows) is a bug a retry repeats: raised as it is.
RETRYABLE: tuple[type[BaseException], ...] = (
    TrainerFailed,
    ray.exceptions.ActorUnavailableError,
    ray.exceptions.ObjectLostError,
    ray.exceptions.ObjectStoreFullError,
)

# The trainer protocol's errors a rank raises on purpose (`protocols`): they cross as themselves.
ON_PURPOSE: tuple[type[Exception], ...] = (TrainerStateLost, TrainStepStateError)


# How long a rank's failure waits for the other ranks' answers to say whether one of them died: a
# surviving rank's collective fails at once (its peer's connection is reset) while Ray may take a moment
# to report the death; the failure is then the dead rank's.
PEER_DEATH_GRACE_S = 10.0


async def rank_call(what: str, refs: list) -> list:
    results = []
    for rank, ref in enumerate(refs):
        try:
            results.append(await ref)
        except ray.exceptions.ActorDiedError as e:
            raise TrainerRankDied(f"trainer rank {rank} died during {what}: {first_line(e)}") from e
        except Exception as e:
            dead = await _dead_peer(refs, rank)
            if dead is not None:
                raise TrainerRankDied(
                    f"trainer rank {dead[0]} died during {what}: {first_line(dead[1])} "
                    f"(rank {rank} failed with it: {first_line(_cause(e))})"
                ) from e
            err = _as_its_kind(what, rank, e)
            if err is e:
                raise  # a bug: as it is
            raise err from e
    return results


async def _dead_peer(refs: list, failed: int) -> tuple[int, BaseException] | None:
    """(rank, its death) of a rank among `refs` (but `failed`) that died, as far as their answers tell
    within `PEER_DEATH_GRACE_S`; None: none did."""
    tasks = {asyncio.ensure_future(ref): r for r, ref in enumerate(refs) if r != failed}
    pending = set(tasks)
    deadline = asyncio.get_running_loop().time() + PEER_DEATH_GRACE_S
    try:
        while pending:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return None
            done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                e = t.exception()
                if isinstance(e, ray.exceptions.ActorDiedError):
                    return tasks[t], e
        return None
    finally:
        for t in pending:
            t.cancel()


def _as_its_kind(what: str, rank: int, e: Exception) -> Exception:
    """A rank's failure (no rank died) as what it is: retryable (`TrainerFailed`), on purpose (its own
    class, naming the rank), or a bug (`e` itself)."""
    if isinstance(e, RETRYABLE):
        return TrainerFailed(f"trainer {what} failed on rank {rank}: {first_line(_cause(e))}")
    cause = _cause(e)
    if isinstance(e, ray.exceptions.RayTaskError) and isinstance(cause, ON_PURPOSE):
        return type(cause)(f"trainer rank {rank}: {cause}")
    return e


def _cause(e: BaseException) -> BaseException:
    """The rank's own error inside Ray's wrapper (whose message is the whole remote traceback)."""
    return getattr(e, "cause", None) or e


async def train_status_of(ranks: Sequence[Any]) -> TrainStatus:
    """Where the ranks stand; they must agree."""
    statuses = await rank_call("train_status", [r.train_status.remote() for r in ranks])
    if any(s != statuses[0] for s in statuses[1:]):
        raise TrainerFailed(f"trainer ranks disagree on where they stand: {statuses}")
    return TrainStatus(**statuses[0])


async def load_state_of(ranks: Sequence[Any], directory: str) -> int:
    """Every rank loads its state from `directory`; returns the next step they agree on."""
    steps = await rank_call(f"load_state({directory})", [r.load_state.remote(directory) for r in ranks])
    if len(set(steps)) != 1:
        raise TrainerFailed(f"trainer ranks loaded different steps from {directory}: {steps}")
    return steps[0]


async def stop_ranks(ranks: Sequence[Any], placement: RankPlacement | None) -> None:
    """Stop the rank actors (`actors.kill_all`), then free their placement, if any."""
    try:
        await kill_all(ranks)
    finally:
        if placement is not None:
            placement.release()


# ----------------------------------------------------------------------------------------------
# Rendezvous (actor side, then controller side)


def node_ip() -> str:
    """The address this node registered with the cluster (what other nodes reach it at). Not
    `ray.util.get_node_ip_address()`: in a worker process that may guess another interface (e.g.
    eth0 for a node started with --node-ip-address=127.0.0.1). Outside Ray (a bare process): the
    loopback (asking Ray's runtime context would start a local Ray)."""
    if not ray.is_initialized():
        return "127.0.0.1"
    node_id = ray.get_runtime_context().get_node_id()
    for n in ray.nodes():
        if n.get("NodeID") == node_id and n.get("NodeManagerAddress"):
            return n["NodeManagerAddress"]
    return ray.util.get_node_ip_address()


_MASTER_STORE: list = []  # rank 0's TCPStore, opened by node_address() before any rank connects


def node_address() -> tuple[str, int]:
    """Rank 0: open the group's rendezvous (a torch TCPStore server) on this node's registered IP
    and a port it picks, and return (ip, port). Listening before any other rank is told where, so
    none of them meets a refused connection (torch's retry backoff then sleeps up to a minute)."""
    import datetime

    import torch.distributed as dist

    ip = node_ip()
    _MASTER_STORE.clear()
    store = dist.TCPStore(ip, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=600))
    _MASTER_STORE.append(store)
    return ip, store.port


def join_store(master_addr: str, master_port: int, rank: int, world_size: int, timeout_s: float):
    """The rendezvous store for `dist.init_process_group(store=...)`: rank 0's own (from
    `node_address`, or opened now at the given address), a client of it elsewhere."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        if _MASTER_STORE:
            return _MASTER_STORE[0]
        return dist.TCPStore(master_addr, master_port, world_size, is_master=True, timeout=timeout)
    return dist.TCPStore(master_addr, master_port, world_size, is_master=False, timeout=timeout)


def join_group(
    master_addr: str | None,
    master_port: int | None,
    rank: int,
    world_size: int,
    timeout_s: float,
    backend: str = "gloo",
) -> None:
    """Initialize this process's default group at rank 0's store (`join_store`; one rank alone: a
    store of its own); its collectives fail after `timeout_s` instead of waiting for a peer forever.
    NCCL: on the one GPU Ray gave this actor."""
    import datetime

    import torch
    import torch.distributed as dist

    if world_size == 1:
        store: Any = dist.HashStore()
    else:
        assert master_addr is not None and master_port is not None  # rank 0's address, for a group
        store = join_store(str(master_addr), int(master_port), rank, world_size, timeout_s)
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
    )


def node_info() -> dict[str, str]:
    """Where the calling actor runs: {"node_id", "node_ip"}."""
    return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": node_ip()}


async def rendezvous(rank0: Any) -> tuple[str, int]:
    """MASTER_ADDR / MASTER_PORT of a rank group: rank 0's node IP and a port free there."""
    (address,) = await rank_call("rendezvous address", [rank0.node_address.remote()])
    return address[0], int(address[1])


# ----------------------------------------------------------------------------------------------
# Placement


@dataclass
class RankPlacement:
    """`options[r]`: what rank r's actor adds to its `.options()`; `release()` frees the reservation."""

    options: list[dict[str, Any]]
    group: Any = field(default=None, repr=False)  # the placement group (spread), else None

    def release(self) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            try:
                ray.util.remove_placement_group(group)
            except Exception:  # Ray already gone: nothing is reserved any more
                pass


async def place_ranks(placement: str, world: int, bundle: Mapping[str, float], timeout_s: float) -> RankPlacement:
    """Reserve where `world` rank actors go (see the module docstring); `bundle`: what one rank needs."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if placement not in PLACEMENTS:
        raise ValueError(f"trainer placement {placement!r}: expected one of {PLACEMENTS}")
    if placement == "pack" or world == 1:
        return RankPlacement([{} for _ in range(world)])
    nodes = await asyncio.to_thread(_alive_nodes)
    if len(nodes) < world:
        raise TrainerPlacementError(
            f"backend.trainer_placement=spread puts each of the {world} trainer ranks on its own node, but the "
            f"Ray cluster has {len(nodes)} alive node(s) ({_describe(nodes)}); add nodes, lower "
            f"backend.num_trainer_ranks, or use backend.trainer_placement=pack"
        )
    group = placement_group([dict(bundle) for _ in range(world)], strategy="STRICT_SPREAD")
    timeout_s = timeout_s / 2  # within the caller's setup deadline, so this error is the one reported
    try:
        await within(
            group.ready(), timeout_s, f"a STRICT_SPREAD placement group of {world} x {dict(bundle)} (trainer ranks)"
        )
    except DeadlineExceeded as e:
        ray.util.remove_placement_group(group)
        nodes = await asyncio.to_thread(_alive_nodes)
        raise TrainerPlacementError(
            f"backend.trainer_placement=spread: the cluster could not place {world} trainer ranks on {world} "
            f"distinct nodes with {dict(bundle)} free on each within {timeout_s:g}s; nodes: {_describe(nodes)}"
        ) from e
    except BaseException:
        ray.util.remove_placement_group(group)
        raise
    return RankPlacement(
        [
            {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=r)}
            for r in range(world)
        ],
        group,
    )


def _alive_nodes() -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive")]


def _describe(nodes: list[dict]) -> str:
    def res(n: dict) -> str:
        r = n.get("Resources", {})
        return ", ".join(f"{k}={r[k]:g}" for k in ("CPU", "GPU") if k in r)

    return "; ".join(f"{n.get('NodeManagerAddress')} ({n.get('NodeID', '')[:8]}: {res(n)})" for n in nodes) or "none"


class StepCore(Protocol):
    """What `RankStepCalls` calls on a rank's trainer core (torch's `TrainerCore`, Megatron's)."""

    @property
    def steps(self) -> SplitStep: ...

    def finish_train_step(self, step: int) -> dict[str, float]: ...

    def abort_train_step(self, step: int) -> None: ...


class RankStepCalls:
    """The split-API calls a trainer rank actor forwards to its core as they are (`self.core`; the
    rank's `self.prefetcher`, None where the rank reads nothing, supplies the prefetch hit rate), and
    the reading of a microbatch's rows."""

    core: StepCore | None  # None until the rank actor builds it
    prefetcher: RowPrefetcher | None
    _last_extra: dict[str, float] = {}  # rank-side metrics of the step finished last

    def _step_core(self) -> StepCore:
        assert self.core is not None  # the group builds every rank's core before any split-API call
        return self.core

    def _refuse_other_step(self, step: int, what: str) -> None:
        """Refuse a call for `step` unless it is the open step: a call that arrives after its step was
        aborted or finished (or before it began) never adds to another step's gradients."""
        open_step = self._step_core().steps.status()["open_step"]
        if open_step is None:
            raise TrainStepStateError(f"{what}(step {step}): no train step is open (call begin_train_step first)")
        if open_step != step:
            raise TrainStepStateError(f"{what}(step {step}): the open step is {open_step}")

    def _read_rows(self, step: int, read: Callable[[], tuple[Mapping[str, Any], int]]) -> tuple[Mapping[str, Any], int]:
        """`read()` of this rank's rows for a microbatch of `step` (the rows, the bytes read). A
        failure marks the step failed (its finish refuses; only an abort closes it); one a retry can
        fix (the storage could not serve the rows, or could not be reached) is raised as
        `TrainerFailed`."""
        from replay.storage import StorageError

        try:
            return read()
        except (StorageError, OSError) as e:
            self._step_core().steps.mark_failed(f"reading its rows: {type(e).__name__}: {e}")
            raise TrainerFailed(f"train_microbatch(step {step}): reading its rows: {type(e).__name__}: {e}") from e
        except BaseException as e:
            self._step_core().steps.mark_failed(f"reading its rows: {type(e).__name__}: {e}")
            raise

    def finish_train_step(self, step: int) -> dict[str, float]:
        core = self._step_core()
        fresh = core.steps.is_open
        turns = getattr(self, "turns", None)  # `colocation.ComputeTurns` of a colocated rank
        with turns.hold() if turns is not None else contextlib.nullcontext():
            metrics = core.finish_train_step(step)
        if fresh:  # a retried finish reports the step's figures again
            extra: dict[str, float] = {}
            if self.prefetcher is not None:
                extra["train/prefetch_hit_rate"] = self.prefetcher.take_hit_rate()
            if turns is not None and turns.enabled:  # this rank's waits for its turns
                extra.update(turns.take_step_figures())
            self._last_extra = extra
        return {**metrics, **self._last_extra}

    def abort_train_step(self, step: int) -> None:
        self._step_core().abort_train_step(step)

    def train_status(self) -> dict[str, int | None]:
        return self._step_core().steps.status()
