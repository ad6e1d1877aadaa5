"""The FSDP2 trainer core (`backend.trainer: fsdp`; its rank actor: `ray_workers.FsdpRankActor`).

`FsdpTrainerCore` is the torch trainer's split step (`backends/torch/trainer.py`: raw loss sums per
microbatch, counts all-reduced once at finish, 1/N once, clip, one AdamW step) over a policy sharded
with `fully_shard` on a one-dimensional `DeviceMesh` (gloo on the CPU, NCCL on CUDA): each repeated
block (the largest `ModuleList`: an HF model's decoder layers, TinyGPT's blocks) is its own FSDP unit,
the root holds the rest. Every rank keeps 1/N of each parameter, of its gradient and of the AdamW
state; a block's full parameters exist only while it computes.

Gradients are reduce-scattered as raw sums (no division: the step divides by the global count once).
`reduce`: `microbatch` (default) reduce-scatters after each microbatch's backward, so gradients stay
sharded; `finish` accumulates the unsharded gradients over the step and reduce-scatters them once, in
`finish_train_step` (fewer collectives, a whole unsharded gradient per rank meanwhile). Both give the
same step: a sum is a sum. Every rank runs as many passes per microbatch as the rank with the most
(`train.micro_batch_tokens`; the others pad with one token at zero weight): FSDP's collectives pair
up by forward and backward. Whole rows only (no shared-prompt passes).

Mixed precision (`model.dtype` bfloat16 or float16): FSDP all-gathers the parameters in that dtype and
reduce-scatters gradients in float32 into float32 shards (the master weights and AdamW state stay
float32). The KL reference, when there is one, is sharded the same way. `gathered` yields the whole
tensors one at a time (every rank takes part: an all-gather each), so a weight export or a saved
policy never needs the whole model on one rank; `distributed_state` / `load_distributed_state` are
what a torch distributed checkpoint saves and loads, on any number of ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from single_controller.algorithm.logprobs import token_logprobs
from single_controller.backends.common.split_step import token_passes
from single_controller.backends.common.weights import SnapshotBuilder, WeightSnapshot, bucket_groups
from single_controller.backends.torch.model import state_module
from single_controller.backends.torch.trainer import TrainerCore

Reduce = Literal["microbatch", "finish"]


def repeated_blocks(module: nn.Module) -> nn.ModuleList:
    """The model's repeated blocks: the `ModuleList` holding the most parameters."""
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(f"{type(module).__name__} has no ModuleList of blocks to shard")
    return max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters()))


