"""Generation workers on Ray, controller side: the client every generation backend (torch, vLLM) uses.

`ActorGenerationClient` is the `GenerationWorker` over one Ray async generation actor (any actor
with `generate_many`, `cancel`, `update_weights`, `connect`, ...); `start_generation_clients` starts
the actors, connects them to storage and leaves nothing running on failure. Adapters await object
refs; nothing here calls `ray.get`. Actors are stopped with `actors.kill_all`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import ray

from single_controller.backends.common.actors import first_line, kill_all
from single_controller.backends.common.rank_calls import SYNC_GROUP
from single_controller.backends.common.weight_broadcast import GroupAddress, StagedWeights, SyncLink
from single_controller.deadlines import DeadlineExceeded, within
from single_controller.protocols import GenerationFailed, GenerationWorkerDied, TrainerRankDied, generate
from single_controller.types import GenerationRequest, GenerationResult, WeightsHandle

log = logging.getLogger(__name__)

CANCEL_ACK_S = 30.0  # a cancel waits out at most one batch's row write (or engine step) on the actor


class ActorGenerationClient:
    """`GenerationWorker` over one generation actor.

    Requests issued in the same event-loop tick (the rollout pump dispatches a wave of groups at
    once) are coalesced into one `generate_many` call: one Ray round trip per wave instead of one
    per group, which on a small machine is most of the generation worker's CPU otherwise. A
    cancelled caller first waits for the actor's `cancel` (`_cancel_remote`): the caller's clean-up
    (clearing the group's keys) then runs after the worker guaranteed it writes none of them.
    `shielded_cancel`: that wait cannot be cut short by a second cancellation, and a worker that
    does not answer it (dead, or stuck past `CANCEL_ACK_S`) lets the cancellation go on (vLLM);
    otherwise only a dead actor does. A dead actor surfaces as `GenerationWorkerDied`;
    `restart(weights)` replaces it. The actor holds a request until it has the weights of its
    `min_version` (`protocols.VersionGated`), so a weight sync reopens admission as soon as it has
    sent the snapshot. `generate` is `submit`, await and, when cancelled, `withdraw`."""

    honours_min_version = True

    def __init__(
        self,
        name: str,
        actor_handle: Any,
        spawn: Callable[[], Any] | None = None,
        *,
        shielded_cancel: bool = False,
        sync: SyncLink | None = None,
    ):
        self.name = name
        self.actor = actor_handle
        self._spawn = spawn  # starts a replacement actor (restart after a death)
        self._shielded_cancel = shielded_cancel
        self._sync = sync or SyncLink()
        self._group: tuple[Any, str] | None = None  # (sender, key) of this incarnation's weight-sync group
        self.sync_fallback: str | None = None  # why this incarnation gets weights through the object store
        self._queue: list[tuple[GenerationRequest, asyncio.Future]] = []
        self._deliveries: set[asyncio.Task] = set()

    def submit(self, request: GenerationRequest) -> asyncio.Future[GenerationResult]:
        """Queued for this tick's `generate_many`; its result as a future."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[GenerationResult] = loop.create_future()
        if not self._queue:
            loop.call_soon(self._flush)
        self._queue.append((request, fut))
        return fut

    async def withdraw(self, request: GenerationRequest, future: asyncio.Future[GenerationResult]) -> None:
        """After `future` was cancelled: a request not sent yet never will be; a sent one is
        cancelled on the actor, which answers once it writes none of the request's rows."""
        if not any(f is future for _, f in self._queue):
            await self._cancel_remote(request.group_id)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await generate(self, request)

    async def _cancel_remote(self, group_id: str) -> None:
        what = f"generation worker {self.name}: cancel({group_id})"
        ack = within(self.actor.cancel.remote(group_id), CANCEL_ACK_S, what)
        if self._shielded_cancel:
            # Not cancellable itself: the caller clears the group's keys only after this.
            with contextlib.suppress(Exception):  # a dead or stuck worker writes nothing more
                await asyncio.shield(ack)
            return
        with contextlib.suppress(ray.exceptions.RayActorError):  # the actor is gone: it writes nothing any more
            await ack

    def _flush(self) -> None:
        batch, self._queue = self._queue, []
        live = [(r, f) for r, f in batch if not f.done()]
        if not live:
            return
        ref = self.actor.generate_many.remote([r for r, _ in live])
        task = asyncio.get_running_loop().create_task(self._deliver(ref, live))
        self._deliveries.add(task)
        task.add_done_callback(self._deliveries.discard)

    async def _deliver(self, ref: Any, batch: list[tuple[GenerationRequest, asyncio.Future]]) -> None:
        """Hand each result to its caller; every caller gets an answer, whatever happens."""
        try:
            results = await ref
        except BaseException as e:
            for req, fut in batch:
                if not fut.done():
                    fut.set_exception(self._failure(req, e))
            if not isinstance(e, Exception):
                raise
            return
        for (_, fut), res in zip(batch, results):
            if fut.done():
                continue  # its caller was cancelled
            if isinstance(res, BaseException):
                fut.set_exception(res)
            else:
                fut.set_result(res)

    def _failure(self, req: GenerationRequest, e: BaseException) -> GenerationFailed:
        if isinstance(e, ray.exceptions.RayActorError):
            err: GenerationFailed = GenerationWorkerDied(
                f"generation worker {self.name} died during generate({req.group_id}): {first_line(e)}"
            )
        else:
            err = GenerationFailed(f"{self.name}: generate({req.group_id}) failed: {first_line(e)}")
        err.__cause__ = e
        return err

    async def update_weights(self, weights: WeightsHandle) -> None:
        try:
            if isinstance(weights.payload, StagedWeights):
                await self._broadcast_weights(weights)
            else:
                await self.actor.update_weights.remote(weights)
        except ray.exceptions.RayActorError as e:
            raise GenerationWorkerDied(
                f"generation worker {self.name} died during update_weights(v{weights.version}): {first_line(e)}"
            ) from e

    # -- the collective transport (`weight_broadcast`) ---------------------------------------------

    async def _broadcast_weights(self, weights: WeightsHandle) -> None:
        """The sender's broadcast beside this worker's receive, over this worker's group; through the
        object store when no group can be formed. A failed broadcast may leave the worker's engine
        half-written: it fails as `GenerationFailed` (the caller takes the worker out and restarts it),
        unless the sender (a trainer rank) died: that is the trainer's failure, `TrainerRankDied`
        (the run stops, resumable), not this worker's, nor every other worker's it was sending to."""
        staged: StagedWeights = weights.payload
        v = weights.version
        key = await self._sync_group(staged.sender)
        if key is None:
            snapshot = await self._from_sender(
                staged.sender.put_weights.options(concurrency_group=SYNC_GROUP).remote(v), f"put_weights(v{v})"
            )
            await self.actor.update_weights.remote(WeightsHandle(v, snapshot, weights.num_bytes))
            return
        send = asyncio.ensure_future(
            self._from_sender(
                staged.sender.send_weights.options(concurrency_group=SYNC_GROUP).remote(key, v), f"send_weights(v{v})"
            )
        )
        try:
            await self.actor.receive_weights.remote(weights, key)
            await send
        except BaseException as e:
            # The send's own error (if any) is this one's cause or consequence: retrieved, not raised.
            send.add_done_callback(lambda f: f.cancelled() or f.exception())
            # Whatever ended the wait (an error, a dead worker or sender, our caller's deadline), the
            # transfer may go on on both ends: the next one forms a new group, never a second transfer
            # on this one (both ends drop this group when this transfer ends or fails at its own timeout).
            self._leave_group()
            if isinstance(e, TrainerRankDied) or not isinstance(e, ray.exceptions.RayTaskError):
                raise  # the sender died; a dead worker (restarted with a group of its own); our caller's cancellation
            # The receive fails as soon as the connection breaks, maybe before Ray reports the
            # sender's death: ask the sender whether it is there (raises TrainerRankDied if not).
            alive = await self._sender_answers(staged.sender, v)
            raise GenerationFailed(
                f"{self.name}: weights v{v} over weight-sync group {key} failed "
                f"(the engine may hold part of them; {alive}): {first_line(e)}"
            ) from e

    async def _from_sender(self, ref: Any, what: str) -> Any:
        """A call on the weights' sender, a trainer rank: its death is the trainer's, not this worker's."""
        try:
            return await ref
        except ray.exceptions.ActorDiedError as e:
            raise TrainerRankDied(
                f"the trainer rank sending weights died during {what} to generation worker {self.name}: {first_line(e)}"
            ) from e

    async def _sender_answers(self, sender: Any, version: int) -> str:
        """After a failed weight sync: raises `TrainerRankDied` when the sender is gone; else says
        whether it answered."""
        what = f"the weight sender's sync_address (is it alive after v{version} failed on {self.name}?)"
        try:
            await within(
                self._from_sender(sender.sync_address.options(concurrency_group=SYNC_GROUP).remote(), what),
                self._sync.timeout_s,
                what,
            )
        except DeadlineExceeded as e:
            return f"the sender did not answer either: {e}"
        return "the sender is alive"

    async def _sync_group(self, sender: Any) -> str | None:
        """The key of this worker's group with `sender`, formed on first use; None: the object store
        (announced once per worker incarnation)."""
        if self._group is not None and self._group[0] == sender:
            return self._group[1]
        if self.sync_fallback is not None:
            return None
        self._leave_group()
        try:
            ranks = await self.actor.sync_ranks.remote()
            host, port = await self._from_sender(
                sender.sync_address.options(concurrency_group=SYNC_GROUP).remote(), "sync_address"
            )
            addr = GroupAddress(
                f"{self.name}-{uuid.uuid4().hex[:8]}", host, port, 1 + ranks, self._sync.backend, self._sync.timeout_s
            )
            await within(
                asyncio.gather(
                    self._from_sender(
                        sender.open_sync_group.options(concurrency_group=SYNC_GROUP).remote(addr), "open_sync_group"
                    ),
                    self.actor.join_sync_group.remote(addr),
                ),
                self._sync.timeout_s + 5.0,
                f"generation worker {self.name}: forming its weight-sync group at {host}:{port}",
            )
        except (ray.exceptions.RayActorError, TrainerRankDied):  # a dead worker, or a dead sender
            raise
        except Exception as e:  # noqa: BLE001 - any failure to form the group means: use the object store
            self.sync_fallback = first_line(e)
            log.warning(
                "generation worker %s: no weight-sync group (%s); its weights go through the object store",
                self.name,
                self.sync_fallback,
            )
            return None
        self._group = (sender, addr.key)
        return addr.key

    def _leave_group(self) -> None:
        """Forget this worker's group; the sender drops its end (fire and forget: it may be gone)."""
        if self._group is not None:
            sender, key = self._group
            self._group = None
            with contextlib.suppress(Exception):
                sender.close_sync_group.options(concurrency_group=SYNC_GROUP).remote(key)

    async def restart(self, weights: WeightsHandle | None) -> None:
        """Replace a dead actor: start a new one, connect it to storage, apply `weights`."""
        if self._spawn is None or weights is None:
            raise GenerationFailed(f"generation worker {self.name} cannot be restarted (no factory or no weights)")
        ray.kill(self.actor)  # the old one is dead, or must be (a no-op on a dead actor)
        self._leave_group()  # the new process joins a group of its own
        self.sync_fallback = None
        self.actor = self._spawn()
        await self.actor.connect.remote()
        await self.update_weights(weights)

    async def in_flight(self) -> int:
        return await self.actor.in_flight.remote()

    async def running(self) -> Mapping[str, float]:
        """`protocols.ReportsRunning`: the liveness call the rollout pump makes at a request's deadline."""
        return await self.actor.running.remote()

    async def sleep(self, level: int) -> None:
        """Elastic shrink (`protocols.Sleepable`): level 0 is routing only, nothing to send."""
        if level > 0:
            await self._unless_dead(self.actor.sleep.remote(level), f"sleep({level})")

    async def wake(self) -> None:
        await self._unless_dead(self.actor.wake.remote(), "wake()")

    async def policy_version(self) -> int | None:
        return await self._unless_dead(self.actor.policy_version.remote(), "policy_version()")

    async def _unless_dead(self, ref: Any, call: str) -> Any:
        """`ref`'s result; a dead actor as `GenerationWorkerDied` (the caller restarts the worker)."""
        try:
            return await ref
        except ray.exceptions.RayActorError as e:
            raise GenerationWorkerDied(f"generation worker {self.name} died during {call}: {first_line(e)}") from e

    async def pause(self, *after_steps: int) -> int:
        """Idle the engine (vLLM: after `after_steps` more engine steps); returns the requests in flight."""
        return await self.actor.pause.remote(*after_steps)

    async def resume(self) -> None:
        await self.actor.resume.remote()

    async def statistics(self) -> Any:
        return await self.actor.statistics.remote()

    async def shutdown(self) -> None:
        await kill_all([self.actor])


async def start_generation_clients(
    prefix: str,
    count: int,
    spawn_of: Callable[[int], Callable[[], Any]],
    storage_ready: Awaitable[Any] | None,
    *,
    shielded_cancel: bool = False,
    sync: SyncLink | None = None,
) -> list[ActorGenerationClient]:
    """`count` clients named `{prefix}{i}`, each over the actor `spawn_of(i)()` starts (the same
    spawner restarts a dead one); their processes start before `storage_ready` is awaited, then
    every actor connects to storage. On failure every actor is stopped."""
    clients = []
    for i in range(count):
        spawn = spawn_of(i)
        clients.append(
            ActorGenerationClient(f"{prefix}{i}", spawn(), spawn, shielded_cancel=shielded_cancel, sync=sync)
        )
    try:
        if storage_ready is not None:
            await storage_ready
        await asyncio.gather(*(c.actor.connect.remote() for c in clients))
    except BaseException:
        await asyncio.shield(kill_all([c.actor for c in clients]))
        raise
    return clients
