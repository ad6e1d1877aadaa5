"""The vLLM generation backend on Ray: `start_vllm_generation` (the starter `backends.registry` names)
starts `VllmGenerationActor`s and returns one `backends.common.actor_client.ActorGenerationClient`
(the controller-side `GenerationWorker`) over each.

Each actor runs one in-process engine: on `vllm.device=cpu` it asks Ray for no logical CPU (like
the torch workers; TransferQueue may hold them all), on `cuda` for one GPU (in a pool, a share of
one: `gpu_share`). Its process environment
(`engine_env`) is set by the actor itself before vLLM is imported.

The client coalesces the requests the controller issues in one event-loop tick into one
`generate_many` call. When a caller is cancelled (a deadline, the `abort` drain policy, the stale
in-flight rule, the run's end) the client awaits the actor's `cancel` before letting the
cancellation through, and a second cancellation cannot cut that wait short (`shielded_cancel`): the
caller's own clean-up (clearing the group's keys) then runs after the worker has guaranteed that no
row of that group is or will be stored. `pause(after_steps)` freezes the engine after that many steps.

A dead actor process surfaces as `GenerationWorkerDied` (from `generate` and `update_weights`), and
`restart(weights)` replaces it (a new actor and engine, connected to storage, with `weights`): the
rollout pump re-dispatches its prompts and restarts it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import ray

from single_controller.backends.common.actor_client import ActorGenerationClient, start_generation_clients
from single_controller.backends.common.actors import kill_all
from single_controller.backends.common.weight_broadcast import sync_link
from single_controller.config.schema import Config


async def start_vllm_generation(
    cfg: Config,
    storage_factory: Callable[[], Any],
    *,
    storage_ready: Awaitable[Any] | None = None,
    options: dict | None = None,
) -> list[ActorGenerationClient]:
    """Start `backend.num_generation_workers` vLLM actors (engines start in their constructors,
    beside the storage service's own start) and connect them to storage."""
    from single_controller.backends.vllm.worker import VllmGenerationActor

    res = {"num_cpus": 0, "num_gpus": gpu_share(cfg)} if cfg.vllm.device == "cuda" else {"num_cpus": 0}
    actor_cls = ray.remote(VllmGenerationActor)

    def spawner(i: int) -> Callable[[], Any]:  # also what restarts a dead worker
        def spawn() -> Any:
            return actor_cls.options(**{**res, **(options or {})}).remote(
                f"vllm{i}", cfg, storage_factory, seed=cfg.seed * 1000 + i
            )

        return spawn

    return await start_generation_clients(
        "vllm",
        cfg.backend.num_generation_workers,
        spawner,
        storage_ready,
        shielded_cancel=True,
        sync=sync_link(cfg.backend.trainer_device, cfg.vllm.device, cfg.timeouts.weight_sync_s),
    )


def gpu_share(cfg: Config) -> float:
    """The GPU a worker asks Ray for: a whole one, or in a pool (where the pool, not Ray, time-shares
    a slot between runs, each run's engine sleeping while another's works) the fraction of its
    memory the engine may take (`vllm.gpu_memory_utilization`), so the runs' engines fit one GPU."""
    return cfg.vllm.gpu_memory_utilization if cfg.pool.enabled else 1


async def shutdown_vllm_generation(clients: Sequence[ActorGenerationClient]) -> None:
    await kill_all([c.actor for c in clients])


__all__ = ["start_vllm_generation", "shutdown_vllm_generation"]
