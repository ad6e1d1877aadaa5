"""The split train API's bookkeeping, shared by every trainer backend (torch, Megatron) by composition.

A rank holds one `SplitStep` (`core.steps`) that checks the order of begin / microbatch / finish /
abort by step id and records each finished step's metrics, while the engine makes its own moves
(zeroing gradients, collectives, the optimizer step). `train_rows` cuts a microbatch into passes of
at most `train.micro_batch_tokens` tokens and `rows_loss` runs forward, the GRPO loss and backward.
A finish of the step finished last returns its recorded metrics (never a second optimizer step); an
abort drops the gradients, bit-exactly what was there before the begin (no copy is kept), unless the
step has several updates (`train.updates_per_step`) and one was applied: then the engine restores
the copy of the step's start it took first (`step_start.StepStart`). An
optimizer step that fails inside `steps.applying` leaves the rank refusing everything but a
checkpoint load (`TrainerStateLost`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch
import torch.distributed as dist

from single_controller.algorithm.logprobs import LogitsPolicy, pad_right, token_logprobs, token_logprobs_entropy
from single_controller.algorithm.losses import (
    LossOutput,
    grpo_loss,
    loss_normalizer,
    loss_problems,
    mismatch_stats,
    row_kl_sums,
)
from single_controller.algorithm.schedules import LrSchedule, lr_at
from single_controller.backends.common.step_start import StepStart
from single_controller.config.schema import TrainConfig
from single_controller.protocols import TrainerFailed, TrainerStateLost, TrainStepStateError
from single_controller.types import LossConfig

# Statistics summed over a step's tokens (the loss's, the rows without loss, then the engines' mismatch), in the
# order they travel in the finish's all-reduce; then those whose step value is the ranks' largest.
STAT_KEYS = (
    "clipped",
    "clipped_low",
    "clipped_high",
    "is_weight",
    "is_truncated",
    "is_masked",
    "gen_gap",
    "kl",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "entropy",
    "no_loss",
    "mm_abs",
    "mm_kl",
    "mm_tokens",
)
MAX_KEYS = ("is_ratio_max",)


class StepCounts(TypedDict):
    """`SplitStep.counts()`: the fields of a rank's `statistics()` record every trainer backend shares."""

    steps_done: int
    aborts: int
    open_step: int | None
    open_microbatches: int
    open_tokens: int


@dataclass
class OpenStep:
    step: int
    loss: LossConfig
    started: float = field(default_factory=time.perf_counter)
    # Several updates (`train.updates_per_step`): the one under way, the metrics of those applied,
    # and what the step started from (taken before its first optimizer step; None with one update).
    update: int = 0
    applied: list[dict[str, float]] = field(default_factory=list)
    start: StepStart | None = None
    tokens: int = 0
    sequences: int = 0
    microbatches: int = 0
    passes: int = 0  # forward/backward passes (a microbatch is cut into several by train.micro_batch_tokens)
    loss_sum: float = 0.0
    stats: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAT_KEYS, 0.0))
    maxes: dict[str, float] = field(default_factory=lambda: dict.fromkeys(MAX_KEYS, 0.0))
    bytes_read: int = 0
    failed: str | None = None  # why a microbatch of this step failed: the step can then only be aborted

    def take_rows(self, rows: Mapping[str, Any], bytes_read: int) -> bool:
        """Count a microbatch of `rows` (columns of TRAIN_FIELDS); False when it has no row to train."""
        self.bytes_read += bytes_read
        self.microbatches += 1
        if len(rows["prompt_ids"]) == 0:
            return False
        bad = [
            i
            for i, (r, g, m) in enumerate(zip(rows["response_ids"], rows["gen_logprobs"], rows["response_mask"]))
            if not r.shape[0] == g.shape[0] == m.shape[0]
        ]
        if bad:
            raise ValueError(f"rows {bad[:5]}: response_ids, gen_logprobs and response_mask lengths differ")
        return True

    def add(self, out: LossOutput, extra: Mapping[str, float]) -> None:
        self.passes += 1
        self.tokens += out.num_tokens
        self.sequences += out.num_sequences
        self.loss_sum += float(out.loss_sum.detach())
        for k, v in {**out.token_stats, **extra}.items():
            self.stats[k] += v
        for k, v in out.maxes.items():
            self.maxes[k] = max(self.maxes[k], v)

    def sums(self) -> list[float]:
        """What the finish all-reduces (a sum): [tokens, sequences, loss sum, *STAT_KEYS]."""
        return [self.tokens, self.sequences, self.loss_sum, *(self.stats[k] for k in STAT_KEYS)]

    def max_values(self) -> list[float]:
        """What the finish all-reduces with MAX: MAX_KEYS."""
        return [self.maxes[k] for k in MAX_KEYS]

    def next_update(self, metrics: dict[str, float]) -> None:
        """The update under way was applied (`metrics`): the next one starts from zero sums."""
        self.applied.append(metrics)
        self.update += 1
        self.tokens = self.sequences = self.microbatches = self.passes = self.bytes_read = 0
        self.loss_sum = 0.0
        self.stats, self.maxes = dict.fromkeys(STAT_KEYS, 0.0), dict.fromkeys(MAX_KEYS, 0.0)

    @property
    def ratio_to_start(self) -> bool:
        """This update's ratio is taken against the policy at the step's start, which it no longer is."""
        return self.update > 0 and not self.loss.ratio_to_gen


