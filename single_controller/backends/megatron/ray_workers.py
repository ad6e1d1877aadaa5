"""The Megatron trainer on Ray: one actor per rank (gloo on CPU, NCCL with one GPU each), and the
controller-side `RankTrainerGroup` (`megatron_trainer_group`) that satisfies `protocols.TrainerGroup`.

`MegatronRankActor` joins the group's world, then `build`s a `MegatronTrainerCore` from the model
directory (again with another TP size if asked). The group splits each chunk over DP ranks
(`algorithm.dp_split`); inside a TP group only the leader reads rows and broadcasts them
(`replay.fetch.fetch_and_broadcast`). Weights leave as a `WeightSnapshot` under HF names, put by
rank 0, so they never pass through the controller; checkpoints are HF model directories.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from replay.fetch import RowPrefetcher, fetch_and_broadcast, with_advantages
from replay.storage import Column, FieldSpec, LazyRowStorage, column_nbytes
from single_controller.algorithm.logprobs import token_logprobs
from single_controller.backends.common.colocation import gpu_shares, threads_per_process, turns_from_env
from single_controller.backends.common.rank_calls import (
    CPU_BUNDLE,
    RANK_CONCURRENCY,
    RankPlacement,
    RankStepCalls,
    join_group,
    node_address,
    node_info,
    place_ranks,
    rank_call,
    rendezvous,
    stop_ranks,
)
from single_controller.backends.common.safetensors_files import WEIGHT_FILE_SUFFIXES, write_safetensors
from single_controller.backends.common.split_step import collective
from single_controller.backends.common.trainer_group import RankTrainerGroup
from single_controller.backends.common.weight_broadcast import StagedWeights, WeightSender
from single_controller.backends.common.weights import WeightSnapshot, pack_weights
from single_controller.backends.common.worker_logs import redirect_output
from single_controller.backends.megatron.model import ModelSpec
from single_controller.config.schema import TrainConfig
from single_controller.types import LossConfig

if TYPE_CHECKING:  # imported where a rank builds its core (`build`)
    from single_controller.backends.megatron.trainer import MegatronTrainerCore, MegatronTrainerStatistics

HF_CONFIG = "config.json"


def read_hf_dir(directory: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json as a dict, every tensor of the directory's safetensors files)."""
    from safetensors.torch import load_file

    d = Path(directory)
    cfg = json.loads((d / HF_CONFIG).read_text())
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{d}: no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return cfg, tensors


def destroy_model_parallel() -> None:
    """`parallel_state.destroy_model_parallel()`, and the process groups it forgets: megatron-core
    drops its references to the groups `initialize_model_parallel` made but destroys only its explicit
    gloo ones; torch.distributed keeps the rest registered, so every `build` in the same world leaked
    its groups with their gloo threads (dozens of threads a build, and an idle rank after many
    builds kept most of a core busy polling). Destroyed as megatron-core destroys its own: only groups still registered;
    a group's threads end with its last reference, which the replaced core holds in reference cycles
    (its modules and optimizer): collected here, not whenever the collector next runs."""
    from megatron.core import parallel_state as mps

    made = [g for g in mps._global_process_group_list or () if g is not None]  # None: the default group
    registered = dist.distributed_c10d._world.pg_map
    for group in {id(g): g for g in made}.values():
        if registered.get(group) is not None:
            dist.destroy_process_group(group)
    mps.destroy_model_parallel()
    gc.collect()


class _PrefetchedReader:
    """`fetch_and_broadcast`'s storage on the TP leader: reads go through the rank's prefetcher."""

    def __init__(self, prefetcher: RowPrefetcher, storage: LazyRowStorage):
        self.prefetcher = prefetcher
        self.schema: Mapping[str, FieldSpec] = storage.schema

    def get_rows_sync(self, keys: Sequence[str], fields: Sequence[str]) -> dict[str, Column]:
        return self.prefetcher.fetch(keys, fields)


# The saved policy's safetensors files are at most this large (Hugging Face's own default shard size).
SAVE_SHARD_BYTES = 5 << 30


