"""One Megatron trainer rank without Ray: the split train API on megatron-core's own machinery.

The torch trainer's contract and loss math (`backends.common.split_step.SplitStep`), on Megatron:
microbatches accumulate the raw loss sum into DDP's buffers under `no_sync()`; finish all-reduces the
counts and sums over DP, runs `finalize_model_grads`, scales by 1/N once, clips with the TP-aware
norm and steps at `lr_at(step)` (set on the inner optimizers directly: no `OptimizerParamScheduler`,
no second step counter). An abort drops the gradients. `hf_state_dict()` gathers the TP shards under
HF names (weight sync, checkpoints); every rank of a TP group must call it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

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
from single_controller.backends.common.step_start import StateCopy, StepStart
from single_controller.backends.megatron.cpu_emulation import cpu_emulation, manual_seed
from single_controller.backends.megatron.model import (
    MegatronPolicy,
    ModelSpec,
    build_gpt,
    hf_to_megatron,
    megatron_to_hf,
)
from single_controller.config.schema import TrainConfig
from single_controller.protocols import TrainerFailed
from single_controller.types import LossConfig


@dataclass(frozen=True)
class MegatronTrainerStatistics:
    rank: int
    dp_rank: int
    tp_rank: int
    steps_done: int
    aborts: int
    open_step: int | None
    open_microbatches: int
    open_tokens: int


def _inner_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a Megatron (chained, FP32 or distributed) optimizer."""
    chain = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [o.optimizer for o in chain if getattr(o, "optimizer", None) is not None]


