"""One trainer rank without Ray: the split train API over a policy, AdamW and an optional gloo group.

Contract of a step (`TrainerCore`); every call names its step (see `protocols.TrainerGroup`):
  begin_train_step(step, loss)  opens a step (raises if one is open or `step` is not `next_step`),
                                zeroes gradients and snapshots parameters + optimizer state for abort.
  train_microbatch(rows)        (raises if no step is open) adds d(raw loss sum)/dθ to the local
                                gradients, under DDP `no_sync()`: no communication per microbatch.
  finish_train_step(step)       all-reduces [counts, loss and stat sums] and, once, all gradients
                                flattened into one buffer; scales by 1/N (N = global valid tokens for
                                token-level loss, global sequences for sequence-level); clips to
                                grad_clip; one AdamW step; closes the step and returns metrics. If it
                                raises (non-finite gradient norm, no valid tokens, a collective
                                failed) the step stays open: the caller aborts it. finish of the
                                step finished last returns its recorded metrics (no second step).
  abort_train_step(step)        idempotent: restores parameters and optimizer state bit-identically
                                to before begin (no-op when `step` is not open: never undoes a finish).
After finish, `p.grad` holds the gradient that was applied (scaled and clipped) until the next begin.

Weights leave the trainer as a `WeightSnapshot`: the parameters packed into flat numpy buckets of at
most `bucket_bytes` (one parameter larger than that gets its own bucket) plus a manifest of names,
shapes and offsets tagged with the policy version. `load_snapshot` is the consumer side; it checks
the whole manifest against the module before it copies anything.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import warnings
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from single_controller.algorithm.losses import LOSS_LEVELS, grpo_loss, mismatch_stats
from single_controller.backends.torch.model import pad_right, state_module, token_logprobs
from single_controller.config.schema import TrainConfig
from single_controller.backends.torch.eager_optim import eager_adamw, eager_step
from single_controller.protocols import TrainerFailed, TrainStepStateError  # noqa: F401  (re-exported)
from single_controller.types import LossConfig


# --- weight snapshots --------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightEntry:
    name: str
    shape: tuple[int, ...]
    bucket: int
    offset: int  # in elements, within the bucket
    numel: int


@dataclass(frozen=True)
class WeightManifest:
    version: int
    dtype: str  # numpy dtype name of every bucket, e.g. "float32"
    entries: tuple[WeightEntry, ...]
    bucket_numels: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return sum(self.bucket_numels) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class WeightSnapshot:
    """`buckets[i]` is a 1-D numpy array, or (Ray) an ObjectRef of one, resolved by `resolve_snapshot`."""

    manifest: WeightManifest
    buckets: Sequence[Any]


def pack_weights(module: nn.Module, version: int, bucket_bytes: int = 4 << 20) -> WeightSnapshot:
    """Copy the parameters of `module` into flat buckets (all parameters must share one dtype)."""
    params = list(module.named_parameters())
    dtypes = {p.dtype for _, p in params}
    if len(dtypes) != 1:
        raise ValueError(f"parameters mix dtypes {sorted(map(str, dtypes))}; one dtype per snapshot")
    itemsize = params[0][1].element_size()
    groups: list[list[tuple[str, torch.Tensor]]] = [[]]
    filled = 0
    for name, p in params:
        if groups[-1] and (filled + p.numel()) * itemsize > bucket_bytes:
            groups.append([])
            filled = 0
        groups[-1].append((name, p))
        filled += p.numel()
    entries, buckets = [], []
    with torch.no_grad():
        for b, group in enumerate(groups):
            offset = 0
            for name, p in group:
                entries.append(WeightEntry(name, tuple(p.shape), b, offset, p.numel()))
                offset += p.numel()
            buckets.append(torch.cat([p.detach().reshape(-1) for _, p in group]).cpu().numpy())
    manifest = WeightManifest(
        version=version,
        dtype=str(buckets[0].dtype),
        entries=tuple(entries),
        bucket_numels=tuple(len(b) for b in buckets),
    )
    return WeightSnapshot(manifest, buckets)


async def resolve_snapshot(snapshot: WeightSnapshot) -> WeightSnapshot:
    """Await bucket ObjectRefs (Ray), leaving in-process numpy buckets as they are."""
    buckets = [await b if inspect.isawaitable(b) else b for b in snapshot.buckets]
    return WeightSnapshot(snapshot.manifest, buckets)


def load_snapshot(module: nn.Module, snapshot: WeightSnapshot) -> None:
    """Copy a snapshot into `module`'s parameters; validates names, shapes and sizes first."""
    m = snapshot.manifest
    params = dict(module.named_parameters())
    problems = []
    if set(params) != {e.name for e in m.entries}:
        missing = sorted(set(params) - {e.name for e in m.entries})
        extra = sorted({e.name for e in m.entries} - set(params))
        problems.append(f"parameter names differ (missing {missing[:5]}, unexpected {extra[:5]})")
    if len(snapshot.buckets) != len(m.bucket_numels):
        problems.append(f"{len(snapshot.buckets)} buckets for a manifest of {len(m.bucket_numels)}")
    else:
        for i, (b, n) in enumerate(zip(snapshot.buckets, m.bucket_numels)):
            if b.ndim != 1 or len(b) != n or str(b.dtype) != m.dtype:
                problems.append(f"bucket {i} is {b.dtype}{list(b.shape)}, manifest says {m.dtype}[{n}]")
    for e in m.entries:
        p = params.get(e.name)
        if p is not None and tuple(p.shape) != e.shape:
            problems.append(f"{e.name}: shape {tuple(p.shape)} != snapshot {e.shape}")
    if problems:
        raise ValueError(f"weight snapshot v{m.version} does not fit the model: " + "; ".join(problems))
    with torch.no_grad(), warnings.catch_warnings():
        # Buckets read from Ray's object store are read-only; they are only copied from here.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for e in m.entries:
            src = torch.from_numpy(np.asarray(snapshot.buckets[e.bucket][e.offset : e.offset + e.numel]))
            params[e.name].copy_(src.view(e.shape))


