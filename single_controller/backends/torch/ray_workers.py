"""The embedded torch backend on Ray: trainer-rank and generation actors, and their controller-side
adapters (`protocols.TrainerGroup`, `protocols.GenerationWorker`).

`RankTrainerGroup` drives `TrainerRankActor`s: a gloo group met at rank 0's TCPStore
(`rank_calls.rendezvous`), each chunk split over ranks by tokens (`algorithm.dp_split`), each rank
reading its own rows; rank 0 `ray.put`s the weight buckets, so weights never pass through the
controller. Generation is `ActorGenerationClient` over a `GenerationActor`. `start_torch_generation` /
`start_torch_trainer` are the starters `backends.registry` names. Errors: `rank_calls`, `actor_client`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import ray

from single_controller.backends.common.actor_client import ActorGenerationClient, start_generation_clients
from single_controller.backends.common.actors import kill_all
from single_controller.backends.common.colocation import gpu_shares, threads_per_process
from single_controller.backends.common.rank_calls import (
    CPU_BUNDLE,
    RANK_CONCURRENCY,
    place_ranks,
    rank_call,
    rendezvous,
)
from single_controller.backends.common.trainer_group import RankTrainerGroup
from single_controller.backends.common.weight_broadcast import SyncLink, sync_link
from single_controller.backends.torch.generation import GenerationActor
from single_controller.backends.torch.trainer_actor import TrainerRankActor
from single_controller.config.schema import Config, rollout_max_new_tokens, run_reward


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
) -> RankTrainerGroup:
    """Start `backend.num_trainer_ranks` trainer ranks where `backend.trainer_placement` puts them,
    join their gloo group at rank 0's address and build the policy (the `registry` starter contract)."""
    return await start_trainer_ranks(
        cfg, storage_factory, TrainerRankActor, storage_ready=storage_ready, options=options, dtype=dtype
    )


async def start_trainer_ranks(
    cfg: Config,
    storage_factory: Callable[[], Any],
    actor_cls: type,
    *,
    storage_ready: Awaitable[Any] | None = None,
    options: dict | None = None,
    dtype: str = "float32",
    group_options: dict | None = None,
) -> RankTrainerGroup:
    """`start_torch_trainer` with rank actors of `actor_cls` (a `TrainerRankActor`); `group_options`:
    what `RankTrainerGroup` takes besides the ranks and their placement."""
    world = cfg.backend.num_trainer_ranks
    # ray.remote's typed overloads omit the concurrency_groups option (it is accepted at run time)
    rank_cls = ray.remote(concurrency_groups=RANK_CONCURRENCY)(actor_cls)  # type: ignore[call-overload]
    cuda = cfg.backend.trainer_device == "cuda"
    share = gpu_shares(cfg)[1]  # a GPU per rank, or colocated with the engine on one GPU the share left to it
    res = {"num_cpus": 0, "num_gpus": share} if cuda else {"num_cpus": 0}
    placement = await place_ranks(
        cfg.backend.trainer_placement, world, {"GPU": share} if cuda else CPU_BUNDLE, cfg.timeouts.setup_s
    )
    ranks = [
        rank_cls.options(**{**res, **placement.options[r], **(options or {})}).remote(
            r, world, cfg, storage_factory, dtype
        )
        for r in range(world)
    ]
    group = RankTrainerGroup(ranks, placement=placement, **(group_options or {}))
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
) -> tuple[list[ActorGenerationClient], RankTrainerGroup]:
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


async def shutdown_cpu_workers(clients: Sequence[ActorGenerationClient], group: RankTrainerGroup) -> None:
    await kill_all([c.actor for c in clients] + list(group.ranks))


__all__ = [
    "TrainerRankActor",
    "RankTrainerGroup",
    "create_cpu_workers",
    "start_torch_generation",
    "start_torch_trainer",
    "start_trainer_ranks",
    "shutdown_cpu_workers",
]