@dataclass(frozen=True)
class StepSums:
    """A step's sums over every rank (`OpenStep.sums()`, all-reduced)."""

    tokens: float
    sequences: float
    loss_sum: float
    stats: dict[str, float]
    maxes: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, values: Sequence[float], maxes: Sequence[float] = ()) -> StepSums:
        tokens, sequences, loss_sum = (float(x) for x in values[:3])
        stats = dict(zip(STAT_KEYS, (float(x) for x in values[3:])))
        return cls(tokens, sequences, loss_sum, stats, dict(zip(MAX_KEYS, (float(x) for x in maxes))))

    def normalizer(self, st: OpenStep) -> float:
        """N, what the raw gradient sums are divided by (`loss_normalizer` of the step's kept tokens
        and sequences over every rank). A step whose every token a mask correction dropped has a
        zero gradient: N = 1, as has one whose every row carries no loss (`train.mask_truncated`).
        Raises when the step had no valid token at all."""
        n = loss_normalizer(st.loss, self.tokens, self.sequences)
        if n > 0:
            return n
        if self.stats.get("is_masked", 0.0) + self.stats.get("no_loss", 0.0) > 0:
            return 1.0
        raise TrainerFailed(f"step {st.step}: no valid tokens on any rank ({st.microbatches} local microbatches)")


