"""The FSDP2 trainer on Ray (`backend.trainer: fsdp`): `FsdpRankActor`, one rank per actor (gloo on the
CPU, NCCL with a GPU each), driven by the same `RankTrainerGroup` as the torch trainer's ranks.

What differs from a torch rank is what the whole model is needed for, and every rank takes part in
each (`collective_io`): a weight export gathers the parameters a tensor at a time into one bucket at a
time, which rank 0 puts in the object store (or stages for a collective broadcast) before packing
the next; the saved policy goes to safetensors files the same way (`checkpoint.write_safetensors`);
a checkpoint is a torch distributed checkpoint that loads onto any number of ranks. The ranks meet
the same deadlines as the torch trainer's: a rank that dies is `TrainerRankDied` (`rank_calls`), and
the survivors' collectives fail within `timeouts.setup_s` (the group's timeout) instead of hanging.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

import ray
import torch
import torch.distributed as dist

from single_controller.backends.common.weight_broadcast import StagedWeights
from single_controller.backends.common.weights import WeightSnapshot
from single_controller.backends.fsdp.checkpoint import load_distributed, save_distributed, save_policy_dir
from single_controller.backends.fsdp.trainer import FsdpTrainerCore
from single_controller.backends.torch.model import state_module
from single_controller.backends.torch.ray_workers import start_trainer_ranks
from single_controller.backends.torch.trainer_actor import TrainerRankActor
from single_controller.config.schema import Config
from single_controller.protocols import TrainStepStateError


class FsdpRankActor(TrainerRankActor):
    """One FSDP2 rank (`ray.remote(FsdpRankActor)`); exports, checkpoints and saved policies are
    collective: every rank is asked, rank 0 answers."""

    ALWAYS_GROUPED = True

    def _join(
        self, master_addr: str | None, master_port: int | None, timeout_s: float, backend: str = "gloo"
    ) -> dist.ProcessGroup:
        backend = "nccl" if self.device().type == "cuda" else backend  # on the GPU Ray gave each rank
        return super()._join(master_addr, master_port, timeout_s, backend)

    def _build_core(self, policy: torch.nn.Module, pg: dist.ProcessGroup | None) -> FsdpTrainerCore:
        assert pg is not None  # ALWAYS_GROUPED
        return FsdpTrainerCore(
            policy,
            self.cfg.train,
            process_group=pg,
            reduce=self.cfg.fsdp.reduce,
            device=self.device().type,
            **self._core_options(),
        )

    def _fsdp(self) -> FsdpTrainerCore:
        core = self._trainer()
        assert isinstance(core, FsdpTrainerCore)  # `_build_core` made it
        return core

    # collective: every rank is asked, the others answer None (RankTrainerGroup takes rank 0's answer)
    def export_weights(self, version: int) -> WeightSnapshot | StagedWeights | None:  # type: ignore[override]
        """Every rank: gather the policy's parameters a tensor at a time, in the compute dtype; rank 0
        packs them a bucket at a time (`sync.weight_bucket_mb`) and puts each bucket in the object store
        before packing the next (or, `sync.transport: collective`, stages them for broadcasting).
        Rank 0 returns the snapshot, the others None."""
        core, transport = self._fsdp(), self.cfg.sync.transport
        lead = self.rank == 0
        spare = self.make_room() if lead and transport == "collective" else None
        put = ray.put if transport != "collective" else None  # None: kept here, staged for the broadcast
        with self.turns.hold():
            snap = core.publish_buckets(version, lead=lead, put=put, into=spare)
        if snap is None:
            return None
        if transport == "collective":
            return self.stage_weights(snap, ray.get_runtime_context().current_actor)
        return snap

    def save_checkpoint(self, directory: str) -> str | None:  # type: ignore[override]  # collective: as export
        """Every rank: the policy as a model directory loadable by `transformers` and vLLM (an HF
        model's config and tokenizer files; safetensors of at most `fsdp.safetensors_shard_mb` MiB
        each), or a TinyGPT's own; rank 0 writes it and returns its path."""
        core = self._fsdp()
        if core.steps.is_open:
            raise TrainStepStateError("save_checkpoint while a train step is open")
        shard_bytes = self.cfg.fsdp.safetensors_shard_mb * 2**20
        return save_policy_dir(
            core, directory, shard_bytes=shard_bytes, source=self.cfg.model.path, write=self.rank == 0
        )

    def save_state(self, directory: str) -> None:
        """Every rank: its shards (a torch distributed checkpoint, reshardable) and RNG state; and the
        policy as a model directory (`policy/`)."""
        core = self._fsdp()
        save_distributed(core, directory, self.rank, self.world_size)
        self.save_checkpoint(os.path.join(directory, "policy"))

    def load_state(self, directory: str) -> int:
        return load_distributed(self._fsdp(), directory, self.rank)

    def get_weights(self) -> dict[str, Any]:
        """Every rank: the whole parameters (checks; gathered)."""
        core = self._fsdp()
        named = list(state_module(core.policy).named_parameters())
        return {n: t.cpu().clone().numpy() for n, t in core.gathered(named)}

    def get_grads(self) -> dict[str, Any]:
        """Every rank: the whole gradient the last finished step applied (checks; gathered)."""
        grads = [(n, p.grad) for n, p in self._fsdp().policy.named_parameters() if p.grad is not None]
        return {n: _whole(g).cpu().clone().numpy() for n, g in grads}


def _whole(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)  # a DTensor's: an all-gather
    return full() if full is not None else t


async def start_fsdp_trainer(
    cfg: Config,
    storage_factory: Callable[[], Any],
    *,
    storage_ready: Awaitable[Any] | None = None,
    options: dict | None = None,
    dtype: str = "float32",
) -> Any:
    """The `registry` starter for `backend.trainer: fsdp`: `backend.num_trainer_ranks` FSDP2 ranks."""
    return await start_trainer_ranks(
        cfg,
        storage_factory,
        FsdpRankActor,
        storage_ready=storage_ready,
        options=options,
        dtype=dtype,
        group_options=dict(collective_io=True),
    )
