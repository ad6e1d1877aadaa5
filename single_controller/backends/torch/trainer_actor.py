"""`TrainerRankActor`: one trainer rank of the embedded torch backend, run as a Ray actor.

`ray_workers` starts it (`ray.remote(TrainerRankActor)`); `RankTrainerGroup`
(`backends.common.trainer_group`) drives it from the controller.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray
import torch
import torch.distributed as dist

from replay.fetch import RowPrefetcher, with_advantages
from replay.storage import LazyRowStorage, column_nbytes
from single_controller.backends.common.colocation import threads_per_process, turns_from_env
from single_controller.backends.common.rank_calls import RankStepCalls, join_group, node_address, node_info
from single_controller.backends.common.weight_broadcast import StagedWeights, WeightSender
from single_controller.backends.common.weights import WeightSnapshot
from single_controller.backends.common.worker_logs import redirect_output
from single_controller.backends.torch.model import build_policy, save_policy, state_module
from single_controller.backends.torch.trainer import TrainerCore, TrainerStatistics
from single_controller.config.schema import Config
from single_controller.data.tokenizer import load_tokenizer
from single_controller.protocols import TrainStepStateError
from single_controller.types import LossConfig, OffloadRecord

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


class TrainerRankActor(RankStepCalls, WeightSender):
    """One trainer rank (run with `ray.remote(TrainerRankActor)`; its methods are synchronous and run
    one at a time in the actor's process)."""

    ALWAYS_GROUPED = False  # a process group even for one rank (a sharded trainer's mesh needs one)

    def __init__(
        self, rank: int, world_size: int, cfg: Config, storage_factory: Callable[[], Any], dtype: str = "float32"
    ):
        redirect_output(f"trainer{rank}")
        torch.set_num_threads(threads_per_process(cfg.backend))
        self.rank, self.world_size, self.cfg = rank, world_size, cfg
        self.dtype = _DTYPES[dtype]
        self.storage = LazyRowStorage(storage_factory)  # connected in setup(): storage may still be starting
        self.prefetcher: RowPrefetcher = RowPrefetcher(self.storage)
        self.core: TrainerCore | None = None  # built by setup()
        self.turns = turns_from_env("train")  # `backend.colocate`: compute in turns with the generation workers

    def _trainer(self) -> TrainerCore:
        assert self.core is not None  # `start_torch_trainer` calls setup() on every rank before anything else
        return self.core

    def node_address(self) -> tuple[str, int]:
        """(this node's IP, a port free there): the group's rendezvous when this is rank 0."""
        return node_address()

    def node_info(self) -> dict[str, str]:
        return node_info()

    def setup(self, master_addr: str | None, master_port: int | None, timeout_s: float) -> int:
        """Join the rank group at rank 0's address (all ranks call this concurrently) and build the
        policy and optimizer; returns the parameter count. Needs no storage: it runs while the storage
        service is still starting (`connect_storage` follows once it is up)."""
        pg = self._join(master_addr, master_port, timeout_s) if self.world_size > 1 or self.ALWAYS_GROUPED else None
        device = self.device()
        if device.type == "cuda" and self.cfg.train.gpu_memory_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(self.cfg.train.gpu_memory_fraction)
        policy = build_policy(self.cfg.model, load_tokenizer(self.cfg.model.path).vocab_size, seed=self.cfg.seed).to(
            device=device, dtype=self.dtype
        )
        self.core = self._build_core(policy, pg)
        return sum(p.numel() for p in policy.parameters())

    def device(self) -> torch.device:
        return torch.device("cuda" if self.cfg.backend.trainer_device == "cuda" else "cpu")

    def _join(
        self, master_addr: str | None, master_port: int | None, timeout_s: float, backend: str = "gloo"
    ) -> dist.ProcessGroup:
        """The default group of every rank, met at rank 0's TCPStore (one rank: a store of its own)."""
        join_group(master_addr, master_port, self.rank, self.world_size, timeout_s, backend)
        assert dist.group.WORLD is not None  # initialized just now
        return dist.group.WORLD

    def _core_options(self) -> dict[str, Any]:
        """What every trainer core of a rank is built with, besides the policy and its group."""
        return dict(
            temperature=self.cfg.rollout.temperature,
            bucket_bytes=int(self.cfg.sync.weight_bucket_mb * 2**20),
            max_steps=self.cfg.run.max_steps,
            # model.dtype float32: compute in the parameters' own dtype (float64 in equivalence tests)
            compute_dtype=None if self.cfg.model.dtype == "float32" else getattr(torch, self.cfg.model.dtype),
            keep_reference=self.cfg.train.kl_coef > 0 or self.cfg.reward.kl_coef > 0,
        )

    def _build_core(self, policy: torch.nn.Module, pg: dist.ProcessGroup | None) -> TrainerCore:
        return TrainerCore(policy, self.cfg.train, process_group=pg, **self._core_options())

    def connect_storage(self) -> None:
        """Build this rank's storage client now (not on its first read): a storage that is not up
        fails the start, not the first step."""
        self.storage.connect()

    def begin_train_step(self, step: int, loss: LossConfig) -> None:
        self._trainer().begin_train_step(step, loss)

    def train_microbatch_keys(
        self,
        step: int,
        keys: Sequence[str],
        fields: Sequence[str],
        advantages: Sequence[float] | None = None,
        update: int = 0,
    ) -> int:
        """Fetch this rank's rows and accumulate their gradients into step `step` (refused unless it is
        the open one), in its update `update`; returns the bytes read. `advantages` (one per key) come
        with the call; None: the rows' `advantage` field is among `fields`."""
        self._refuse_other_step(step, "train_microbatch")  # before touching storage
        rows: Mapping[str, Any] = {"prompt_ids": []}
        nbytes = 0
        if keys:
            rows, nbytes = self._read_rows(step, lambda: self._fetch(keys, fields, advantages))
        with self.turns.hold():
            self._trainer().train_microbatch(rows, bytes_read=nbytes, update=update)
        return nbytes

    def _fetch(
        self, keys: Sequence[str], fields: Sequence[str], advantages: Sequence[float] | None
    ) -> tuple[Mapping[str, Any], int]:
        rows = self.prefetcher.fetch(list(keys), list(fields))
        return with_advantages(rows, advantages), sum(column_nbytes(c) for c in rows.values())

    def reward_kl_keys(self, keys: Sequence[str], fields: Sequence[str], estimator: str) -> list[float]:
        """Read these rows and return each one's KL to the reference policy (`reward.kl_coef`), in key
        order; every rank is called (a sharded reference's forwards are collectives)."""
        rows: Mapping[str, Any] = {"prompt_ids": [], "response_ids": []}
        if keys:
            rows = self.prefetcher.fetch(list(keys), list(fields))
        with self.turns.hold():
            return self._trainer().reward_kl(rows, estimator)

    def prefetch_keys(self, keys: Sequence[str], fields: Sequence[str]) -> None:
        """Start reading rows this rank will probably train soon, on a background thread; returns at once."""
        self.prefetcher.prefetch(list(keys), list(fields))

    def export_weights(self, version: int) -> WeightSnapshot | StagedWeights:
        """The policy as of `version`: `ray.put` buckets, or (`sync.transport: collective`) staged here
        for broadcasting (`WeightSender`)."""
        spare = self.make_room() if self.cfg.sync.transport == "collective" else None
        with self.turns.hold():
            snap = self._trainer().publish_weights(version, into=spare)
        if self.cfg.sync.transport == "collective":
            return self.stage_weights(snap, ray.get_runtime_context().current_actor)
        return WeightSnapshot(snap.manifest, [ray.put(b) for b in snap.buckets])

    def save_checkpoint(self, directory: str) -> str:
        core = self._trainer()
        if core.steps.is_open:
            raise TrainStepStateError("save_checkpoint while a train step is open")
        core.ensure_on_device()
        return str(save_policy(core.policy, directory, self.cfg.model))

    def save_state(self, directory: str) -> None:
        """Rank 0 writes the shared state (policy, optimizer: identical on every rank after the
        all-reduce) and a loadable policy; every rank writes its own RNG state."""
        os.makedirs(directory, exist_ok=True)
        core = self._trainer()
        state = core.state_dict()
        torch.save({"rng": state.pop("rng")}, os.path.join(directory, f"rank{self.rank}_rng.pt"))
        if self.rank == 0:
            torch.save(state, os.path.join(directory, "trainer.pt"))
            save_policy(core.policy, os.path.join(directory, "policy"), self.cfg.model)

    def load_state(self, directory: str) -> int:
        state = torch.load(os.path.join(directory, "trainer.pt"), weights_only=False)
        rng_path = os.path.join(directory, f"rank{self.rank}_rng.pt")
        state["rng"] = torch.load(rng_path)["rng"] if os.path.exists(rng_path) else torch.get_rng_state()
        core = self._trainer()
        core.load_state_dict(state)
        return core.steps.next_step

    def offload(self, what: str) -> OffloadRecord:
        """`train.offload`: this rank's optimizer state (and with `all` its parameters) to host memory."""
        return self._trainer().offload(what)

    def onload(self) -> OffloadRecord:
        return self._trainer().onload()

    def get_weights(self) -> dict[str, Any]:
        self._trainer().ensure_on_device()
        return {n: p.detach().cpu().clone().numpy() for n, p in state_module(self._trainer().policy).named_parameters()}

    def statistics(self) -> TrainerStatistics:
        return self._trainer().statistics()

    def get_grads(self) -> dict[str, Any]:
        """The gradient the last finished step applied (for checks)."""
        return {
            n: p.grad.detach().cpu().clone().numpy()
            for n, p in self._trainer().policy.named_parameters()
            if p.grad is not None
        }

    def close(self) -> None:
        self.prefetcher.close()
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
