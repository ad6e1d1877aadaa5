"""One Megatron trainer rank without Ray: the split train API on megatron-core's own machinery.

The caller has joined a torch.distributed group and initialized `megatron.core.parallel_state`
(TP x DP ranks); every rank of the group builds one `MegatronTrainerCore` and makes the same calls.

Contract of a step (the torch trainer's, `backends.cpu.trainer.TrainerCore`, with the same loss math):
  begin_train_step(step, loss)  refuses unless `step` == next_step and no step is open; zeroes
                                Megatron DDP's gradient buffers and snapshots parameters + the
                                optimizer's state (every tensor of the inner torch optimizers and
                                their main parameters) for abort.
  train_microbatch(rows)        forward/backward of the RAW masked loss sum (`grpo_loss`) under DDP
                                `no_sync()`: gradients accumulate in DDP's main_grad buffers, no
                                communication. All ranks of a TP group get the same rows.
  finish_train_step(step)       all-reduces [counts, loss and stat sums] over the DP group, then
                                `finalize_model_grads` (DDP grad all-reduce, or reduce-scatter with
                                the distributed optimizer), scales by 1/N once (N = global valid
                                tokens or sequences), clips with Megatron's TP-aware norm, one
                                optimizer step. finish of the step finished last returns its recorded
                                metrics (no second step). If it raises the step stays open.
  abort_train_step(step)        the open `step`: restores parameters and optimizer state bit-exactly;
                                anything else: no-op (never undoes a finished step).
  status()                      {"next_step", "open_step", "last_finished"}.
`hf_state_dict()` gathers the TP shards and converts them to Hugging Face names (weight sync and
checkpoints); every rank of the TP group must call it.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist

from single_controller.algorithm.losses import LOSS_LEVELS, grpo_loss, mismatch_stats
from single_controller.backends.torch.model import pad_right, token_logprobs
from single_controller.backends.torch.trainer import STAT_KEYS, TrainStepStateError, step_metrics
from single_controller.backends.megatron.cpu_emulation import cpu_emulation, manual_seed
from single_controller.backends.megatron.model import ModelSpec, MegatronPolicy, build_gpt, hf_to_megatron, megatron_to_hf
from single_controller.config.schema import TrainConfig
from single_controller.protocols import TrainerFailed
from single_controller.types import LossConfig


@dataclass
class _OpenStep:
    step: int
    loss: LossConfig
    snapshot: "_Snapshot"
    tokens: int = 0
    sequences: int = 0
    microbatches: int = 0
    loss_sum: float = 0.0
    stats: dict[str, float] | None = None
    bytes_read: int = 0
    started: float = 0.0


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


@dataclass(frozen=True)
class _Snapshot:
    """Everything an optimizer step changes: model parameters, each inner optimizer's main
    parameters (the model's own for FP32Optimizer, fp32 shards for the distributed optimizer), its
    per-parameter state and its group hyperparameters."""

    params: tuple[torch.Tensor, ...]
    main_params: tuple[tuple[torch.Tensor, ...], ...]  # [optimizer][param]
    states: tuple[dict[int, dict[str, Any]], ...]  # [optimizer] param index -> state
    groups: tuple[tuple[dict[str, Any], ...], ...]  # [optimizer][group] without "params"

    @staticmethod
    def _main(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [p for g in opt.param_groups for p in g["params"]]

    @classmethod
    def take(cls, params: list[torch.Tensor], optimizer) -> "_Snapshot":
        opts = _inner_optimizers(optimizer)

        def clone(v: Any) -> Any:
            return v.detach().clone() if torch.is_tensor(v) else v

        states = []
        for opt in opts:
            index = {p: i for i, p in enumerate(cls._main(opt))}
            states.append({index[p]: {k: clone(v) for k, v in s.items()} for p, s in opt.state.items()})
        return cls(
            params=tuple(p.detach().clone() for p in params),
            main_params=tuple(tuple(p.detach().clone() for p in cls._main(o)) for o in opts),
            states=tuple(states),
            groups=tuple(tuple({k: clone(v) for k, v in g.items() if k != "params"} for g in o.param_groups) for o in opts),
        )

    @torch.no_grad()
    def restore(self, params: list[torch.Tensor], optimizer) -> None:
        for p, saved in zip(params, self.params):
            p.copy_(saved)
        for opt, mains, state, groups in zip(_inner_optimizers(optimizer), self.main_params, self.states, self.groups):
            ps = self._main(opt)
            for p, saved in zip(ps, mains):
                p.copy_(saved)
            opt.state.clear()
            for i, s in state.items():
                opt.state[ps[i]] = {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for g, saved in zip(opt.param_groups, groups):
                g.update({k: v.clone() if torch.is_tensor(v) else v for k, v in saved.items()})

    def equals(self, other: "_Snapshot") -> bool:
        """Bit-identical (for tests)."""

        def same(a: Any, b: Any) -> bool:
            if torch.is_tensor(a) or torch.is_tensor(b):
                return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
            return a == b

        return (
            len(self.params) == len(other.params)
            and all(same(a, b) for a, b in zip(self.params, other.params))
            and all(same(a, b) for x, y in zip(self.main_params, other.main_params) for a, b in zip(x, y))
            and all(
                x.keys() == y.keys() and all(x[i].keys() == y[i].keys() and all(same(x[i][k], y[i][k]) for k in x[i]) for i in x)
                for x, y in zip(self.states, other.states)
            )
            and all(g.keys() == h.keys() and all(same(g[k], h[k]) for k in g) for x, y in zip(self.groups, other.groups) for g, h in zip(x, y))
        )


class MegatronTrainerCore:
    """One rank of a TP x DP Megatron trainer, initialized from Hugging Face Llama or GPT-2 weights."""

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
    ):
        from megatron.core import parallel_state as mps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.spec, self.cfg, self.temperature = spec, cfg, temperature
        self.emulate_cpu = emulate_cpu
        self.tp = mps.get_tensor_model_parallel_world_size()
        self.tp_rank = mps.get_tensor_model_parallel_rank()
        self.dp = mps.get_data_parallel_world_size()
        self.dp_rank = mps.get_data_parallel_rank()
        self.rank = dist.get_rank()
        problems = spec.tp_problems(self.tp)
        if problems:
            raise ValueError("; ".join(problems))
        with self._mc():
            manual_seed(seed, emulate_cpu)
            model = build_gpt(spec, self.tp, dtype, cpu_init=emulate_cpu)
            self._load_hf(model, hf_state)
            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,  # gradients are reduced once, in finish
                use_distributed_optimizer=distributed_optimizer,
                check_for_nan_in_grad=False,
            )
            self.model = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
            opt_config = OptimizerConfig(
                optimizer="adam",
                lr=cfg.lr,
                weight_decay=cfg.weight_decay,
                adam_beta1=cfg.betas[0],
                adam_beta2=cfg.betas[1],
                adam_eps=1e-8,
                params_dtype=dtype,
                use_distributed_optimizer=distributed_optimizer,
                clip_grad=cfg.grad_clip,
            )
            # config_overrides={}: weight decay on every parameter, like the torch trainer's AdamW.
            self.optimizer = get_megatron_optimizer(opt_config, [self.model], config_overrides={})
            self.reference = None
            if cfg.kl_coef > 0:  # frozen initial weights for the KL penalty
                self.reference = build_gpt(spec, self.tp, dtype, cpu_init=emulate_cpu)
                self._load_hf(self.reference, hf_state)
                self.reference.requires_grad_(False)
        self.params = [p for p in self.model.module.parameters() if p.requires_grad]
        self.device = self.params[0].device  # cpu under the emulation, the rank's GPU otherwise
        self.policy = MegatronPolicy(self.model, spec.vocab_size)
        self._open: _OpenStep | None = None
        self._last_finished: tuple[int, dict[str, float]] | None = None
        self.next_step = 0
        self.steps_done = 0
        self.aborts = 0

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
                    raise ValueError(f"{name}: Megatron shape {tuple(p.shape)} != converted {tuple(converted[name].shape)}")
                p.copy_(converted[name])

    # --- the split API -------------------------------------------------------------------------

    @property
    def step_open(self) -> bool:
        return self._open is not None

    def status(self) -> dict[str, int | None]:
        return {
            "next_step": self.next_step,
            "open_step": None if self._open is None else self._open.step,
            "last_finished": None if self._last_finished is None else self._last_finished[0],
        }

    def statistics(self) -> MegatronTrainerStatistics:
        st = self._open
        return MegatronTrainerStatistics(
            rank=self.rank, dp_rank=self.dp_rank, tp_rank=self.tp_rank, steps_done=self.steps_done,
            aborts=self.aborts, open_step=None if st is None else st.step,
            open_microbatches=0 if st is None else st.microbatches, open_tokens=0 if st is None else st.tokens,
        )

    def begin_train_step(self, step: int, loss: LossConfig) -> None:
        if self._open is not None:
            raise TrainStepStateError(f"begin_train_step({step}): step {self._open.step} is still open")
        if step != self.next_step:
            raise TrainStepStateError(f"begin_train_step({step}): the trainer's next step is {self.next_step}")
        if loss.level not in LOSS_LEVELS:
            raise ValueError(f"loss level must be one of {LOSS_LEVELS}, got {loss.level!r}")
        if loss.kl_coef > 0 and self.reference is None:
            raise ValueError("loss.kl_coef > 0 but the trainer was built with train.kl_coef == 0 (no reference policy)")
        with self._mc():
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            snapshot = _Snapshot.take(self.params, self.optimizer)
        self._open = _OpenStep(step=step, loss=loss, snapshot=snapshot, stats=dict.fromkeys(STAT_KEYS, 0.0), started=time.perf_counter())

    def train_microbatch(self, rows: Mapping[str, Any], bytes_read: int = 0) -> int:
        """Accumulate the gradients of one microbatch (columns of TRAIN_FIELDS); returns its valid tokens."""
        st = self._require_open("train_microbatch")
        st.bytes_read += bytes_read
        st.microbatches += 1
        if len(rows["prompt_ids"]) == 0:
            return 0
        bad = [
            i for i, (r, g, m) in enumerate(zip(rows["response_ids"], rows["gen_logprobs"], rows["response_mask"]))
            if not r.shape[0] == g.shape[0] == m.shape[0]
        ]
        if bad:
            raise ValueError(f"rows {bad[:5]}: response_ids, gen_logprobs and response_mask lengths differ")
        dtype = self.params[0].dtype
        rows = self._rows_to_device(rows)
        with self.on_device(), self.model.no_sync():
            logp, valid = token_logprobs(self.policy, rows["prompt_ids"], rows["response_ids"], self.temperature)
            mask = pad_right(rows["response_mask"], False, torch.bool) & valid  # [B, R]
            gen = pad_right(rows["gen_logprobs"], 0.0, dtype)  # [B, R]
            ref = None
            if st.loss.kl_coef > 0:
                with torch.no_grad():
                    ref_policy = MegatronPolicy(self.reference, self.spec.vocab_size)
                    ref, _ = token_logprobs(ref_policy, rows["prompt_ids"], rows["response_ids"], self.temperature)
            out = grpo_loss(logp, gen, torch.as_tensor(rows["advantage"]), mask, st.loss, ref_logprobs=ref)
            out.loss_sum.backward()
            if rows.get("token_versions") is not None:
                # the engine's mismatch: rows whose every token was sampled with the weights this step
                # trains (as in backends/torch/trainer.py)
                versions = pad_right(rows["token_versions"], -1, torch.long).to(mask.device)  # [B, R]
                fresh = ((versions == st.step) | ~mask).all(dim=1) & mask.any(dim=1)  # [B]
                for k, v in mismatch_stats(logp, gen, mask & fresh[:, None]).items():
                    st.stats[k] += v
        st.tokens += out.num_tokens
        st.sequences += out.num_sequences
        st.loss_sum += float(out.loss_sum.detach())
        for k, v in out.token_stats.items():
            st.stats[k] += v
        return out.num_tokens

    def finish_train_step(self, step: int) -> dict[str, float]:
        from megatron.core import parallel_state as mps
        from megatron.core.distributed import finalize_model_grads

        if self._open is None and self._last_finished is not None and self._last_finished[0] == step:
            return dict(self._last_finished[1])  # a retried finish: applied once already
        st = self._require_open(f"finish_train_step({step})")
        if st.step != step:
            raise TrainStepStateError(f"finish_train_step({step}): the open step is {st.step}")
        with self.on_device():
            # Every rank of a TP group trained the same rows: sum over the DP group only.
            sums = torch.tensor([st.tokens, st.sequences, st.loss_sum, *(st.stats[k] for k in STAT_KEYS)], dtype=torch.float64)
            dist.all_reduce(sums, group=mps.get_data_parallel_group())
            tokens, sequences, loss_sum = (float(x) for x in sums[:3])
            stat_sums = dict(zip(STAT_KEYS, sums[3:].tolist()))
            n = tokens if st.loss.level == "token" else sequences
            if n <= 0:
                raise TrainerFailed(f"step {st.step}: no valid tokens on any rank ({st.microbatches} local microbatches)")
            finalize_model_grads([self.model])  # DDP: sum (or reduce-scatter) the raw gradients once
            self.model.scale_gradients(1.0 / n)
            self.optimizer.prepare_grads()
            max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
            grad_norm = float(self.optimizer.clip_grad_norm(max_norm))
            if not math.isfinite(grad_norm):
                raise TrainerFailed(f"step {st.step}: gradient norm is {grad_norm}")
            self.optimizer.step_with_ready_grads()  # distributed optimizer: also all-gathers params
        self._open = None
        self.steps_done += 1
        self.next_step = st.step + 1
        metrics = step_metrics(st, n, loss_sum, tokens, sequences, stat_sums, grad_norm, lr=float(_inner_optimizers(self.optimizer)[0].param_groups[0]["lr"]))
        self._last_finished = (st.step, dict(metrics))
        return metrics

    def abort_train_step(self, step: int) -> None:
        st = self._open
        if st is None or st.step != step:
            return  # nothing of this step is open: an abort never undoes a finished step
        with self._mc():
            st.snapshot.restore(self.params, self.optimizer)
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
        self._open = None
        self.aborts += 1

    def layout(self) -> dict[str, Any]:
        """What a saved state must match to be loaded here (shards differ by layout)."""
        return {"tp": self.tp, "dp": self.dp, "tp_rank": self.tp_rank, "dp_rank": self.dp_rank,
                "distributed_optimizer": type(self.optimizer).__name__, "spec": self.spec}

    def state_dict(self) -> dict[str, Any]:
        """This rank's resume state between steps: its parameter shard and optimizer state (the
        abort snapshot's contents), RNG, next step."""
        if self._open is not None:
            raise TrainStepStateError(f"state_dict while step {self._open.step} is open")
        return {
            "layout": self.layout(),
            "snapshot": _Snapshot.take(self.params, self.optimizer),
            "rng": torch.get_rng_state(),
            "next_step": self.next_step,
            "steps_done": self.steps_done,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self._open is not None:
            raise TrainStepStateError("load_state_dict while a step is open")
        if state["layout"] != self.layout():
            raise ValueError(f"saved trainer state has layout {state['layout']}, this rank is {self.layout()}")
        with self._mc():
            state["snapshot"].restore(self.params, self.optimizer)
        torch.set_rng_state(state["rng"])
        self.next_step = int(state["next_step"])
        self.steps_done = int(state["steps_done"])
        self._last_finished = None

    def _require_open(self, what: str) -> _OpenStep:
        if self._open is None:
            raise TrainStepStateError(f"{what}: no train step is open (call begin_train_step first)")
        return self._open

    # --- weights -------------------------------------------------------------------------------

    def megatron_state(self) -> dict[str, torch.Tensor]:
        """This rank's parameters under their Megatron names (detached copies)."""
        return {n: p.detach().clone() for n, p in self.model.module.named_parameters()}

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
        if self._open is not None:
            raise TrainStepStateError(f"weights requested while step {self._open.step} is open")
        return {k: v.cpu() for k, v in megatron_to_hf(self.gather_tp(self.megatron_state()), self.spec).items()}

    def hf_grads(self) -> dict[str, torch.Tensor]:
        """The gradient the last finished step applied (scaled and clipped), under HF names; plain
        (non-distributed) optimizer only. For checks."""
        grads = {n: p.main_grad.detach().clone() for n, p in self.model.module.named_parameters()}
        return {k: v.cpu() for k, v in megatron_to_hf(self.gather_tp(grads), self.spec).items()}

    def snapshot(self) -> _Snapshot:
        """Parameters + optimizer state now (for checks)."""
        return _Snapshot.take(self.params, self.optimizer)