class SplitStep:
    """Where one trainer rank stands in the split API (see the module docstring). `has_reference`:
    the rank keeps a frozen reference policy, so a loss with a KL penalty can be computed."""

    def __init__(self, *, has_reference: bool) -> None:
        self.has_reference = has_reference
        self.open: OpenStep | None = None
        self.last_finished: tuple[int, dict[str, float]] | None = None
        self.next_step = 0  # the step begin accepts: optimizer steps applied (set by a checkpoint load)
        self.steps_done = 0
        self.aborts = 0
        self.lost: str | None = None  # why the rank's state is partly updated (`applying`), until a load

    @property
    def is_open(self) -> bool:
        return self.open is not None

    def status(self) -> dict[str, int | None]:
        return {
            "next_step": self.next_step,
            "open_step": None if self.open is None else self.open.step,
            "last_finished": None if self.last_finished is None else self.last_finished[0],
        }

    def counts(self) -> StepCounts:
        """The fields a rank's `statistics()` record shares with every trainer backend."""
        st = self.open
        return {
            "steps_done": self.steps_done,
            "aborts": self.aborts,
            "open_step": None if st is None else st.step,
            "open_microbatches": 0 if st is None else st.microbatches,  # local, in the open step
            "open_tokens": 0 if st is None else st.tokens,  # local valid tokens in the open step
        }

    def require_open(self, what: str) -> OpenStep:
        if self.open is None:
            raise TrainStepStateError(f"{what}: no train step is open (call begin_train_step first)")
        return self.open

    def require_closed(self, what: str, *, loading: bool = False) -> None:
        """No step open, and (but for a checkpoint load, which is the way back) a consistent state."""
        if self.lost is not None and not loading:
            raise TrainerStateLost(f"{what}: {self.lost}")
        if self.open is not None:
            raise TrainStepStateError(f"{what} while step {self.open.step} is open")

    def check_begin(self, step: int, loss: LossConfig) -> None:
        if self.lost is not None:
            raise TrainerStateLost(f"begin_train_step({step}): {self.lost}")
        if self.open is not None:
            raise TrainStepStateError(f"begin_train_step({step}): step {self.open.step} is still open")
        if step != self.next_step:
            raise TrainStepStateError(f"begin_train_step({step}): the trainer's next step is {self.next_step}")
        problems = loss_problems(loss)
        if problems:
            raise ValueError(f"begin_train_step({step}): " + "; ".join(message for _, message in problems))
        if loss.kl_coef > 0 and not self.has_reference:
            raise ValueError("loss.kl_coef > 0 but the trainer was built with train.kl_coef == 0 (no reference policy)")

    def open_step(self, step: int, loss: LossConfig) -> OpenStep:
        self.open = OpenStep(step=step, loss=loss)
        return self.open

    @contextlib.contextmanager
    def applying(self, st: OpenStep) -> Iterator[None]:
        """Around `st`'s optimizer step, the one place parameters and optimizer state change. A
        failure inside leaves them partly updated: the step is closed as lost, and the rank refuses
        every step, abort and save until a checkpoint is loaded."""
        try:
            yield
        except BaseException as e:
            self.lost = (
                f"the optimizer step of step {st.step} failed partway ({type(e).__name__}: {e}); the rank's "
                "parameters and optimizer state are partly updated and no copy is kept: resume from the last checkpoint"
            )
            self.open = None
            raise TrainerStateLost(self.lost) from e

    def mark_failed(self, reason: str) -> None:
        """A microbatch of the open step failed: its gradients are partial, so only an abort closes it."""
        if self.open is not None and self.open.failed is None:
            self.open.failed = reason

    def retried_finish(self, step: int) -> dict[str, float] | None:
        """The recorded metrics when `step` is the step finished last and none is open, else None."""
        if self.open is None and self.last_finished is not None and self.last_finished[0] == step:
            return dict(self.last_finished[1])
        return None

    def finishing(self, step: int) -> OpenStep:
        st = self.require_open(f"finish_train_step({step})")
        if st.step != step:
            raise TrainStepStateError(f"finish_train_step({step}): the open step is {st.step}")
        return st

    def starts_update(self, st: OpenStep, update: int) -> bool:
        """Whether a microbatch of update `update` of `st` must first apply the update under way.
        Updates go in order, each once, none skipped."""
        if update == st.update:
            return False
        if update != st.update + 1:
            raise TrainStepStateError(
                f"train_microbatch: update {update} of step {st.step} while update {st.update} is under way "
                "(a step's updates go in order, each once)"
            )
        if st.failed is not None:
            raise TrainerFailed(
                f"step {st.step}: a microbatch of update {st.update} failed ({st.failed}); no optimizer step: "
                "abort the step"
            )
        return True

    def apply_update(
        self,
        st: OpenStep,
        start: Callable[[], StepStart],
        apply: Callable[[OpenStep, str], tuple[StepSums, float, float]],
    ) -> None:
        """Apply `st`'s update under way (not its last: the step stays open): `start()`, the engine's
        copy of the step's start, first (once), then `apply`, the engine's optimizer step ->
        (sums, grad norm, lr). A failure leaves the step failed: only an abort closes it."""
        try:
            if st.start is None:
                st.start = start()
            sums, grad_norm, lr = apply(st, f"update {st.update} of step {st.step}")
        except BaseException as e:
            self.mark_failed(f"{type(e).__name__}: {e}")
            raise
        st.next_update(step_metrics(st, sums, grad_norm, lr=lr))

    def finished(self, st: OpenStep, sums: StepSums, grad_norm: float, *, lr: float) -> dict[str, float]:
        """Close `st` after its (last update's) optimizer step; returns (and records) its metrics."""
        metrics = of_updates([*st.applied, step_metrics(st, sums, grad_norm, lr=lr)])
        st.start = None  # the copy of the step's start is no longer needed
        self.open = None
        self.steps_done += 1
        self.next_step = st.step + 1
        self.last_finished = (st.step, dict(metrics))
        return metrics

    def aborting(self, step: int) -> OpenStep | None:
        """The open step if it is `step` (the engine then drops its gradients and calls `aborted`)."""
        if self.lost is not None:
            raise TrainerStateLost(f"abort_train_step({step}): {self.lost}")
        st = self.open
        return st if st is not None and st.step == step else None

    def aborted(self) -> None:
        self.open = None
        self.aborts += 1

    def loaded(self, next_step: int, steps_done: int) -> None:
        """A checkpoint was loaded (between steps)."""
        self.next_step, self.steps_done, self.last_finished = int(next_step), int(steps_done), None
        self.lost = None


