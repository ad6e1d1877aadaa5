"""Plain records passed between the controller, its pumps and the workers.

Everything here is small (metadata and per-row scalars). Bulk tensors (token ids, logprobs) never
appear in these records: they live in the row storage under the keys named here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Prompt:
    """One prompt from the dataloader; `prompt_id` is unique over the whole run."""

    prompt_id: str
    token_ids: tuple[int, ...]
    answer: str = ""  # what the reward function needs to score a response (small)
    # The prompt as the dataset gave it (a string or a list of {role, content} messages); None: decode token_ids.
    raw_prompt: Any = None
    # The dataset's other columns, passed to reward functions by name.
    columns: Mapping[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class SamplingParams:
    n: int  # completions per prompt (the group size G; eval: samples per prompt)
    temperature: float = 1.0  # 0.0 means greedy (argmax), as in vLLM; logprobs are then reported at temperature 1
    top_p: float = 1.0
    max_new_tokens: int = 3
    stop_token_ids: tuple[int, ...] = ()  # generation of a row ends after any of these tokens (e.g. every EOS)


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt group to generate and score.

    A rollout request stores its `sampling.n` rows under `row_keys` (one key per completion).
    An eval request (`eval=True`) has no row keys: the worker samples and scores it exactly like a
    rollout, writes NOTHING to storage, and returns only the small columns of `GenerationResult`
    (rewards, lengths, version stamps). Workers serve eval requests ahead of queued rollout
    requests (a priority lane); see `protocols.GenerationWorker` for the whole contract.
    """

    group_id: str
    prompt: Prompt
    sampling: SamplingParams
    row_keys: tuple[str, ...] = ()
    eval: bool = False
    sample_id: str | None = None
    """What a worker that seeds its draws per group seeds this group's with (None: `group_id`): the
    prompt and its charged attempts, so that an uncharged re-dispatch (a preempted or aborted group)
    draws what the attempt it replaces would have, and a retry after a failure draws anew."""
    min_version: int | None = None
    """Serve only with weights of this policy version or newer (None: any). A worker that honours it
    (`protocols.VersionGated`) holds the request until such weights are applied, whatever order the
    request and the weight update reach it in; others ignore it."""

    def __post_init__(self) -> None:
        if self.eval and self.row_keys:
            raise ValueError(f"eval request {self.group_id} must not carry row keys (eval writes nothing)")


@dataclass(frozen=True)
class GenerationResult:
    """What comes back to the controller: small columns only; the rows are already stored (none
    for an eval request). An eval result counts for version v only if version_start == version_end == v."""

    group_id: str
    rewards: tuple[float, ...]  # [G]
    response_lengths: tuple[int, ...]  # [G] generated tokens per row (incl. the stop token)
    prompt_length: int
    version_start: int  # policy version of the weights that produced the first token
    version_end: int  # policy version of the weights that produced the last token
    # Per reward function (`reward.functions`, by name): its value for each row, None where it does
    # not apply; `rewards` is their weighted sum. Empty for the default (`task.reward_fn` alone).
    reward_parts: Mapping[str, tuple[float | None, ...]] = field(default_factory=dict)
    sample: tuple[str, str, float] | None = None  # (prompt text, row 0's completion text, its reward), for logs
    # Multi-turn episodes (`env`): sums over the group's G episodes (`backends/common/episodes.py`
    # `episode_stats`: episodes, turns, tool_calls, env_s, policy_tokens, observation_tokens,
    # truncated, retries); empty for single-turn generation.
    episode_stats: Mapping[str, float] = field(default_factory=dict)
    # [G] rows cut short: a completion that reached `max_new_tokens` without one of the request's stop
    # tokens, an episode that ended at `env.max_turns` or the context; () from a worker that does not
    # tell (none counts as cut). A request without stop tokens has completions of a fixed length: never cut.
    truncated: tuple[bool, ...] = ()


def cut_by_length(ids: Sequence[int], stop_token_ids: Sequence[int]) -> bool:
    """Whether a single-turn completion `ids` ended at its length limit, not at a stop token (with no
    stop tokens every completion has its fixed length and none is cut)."""
    return bool(stop_token_ids) and (not ids or ids[-1] not in stop_token_ids)


