"""One trainer rank without Ray: the split train API over a policy, AdamW and an optional gloo group.

`TrainerCore` follows `protocols.TrainerGroup` with `backends.common.split_step.SplitStep`'s
bookkeeping: microbatches add the raw loss sum's gradient under DDP `no_sync()` (no communication);
finish all-reduces counts, sums and the flattened gradients once, scales by 1/N, clips and takes one
AdamW step at `lr_at(step)`; an abort drops the gradients. A step of several updates
(`train.updates_per_step`) applies each but the last when the next one's first microbatch arrives
(`_next_update`), all at `lr_at(step)`; its abort restores the step's start. Parameters and AdamW state keep their
build dtype; `compute_dtype` (`model.dtype`) runs forwards under `torch.autocast` (logprobs and loss
in float32) and is the dtype snapshots are published in.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from single_controller.backends.common.offload import HostOffload, optimizer_tensors
from single_controller.backends.common.split_step import (
    OpenStep,
    SplitStep,
    StepSums,
    collective,
    lr_schedule,
    reduce_sums,
    reference_kl_rows,
    set_lr,
    train_rows,
)
from single_controller.backends.common.step_start import StepStart
from single_controller.backends.common.weights import WeightSnapshot, load_snapshot, pack_weights
from single_controller.backends.torch.eager_optim import eager_adamw, eager_step
from single_controller.backends.torch.model import enable_gradient_checkpointing, state_module
from single_controller.config.schema import TrainConfig
from single_controller.protocols import TrainerFailed
from single_controller.types import LossConfig, OffloadRecord


@dataclass(frozen=True)
class TrainerStatistics:
    rank: int
    world_size: int
    steps_done: int
    aborts: int
    open_step: int | None
    open_microbatches: int  # local, in the open step
    open_tokens: int  # local valid tokens in the open step


class TrainerCore:
    """One data-parallel rank. `process_group` None: single process; else a gloo group this rank is in
    (the policy is wrapped in DDP, which also broadcasts rank 0's parameters at construction).
    `max_steps`: the run's steps, the horizon of a decaying `cfg.lr_schedule` (None: constant only)."""

    def __init__(
        self,
        policy: nn.Module,
        cfg: TrainConfig,
        *,
        temperature: float = 1.0,
        process_group: dist.ProcessGroup | None = None,
        bucket_bytes: int = 4 << 20,
        max_steps: int | None = None,
        compute_dtype: torch.dtype | None = None,
        keep_reference: bool = False,
    ):
        self.policy = policy
        p0 = next(policy.parameters())
        if compute_dtype is not None and compute_dtype != p0.dtype and p0.dtype != torch.float32:
            raise ValueError(f"compute dtype {compute_dtype} needs float32 master parameters, not {p0.dtype}")
        # None: compute in the parameters' dtype; a 16-bit dtype: autocast to it, publish in it
        self.compute_dtype = None if compute_dtype in (None, p0.dtype) else compute_dtype
        self.cfg = cfg
        self.schedule = lr_schedule(cfg, max_steps)
        if cfg.gradient_checkpointing:
            enable_gradient_checkpointing(policy)  # before DDP wraps it and before the reference copy
        self.temperature = temperature
        self.bucket_bytes = bucket_bytes
        self.pg = process_group
        self.rank = 0 if process_group is None else dist.get_rank(process_group)
        self.world_size = 1 if process_group is None else dist.get_world_size(process_group)
        # Frozen copy of the initial weights for a KL penalty (in the loss: train.kl_coef; in the reward:
        # `keep_reference`), only when there is one (before any wrapping).
        keep = bool(keep_reference) or cfg.kl_coef > 0
        self.reference = copy.deepcopy(policy).requires_grad_(False) if keep else None
        self._ddp: nn.parallel.DistributedDataParallel | None = None
        self._forward: nn.Module = self._wrap(policy, process_group)
        self.params = [p for p in policy.parameters() if p.requires_grad]
        # never imports torch._dynamo (a start-up cost; nothing here is compiled)
        self.optimizer = eager_adamw(self.params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
        self.steps = SplitStep(has_reference=self.reference is not None)
        self.host = HostOffload()  # `train.offload`: what is in host memory while the engine has the device
        self.implicit_onloads = 0  # a call that needed the state while it was offloaded brought it back

    def _wrap(self, policy: nn.Module, process_group: dist.ProcessGroup | None) -> nn.Module:
        """What the forward runs: the policy, or over several ranks its DDP wrapper (gradients are
        all-reduced at finish, `_reduced_grads`; the backward runs under `no_sync`)."""
        if process_group is None:
            return policy
        # broadcast_buffers=False: buffers (e.g. HF rotary tables) are constants here, and a
        # per-forward buffer broadcast would be a collective per microbatch.
        self._ddp = nn.parallel.DistributedDataParallel(policy, process_group=process_group, broadcast_buffers=False)
        return self._ddp

    def statistics(self) -> TrainerStatistics:
        return TrainerStatistics(rank=self.rank, world_size=self.world_size, **self.steps.counts())

    def offload(self, what: str) -> OffloadRecord:
        """Move `what` (`optimizer`, or `all`: the parameters and the KL reference too) to host
        memory, between steps (`train.offload`); anything that needs it back brings it back."""
        self.steps.require_closed(f"offload({what})")
        if what not in ("optimizer", "all"):
            raise ValueError(f"offload: what must be 'optimizer' or 'all', got {what!r}")
        self.optimizer.zero_grad(set_to_none=True)  # no gradient lives between steps
        tensors = optimizer_tensors(self.optimizer)
        if what == "all":
            modules = [m for m in (self.policy, self.reference) if m is not None]
            tensors += [t for m in modules for t in (*m.parameters(), *m.buffers())]
        return self.host.offload(tensors)

    def onload(self) -> OffloadRecord:
        """Everything `offload` moved, back on the device, bit-exact (nothing: a no-op)."""
        return self.host.onload()

    def ensure_on_device(self) -> None:
        if self.host.offloaded:
            self.implicit_onloads += 1
            self.host.onload()

    def begin_train_step(self, step: int, loss: LossConfig) -> None:
        self.steps.check_begin(step, loss)
        self.ensure_on_device()
        self._zero_grads()
        self.steps.open_step(step, loss)

    def _zero_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def train_microbatch(self, rows: Mapping[str, Any], bytes_read: int = 0, update: int = 0) -> int:
        """Accumulate gradients of one microbatch (columns of TRAIN_FIELDS); returns its valid tokens.
        A microbatch that fails leaves partial gradients: the step's finish then refuses (on every
        rank: the flag travels in the finish's all-reduce) and only an abort closes it, so calls can
        be pipelined behind a microbatch. `update` (`train.updates_per_step`): the first microbatch of
        the step's next update first applies the update under way (every rank gets every microbatch
        call, so every rank takes that optimizer step together)."""
        st = self.steps.require_open("train_microbatch")
        if self.steps.starts_update(st, update):
            self._next_update(st)
        try:
            if not st.take_rows(rows, bytes_read):
                return 0
            ctx = self._ddp.no_sync() if self._ddp is not None else contextlib.nullcontext()
            with ctx:
                return train_rows(
                    self._forward,
                    self.reference,
                    rows,
                    st,
                    temperature=self.temperature,
                    dtype=self.params[0].dtype,
                    micro_batch_tokens=self.cfg.micro_batch_tokens,
                    autocast=self.compute_dtype,
                    share_prefixes=self.cfg.share_prompt_prefix,
                )
        except BaseException as e:
            self.steps.mark_failed(f"{type(e).__name__}: {e}")
            raise

    def finish_train_step(self, step: int) -> dict[str, float]:
        retried = self.steps.retried_finish(step)
        if retried is not None:
            return retried  # the step was applied once already
        st = self.steps.finishing(step)
        totals, grad_norm, lr = self._apply(st, f"finish_train_step({step})")
        return self.steps.finished(st, totals, grad_norm, lr=lr)

    def _next_update(self, st: OpenStep) -> None:
        """Apply the update under way of a step with several (`SplitStep.apply_update`); the next one
        accumulates from zero gradients."""
        self.steps.apply_update(
            st, lambda: StepStart(self.params, (), [self.optimizer], settle=self._settle), self._apply
        )
        self._zero_grads()

    def _settle(self) -> None:
        """After the parameters changed in place outside an optimizer step (`StepStart`): nothing here."""

    def _apply(self, st: OpenStep, what: str) -> tuple[StepSums, float, float]:
        """The optimizer step of `st`'s update under way: (its sums over the ranks, grad norm, lr)."""
        # first: every rank learns whether one had a failed microbatch
        totals, (failed,) = reduce_sums(st, self.pg, what, [float(st.failed is not None)])
        self._refuse_partial(st, int(failed))
        with collective(what):
            grads = self._reduced_grads()
        n = totals.normalizer(st)
        for p, g in zip(self.params, grads):
            p.grad = g.mul_(1.0 / n)
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        if not math.isfinite(grad_norm):
            raise TrainerFailed(f"step {st.step}: gradient norm is {grad_norm}")
        with self.steps.applying(st):
            set_lr(self.optimizer.param_groups, st.step, self.schedule)
            eager_step(self.optimizer)
        return totals, grad_norm, float(self.optimizer.param_groups[0]["lr"])

    @staticmethod
    def _refuse_partial(st: OpenStep, failed_ranks: int) -> None:
        """The same decision on every rank, before the gradients' collective."""
        if failed_ranks:
            here = f" (here: {st.failed})" if st.failed else ""
            raise TrainerFailed(
                f"finish_train_step({st.step}): a microbatch of the step failed on {failed_ranks} rank(s){here}; "
                "its gradients are partial, so no optimizer step: abort the step"
            )

    def _reduced_grads(self) -> list[torch.Tensor]:
        """Every parameter's raw gradient sum over the ranks (one collective for all of them)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if self.pg is not None:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.pg)
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))
        return grads

    def abort_train_step(self, step: int) -> None:
        st = self.steps.aborting(step)
        if st is None:
            return  # nothing of this step is open: an abort never undoes a finished step
        if st.start is not None:  # updates were applied: back to the step's start, bit-exactly
            st.start.restore()
        self._zero_grads()  # with one update, nothing else changed before the optimizer step
        self.steps.aborted()

    def reward_kl(self, rows: Mapping[str, Any], estimator: str) -> list[float]:
        """Each row's KL to the reference policy (`reward.kl_coef`: `split_step.reference_kl_rows`), in
        row order. Runs beside an open step (the reference never trains)."""
        if self.reference is None:
            raise ValueError("reward_kl: this trainer keeps no reference policy (no KL in the loss or the reward)")
        self.ensure_on_device()
        if len(rows["prompt_ids"]) == 0:
            return []
        return reference_kl_rows(
            self.reference,
            rows,
            estimator,
            temperature=self.temperature,
            micro_batch_tokens=self.cfg.micro_batch_tokens,
            autocast=self.compute_dtype,
            share_prefixes=self.cfg.share_prompt_prefix,
        )

    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs of this rank (between steps): policy, optimizer, RNG, next step."""
        self.steps.require_closed("state_dict")
        self.ensure_on_device()
        return {
            "policy": {k: v.detach().clone() for k, v in self.policy.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "rng": torch.get_rng_state(),
            "next_step": self.steps.next_step,
            "steps_done": self.steps.steps_done,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.steps.require_closed("load_state_dict", loading=True)
        self.ensure_on_device()
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        self.steps.loaded(state["next_step"], state["steps_done"])

    def publish_weights(self, version: int, into: Sequence[torch.Tensor] | None = None) -> WeightSnapshot:
        """The policy as a snapshot in `compute_dtype`; `into`: spare buckets to pack into (`pack_weights`)."""
        self.steps.require_closed(f"publish_weights({version})")
        self.ensure_on_device()
        return pack_weights(state_module(self.policy), version, self.bucket_bytes, dtype=self.compute_dtype, into=into)

    def load_weights(self, snapshot: WeightSnapshot) -> None:
        self.steps.require_closed("load_weights")
        self.ensure_on_device()
        load_snapshot(state_module(self.policy), snapshot)