@contextlib.contextmanager
def collective(what: str) -> Iterator[None]:
    """Around a collective of the ranks (an all-reduce, a broadcast): its failure (a peer gone or
    too slow, a broken connection) is one a retry of the step can fix, raised as `TrainerFailed`.
    torch.distributed raises these as `RuntimeError` (`DistError` and gloo's own errors)."""
    try:
        yield
    except RuntimeError as e:
        raise TrainerFailed(f"{what}: a collective of the trainer ranks failed: {e}") from e


def lr_schedule(train: TrainConfig, max_steps: int | None) -> LrSchedule:
    """The lr schedule of `train` over a run of `max_steps` steps (its decay horizon; None only with
    a constant schedule: a trainer built without a run, e.g. in a test)."""
    return LrSchedule(
        lr=train.lr,
        kind=train.lr_schedule,
        warmup_steps=train.warmup_steps,
        min_lr_ratio=train.min_lr_ratio,
        total_steps=max_steps,
    )


def set_lr(param_groups: Iterable[MutableMapping[str, Any]], step: int, schedule: LrSchedule) -> float:
    """Give every parameter group the lr of `step` (right before its optimizer step, so an aborted step
    never changed it); returns that lr."""
    lr = lr_at(step, schedule)
    for group in param_groups:
        group["lr"] = lr
    return lr


def token_passes(lengths: Sequence[int], budget: int | None) -> list[list[int]]:
    """The rows of a microbatch (their prompt + response lengths) in forward/backward passes of at most
    `budget` padded tokens each (rows x the pass's longest row); a row longer than `budget` runs alone.
    Rows go longest first, so rows of like lengths pad together. None: one pass of every row."""
    if budget is None or not lengths:
        return [list(range(len(lengths)))] if lengths else []
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep their order
    passes: list[list[int]] = []
    for i in order:
        # the pass's first row is its longest: a row joins while (rows + 1) x that length fits
        if passes and (len(passes[-1]) + 1) * lengths[passes[-1][0]] <= budget:
            passes[-1].append(i)
        else:
            passes.append([i])
    return passes


def select_rows(rows: Mapping[str, Any], idx: Sequence[int]) -> dict[str, Any]:
    """The rows `idx` of `rows` (columns: lists of per-row tensors, or one tensor per column)."""
    out: dict[str, Any] = {}
    for k, col in rows.items():
        if col is None:
            out[k] = None
        elif torch.is_tensor(col):
            out[k] = col[torch.as_tensor(idx, dtype=torch.long, device=col.device)]
        else:
            out[k] = [col[i] for i in idx]
    return out


def train_rows(
    policy: LogitsPolicy,
    reference: LogitsPolicy | None,
    rows: Mapping[str, Any],
    st: OpenStep,
    *,
    temperature: float,
    dtype: torch.dtype,
    micro_batch_tokens: int | None,
    autocast: torch.dtype | None = None,
    share_prefixes: bool = False,
) -> int:
    """Forward and backward of a microbatch of `st` in passes of at most `micro_batch_tokens`
    (`token_passes`), each pass's sums added to `st`; returns the microbatch's valid tokens.
    `autocast`: the forwards run under `torch.autocast` in that dtype (see `rows_loss`)."""
    lengths = [len(p) + len(r) for p, r in zip(rows["prompt_ids"], rows["response_ids"])]
    passes = token_passes(lengths, micro_batch_tokens)
    tokens = 0
    for idx in passes:
        part = rows if len(passes) == 1 else select_rows(rows, idx)
        out, mismatch = rows_loss(
            policy,
            reference,
            part,
            st,
            temperature=temperature,
            dtype=dtype,
            autocast=autocast,
            share_prefixes=share_prefixes,
        )
        st.add(out, mismatch)
        tokens += out.num_tokens
    return tokens


