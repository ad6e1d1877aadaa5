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

from single_controller.backends.torch.ray_workers import ActorGenerationClient, _kill_all
from single_controller.config.schema import Config
from single_controller.deadlines import within

CANCEL_TIMEOUT_S = 30.0


class VllmGenerationClient(ActorGenerationClient):
    """`GenerationWorker` over one `VllmGenerationActor`: the shared actor client, plus vLLM's
    `pause(after_steps)` and `cancel`, and a cancel acknowledgement that a second cancellation cannot cut short.
    The actor holds a request until it has loaded the weights of its `min_version`
    (`protocols.VersionGated`)."""

    honours_min_version = True

    async def _cancel_remote(self, group_id: str) -> None:
        # Not cancellable itself: the caller clears the group's keys only after this.
        try:
            await asyncio.shield(within(self.actor.cancel.remote(group_id), CANCEL_TIMEOUT_S, f"{self.name}: cancel({group_id})"))
        except Exception:  # noqa: BLE001 - a dead or stuck worker writes nothing more; the cancellation must go on
            pass

    async def pause(self, after_steps: int = 0) -> int:
        return await self.actor.pause.remote(after_steps)

    async def cancel(self, group_id: str) -> bool:
        return await self.actor.cancel.remote(group_id)


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