class MegatronRankActor(RankStepCalls, WeightSender):
    """One Megatron trainer rank (run with `ray.remote(MegatronRankActor)`); methods are synchronous
    and run one at a time in the actor's process."""

    def __init__(
        self, rank: int, world_size: int, storage_factory: Callable[[], Any] | None = None, torch_threads: int = 1
    ):
        redirect_output(f"megatron{rank}")
        torch.set_num_threads(torch_threads)
        self.turns = turns_from_env("train")  # `backend.colocate`: compute in turns with the generation workers
        self.rank, self.world_size = rank, world_size
        self.storage = LazyRowStorage(storage_factory) if storage_factory is not None else None
        self.prefetcher = RowPrefetcher(self.storage) if self.storage is not None else None
        self.core: MegatronTrainerCore | None = None
        self.model_dir: str | None = None

    def node_address(self) -> tuple[str, int]:
        """(this node's IP, a port free there): the rendezvous of the world when this is rank 0."""
        return node_address()

    def node_info(self) -> dict[str, str]:
        return node_info()

    def join(self, master_addr: str, master_port: int, timeout_s: float, backend: str = "gloo") -> None:
        """Join the world (all ranks call this concurrently) and connect to storage."""
        if self.storage is not None:
            self.storage.connect()
        if dist.is_initialized():
            return
        join_group(master_addr, master_port, self.rank, self.world_size, timeout_s, backend)

    def build(
        self,
        model_dir: str,
        train: TrainConfig,
        *,
        tensor_parallel_size: int,
        distributed_optimizer: bool = False,
        emulate_cpu: bool = False,
        temperature: float = 1.0,
        seed: int = 0,
        max_steps: int | None = None,
        dtype: str = "float32",
        keep_reference: bool = False,
    ) -> dict[str, int]:
        """(Re)build the model-parallel layout and the trainer from the HF model directory; returns
        {"dp_rank", "tp_rank", "dp", "tp", "params"} (params: this rank's parameter count).
        `max_steps`: the run's steps, the horizon of a decaying `train.lr_schedule`. `dtype`
        (`model.dtype`): float32, or bfloat16 (bfloat16 model over float32 main parameters).
        `keep_reference`: keep the initial weights for a KL in the reward (train.kl_coef > 0 keeps them too)."""
        from megatron.core import parallel_state as mps

        from single_controller.backends.megatron.cpu_emulation import check_version, cpu_emulation
        from single_controller.backends.megatron.trainer import MegatronTrainerCore

        if emulate_cpu:
            check_version()
        hf_cfg, hf_state = read_hf_dir(model_dir)
        spec = ModelSpec.from_hf_config(hf_cfg)
        self.core = None
        with cpu_emulation(emulate_cpu):
            if mps.model_parallel_is_initialized():
                destroy_model_parallel()
            mps.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size)
        self.model_dir = model_dir
        self.core = MegatronTrainerCore(
            hf_state,
            spec,
            train,
            distributed_optimizer=distributed_optimizer,
            emulate_cpu=emulate_cpu,
            temperature=temperature,
            seed=seed,
            max_steps=max_steps,
            dtype=getattr(torch, dtype),
            keep_reference=keep_reference,
        )
        c = self.core
        return {
            "dp_rank": c.dp_rank,
            "tp_rank": c.tp_rank,
            "dp": c.dp,
            "tp": c.tp,
            "params": sum(p.numel() for p in c.params),
        }

    @property
    def _core(self) -> MegatronTrainerCore:
        """The core `build` made: every call below comes after it."""
        assert self.core is not None, "call build() first"
        return self.core

    # --- the split API, per rank ---------------------------------------------------------------

    def begin_train_step(self, step: int, loss: LossConfig) -> None:
        self._core.begin_train_step(step, loss)

    def train_microbatch_keys(
        self,
        step: int,
        keys: Sequence[str],
        fields: Sequence[str],
        advantages: Sequence[float] | None = None,
        update: int = 0,
    ) -> int:
        """Read this rank's rows (TP leader reads, broadcasts to its TP group) and accumulate their
        gradients into step `step` (refused unless it is the open one), in its update `update`;
        returns the bytes this rank read from storage."""
        self._refuse_other_step(step, "train_microbatch")  # before touching storage or a collective
        rows: Mapping[str, Any] = {"prompt_ids": []}
        nbytes = 0
        if keys:
            rows, nbytes = self._read_rows(step, lambda: self._fetch(step, list(keys), list(fields), advantages))
        with self.turns.hold():
            self._core.train_microbatch(rows, bytes_read=nbytes, update=update)
        return nbytes

    def _fetch(
        self, step: int, keys: list[str], fields: list[str], advantages: Sequence[float] | None
    ) -> tuple[Mapping[str, Any], int]:
        """(rows with their advantages, bytes this rank read): read here (TP 1), or by the TP leader
        and broadcast to its TP group."""
        assert self.prefetcher is not None and self.storage is not None  # keys come only to ranks with storage
        if self._core.tp == 1:
            rows = self.prefetcher.fetch(keys, fields)
            return with_advantages(rows, advantages), sum(column_nbytes(c) for c in rows.values())
        from megatron.core import parallel_state as mps

        leader = self._core.tp_rank == 0
        reader = _PrefetchedReader(self.prefetcher, self.storage) if leader else None
        with self._core.on_device(), collective(f"train_microbatch(step {step})"):  # NCCL broadcasts CUDA tensors
            rows = fetch_and_broadcast(
                reader,
                keys,
                fields,
                mps.get_tensor_model_parallel_group(),
                mps.get_tensor_model_parallel_src_rank(),
                schema=self.storage.schema,
            )
        nbytes = sum(column_nbytes(c) for c in rows.values()) if leader else 0
        return with_advantages(rows, advantages), nbytes  # every rank of a TP group got the same ones

    def reward_kl_keys(self, keys: Sequence[str], fields: Sequence[str], estimator: str) -> list[float]:
        """Read these rows (the TP leader, for its TP group) and return each one's KL to the reference
        policy (`reward.kl_coef`), in key order."""
        rows: Mapping[str, Any] = {"prompt_ids": []}
        if keys:
            rows, _ = self._fetch(-1, list(keys), list(fields), None)
        with self.turns.hold():
            return self._core.reward_kl(rows, estimator)

    def train_microbatch_rows(self, rows: Mapping[str, Any], update: int = 0) -> int:
        """Accumulate gradients of rows given directly (tests; no storage)."""
        return self._core.train_microbatch(rows, update=update)

    def prefetch_keys(self, keys: Sequence[str], fields: Sequence[str]) -> None:
        """Start reading rows this rank will probably train soon (TP leaders only read)."""
        if self._core.tp_rank == 0:
            assert self.prefetcher is not None  # keys come only to ranks with storage
            self.prefetcher.prefetch(list(keys), list(fields))

    # --- weights -------------------------------------------------------------------------------

    def export_weights(
        self, version: int, prefix: str = "", transport: str = "object_store"
    ) -> WeightSnapshot | StagedWeights | None:
        """Every rank calls this (TP all-gather); rank 0 returns the snapshot with ray.put buckets, or
        (`transport="collective"`) stages it for broadcasting (`WeightSender`), in the model's dtype
        (bfloat16: the bfloat16 model parameters, i.e. the float32 mains cast)."""
        import ray

        with self.turns.hold():  # `backend.colocate`: the TP all-gather and the packing compute
            hf = self._core.hf_state_dict()
            if self.rank != 0:
                return None
            spare = self.make_room() if transport == "collective" else None
            snap = pack_weights(hf, version, prefix=prefix, into=spare)
        if transport == "collective":
            return self.stage_weights(snap, ray.get_runtime_context().current_actor)
        return WeightSnapshot(snap.manifest, [ray.put(b) for b in snap.buckets])

    def save_checkpoint(self, directory: str) -> str | None:
        """Every rank calls this; rank 0 writes an HF model directory: the source directory's other
        files (config.json, the tokenizer's) copied, never its weight files or their index; the
        weights in safetensors files of at most `SAVE_SHARD_BYTES` (with their own index past one)."""
        hf = self._core.hf_state_dict()
        if self.rank != 0:
            return None
        assert self.model_dir is not None  # set with the core, by build()
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        for f in Path(self.model_dir).iterdir():
            if f.is_file() and not f.name.endswith(WEIGHT_FILE_SUFFIXES):
                shutil.copy2(f, out / f.name)
        named = sorted(hf.items())
        itemsize = named[0][1].element_size()
        write_safetensors(named, iter(named), out, shard_bytes=SAVE_SHARD_BYTES, itemsize=itemsize, write=True)
        return str(out)

    def save_state(self, directory: str) -> None:
        """Every rank writes its own shard state (`rank{r}.pt`); rank 0 also writes the whole policy
        as an HF model directory (`policy/`)."""
        os.makedirs(directory, exist_ok=True)
        torch.save(self._core.state_dict(), os.path.join(directory, f"rank{self.rank}.pt"))
        self.save_checkpoint(os.path.join(directory, "policy"))

    def load_state(self, directory: str) -> int:
        """Restore what `save_state` wrote with the same layout; returns the next step."""
        state = torch.load(os.path.join(directory, f"rank{self.rank}.pt"), weights_only=False)
        self._core.load_state_dict(state)
        return self._core.steps.next_step

    # --- checks (tests) ------------------------------------------------------------------------

    def hf_weights(self) -> dict[str, np.ndarray]:
        return {k: v.float().numpy() for k, v in self._core.hf_state_dict().items()}  # bfloat16: exact in float32

    def hf_grads(self) -> dict[str, np.ndarray]:
        return {k: v.numpy() for k, v in self._core.hf_grads().items()}

    def state_fingerprint(self) -> Any:
        """Parameters and optimizer state now (compare two with `same_state`)."""
        return self._core.snapshot()

    def same_state(self, other: Any) -> bool:
        return self._core.snapshot().equals(other)

    def logprobs(
        self, prompt_ids: Sequence[torch.Tensor], response_ids: Sequence[torch.Tensor], temperature: float = 1.0
    ) -> torch.Tensor:
        """Token logprobs of responses under the current weights (no grad), [B, R]."""
        rows = self._core._rows_to_device({"prompt_ids": prompt_ids, "response_ids": response_ids})
        with self._core.on_device(), torch.no_grad():
            logp, _ = token_logprobs(self._core.policy, rows["prompt_ids"], rows["response_ids"], temperature)
        return logp.cpu()

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Whole-vocabulary logits [B, L, V] under the current weights (no grad)."""
        with self._core.on_device(), torch.no_grad():
            return self._core.policy(input_ids.to(self._core.device)).cpu()

    def statistics(self) -> MegatronTrainerStatistics:
        return self._core.statistics()

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
        if dist.is_initialized():
            try:
                destroy_model_parallel()
            finally:
                dist.destroy_process_group()


def megatron_trainer_group(
    rank_handles: Sequence[Any],
    layout: Sequence[Mapping[str, int]],
    weight_prefix: str = "",
    *,
    rank_nodes: Sequence[Mapping[str, str]] = (),
    placement: RankPlacement | None = None,
    transport: str = "object_store",
) -> RankTrainerGroup:
    """The `TrainerGroup` over `MegatronRankActor` handles in rank order, after `build` (its `layout`:
    one {"dp_rank", "dp", "tp", ...} per rank): a chunk goes to each data-parallel rank (the ranks of
    a tensor-parallel group read the same rows), and every rank takes part in an export (rank 0
    gathers the shards; `transport`: how it publishes them) and a checkpoint."""
    if not rank_handles or len(layout) != len(rank_handles):
        raise ValueError("need one layout entry per trainer rank")
    return RankTrainerGroup(
        rank_handles,
        data_ranks=[int(x["dp_rank"]) for x in layout],
        tensor_parallel_size=int(layout[0]["tp"]),
        export_args=(weight_prefix, transport),
        collective_io=True,
        rank_nodes=[dict(n) for n in rank_nodes],
        placement=placement,
    )


async def start_megatron_ranks(
    num_ranks: int,
    storage_factory: Callable[[], Any] | None,
    model_dir: str,
    train: TrainConfig,
    *,
    emulate_cpu: bool,
    setup_timeout_s: float,
    torch_threads: int = 1,
    actor_options: dict | None = None,
    storage_ready: Any = None,
    weight_prefix: str = "",
    placement: str = "pack",
    transport: str = "object_store",
    gpu_share: float = 1.0,
    **build: Any,
) -> RankTrainerGroup:
    """Start `num_ranks` rank actors where `placement` puts them (`rank_calls.place_ranks`), join
    them into one world at rank 0's address (gloo when emulating CPU, else NCCL with one GPU per
    rank) and build the trainer (`MegatronRankActor.build` with `build`: tensor_parallel_size and
    the rest); returns the group."""
    import ray

    opts = {"num_cpus": 0, **(actor_options or {})}
    if not emulate_cpu:  # a GPU per rank (colocated with the engine on one GPU: the share left to it)
        opts.setdefault("num_gpus", gpu_share)
    where = await place_ranks(placement, num_ranks, CPU_BUNDLE if emulate_cpu else {"GPU": gpu_share}, setup_timeout_s)
    # Ray's overloads of remote() list task options only, not actor ones such as concurrency_groups
    cls = ray.remote(concurrency_groups=RANK_CONCURRENCY)(MegatronRankActor)  # type: ignore[call-overload]
    ranks = [
        cls.options(**{**opts, **where.options[r]}).remote(r, num_ranks, storage_factory, torch_threads)
        for r in range(num_ranks)
    ]
    try:
        if storage_ready is not None:
            await storage_ready
        addr, port = await rendezvous(ranks[0])
        backend = "gloo" if emulate_cpu else "nccl"
        await rank_call("join", [r.join.remote(addr, port, setup_timeout_s, backend) for r in ranks])
        rank_nodes = await rank_call("node_info", [r.node_info.remote() for r in ranks])
        build = {**build, "emulate_cpu": emulate_cpu}
        layout = await rank_call("build", [r.build.remote(model_dir, train, **build) for r in ranks])
    except BaseException:
        await asyncio.shield(stop_ranks(ranks, where))
        raise
    return megatron_trainer_group(
        ranks, layout, weight_prefix=weight_prefix, rank_nodes=rank_nodes, placement=where, transport=transport
    )


async def start_megatron_trainer(
    cfg: Any,
    storage_factory: Callable[[], Any],
    *,
    storage_ready: Any = None,
    options: dict | None = None,
) -> RankTrainerGroup:
    """The `registry` starter for `backend.trainer: megatron`: `backend.num_trainer_ranks` rank actors
    (TP = megatron.tensor_parallel_size, DP = megatron.data_parallel_size) training `model.path`."""
    mg = cfg.megatron
    return await start_megatron_ranks(
        cfg.backend.num_trainer_ranks,
        storage_factory,
        cfg.model.path,
        cfg.train,
        tensor_parallel_size=mg.tensor_parallel_size,
        distributed_optimizer=mg.distributed_optimizer,
        emulate_cpu=mg.cpu_emulation,
        temperature=cfg.rollout.temperature,
        seed=cfg.seed,
        setup_timeout_s=cfg.timeouts.setup_s,
        max_steps=cfg.run.max_steps,
        torch_threads=threads_per_process(cfg.backend),
        actor_options=options,
        storage_ready=storage_ready,
        placement=cfg.backend.trainer_placement,
        transport=cfg.sync.transport,
        dtype=cfg.model.dtype,
        gpu_share=gpu_shares(cfg)[1],
        keep_reference=cfg.reward.kl_coef > 0,
    )