def reference_kl_rows(
    reference: LogitsPolicy,
    rows: Mapping[str, Any],
    estimator: str,
    *,
    temperature: float,
    micro_batch_tokens: int | None,
    autocast: torch.dtype | None = None,
    share_prefixes: bool = False,
) -> list[float]:
    """Each row's KL to the reference (`algorithm.losses.row_kl_sums`, for `reward.kl_coef`), by
    no-grad forwards of the reference in passes of at most `micro_batch_tokens`; in row order."""
    lengths = [len(p) + len(r) for p, r in zip(rows["prompt_ids"], rows["response_ids"])]
    out = [0.0] * len(lengths)
    passes = token_passes(lengths, micro_batch_tokens)
    for idx in passes:
        part = rows if len(passes) == 1 else select_rows(rows, idx)
        with torch.no_grad(), _autocast(reference, autocast):
            ref, valid = token_logprobs(
                reference, part["prompt_ids"], part["response_ids"], temperature, share_prefixes
            )
        mask = pad_right(part["response_mask"], False, torch.bool).to(valid.device) & valid
        gen = pad_right(part["gen_logprobs"], 0.0, torch.float64).to(valid.device)
        for i, kl in zip(idx, row_kl_sums(ref, gen, mask, estimator).tolist()):
            out[i] = kl
    return out