# --- the trainer -------------------------------------------------------------------------------


@dataclass
class _OpenStep:
    step: int
    loss: LossConfig
    params: list[torch.Tensor]  # snapshot for abort
    optim_state: dict
    tokens: int = 0
    sequences: int = 0
    microbatches: int = 0
    loss_sum: float = 0.0
    stats: dict[str, float] | None = None
    bytes_read: int = 0
    started: float = 0.0
    failed: str | None = None  # why a microbatch of this step failed: the step can then only be aborted


@dataclass(frozen=True)
class TrainerStatistics:
    rank: int
    world_size: int
    steps_done: int
    aborts: int
    open_step: int | None
    open_microbatches: int  # local, in the open step
    open_tokens: int  # local valid tokens in the open step


STAT_KEYS = ("clipped", "is_weight", "is_truncated", "gen_gap", "kl", "mm_abs", "mm_kl", "mm_tokens")


def _clone_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """A deep copy of `optimizer.state_dict()` (tensors cloned), ~10x faster than copy.deepcopy."""
    sd = optimizer.state_dict()
    return {
        "state": {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for i, s in sd["state"].items()},
        "param_groups": copy.deepcopy(sd["param_groups"]),
    }


class TrainerCore:
    """One data-parallel rank. `process_group` None: single process; else a gloo group this rank is in
    (the policy is wrapped in DDP, which also broadcasts rank 0's parameters at construction)."""

    def __init__(
        self,
        policy: nn.Module,
        cfg: TrainConfig,
        *,
        temperature: float = 1.0,
        process_group: dist.ProcessGroup | None = None,
        bucket_bytes: int = 4 << 20,
    ):
        self.policy = policy
        self.cfg = cfg
        self.temperature = temperature
        self.bucket_bytes = bucket_bytes
        self.pg = process_group
        self.rank = 0 if process_group is None else dist.get_rank(process_group)
        self.world_size = 1 if process_group is None else dist.get_world_size(process_group)
        if process_group is not None:
            # broadcast_buffers=False: buffers (e.g. HF rotary tables) are constants here, and a
            # per-forward buffer broadcast would be a collective per microbatch.
            self._forward = nn.parallel.DistributedDataParallel(policy, process_group=process_group, broadcast_buffers=False)
        else:
            self._forward = policy
        self.params = [p for p in policy.parameters() if p.requires_grad]
        # never imports torch._dynamo (~1.3 s of CPU at start-up; nothing here is compiled)
        self.optimizer = eager_adamw(self.params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
        # Frozen copy of the initial weights for the KL penalty, only when it is enabled.
        self.reference = copy.deepcopy(policy).requires_grad_(False) if cfg.kl_coef > 0 else None
        self._open: _OpenStep | None = None
        self.steps_done = 0
        self.next_step = 0  # the step begin accepts: optimizer steps applied (set by a checkpoint load)
        self._last_finished: tuple[int, dict[str, float]] | None = None
        self.aborts = 0

    @property
    def step_open(self) -> bool:
        return self._open is not None

    def statistics(self) -> "TrainerStatistics":
        st = self._open
        return TrainerStatistics(
            rank=self.rank,
            world_size=self.world_size,
            steps_done=self.steps_done,
            aborts=self.aborts,
            open_step=None if st is None else st.step,
            open_microbatches=0 if st is None else st.microbatches,
            open_tokens=0 if st is None else st.tokens,
        )

    def status(self) -> dict[str, int | None]:
        return {
            "next_step": self.next_step,
            "open_step": None if self._open is None else self._open.step,
            "last_finished": None if self._last_finished is None else self._last_finished[0],
        }

    def begin_train_step(self, step: int, loss: LossConfig) -> None:
        if self._open is not None:
            raise TrainStepStateError(f"begin_train_step({step}): step {self._open.step} is still open")
        if step != self.next_step:
            raise TrainStepStateError(f"begin_train_step({step}): the trainer's next step is {self.next_step}")
        if loss.level not in LOSS_LEVELS:
            raise ValueError(f"loss level must be one of {LOSS_LEVELS}, got {loss.level!r}")
        if loss.kl_coef > 0 and self.reference is None:
            raise ValueError("loss.kl_coef > 0 but the trainer was built with train.kl_coef == 0 (no reference policy)")
        self.optimizer.zero_grad(set_to_none=True)
        self._open = _OpenStep(
            step=step,
            loss=loss,
            params=[p.detach().clone() for p in self.params],
            optim_state=_clone_optimizer_state(self.optimizer),
            stats=dict.fromkeys(STAT_KEYS, 0.0),
            started=time.perf_counter(),
        )

    def train_microbatch(self, rows: Mapping[str, Any], bytes_read: int = 0) -> int:
        """Accumulate gradients of one microbatch (columns of TRAIN_FIELDS); returns its valid tokens."""
        st = self._require_open("train_microbatch")
        try:
            return self._accumulate(st, rows, bytes_read)
        except BaseException as e:
            self.mark_failed(f"{type(e).__name__}: {e}")
            raise

    def mark_failed(self, reason: str) -> None:
        """A microbatch of the open step failed (here, or while its rows were read): its gradients
        are partial, so the step's finish refuses (on every rank: the flag travels in the finish's
        all-reduce) and only an abort closes it. Calls can then be pipelined behind a microbatch: a
        finish that arrives after a failed one never applies partial gradients."""
        if self._open is not None and self._open.failed is None:
            self._open.failed = reason

    def _accumulate(self, st: "_OpenStep", rows: Mapping[str, Any], bytes_read: int) -> int:
        st.bytes_read += bytes_read
        st.microbatches += 1
        n = len(rows["prompt_ids"])
        if n == 0:
            return 0
        bad = [
            i for i, (r, g, m) in enumerate(zip(rows["response_ids"], rows["gen_logprobs"], rows["response_mask"]))
            if not r.shape[0] == g.shape[0] == m.shape[0]
        ]
        if bad:
            raise ValueError(f"rows {bad[:5]}: response_ids, gen_logprobs and response_mask lengths differ")
        dtype = self.params[0].dtype
        ctx = self._forward.no_sync() if self.pg is not None else contextlib.nullcontext()
        with ctx:
            logp, valid = token_logprobs(self._forward, rows["prompt_ids"], rows["response_ids"], self.temperature)
            dev = valid.device
            mask = pad_right(rows["response_mask"], False, torch.bool).to(dev) & valid  # [B, R]
            gen = pad_right(rows["gen_logprobs"], 0.0, dtype).to(dev)  # [B, R]
            ref = None
            if st.loss.kl_coef > 0:
                with torch.no_grad():
                    ref, _ = token_logprobs(self.reference, rows["prompt_ids"], rows["response_ids"], self.temperature)
            out = grpo_loss(logp, gen, torch.as_tensor(rows["advantage"]).to(dev), mask, st.loss, ref_logprobs=ref)
            out.loss_sum.backward()
        if rows.get("token_versions") is not None:
            # Rows whose every token was sampled with the weights this step trains (version == step;
            # then the prompt's and earlier tokens' KV cache came from them too, which a row resumed
            # across a `keep` sync lacks): their logprob gap is the engine's mismatch, free of staleness.
            versions = pad_right(rows["token_versions"], -1, torch.long).to(mask.device)  # [B, R]
            fresh = ((versions == st.step) | ~mask).all(dim=1) & mask.any(dim=1)  # [B]
            st_mm = mismatch_stats(logp, gen, mask & fresh[:, None])
            for k, v in st_mm.items():
                st.stats[k] += v
        st.tokens += out.num_tokens
        st.sequences += out.num_sequences
        st.loss_sum += float(out.loss_sum.detach())
        for k, v in out.token_stats.items():
            st.stats[k] += v
        return out.num_tokens

    def finish_train_step(self, step: int) -> dict[str, float]:
        if self._open is None and self._last_finished is not None and self._last_finished[0] == step:
            return dict(self._last_finished[1])  # a retried finish: the step was applied once already
        st = self._require_open(f"finish_train_step({step})")
        if st.step != step:
            raise TrainStepStateError(f"finish_train_step({step}): the open step is {st.step}")
        failed_here = float(st.failed is not None)
        sums = torch.tensor([st.tokens, st.sequences, st.loss_sum, *(st.stats[k] for k in STAT_KEYS), failed_here], dtype=torch.float64)
        if self.pg is not None:
            dist.all_reduce(sums, group=self.pg)  # first: every rank learns whether one had a failed microbatch
        failed_ranks = int(sums[-1])
        if failed_ranks:  # the same decision on every rank, before the gradients' collective
            here = f" (here: {st.failed})" if st.failed else ""
            raise TrainerFailed(
                f"finish_train_step({step}): a microbatch of the step failed on {failed_ranks} rank(s){here}; "
                "its gradients are partial, so no optimizer step: abort the step"
            )
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if self.pg is not None:
            flat = torch.cat([g.reshape(-1) for g in grads])  # one collective for every gradient
            dist.all_reduce(flat, group=self.pg)
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))
        tokens, sequences, loss_sum = (float(x) for x in sums[:3])
        stat_sums = dict(zip(STAT_KEYS, sums[3:-1].tolist()))
        n = tokens if st.loss.level == "token" else sequences
        if n <= 0:
            raise TrainerFailed(f"step {st.step}: no valid tokens on any rank ({st.microbatches} local microbatches)")
        for p, g in zip(self.params, grads):
            p.grad = g.mul_(1.0 / n)
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        if not math.isfinite(grad_norm):
            raise TrainerFailed(f"step {st.step}: gradient norm is {grad_norm}")
        eager_step(self.optimizer)
        self._open = None
        self.steps_done += 1
        self.next_step = st.step + 1
        metrics = step_metrics(st, n, loss_sum, tokens, sequences, stat_sums, grad_norm, lr=float(self.optimizer.param_groups[0]["lr"]))
        self._last_finished = (st.step, dict(metrics))
        return metrics

    def abort_train_step(self, step: int) -> None:
        st = self._open
        if st is None or st.step != step:
            return  # nothing of this step is open: an abort never undoes a finished step
        with torch.no_grad():
            for p, saved in zip(self.params, st.params):
                p.copy_(saved)
        self.optimizer.load_state_dict(st.optim_state)
        self.optimizer.zero_grad(set_to_none=True)
        self._open = None
        self.aborts += 1

    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs of this rank (between steps): policy, optimizer, RNG, next step."""
        if self._open is not None:
            raise TrainStepStateError(f"state_dict while step {self._open.step} is open")
        return {
            "policy": {k: v.detach().clone() for k, v in self.policy.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "rng": torch.get_rng_state(),
            "next_step": self.next_step,
            "steps_done": self.steps_done,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self._open is not None:
            raise TrainStepStateError("load_state_dict while a step is open")
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        self.next_step = int(state["next_step"])
        self.steps_done = int(state["steps_done"])
        self._last_finished = None

    def publish_weights(self, version: int) -> WeightSnapshot:
        if self._open is not None:
            raise TrainStepStateError(f"publish_weights({version}) while step {self._open.step} is open")
        return pack_weights(state_module(self.policy), version, self.bucket_bytes)

    def load_weights(self, snapshot: WeightSnapshot) -> None:
        if self._open is not None:
            raise TrainStepStateError("load_weights while a step is open")
        load_snapshot(state_module(self.policy), snapshot)

    def _require_open(self, what: str) -> _OpenStep:
        if self._open is None:
            raise TrainStepStateError(f"{what}: no train step is open (call begin_train_step first)")
        return self._open


def step_metrics(st, n: float, loss_sum: float, tokens: float, sequences: float, stat_sums: dict, grad_norm: float, *, lr: float) -> dict[str, float]:
    """A finished step's metrics from its all-reduced sums (`st`: the open step's record), the same
    for every trainer backend."""
    metrics = {
        "train/loss": loss_sum / n,
        "train/grad_norm": grad_norm,
        "train/tokens": tokens,
        "train/sequences": sequences,
        "train/microbatches": float(st.microbatches),
        "train/clip_frac": stat_sums["clipped"] / max(tokens, 1),
        "train/is_weight_mean": stat_sums["is_weight"] / max(tokens, 1),
        "train/is_truncated_frac": stat_sums["is_truncated"] / max(tokens, 1),
        "train/gen_logprob_gap": stat_sums["gen_gap"] / max(tokens, 1),
        "train/lr": lr,
        "train/step_s": time.perf_counter() - st.started,
        "train/bytes_read": float(st.bytes_read),
    }
    if st.loss.kl_coef > 0:
        metrics["train/kl"] = stat_sums["kl"] / max(tokens, 1)
    mm_tokens = stat_sums["mm_tokens"]
    metrics["train/mismatch_tokens"] = mm_tokens
    if mm_tokens > 0:  # only measurable on tokens sampled with this step's weights
        metrics["train/mismatch_abs_logprob"] = stat_sums["mm_abs"] / mm_tokens
        metrics["train/mismatch_kl"] = stat_sums["mm_kl"] / mm_tokens
    return metrics