def _main_params(optimizer) -> list[tuple[torch.Tensor, torch.Tensor, slice]]:
    """(16-bit model parameter, its float32 main parameter, the main's slice of the flattened model
    parameter) for every 16-bit parameter of a Megatron optimizer: Float16OptimizerWithFloat16Params
    keeps a whole copy, the DistributedOptimizer this rank's shard. Empty for a float32 model."""
    out = []
    for o in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if hasattr(o, "shard_fp32_from_float16_groups"):  # DistributedOptimizer
            for models, mains in zip(o.model_float16_groups, o.shard_fp32_from_float16_groups):
                for p, m in zip(models, mains):
                    r = o._get_model_param_range_map(p)["param"]
                    out.append((p, m, slice(r.start, r.end)))
        elif hasattr(o, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params
            for models, mains in zip(o.float16_groups, o.fp32_from_float16_groups):
                out.extend((p, m, slice(0, p.numel())) for p, m in zip(models, mains))
    return out


# Saved trainer states pickled this class under its old name.
_Snapshot = StateCopy


class MegatronTrainerCore:
    """One rank of a TP x DP Megatron trainer, initialized from Hugging Face Llama, Qwen2, Qwen3 or GPT-2 weights."""

    def __init__(
        self,
        hf_state: Mapping[str, torch.Tensor],
        spec: ModelSpec,
        cfg: TrainConfig,
        *,
        distributed_optimizer: bool = False,
        emulate_cpu: bool = False,
        temperature: float = 1.0,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        max_steps: int | None = None,
        keep_reference: bool = False,
    ):
        from megatron.core import parallel_state as mps

        self.spec, self.cfg, self.temperature = spec, cfg, temperature
        self.schedule = lr_schedule(cfg, max_steps)  # max_steps: the horizon of a decaying schedule
        self.emulate_cpu = emulate_cpu
        self.tp = mps.get_tensor_model_parallel_world_size()
        self.tp_rank = mps.get_tensor_model_parallel_rank()
        self.dp = mps.get_data_parallel_world_size()
        self.dp_rank = mps.get_data_parallel_rank()
        self.rank = dist.get_rank()
        problems = spec.tp_problems(self.tp)
        if problems:
            raise ValueError("; ".join(problems))
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the Megatron trainer computes in float32 or bfloat16, not {dtype}")
        self.dtype = dtype
        with self._mc():
            manual_seed(seed, emulate_cpu)
            self.model = self._build_ddp(hf_state, distributed_optimizer)
            self.optimizer = self._build_optimizer(distributed_optimizer)
            self._load_hf_mains(hf_state)
            self.reference = None
            if cfg.kl_coef > 0 or keep_reference:  # frozen initial weights for a KL penalty (loss or reward)
                self.reference = self._build_gpt(hf_state)
                self.reference.requires_grad_(False)
        self.params = [p for p in self.model.module.parameters() if p.requires_grad]
        self.device = self.params[0].device  # cpu under the emulation, the rank's GPU otherwise
        self.policy = MegatronPolicy(self.model, spec.vocab_size)
        self.reference_policy = None if self.reference is None else MegatronPolicy(self.reference, spec.vocab_size)
        self.steps = SplitStep(has_reference=self.reference is not None)

    def _build_gpt(self, hf_state: Mapping[str, torch.Tensor]) -> Any:
        """The GPTModel with the HF weights in `self.dtype`; bfloat16: inside Megatron's Float16Module
        (inputs cast to bfloat16, logits returned in float32), as Megatron's training loop wraps it."""
        from megatron.core.transformer.module import Float16Module

        gpt = build_gpt(
            self.spec, self.tp, self.dtype, cpu_init=self.emulate_cpu, recompute=self.cfg.gradient_checkpointing
        )
        self._load_hf(gpt, hf_state)  # a float32 checkpoint is rounded to bfloat16 here
        return gpt if self.dtype == torch.float32 else Float16Module(gpt.config, gpt)

    def _build_ddp(self, hf_state: Mapping[str, torch.Tensor], distributed_optimizer: bool) -> Any:
        """The GPTModel with the HF weights, wrapped in Megatron's DDP (inside the emulation, if any).
        Gradients accumulate and are reduced in float32 (`main_grad` buffers) whatever `self.dtype`."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        model = self._build_gpt(hf_state)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,  # gradients are reduced once, in finish
            use_distributed_optimizer=distributed_optimizer,
            check_for_nan_in_grad=False,
        )
        return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)

    def _build_optimizer(self, distributed_optimizer: bool) -> Any:
        """Adam through `get_megatron_optimizer`: float32 -> FP32Optimizer over the model's own
        parameters; bfloat16 -> Float16OptimizerWithFloat16Params (float32 main copies of the bfloat16
        parameters; Adam's state is float32; after each step the mains are cast back into the model);
        either way the DistributedOptimizer (float32 main shards) with `distributed_optimizer`."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg = self.cfg
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.betas[0],
            adam_beta2=cfg.betas[1],
            adam_eps=1e-8,
            params_dtype=self.dtype,
            bf16=self.dtype == torch.bfloat16,
            use_distributed_optimizer=distributed_optimizer,
            clip_grad=cfg.grad_clip,
        )
        # config_overrides={}: weight decay on every parameter, like the torch trainer's AdamW.
        return get_megatron_optimizer(opt_config, [self.model], config_overrides={})

    def _mc(self):
        return cpu_emulation(self.emulate_cpu)

    def on_device(self):
        """Megatron (CPU emulation or not) with new tensors created on the model's device."""
        stack = contextlib.ExitStack()
        stack.enter_context(self._mc())
        if self.device.type != "cpu":
            stack.enter_context(self.device)  # e.g. NCCL collectives need CUDA tensors
        return stack

    def _rows_to_device(self, rows: Mapping[str, Any]) -> dict[str, Any]:
        if self.device.type == "cpu":
            return dict(rows)
        return {k: v.to(self.device) if torch.is_tensor(v) else [t.to(self.device) for t in v] for k, v in rows.items()}

    def _load_hf(self, module: torch.nn.Module, hf_state: Mapping[str, torch.Tensor]) -> None:
        named = dict(module.named_parameters())
        converted = hf_to_megatron(hf_state, self.spec, self.tp, self.tp_rank, list(named))
        with torch.no_grad():
            for name, p in named.items():
                if p.shape != converted[name].shape:
                    raise ValueError(
                        f"{name}: Megatron shape {tuple(p.shape)} != converted {tuple(converted[name].shape)}"
                    )
                p.copy_(converted[name])

    @torch.no_grad()
    def _load_hf_mains(self, hf_state: Mapping[str, torch.Tensor]) -> None:
        """16-bit model: the optimizer made its float32 mains from the 16-bit parameters; set them to
        the checkpoint's own values instead (a float32 checkpoint starts exactly where the torch
        trainer's float32 masters do; the model keeps their bfloat16 cast)."""
        pairs = _main_params(self.optimizer)
        if not pairs:
            return
        named = dict(self._gpt().named_parameters())
        converted = hf_to_megatron(hf_state, self.spec, self.tp, self.tp_rank, list(named))
        full = {id(p): converted[n] for n, p in named.items()}
        for p, main, part in pairs:
            main.copy_(full[id(p)].reshape(-1)[part].view_as(main))

    # --- the split API -------------------------------------------------------------------------

    def statistics(self) -> MegatronTrainerStatistics:
        return MegatronTrainerStatistics(
            rank=self.rank, dp_rank=self.dp_rank, tp_rank=self.tp_rank, **self.steps.counts()
        )

    def begin_train_step(self, step: int, loss: LossConfig) -> None:
        self.steps.check_begin(step, loss)
        self._zero_grads()
        self.steps.open_step(step, loss)

    def _zero_grads(self) -> None:
        with self._mc():
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()

    def train_microbatch(self, rows: Mapping[str, Any], bytes_read: int = 0, update: int = 0) -> int:
        """Accumulate the gradients of one microbatch (columns of TRAIN_FIELDS); returns its valid
        tokens. The first microbatch of the step's next `update` first applies the one under way (as
        the torch trainer's)."""
        st = self.steps.require_open("train_microbatch")
        if self.steps.starts_update(st, update):
            self._next_update(st)
        if not st.take_rows(rows, bytes_read):
            return 0
        rows = self._rows_to_device(rows)
        with self.on_device(), self.model.no_sync():
            return train_rows(
                self.policy,
                self.reference_policy,
                rows,
                st,
                temperature=self.temperature,
                dtype=torch.float32,  # logprobs and loss: Float16Module returns float32 logits
                micro_batch_tokens=self.cfg.micro_batch_tokens,
            )

    def finish_train_step(self, step: int) -> dict[str, float]:
        retried = self.steps.retried_finish(step)
        if retried is not None:
            return retried  # applied once already
        st = self.steps.finishing(step)
        totals, grad_norm, lr = self._apply(st, f"finish_train_step({step})")
        return self.steps.finished(st, totals, grad_norm, lr=lr)

    def _next_update(self, st: OpenStep) -> None:
        """Apply the update under way of a step with several (`SplitStep.apply_update`)."""

        def start() -> StepStart:
            with self._mc():
                return StepStart(self.params, self.params, _inner_optimizers(self.optimizer))

        self.steps.apply_update(st, start, self._apply)
        self._zero_grads()

    def _apply(self, st: OpenStep, what: str) -> tuple[StepSums, float, float]:
        """The optimizer step of `st`'s update under way: (its sums over the ranks, grad norm, lr)."""
        from megatron.core import parallel_state as mps
        from megatron.core.distributed import finalize_model_grads

        with self.on_device():
            # Every rank of a TP group trained the same rows: sum over the DP group only.
            totals, _ = reduce_sums(st, mps.get_data_parallel_group(), what)
            n = totals.normalizer(st)
            with collective(what):
                finalize_model_grads([self.model])  # DDP: sum (or reduce-scatter) the raw gradients once
            self.model.scale_gradients(1.0 / n)
            self.optimizer.prepare_grads()
            max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
            grad_norm = float(self.optimizer.clip_grad_norm(max_norm))
            if not math.isfinite(grad_norm):
                raise TrainerFailed(f"step {st.step}: gradient norm is {grad_norm}")
            with self.steps.applying(st):
                set_lr((g for o in _inner_optimizers(self.optimizer) for g in o.param_groups), st.step, self.schedule)
                self.optimizer.step_with_ready_grads()  # distributed optimizer: also all-gathers params
        return totals, grad_norm, float(_inner_optimizers(self.optimizer)[0].param_groups[0]["lr"])

    def abort_train_step(self, step: int) -> None:
        st = self.steps.aborting(step)
        if st is None:
            return  # nothing of this step is open: an abort never undoes a finished step
        if st.start is not None:  # updates were applied: back to the step's start, bit-exactly
            with self._mc():
                st.start.restore()
        self._zero_grads()  # with one update, nothing but the gradients changed before the optimizer step
        self.steps.aborted()

    def reward_kl(self, rows: Mapping[str, Any], estimator: str) -> list[float]:
        """Each row's KL to the reference policy (`reward.kl_coef`), in row order (every rank of a TP
        group gets the same rows and takes part in its forwards)."""
        if self.reference_policy is None:
            raise ValueError("reward_kl: this trainer keeps no reference policy (no KL in the loss or the reward)")
        if len(rows["prompt_ids"]) == 0:
            return []
        with self.on_device():
            return reference_kl_rows(
                self.reference_policy,
                self._rows_to_device(rows),
                estimator,
                temperature=self.temperature,
                micro_batch_tokens=self.cfg.micro_batch_tokens,
            )

    def layout(self) -> dict[str, Any]:
        """What a saved state must match to be loaded here (shards differ by layout)."""
        return {
            "tp": self.tp,
            "dp": self.dp,
            "tp_rank": self.tp_rank,
            "dp_rank": self.dp_rank,
            "distributed_optimizer": type(self.optimizer).__name__,
            "dtype": str(self.dtype),
            "spec": self.spec,
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's resume state between steps: its parameter shard and optimizer state (a
        `StateCopy`: everything an optimizer step changes), RNG, next step."""
        self.steps.require_closed("state_dict")
        return {
            "layout": self.layout(),
            "snapshot": StateCopy.take(self.params, _inner_optimizers(self.optimizer)),
            "rng": torch.get_rng_state(),
            "next_step": self.steps.next_step,
            "steps_done": self.steps.steps_done,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.steps.require_closed("load_state_dict", loading=True)
        saved = {"dtype": str(torch.float32), **state["layout"]}  # states saved before bfloat16 were float32
        if saved != self.layout():
            raise ValueError(f"saved trainer state has layout {saved}, this rank is {self.layout()}")
        with self._mc():
            state["snapshot"].restore(self.params, _inner_optimizers(self.optimizer))
        torch.set_rng_state(state["rng"])
        self.steps.loaded(state["next_step"], state["steps_done"])

    # --- weights -------------------------------------------------------------------------------

    def _gpt(self) -> Any:
        """The GPTModel inside DDP (and Float16Module): its parameter names are the converters'."""
        inner = self.model.module
        return inner.module if self.dtype != torch.float32 else inner

    def megatron_state(self) -> dict[str, torch.Tensor]:
        """This rank's parameters under their Megatron names (detached copies)."""
        return {n: p.detach().clone() for n, p in self._gpt().named_parameters()}

    def gather_tp(self, tensors: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Every TP rank's tensors (rank order), by all-gather in the TP group."""
        from megatron.core import parallel_state as mps

        if self.tp == 1:
            return [dict(tensors)]
        group = mps.get_tensor_model_parallel_group()
        names = sorted(tensors)
        flat = torch.cat([tensors[n].reshape(-1) for n in names])
        parts = [torch.empty_like(flat) for _ in range(self.tp)]
        with self._mc():
            dist.all_gather(parts, flat, group=group)
        out = []
        for part in parts:
            pieces = part.split([tensors[n].numel() for n in names])
            out.append({n: x.view_as(tensors[n]) for n, x in zip(names, pieces)})
        return out

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model under Hugging Face names (every TP rank must call this)."""
        self.steps.require_closed("hf_state_dict (weights requested)")
        return {k: v.cpu() for k, v in megatron_to_hf(self.gather_tp(self.megatron_state()), self.spec).items()}

    def hf_grads(self) -> dict[str, torch.Tensor]:
        """The gradient the last finished step applied (scaled and clipped), under HF names; plain
        (non-distributed) optimizer only. For checks."""
        grads = {n: p.main_grad.detach().clone() for n, p in self._gpt().named_parameters()}
        return {k: v.cpu() for k, v in megatron_to_hf(self.gather_tp(grads), self.spec).items()}

    def snapshot(self) -> StateCopy:
        """Parameters + optimizer state now (for checks)."""
        return StateCopy.take(self.params, _inner_optimizers(self.optimizer))