def _autocast(policy: LogitsPolicy, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """`torch.autocast` in `dtype` on the policy's device type; None: no autocast."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=next(policy.parameters()).device.type, dtype=dtype)


def rows_loss(
    policy: LogitsPolicy,
    reference: LogitsPolicy | None,
    rows: Mapping[str, Any],
    st: OpenStep,
    *,
    temperature: float,
    dtype: torch.dtype,
    autocast: torch.dtype | None = None,
    share_prefixes: bool = False,
) -> tuple[LossOutput, dict[str, float]]:
    """Forward, the raw GRPO loss sum and its backward for one microbatch of `st`; returns the loss
    output and the other sums of `STAT_KEYS` it made: the tokens of rows that carry no loss (an
    advantage of `types.NO_LOSS`: they are dropped before the loss) and the engine mismatch (without
    `token_versions`, none). `autocast` (a 16-bit
    dtype): the policy's and the reference's forwards run under `torch.autocast` in it, the master
    parameters keep their dtype; logprobs (upcast before the log-softmax), the loss and the backward's
    start are float32 or `dtype`, outside autocast (its documented use)."""
    old = None
    if st.ratio_to_start:  # before the policy's own forward: the parameters are swapped in place meanwhile
        assert st.start is not None  # taken before the step's first optimizer step
        with torch.no_grad(), st.start.policy_at_start(), _autocast(policy, autocast):
            old, _ = token_logprobs(policy, rows["prompt_ids"], rows["response_ids"], temperature, share_prefixes)
    with _autocast(policy, autocast):
        logp, valid, entropy = token_logprobs_entropy(
            policy, rows["prompt_ids"], rows["response_ids"], temperature, share_prefixes
        )
    logp = logp.to(dtype)
    dev = valid.device
    mask = pad_right(rows["response_mask"], False, torch.bool).to(dev) & valid  # [B, R]
    gen = pad_right(rows["gen_logprobs"], 0.0, dtype).to(dev)  # [B, R]
    ref = None
    if st.loss.kl_coef > 0:
        assert reference is not None  # SplitStep.check_begin refuses a KL loss to a rank without one
        with torch.no_grad(), _autocast(reference, autocast):
            ref, _ = token_logprobs(reference, rows["prompt_ids"], rows["response_ids"], temperature, share_prefixes)
        ref = ref.to(dtype)
    adv = torch.as_tensor(rows["advantage"])
    extra: dict[str, float] = {}
    loss_mask, no_loss = mask, torch.isnan(adv)  # on the host: the chunk carried them
    if bool(no_loss.any()):  # (the engine mismatch is still measured on those rows)
        keep = ~no_loss.to(dev)
        extra["no_loss"] = float((mask & ~keep[:, None]).sum())
        loss_mask, adv = mask & keep[:, None], torch.where(no_loss, 0.0, adv)
    old = None if old is None else old.to(dtype)
    out = grpo_loss(logp, gen, adv.to(dev), loss_mask, st.loss, old_logprobs=old, ref_logprobs=ref, entropy=entropy)
    out.loss_sum.backward()
    if rows.get("token_versions") is not None:
        # Rows whose every token was sampled with the weights this step trains (version == step;
        # then the prompt's and earlier tokens' KV cache came from them too, which a row resumed
        # across a `keep` sync lacks): their logprob gap is the engine's mismatch, free of staleness.
        versions = pad_right(rows["token_versions"], -1, torch.long).to(dev)  # [B, R]
        fresh = ((versions == st.step) | ~mask).all(dim=1) & mask.any(dim=1)  # [B]
        extra.update(mismatch_stats(logp, gen, mask & fresh[:, None]))
    return out, extra


def reduce_sums(st: OpenStep, group: Any, what: str, extra: Sequence[float] = ()) -> tuple[StepSums, list[float]]:
    """`st`'s sums over the ranks of `group` (None: this rank alone): one SUM all-reduce of
    `st.sums()` plus `extra` (flags every rank must learn, returned summed), one MAX of `st.max_values()`."""
    sums = torch.tensor([*st.sums(), *extra], dtype=torch.float64)
    maxes = torch.tensor(st.max_values(), dtype=torch.float64)
    if group is not None:
        with collective(what):
            dist.all_reduce(sums, group=group)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
    values = sums.tolist()
    n = len(values) - len(extra)
    return StepSums.of(values[:n], maxes.tolist()), values[n:]


def step_metrics(st: OpenStep, sums: StepSums, grad_norm: float, *, lr: float) -> dict[str, float]:
    """A finished step's metrics from its all-reduced sums, the same for every trainer backend."""
    n = sums.normalizer(st)
    tokens, stats = max(sums.tokens, 1), sums.stats
    metrics = {
        "train/loss": sums.loss_sum / n,
        "train/grad_norm": grad_norm,
        "train/tokens": sums.tokens,
        "train/sequences": sums.sequences,
        "train/microbatches": float(st.microbatches),
        "train/passes": float(st.passes),  # local forward/backward passes of this rank
        "train/clip_frac": stats["clipped"] / tokens,
        "train/clip_frac_low": stats["clipped_low"] / tokens,
        "train/clip_frac_high": stats["clipped_high"] / tokens,
        "train/is_weight_mean": stats["is_weight"] / tokens,
        "train/is_weight_max": sums.maxes.get("is_ratio_max", 0.0),  # the raw ratio, before truncation or mask
        "train/is_truncated_frac": stats["is_truncated"] / tokens,
        "train/is_masked_frac": stats["is_masked"] / max(sums.tokens + stats["is_masked"], 1),
        "train/truncated_masked_frac": stats["no_loss"] / max(sums.tokens + stats["is_masked"] + stats["no_loss"], 1),
        "train/entropy": stats["entropy"] / tokens,
        "train/gen_logprob_gap": stats["gen_gap"] / tokens,
        "train/lr": lr,
        "train/step_s": time.perf_counter() - st.started,
        "train/bytes_read": float(st.bytes_read),
    }
    if st.loss.kl_coef > 0:
        metrics["train/kl"] = stats["kl"] / tokens
        metrics.update({f"train/kl_{k}": stats[f"kl_{k}"] / tokens for k in ("k1", "k2", "k3")})
    mm_tokens = stats["mm_tokens"]
    metrics["train/mismatch_tokens"] = mm_tokens
    if mm_tokens > 0:  # only measurable on tokens sampled with this step's weights
        metrics["train/mismatch_abs_logprob"] = stats["mm_abs"] / mm_tokens
        metrics["train/mismatch_kl"] = stats["mm_kl"] / mm_tokens
    return metrics


# A step of several updates reports these summed over its updates, these as their largest, the rest
# (loss, grad norm, fractions, means) as their mean over the updates.
_SUMMED = (
    "train/tokens",
    "train/sequences",
    "train/microbatches",
    "train/passes",
    "train/bytes_read",
    "train/mismatch_tokens",
)
_LARGEST = ("train/is_weight_max", "train/step_s")  # step_s: each update's is counted from the step's begin


def of_updates(updates: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """A step's metrics from its updates' (`step_metrics` each); one update: its own. With several,
    `train/updates` says how many."""
    if len(updates) == 1:
        return dict(updates[0])
    out: dict[str, float] = {}
    for k in updates[0]:
        values = [u[k] for u in updates if k in u]
        if k in _SUMMED:
            out[k] = float(sum(values))
        elif k in _LARGEST:
            out[k] = max(values)
        else:
            out[k] = sum(values) / len(values)
    out["train/updates"] = float(len(updates))
    return out