NO_LOSS = float("nan")
"""The advantage a train chunk carries for a row that gets no loss (`train.mask_truncated`): the
trainer neither trains nor counts its tokens."""


@dataclass(frozen=True)
class TrainChunk:
    """Metadata for one `train_microbatch` call: the trainer group fetches these rows itself."""

    step: int
    chunk_index: int
    row_keys: tuple[str, ...]
    seq_lengths: tuple[int, ...]  # prompt + response tokens per row, for token-balanced DP splits
    fields: tuple[str, ...]  # fields each rank must read for these rows
    # Per row (aligned with row_keys): the rows' advantages, which the controller computed and carries
    # here, so ranks read only the bulk fields. Empty: the rows' `advantage` field is read from storage.
    # `NO_LOSS` (NaN, never an advantage: the advantage pump drops non-finite ones): the row carries no loss.
    advantages: tuple[float, ...] = ()
    # Which of the step's updates its rows belong to (`train.updates_per_step`; 0..M-1, in order): the
    # first chunk of update j + 1 makes the trainer apply update j's optimizer step first.
    update: int = 0

    def rank_advantages(self, keys: Sequence[str]) -> list[float] | None:
        """The advantages of `keys` (a rank's share of this chunk), or None when the chunk carries none."""
        if not self.advantages:
            return None
        if len(self.advantages) != len(self.row_keys):
            raise ValueError(
                f"chunk {self.chunk_index}: {len(self.advantages)} advantages for {len(self.row_keys)} keys"
            )
        if keys == self.row_keys:  # one rank: all of them, in order
            return list(self.advantages)
        by_key = dict(zip(self.row_keys, self.advantages))
        return [by_key[k] for k in keys]


@dataclass(frozen=True)
class LossConfig:
    """Per-step loss settings handed to `begin_train_step` (`algorithm/losses.py` has the formulas;
    the run builds it from `train.*`, `pumps.train.loss_config`)."""

    agg: str = (
        "token_mean"  # loss aggregation: token_mean, seq_mean_token_mean, seq_mean_token_sum, seq_mean_token_sum_norm
    )
    policy_loss: str = "ppo_clip"  # ppo_clip, gspo, cispo
    clip_low: float = 0.2  # the ratio's clip range is [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2
    is_correction: str = "token_truncate"  # none, token_truncate, token_mask, sequence_truncate, sequence_mask
    is_low: float = 0.0  # the mask corrections keep importance ratios in [is_low, is_high]
    is_high: float = 2.0  # ... and the truncating ones cap them at is_high
    ratio_to_gen: bool = False  # the ratio against the generation logprobs, not the step-start policy's
    kl_coef: float = 0.0  # KL to the reference policy in the loss (0 disables)
    kl_estimator: str = "k3"  # k1, k2, k3
    norm_tokens: int = 0  # seq_mean_token_sum_norm's constant tokens per sequence


@dataclass(frozen=True)
class StepResult:
    """What `finish_train_step` returns; `metrics` keys are namespaced (`train/...`)."""

    step: int
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainStatus:
    """Where a trainer group stands (`TrainerGroup.train_status`)."""

    next_step: int  # optimizer steps applied so far = the step `begin_train_step` accepts next
    open_step: int | None  # the step open now, if any
    last_finished: int | None  # the step finished last (its result is recorded), if any


@dataclass(frozen=True)
class WeightsHandle:
    """An opaque reference to a published weight snapshot, tagged with its policy version.

    For Ray backends `payload` holds object refs of flat buckets that generation workers read
    directly from the object store, so weight bytes never pass through the controller.
    """

    version: int
    payload: Any = None
    num_bytes: int = 0


@dataclass(frozen=True)
class OffloadRecord:
    """One move of a trainer's state between the device and host memory (`train.offload`): bytes
    moved, seconds taken, and the device memory allocated after it (CUDA; else 0)."""

    direction: str  # "offload" or "onload"
    num_bytes: int
    seconds: float
    device_allocated_bytes: int