def shard_policy(
    policy: nn.Module, process_group: dist.ProcessGroup, device: str = "cpu", compute_dtype: torch.dtype | None = None
) -> list[Any]:
    """`fully_shard` each repeated block and then the root, in place; gradients reduce as raw sums.
    `compute_dtype`: all-gather parameters in it, reduce gradients in float32 (None: the parameters'
    dtype throughout). Returns the FSDP modules, blocks first."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    ranks = dist.get_process_group_ranks(process_group)
    mesh = DeviceMesh.from_group(process_group, device, mesh=torch.tensor(ranks))
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32 if compute_dtype else None)
    units = [fully_shard(block, mesh=mesh, mp_policy=mp) for block in repeated_blocks(policy)]
    units.append(fully_shard(policy, mesh=mesh, mp_policy=mp))
    for unit in units:
        unit.set_gradient_divide_factor(1.0)  # raw sums: the step's 1/N is applied once, at finish
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM, even by 1)
    return units


class FsdpTrainerCore(TrainerCore):
    """One FSDP2 rank of the split step; `process_group`: the ranks that shard the policy."""

    def __init__(
        self,
        policy: nn.Module,
        cfg: Any,
        *,
        process_group: dist.ProcessGroup,
        reduce: Reduce = "microbatch",
        device: str = "cpu",
        **kwargs: Any,
    ):
        # Whole rows: the shared-prompt path runs the model's parts one by one, outside the root unit's
        # forward, where FSDP gathers the root's parameters (the embeddings).
        cfg = dataclasses.replace(cfg, share_prompt_prefix=False)
        self.reduce: Reduce = reduce
        self.device = device
        self._units: list[Any] = []
        super().__init__(policy, cfg, process_group=process_group, **kwargs)

    def _wrap(self, policy: nn.Module, process_group: dist.ProcessGroup | None) -> nn.Module:
        assert process_group is not None  # a sharded trainer has its ranks
        self._units = shard_policy(policy, process_group, self.device, self.compute_dtype)
        self._units[-1].set_requires_gradient_sync(self.reduce == "microbatch")  # recurses into the blocks
        if self.reference is not None:  # forward only: sharded like the policy, never a whole copy per rank
            shard_policy(self.reference, process_group, self.device, self.compute_dtype)
        return policy

    def gathered(
        self, named: Sequence[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each of `named` whole, in `dtype` (cast on the shard, before the all-gather), one at a time:
        a tensor is gathered when the previous one is let go. Every rank iterates (collectives)."""
        self.steps.require_closed("gathered weights")
        self.ensure_on_device()
        for name, t in named:
            with torch.no_grad():  # never around the yield: a generator left unfinished would keep it on
                t = t.detach() if dtype is None else t.detach().to(dtype)
                whole = t.full_tensor() if hasattr(t, "full_tensor") else t
            yield name, whole
            del whole  # before the next all-gather: one whole tensor at a time

    def publish_buckets(
        self,
        version: int,
        *,
        lead: bool,
        put: Callable[[Any], Any] | None = None,
        into: Sequence[torch.Tensor] | None = None,
    ) -> WeightSnapshot | None:
        """Every rank: the policy's parameters gathered a tensor at a time, in the compute dtype. The
        `lead` rank packs them a bucket at a time (`bucket_bytes`) and hands each bucket to `put` (e.g.
        `ray.put`; what it returns is what the snapshot holds; None: the bucket itself) before packing
        the next, so no rank holds more than one bucket and one gathered tensor of the whole policy.
        `into`: spare buckets to pack into. The lead returns the snapshot, the others None."""
        named = list(state_module(self.policy).named_parameters())
        dtype = self.compute_dtype or named[0][1].dtype
        builder = SnapshotBuilder(version, dtype)
        buckets: list[Any] = []
        tensors = self.gathered(named, dtype)
        for b, group in enumerate(bucket_groups(named, dtype.itemsize, self.bucket_bytes)):
            whole = (next(tensors) for _ in group)  # lazily: each gathered when the previous one is let go
            if not lead:
                for _ in whole:
                    pass  # the all-gathers only
                continue
            spare = into[b] if into is not None and b < len(into) else None
            bucket = builder.add(group, into=spare, whole=whole, fresh=True)
            buckets.append(bucket if put is None else put(bucket))
            del bucket  # before the next all-gather: one bucket at a time
        return WeightSnapshot(builder.manifest(), buckets) if lead else None

    def distributed_state(self) -> dict[str, Any]:
        """This rank's shards of the policy and the AdamW state, as a torch distributed checkpoint
        saves them (`torch.distributed.checkpoint.save`; loadable on any number of ranks)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.steps.require_closed("distributed_state")
        self.ensure_on_device()
        model, optim = get_state_dict(self.policy, self.optimizer)
        return {"model": model, "optim": optim}

    def load_distributed_state(self, state: Mapping[str, Any], next_step: int, steps_done: int) -> None:
        """What `distributed_state` saved (loaded into its layout, `torch.distributed.checkpoint.load`)."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        self.steps.require_closed("load_distributed_state", loading=True)
        self.ensure_on_device()
        set_state_dict(self.policy, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.steps.loaded(next_step, steps_done)

    def _reduced_grads(self) -> list[torch.Tensor]:
        """Each parameter's shard of the gradient summed over the ranks (reduce-scattered after each
        microbatch, or now, once, with `reduce: finish`)."""
        if self.reduce == "finish":
            self._reduce_scatter_accumulated()
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]

    def train_microbatch(self, rows: Any, bytes_read: int = 0, update: int = 0) -> int:
        """As the torch trainer's, then as many zero-weight one-token passes as this rank ran fewer
        than the rank with the most (`train.micro_batch_tokens` cuts each share by its own lengths; an
        empty share runs none): FSDP's all-gathers and reduce-scatters pair up by forward and
        backward, so every rank must run the same number."""
        self.steps.require_open("train_microbatch")
        lengths = [len(p) + len(r) for p, r in zip(rows["prompt_ids"], rows["response_ids"])]
        mine = len(token_passes(lengths, self.cfg.micro_batch_tokens)) if lengths else 0
        most = torch.tensor([mine], dtype=torch.int64)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.pg)
        tokens = super().train_microbatch(rows, bytes_read, update)
        for _ in range(int(most.item()) - mine):
            self._empty_pass()
        return tokens

    def _empty_pass(self) -> None:
        """A pass that changes nothing but runs every collective a real one runs, in a real pass's
        order: the forward at the step's start (a later update's old logprobs), the policy's, the
        reference's when the loss has a KL penalty, the backward."""
        one = torch.zeros(1, dtype=torch.long)
        st = self.steps.require_open("train_microbatch")
        if st.ratio_to_start and st.start is not None:
            with torch.no_grad(), st.start.policy_at_start():
                token_logprobs(self._forward, [one], [one], self.temperature)
        logprobs, _ = token_logprobs(self._forward, [one], [one], self.temperature)
        if st.loss.kl_coef > 0 and self.reference is not None:
            with torch.no_grad():  # in a real pass's order: the policy's forward, the reference's, the backward
                token_logprobs(self.reference, [one], [one], self.temperature)
        (logprobs.sum() * 0.0).backward()

    def reward_kl(self, rows: Any, estimator: str) -> list[float]:
        """As the torch trainer's, the sharded reference's forwards padded to the rank with the most
        passes (each all-gathers: every rank runs as many)."""
        lengths = [len(p) + len(r) for p, r in zip(rows["prompt_ids"], rows["response_ids"])]
        mine = len(token_passes(lengths, self.cfg.micro_batch_tokens)) if lengths else 0
        most = torch.tensor([mine], dtype=torch.int64)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.pg)
        out = super().reward_kl(rows, estimator)
        one = torch.zeros(1, dtype=torch.long)
        for _ in range(int(most.item()) - mine):
            with torch.no_grad():
                assert self.reference is not None  # super() refused a trainer without one
                token_logprobs(self.reference, [one], [one], self.temperature)
        return out

    def _zero_grads(self) -> None:
        super()._zero_grads()
        self._drop_accumulated()  # the unsharded gradients accumulated for a deferred reduction too

    def _settle(self) -> None:
        """The sharded parameters changed in place (`StepStart`): no unit may keep whole parameters
        gathered from the old shards (the root keeps its own after a forward)."""
        for unit in self._units:
            unit.reshard()

    def _drop_accumulated(self) -> None:
        """Forget the unsharded gradients accumulated for a deferred reduction (`reduce: finish`)."""
        for unit in self._units:
            group = unit._get_fsdp_state()._fsdp_param_group
            for fsdp_param in group.fsdp_params if group is not None else ():
                fsdp_param.unsharded_accumulated_grad = None
                if hasattr(fsdp_param, "_unsharded_param"):
                    fsdp_param.unsharded_param.grad = None

    def _reduce_scatter_accumulated(self) -> None:
        """The deferred reduction: what FSDP's post-backward does when gradient sync is on, for the
        gradients accumulated with it off (every rank calls it: it is a collective per unit)."""
        for unit in self._units:
            group = unit._get_fsdp_state()._fsdp_param_group
            if group is None:
                continue
            group.reduce_grads = True
            group.post_backward()
            group.reduce_grads = False
        root = self._units[-1]._get_fsdp_state()
        root._root_post_backward_final_callback()


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the same storage), any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t
