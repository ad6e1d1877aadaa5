"""The vLLM generation backend on Ray: `start_vllm_generation` starts `VllmGenerationActor`s and
returns an `ActorGenerationClient` over each.

An actor asks Ray for no logical CPU on `vllm.device=cpu` and one GPU on `cuda` (in a pool, or
colocated with the trainer, its memory share: `colocation.gpu_shares`), and sets its own environment
(`engine_env`) before importing vLLM. The client coalesces one loop tick's requests into one
`generate_many`; a cancelled caller awaits the actor's `cancel` (`shielded_cancel`), so no row of
the group is stored after it. A dead actor surfaces as
`GenerationWorkerDied`, and `restart(weights)` replaces it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import ray

from single_controller.backends.common.actor_client import ActorGenerationClient, start_generation_clients
from single_controller.backends.common.actors import kill_all
from single_controller.backends.common.colocation import colocated_on_gpu, gpu_shares
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

    res = {"num_cpus": 0, "num_gpus": gpu_shares(cfg)[0]} if cfg.vllm.device == "cuda" else {"num_cpus": 0}
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
        sync=sync_link(cfg.backend.trainer_device, cfg.vllm.device, cfg.timeouts.weight_sync_s, colocated_on_gpu(cfg)),
    )


async def shutdown_vllm_generation(clients: Sequence[ActorGenerationClient]) -> None:
    await kill_all([c.actor for c in clients])


__all__ = ["start_vllm_generation", "shutdown_vllm_generation"]
