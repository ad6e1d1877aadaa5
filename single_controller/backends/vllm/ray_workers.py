"""The vLLM generation backend on Ray: `start_vllm_generation` (the starter `backends.registry` names)
and `VllmGenerationClient`, the controller-side `GenerationWorker` over one `VllmGenerationActor`.

Each actor runs one in-process engine: on `vllm.device=cpu` it asks Ray for no logical CPU (like
the torch workers; TransferQueue may hold them all), on `cuda` for one GPU. Its process environment
(`engine_env`) is set by the actor itself before vLLM is imported.

The client coalesces the requests the controller issues in one event-loop tick into one
`generate_many` call. When a caller is cancelled (a deadline, the `abort` drain policy, the stale
in-flight rule, the run's end) the client awaits the actor's `cancel` before letting the
cancellation through: the caller's own clean-up (clearing the group's keys) then runs after the
worker has guaranteed that no row of that group is or will be stored.

A dead actor process surfaces as `GenerationWorkerDied` (from `generate` and `update_weights`), and
`restart(weights)` replaces it (a new actor and engine, connected to storage, with `weights`), as
the torch backend's client does: the rollout pump re-dispatches its prompts and restarts it.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Sequence

import ray

from single_controller.backends.cpu.ray_workers import _kill_all
from single_controller.backends.rank_calls import first_line
from single_controller.config import Config
from single_controller.deadlines import within
from single_controller.protocols import GenerationFailed, GenerationWorkerDied
from single_controller.types import GenerationRequest, GenerationResult, WeightsHandle

CANCEL_TIMEOUT_S = 30.0


class VllmGenerationClient:
    def __init__(self, name: str, actor_handle: Any, spawn: Callable[[], Any] | None = None):
        self.name = name
        self.actor = actor_handle
        self._spawn = spawn  # starts a replacement actor (restart after a death)
        self._queue: list[tuple[GenerationRequest, asyncio.Future]] = []
        self._deliveries: set[asyncio.Task] = set()

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if not self._queue:
            loop.call_soon(self._flush)
        self._queue.append((request, fut))
        try:
            return await fut
        except asyncio.CancelledError:
            # Not cancellable itself: the caller clears the group's keys only after this.
            try:
                await asyncio.shield(
                    within(self.actor.cancel.remote(request.group_id), CANCEL_TIMEOUT_S, f"{self.name}: cancel({request.group_id})")
                )
            except Exception:  # noqa: BLE001 - a dead or stuck worker writes nothing more; the cancellation must go on
                pass
            raise

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
            died = isinstance(e, ray.exceptions.RayActorError)
            for req, fut in batch:
                if not fut.done():
                    if died:
                        err = GenerationWorkerDied(f"generation worker {self.name} died during generate({req.group_id}): {first_line(e)}")
                    else:
                        err = GenerationFailed(f"{self.name}: generate({req.group_id}) failed: {e}")
                    err.__cause__ = e
                    fut.set_exception(err)
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

    async def update_weights(self, weights: WeightsHandle) -> None:
        try:
            await self.actor.update_weights.remote(weights)
        except ray.exceptions.RayActorError as e:
            raise GenerationWorkerDied(f"generation worker {self.name} died during update_weights(v{weights.version}): {first_line(e)}") from e

    async def restart(self, weights: WeightsHandle | None) -> None:
        """Replace a dead actor: start a new one (and its engine), connect it to storage, apply `weights`."""
        if self._spawn is None or weights is None:
            raise GenerationFailed(f"generation worker {self.name} cannot be restarted (no factory or no weights)")
        ray.kill(self.actor)  # the old one is dead, or must be (a no-op on a dead actor)
        self.actor = self._spawn()
        await self.actor.connect.remote()
        await self.update_weights(weights)

    async def in_flight(self) -> int:
        return await self.actor.in_flight.remote()

    async def pause(self, after_steps: int = 0) -> int:
        return await self.actor.pause.remote(after_steps)

    async def resume(self) -> None:
        await self.actor.resume.remote()

    async def cancel(self, group_id: str) -> bool:
        return await self.actor.cancel.remote(group_id)

    async def statistics(self):
        return await self.actor.statistics.remote()

    async def shutdown(self) -> None:
        await _kill_all([self.actor])


async def start_vllm_generation(
    cfg: Config, storage_factory: Callable[[], Any], *, storage_ready: Awaitable[Any] | None = None, options: dict | None = None
) -> list[VllmGenerationClient]:
    """Start `backend.num_generation_workers` vLLM actors (engines start in their constructors,
    beside the storage service's own start) and connect them to storage."""
    from single_controller.backends.vllm.worker import VllmGenerationActor

    res = {"num_cpus": 0, "num_gpus": 1} if cfg.vllm.device == "cuda" else {"num_cpus": 0}
    actor_cls = ray.remote(VllmGenerationActor)

    def spawner(i: int) -> Callable[[], Any]:  # also what restarts a dead worker
        def spawn() -> Any:
            return actor_cls.options(**{**res, **(options or {})}).remote(f"vllm{i}", cfg, storage_factory, seed=cfg.seed * 1000 + i)

        return spawn

    clients = []
    for i in range(cfg.backend.num_generation_workers):
        spawn = spawner(i)
        clients.append(VllmGenerationClient(f"vllm{i}", spawn(), spawn))
    try:
        if storage_ready is not None:
            await storage_ready
        await asyncio.gather(*(c.actor.connect.remote() for c in clients))
    except BaseException:
        await asyncio.shield(_kill_all([c.actor for c in clients]))
        raise
    return clients


async def shutdown_vllm_generation(clients: Sequence[VllmGenerationClient]) -> None:
    await _kill_all([c.actor for c in clients])


__all__ = ["VllmGenerationClient", "start_vllm_generation", "shutdown_vllm_generation"]
