"""The configuration tree: typed, frozen dataclasses with a docstring under every field.

Each field carries its own contract: type, choices (`Literal[...]`), bounds (annotated-types
constraints) and docstring, so adding a field touches this file only (docs/config.md is generated
from it). `single_controller.preflight.loader` reads YAML + overrides into this tree and validates it,
then the cross-field rules of `preflight.rules`. Derived values are computed in one place
(`resolved_capacity`); there are no hidden defaults elsewhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from annotated_types import Ge, Gt, Interval

# Bounds of numeric fields. Every int or float field declares one (tests/unit/test_configs.py checks);
# `AnyFloat` says in so many words that any value is fine.
Count = Annotated[int, Ge(0)]  # 0, 1, 2, ...
PositiveInt = Annotated[int, Ge(1)]  # 1, 2, 3, ...
NonNegative = Annotated[float, Ge(0)]
Positive = Annotated[float, Gt(0)]
Fraction = Annotated[float, Interval(gt=0, le=1)]  # (0, 1]
Ratio = Annotated[float, Interval(ge=0, le=1)]  # [0, 1]
Beta = Annotated[float, Interval(ge=0, lt=1)]  # an AdamW beta, [0, 1)
Port = Annotated[int, Interval(ge=0, le=65535)]  # a TCP port; 0: any free one
AnyFloat = Annotated[float, Interval()]  # no bound


@dataclass(frozen=True)
class RunConfig:
    name: str = "sc-grpo"
    """Run name; the run directory is `<output_dir>/<name>-<timestamp>`."""
    output_dir: str = "runs"
    """Where run directories are created (resolved config, metrics.jsonl, checkpoint, plot)."""
    max_steps: PositiveInt = 400
    """Number of RL steps (= optimizer steps) to train at most."""
    stop_at_success_rate: Fraction | None = None
    """Stop early once the moving average of the trained groups' success rate reaches this (null: never)."""
    success_window: PositiveInt = 5
    """Number of steps in the moving average used by `stop_at_success_rate`."""
    progress_bar: bool = True
    """Show a progress bar on the console (one log line per step is printed regardless)."""
    plot: bool = True
    """Write `curves.png` (reward, staleness, pump waits over time) into the run directory at the end."""
    auto_resume: Count = 0
    """Times a run whose trainer rank died (or whose optimizer step failed partway) heals itself: it
    starts again from its newest checkpoint, in the same process and run directory (Ray, the
    workers and the storage are started anew), and trains on; the prompt ledger stays exactly-once.
    0: it stops with a resumable checkpoint and the command that resumes it."""
    loggers: tuple[Literal["jsonl", "tensorboard", "wandb"], ...] = ("jsonl",)
    """Where each step's record goes besides the console (the driver writes them, never the controller):
    `jsonl` is `metrics.jsonl`, always written whatever this says (resume, the plot and the benchmarks
    read it); `tensorboard`: event files under `<run dir>/tensorboard/` (the `tensorboard` package);
    `wandb`: a Weights & Biases run under `<run dir>/wandb/`, offline unless `WANDB_MODE` says otherwise
    (the `wandb` package). A logger that fails is disabled with one warning; the run goes on."""
    wandb_project: str | None = None
    """The W&B project of a run with `wandb` in `loggers`; null: `run.name`."""
    sample_every_steps: Count = 10
    """Every this many steps, the step record carries `sample`: one trained completion as text
    (prompt, completion, reward), for the loggers; 0: never."""


@dataclass(frozen=True)
class TaskConfig:
    name: str = "reverse_digits"
    """Dataset of prompts: a registered task name (`reverse_digits`, `copy_digits`; `lookup`, `guess`: the
    prompts of the built-in environments, with `env.fn` of the same name) or `module:function` returning
    an iterable of `Prompt`s for (num_prompts, seed)."""
    reward_fn: str = "single_controller.data.tasks:positional_match_reward"
    """Reward function `module:function`, called as fn(prompt, response_text) -> float inside the
    generation worker (or a batched one, as in `reward.functions`). Used when `reward.functions` is
    empty."""
    num_digits: PositiveInt = 3
    """Digits per prompt for the built-in digit tasks."""
    num_prompts: PositiveInt = 1000
    """Size of the prompt pool; the dataloader cycles through it in epochs, reshuffled each epoch."""
    success_reward: AnyFloat = 1.0
    """A completion with reward >= this counts as a success (exact match for the built-in tasks)."""


@dataclass(frozen=True)
class ReasoningGymConfig:
    task: str | None = None
    """A reasoning-gym task (`spell_backward`, `basic_arithmetic`, ... any of its procedural datasets)
    whose items are the training prompts, scored by that task's own `score_answer` (the
    `reasoning_gym` reward); null: off."""
    size: PositiveInt = 1000
    """Items in the training set (the dataloader cycles through them in epochs)."""
    seed: Count | None = None
    """Seed of the training items (null: the run's `seed`); the eval items use seed + 1 (with eval on,
    any training item whose prompt is also an eval prompt is dropped: the two are disjoint)."""
    eval_size: PositiveInt = 64
    """Items in the held-out eval set (eval.enabled)."""
    config: dict[str, Any] = field(default_factory=dict)
    """The task's own options (e.g. `{min_word_len: 3, max_word_len: 4}` for spell_backward)."""
    template: str = "{question}"
    """The prompt, as a Python format string over the item: `{question}`, `{answer}` or metadata fields
    as `{metadata[word]}` (compact prompts for tiny models, which cannot read long instructions)."""
    extract: Literal["answer_tag", "last_line", "full"] = "answer_tag"
    """What of a completion is scored: `answer_tag` the text inside the last `<answer>...</answer>`
    (the whole completion when there is none), `last_line` its last non-empty line, `full` all of it
    (stripped)."""


@dataclass(frozen=True)
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """Training prompts from datasets, in place of `task.name`; empty: the task's generated prompts. Each is a
    file (`.jsonl`, `.json`, `.parquet`), a `datasets` `save_to_disk` directory (its `split`), or a Hub dataset
    repo id (`openai/gsm8k`) in the local Hugging Face cache (its `subset` and `split` files; offline, as
    `model.path`). Each row has a prompt column (`prompt_key`: a string, or a list of `{role, content}` messages),
    an answer column (`answer_key`) and optionally an id column; every other column is passed to the reward
    functions by name. `map` transforms rows first."""
    eval_files: list[str] = field(default_factory=list)
    """Held-out prompts for the eval pump (the same kinds, `eval_split`), in place of `eval.dataset`."""
    subset: str | None = None
    """A Hub dataset's configuration (its folder of files, e.g. GSM8K's `main`); null: its only one, or `data/`."""
    split: str = "train"
    """The split `train_files` take from a `save_to_disk` directory or a Hub dataset."""
    eval_split: str = "test"
    """The split `eval_files` take from a `save_to_disk` directory or a Hub dataset."""
    revision: str | None = None
    """A Hub dataset's branch, tag or commit in the cache (null: `main`)."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a string, or a list of chat messages `{role, content}`."""
    answer_key: str | None = "answer"
    """Column holding what the reward scores against (`Prompt.answer`); null: no answer column."""
    id_key: str | None = None
    """Column holding a unique prompt id (refused if two rows share one); null: `<file stem>-<row>`."""
    chat_template: bool = True
    """Render string prompts through the tokenizer's chat template as one user message (with
    `add_generation_prompt`); false: encode them raw. Chat-message prompts always use the template."""
    system_prompt: str | None = None
    """A system message put before every templated prompt that has none (null: none)."""
    max_prompt_tokens: PositiveInt | None = None
    """Longest prompt, in tokens after the template; longer ones are handled by `overlong_prompts`.
    Also bounds the vLLM engine's context (`max_prompt_tokens + rollout.max_new_tokens`). Null: no limit
    but the model's positions."""
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)
    """Training (and eval) prompts built by a reasoning-gym task, in place of files and `task.name`."""
    overlong_prompts: Literal["filter", "error"] = "filter"
    """A prompt over `max_prompt_tokens`: `filter` drops it (counted in the run's start record and
    `summary.json` as `data_prompts_too_long`), `error` refuses the dataset, naming the row."""
    map: str | None = None
    """A row transform applied to every row of `train_files` and `eval_files` once, as they load (before
    the columns are read and ids checked; a resume loads and maps them again): a built-in (`gsm8k`: the
    `question` becomes the prompt, the number after `####` in `answer` the answer, the worked solution
    stays as column `solution`) or `module:function`, called as fn(row: dict) -> dict."""


@dataclass(frozen=True)
class RewardFunctionConfig:
    """One reward function of `reward.functions` (a list item, not a section)."""

    fn: str
    """A built-in name (`math_verify`, `reasoning_gym`, `positional_match`, `exact_match`) or
    `module:function`."""
    name: str | None = None
    """Its name in the metrics (`reward/<name>/mean`) and errors; null: the built-in name, or the
    function's own name."""
    weight: AnyFloat = 1.0
    """Its factor in the reward: the reward is the sum of weight * value over the functions."""


@dataclass(frozen=True)
class RewardConfig:
    functions: tuple[RewardFunctionConfig, ...] = ()
    """Reward functions, each `{fn, name, weight}`: `fn` a built-in (`math_verify`, `reasoning_gym`,
    `positional_match`, `exact_match`) or `module:function`; `name` (default: the built-in's or the
    function's own) keys its metric `reward/<name>/mean`; `weight` (default 1.0). The reward of a
    completion is the sum of weight * value over the functions that apply to it (a value of None:
    not applicable; none applies: 0.0).
    A function is called once per group as fn(prompts=[...], completions=[...], **columns) ->
    list[float | None] (TRL's signature; `async def` allowed; columns: `answer`, `completion_ids`,
    `prompt_id` and the dataset's columns, each a list over the group), or is the old fn(prompt,
    response_text) -> float. They run in a thread pool of the generation worker. Empty:
    `task.reward_fn` alone, called in the worker's own thread."""
    timeout_s: Positive = 30.0
    """Deadline of one call of a reward function (one group); a call that misses it fails its group
    alone (`reward_failed`). It cannot be stopped: its thread is left to finish, and a fresh pool
    serves the calls after it."""
    max_workers: PositiveInt = 4
    """Threads of a generation worker's reward pool (calls of groups and functions run side by side)."""
    trl_completions: bool = False
    """Pass completions to `module:function` rewards as TRL does: for a prompt of chat messages, each
    completion is `[{"role": "assistant", "content": text}]` (so `completion[0]["content"]` ports as is);
    for a string prompt, the text. false: always the text. Built-ins always get the text."""
    overlong_buffer: Count = 0
    """DAPO's soft overlong punishment: a completion of L tokens longer than rollout.max_new_tokens - overlong_buffer
    gets overlong_penalty x (max_new_tokens - overlong_buffer - L) / overlong_buffer added to its reward (from 0 at
    the buffer's start to -overlong_penalty at max_new_tokens), before advantages. 0: off. Single-turn only."""
    overlong_penalty: NonNegative = 1.0
    """The overlong punishment's size at max_new_tokens (see `overlong_buffer`)."""
    kl_coef: NonNegative = 0.0
    """KL to the initial (reference) policy as a penalty in the reward (InstructGPT, verl `use_kl_in_reward`): each
    completion's reward loses kl_coef x the sum over its tokens of `kl_estimator` of KL(pi_gen || pi_ref), before
    advantages. The trainer computes the reference's logprobs of each committed group (a no-grad forward, beside
    training). 0: off. For the KL in the loss, see train.kl_coef."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """The per-token estimator the reward's KL penalty sums (docs/algorithms.md): `k1` (log pi_gen - log pi_ref, the
    classic penalty), `k2`, `k3`."""


@dataclass(frozen=True)
class ModelConfig:
    d_model: PositiveInt = 64
    """Hidden size of the embedded tiny transformer."""
    n_layers: PositiveInt = 2
    """Number of transformer blocks."""
    n_heads: PositiveInt = 4
    """Attention heads per block."""
    max_seq_len: PositiveInt = 32
    """Longest prompt + response the model accepts (learned absolute positions)."""
    init_std: Positive = 0.02
    """Std of the normal initialisation of weights."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Precision of generation and of the trainer's compute. Generation workers hold their weights and
    compute in it (the sampled token's logprob is still reported in float32: logits are upcast before
    the log-softmax); the trainer keeps float32 master parameters and float32 AdamW state and computes
    its forwards under `torch.autocast` in this dtype (backward follows it), logprobs and loss in float32;
    weight snapshots travel in it (half the bytes of float32). float16 has no loss scaling here: prefer
    bfloat16. See docs/byo.md "Precision" for the logprob mismatch to expect; the Megatron trainer
    trains in bfloat16 with Megatron's own mixed precision (Float16Module, float32 main parameters)
    and refuses float16."""
    checkpoint: str | None = None
    """Load initial weights from this directory (safetensors + config.json) instead of random init."""
    path: str | None = None
    """A Hugging Face model directory (config.json, safetensors, tokenizer files) that every backend
    loads, trains and generates with, or a Hub repo id (`Qwen/Qwen2.5-1.5B-Instruct`) found in the
    local Hugging Face cache (`HF_HUB_CACHE` / `HF_HOME`; offline: nothing is downloaded, a missing one
    is refused naming the command that downloads it); null: the embedded TinyGPT built from the fields
    above."""
    revision: str | None = None
    """With a repo id in `path`: the branch, tag or commit of it to use from the cache (null: `main`)."""
    create: bool = False
    """When `path` does not exist yet, write a random-init tiny model there first (as `sc-grpo
    init-model` does): architecture `arch`, hidden size `d_model`, `n_layers` layers, `n_heads` heads
    (head_dim = d_model / n_heads), `max_seq_len` positions, seeded by `seed`."""
    tokenizer: Literal["auto", "bpe", "char"] = "auto"
    """Tokenizer `create` writes: `bpe` (byte-level BPE, digits split one per token, a ChatML chat
    template: an instruct model's layout), `char` (the built-in digit tasks' character tokenizer:
    those tasks need it), or `auto`: `bpe` when the prompts come from `data.train_files`, else `char`."""
    tokenizer_vocab_size: Annotated[int, Ge(259)] = 512
    """Tokens of the `bpe` tokenizer `create` writes (256 bytes + 3 special + merges; 259: no merges,
    every letter its own token)."""
    arch: Literal["llama", "qwen2", "qwen3", "gpt2"] = "llama"
    """Architecture `create` writes: `llama` (LlamaForCausalLM: RoPE, RMSNorm, SwiGLU), `qwen2`
    (Qwen2ForCausalLM: Llama's plus q/k/v biases), `qwen3` (Qwen3ForCausalLM: Llama's plus an RMSNorm
    of each query and key head) or `gpt2` (GPT2LMHeadModel: learned absolute positions, like the
    embedded TinyGPT)."""
    n_kv_heads: PositiveInt | None = None
    """Key/value heads of the model `create` writes (grouped-query attention: they divide `n_heads`,
    e.g. 14 query / 2 key-value heads in Qwen2.5-0.5B; RoPE archs only); null: one per query head."""
    d_ff: PositiveInt | None = None
    """MLP width of the model `create` writes (Qwen2.5-0.5B: 4,864 for `d_model` 896); null: 4 x `d_model`."""
    tie_embeddings: bool = False
    """`create` ties the output head to the input embedding (`tie_word_embeddings`, as Qwen2.5-0.5B,
    Qwen3-0.6B and GPT-2 do; the embedded TinyGPT is tied too); false: a separate `lm_head`. A tied
    tiny model learns copy-like tasks (reverse the digits) far sooner: the token it attends to scores
    itself through the same vectors."""


@dataclass(frozen=True)
class RolloutConfig:
    group_size: Annotated[int, Ge(2)] = 16
    """Completions per prompt (G); advantages are normalized within each group. Must be >= 2."""
    temperature: Positive = 1.0
    """Sampling temperature."""
    top_p: Fraction = 1.0
    """Nucleus sampling mass (1.0 = full vocabulary)."""
    max_new_tokens: PositiveInt | None = None
    """Tokens generated per completion at most. Null: `task.num_digits` for the generated tasks (their
    answers' length); prompts from `data` (files, reasoning-gym) must set it (no toy default leaks into
    a real run)."""
    stop_at_eos: bool = False
    """End a completion at the EOS token (otherwise exactly `max_new_tokens` are generated)."""
    max_in_flight_groups: PositiveInt = 32
    """Prompt groups dispatched to generation workers and not yet returned, at most."""
    max_in_flight_per_worker: Count = 0
    """Groups in flight on one generation worker at most (0: no limit but `max_in_flight_groups`).
    With elastic workers (a pool, or shrink/expand) a limit keeps the run's groups from queuing on
    the workers routable at the moment they are dispatched: a worker that joins later finds the
    rest still undispatched. Set it to about what one worker computes at once (its batch)."""
    max_batch_groups: PositiveInt = 16
    """A generation worker batches up to this many pending groups into one sampling pass."""
    on_failure: Literal["retry", "drop"] = "retry"
    """On a generation failure: `retry` the prompt (up to `max_retries`, then drop it) or `drop` it.
    Neither applies to an abort the controller decides (`sync.drain_policy=abort`, the stale in-flight
    rule): its prompt is always re-dispatched, uncharged; nor to a reward function that fails (it
    raises, or gives a non-finite reward): that group alone is dropped with reason `reward_failed`
    and its prompt is not retried, as a deterministic reward error would fail again."""
    max_retries: Count = 2
    """Retries of one prompt after generation failures before it is dropped with reason `generation_failed`."""
    max_reward_failures_in_a_row: PositiveInt = 64
    """Groups dropped as `reward_failed` in a row, none scored between, before the run stops with
    `RewardFunctionFailing` (a reward function that fails on everything would drop every prompt)."""
    max_worker_restarts: Count = 3
    """Restart attempts for one generation worker that died, or hung (it did not answer a liveness
    call, `timeouts.liveness_s`, or missed the deadline of a weight update): its prompts are
    re-dispatched uncharged, it is killed and restarted with the newest weights, a failed attempt is
    tried again while attempts remain; then it stays out of routing, and with no worker left the run
    stops with `NoGenerationWorkers`."""
    shrink: Literal["abort", "drain"] = "abort"
    """What a shrink (`Controller.shrink_generation`: a generation worker taken out of the run for
    a while) does with the groups in flight on the worker, once it is out of routing: `abort` cancels
    them (their prompts re-dispatched uncharged, counted as preempted); `drain` lets them finish up to
    `rollout.shrink_drain_timeout_s`, then aborts what is left."""
    shrink_drain_timeout_s: Positive = 30.0
    """How long a `drain` shrink waits for the worker's groups in flight before aborting the rest."""
    sleep_level: Annotated[int, Interval(ge=0, le=2)] = 0
    """The deepest sleep a shrink may put a generation worker to: 0 = out of routing only (it keeps
    its weights and caches), 1 = its weights freed too, 2 = its weights and caches freed. An expand
    wakes it, applies the newest published weights and checks their version before routing to it.
    vLLM sleeps only on CUDA/ROCm: vLLM on the CPU allows level 0 alone."""


@dataclass(frozen=True)
class AdvantageConfig:
    normalize_std: bool = True
    """Divide (r - mean) by (std + eps) within each group; false: only subtract the group mean."""
    eps: Positive = 1e-4
    """Added to the group std before dividing."""
    drop_zero_variance: bool = False
    """Drop groups whose rewards are all equal (no learning signal) and refill them (DAPO dynamic sampling)."""
    max_zero_variance_drops_per_step: Count = 16
    """With `drop_zero_variance`: zero-variance groups dropped (and refilled) for one step at most; past
    it they are kept and trained (with zero advantage), so a solved or hopeless task cannot refill
    forever (`rollout/zero_variance_kept` counts them)."""


@dataclass(frozen=True)
class TrainConfig:
    groups_per_step: PositiveInt = 16
    """Prompt groups per RL step (one optimizer step, or `updates_per_step` of them)."""
    updates_per_step: PositiveInt = 1
    """Optimizer steps per RL step (PPO's mini-batches; verl `ppo_mini_batch_size` = groups_per_step / this): a
    step's groups, in the order they are selected, train in this many updates of groups_per_step / updates_per_step
    groups each (it must divide groups_per_step), all at the step's lr, then one weight sync; the policy version
    advances once. With `recompute_old_logprobs` each update's ratio is taken against the policy at the step's start
    (the trainer keeps a copy of it, and of the optimizer state, while the step is open: the parameters and the
    AdamW moments once more), else against the generation logprobs. An aborted step is put back to its start."""
    min_groups_per_chunk: PositiveInt = 4
    """The train pump sends a microbatch as soon as this many groups of the step are ready (streaming)."""
    lr: Positive = 1e-3
    """AdamW learning rate (the peak of `lr_schedule`)."""
    betas: tuple[Beta, Beta] = (0.9, 0.99)
    """AdamW betas."""
    weight_decay: NonNegative = 0.0
    """AdamW weight decay."""
    grad_clip: NonNegative = 1.0
    """Clip the global gradient norm to this after 1/N scaling (0 disables)."""
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"] = (
        "token_mean"
    )
    """How a step's per-token losses become one number, over its kept tokens on every rank (docs/algorithms.md):
    `token_mean` (their sum / the step's tokens: DAPO, TRL `dapo`, verl `token-mean`); `seq_mean_token_mean`
    (each row's mean, averaged over rows: GRPO's paper, TRL `grpo`); `seq_mean_token_sum` (each row's sum,
    averaged over rows); `seq_mean_token_sum_norm` (the sum / (rows x rollout.max_new_tokens): Dr. GRPO's
    constant normaliser, TRL `dr_grpo`)."""
    policy_loss: Literal["ppo_clip", "gspo", "cispo"] = "ppo_clip"
    """The surrogate each token's loss comes from (docs/algorithms.md): `ppo_clip` (PPO's clipped ratio),
    `gspo` (the row's geometric-mean ratio, clipped per sequence: GSPO; give it clip_eps_low/high of about
    3e-4/4e-4), `cispo` (the clipped ratio as a stop-gradient weight on the log-probability: CISPO)."""
    clip_eps: Positive = 0.2
    """The ratio's clip range [1 - clip_eps, 1 + clip_eps]: shorthand for equal `clip_eps_low` and `clip_eps_high`."""
    clip_eps_low: Positive | None = None
    """The clip range's lower side, 1 - clip_eps_low (null: `clip_eps`)."""
    clip_eps_high: Positive | None = None
    """The clip range's upper side, 1 + clip_eps_high (null: `clip_eps`); above clip_eps_low it is DAPO's clip-higher
    (e.g. 0.2 / 0.28)."""
    is_correction: Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = (
        "token_truncate"
    )
    """Off-policy correction by the importance ratio rho = pi_old / pi_gen of the step-start policy to the one that
    sampled (docs/algorithms.md): `token_truncate` (each token weighted by min(rho, is_threshold): TIS), `token_mask`
    (tokens with rho outside [is_threshold_low, is_threshold] dropped, the rest weighted by rho: MIS / IcePop),
    `sequence_truncate` / `sequence_mask` (the same with the row's product of ratios), `none`."""
    is_threshold: Positive = 2.0
    """The importance ratio's cap (truncating corrections) or upper bound (mask corrections)."""
    is_threshold_low: NonNegative = 0.0
    """The mask corrections' lower bound on the importance ratio (e.g. 0.5); 0 with the others."""
    recompute_old_logprobs: bool = True
    """The ratio is taken against the policy at the step's start (its logprobs recomputed by the trainer; free with one
    update per step, where they are the forward's own), and the correction weighs that policy against the sampler's.
    false: the ratio is taken against the generation logprobs themselves (the clip then also bounds staleness) and
    `is_correction` must be `none`."""
    mask_truncated: bool = False
    """A completion cut short (it reached `rollout.max_new_tokens` without a stop token, or an episode was cut at
    `env.max_turns` or the context) carries no loss: its tokens are neither trained nor counted (DAPO's overlong
    filtering). Its reward still counts in its group's baseline. A step whose every row was cut applies a zero
    gradient. Reported as `train/truncated_masked_frac`."""
    kl_coef: NonNegative = 0.0
    """Weight of the KL penalty to the initial (reference) policy in the loss; 0 disables it."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """The per-token estimator of KL(pi || pi_ref) the penalty uses: `k1` (log pi - log pi_ref), `k2`
    ((log pi - log pi_ref)^2 / 2), `k3` (pi_ref/pi - log(pi_ref/pi) - 1: unbiased, >= 0). All three are reported."""
    max_step_retries: Count = 2
    """Times a train step is aborted and retried after a trainer error before the run fails."""
    pipeline_steps: bool = True
    """When the next step's first chunk is ready as a step finishes, send it right behind the finish (trainer
    backends that can: `torch`), so the trainer never waits for the controller between steps. Same steps, same
    math; off: the next step begins once the finish is answered."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """The learning rate of RL step (= optimizer step) s, a function of s alone (`algorithm.schedules.lr_at`), so a
    resumed run repeats it exactly: after the warmup, `constant` keeps `lr`; `linear` and `cosine` decay it from
    `lr` at step `warmup_steps` to `min_lr_ratio * lr` at the last step, `run.max_steps - 1`. The decay horizon is
    `run.max_steps`: a decaying schedule needs run.max_steps >= warmup_steps + 2, and a resume must keep it."""
    warmup_steps: Count = 0
    """Linear warmup from 0 to `lr` over this many steps: step s < warmup_steps trains with lr * (s + 1) /
    warmup_steps (0: none)."""
    min_lr_ratio: Ratio = 0.0
    """The floor of a decaying schedule (`linear`, `cosine`) as a fraction of `lr`: the lr of the last step."""
    micro_batch_tokens: PositiveInt | None = None
    """Each microbatch a trainer rank gets (its share of a chunk) runs as forward/backward passes of at most this
    many tokens each (rows x the pass's longest prompt + response, padding included; a row longer than this
    runs alone), their raw loss sums added, so the step's math is unchanged: peak activation memory follows
    this budget, not the chunk size. null: one pass per microbatch."""
    gradient_checkpointing: bool = False
    """Recompute each transformer layer's activations in the backward pass instead of keeping them (less
    activation memory, about one more forward pass of compute); same gradients. torch: HF models'
    `gradient_checkpointing_enable`, the embedded TinyGPT per block; Megatron: full recompute, one layer at a time."""
    offload: Literal["none", "optimizer", "all"] = "none"
    """torch and fsdp trainers, `backend.colocate_form=turns` only: what the trainer moves to host memory
    (pinned on CUDA) while the generation workers have the device: `optimizer` (its state: AdamW's two
    moments, 2x the parameters in float32), `all` (the parameters too, and the KL reference; with fsdp
    each rank its shards). Moved back,
    bit-exact, before the next step begins."""
    gpu_memory_fraction: Fraction | None = None
    """torch and fsdp trainers on CUDA: the share of the GPU's memory its process may allocate (torch's
    `set_per_process_memory_fraction`; past it an allocation fails with out-of-memory instead of
    taking the engine's memory); null: no limit. With `backend.colocate_form=shared` on one GPU it and
    `vllm.gpu_memory_utilization` must leave room for each other (they sum to at most 0.95)."""
    share_prompt_prefix: bool = True
    """torch trainer: the rows of a pass that share a prompt (a group's G rows) run it once; each row's
    response attends to its keys and values. Same logprobs and gradients as whole rows, for 1/G of the
    prompt's compute and activation memory. Not with `gradient_checkpointing` (whole rows then); the
    fsdp and Megatron trainers run whole rows."""


@dataclass(frozen=True)
class SamplerConfig:
    max_lookahead_versions: Count = 1
    """L: a rollout for step s may start only while s <= policy_version + L (0 = synchronous on-policy)."""
    order: Literal["in_order", "fifo", "freshest"] = "in_order"
    """`in_order`: step s trains exactly the groups dispatched for it; `fifo` / `freshest`: any ready
    groups within the staleness bound, oldest-dispatched or freshest-weights first."""
    max_staleness_versions: Count = 1
    """A group is never trained with staleness (train step - version that started it) above this; ready
    groups beyond it are evicted."""
    abort_stale_in_flight: bool = False
    """At each weight sync, cancel in-flight rollouts that could only finish above the staleness bound
    (their prompts are re-dispatched)."""


@dataclass(frozen=True)
class BufferConfig:
    capacity_groups: PositiveInt | None = None
    """Prompt groups resident at once (reserved, in flight, stored, training); null: the least that the
    lookahead needs, (L + 1) * groups_per_step."""


@dataclass(frozen=True)
class SyncConfig:
    drain_policy: Literal["drain", "keep", "abort"] = "keep"
    """At a weight sync: `drain` waits for in-flight rollouts to finish first; `keep` lets them run on
    (the engine pauses between tokens, swaps weights and resumes: rows carry a per-token version and
    groups their oldest and newest); `abort` cancels every in-flight rollout (partial groups are
    discarded, their prompts re-dispatched)."""
    drain_timeout_s: Positive = 60.0
    """Deadline for draining in-flight rollouts."""
    transport: Literal["object_store", "collective"] = "object_store"
    """How weights travel from the trainer to the generation workers. `object_store`: the trainer's
    rank 0 puts the buckets into Ray's object store and each worker reads them. `collective`: rank 0
    keeps them and broadcasts them to each worker over a `torch.distributed` group of their own (gloo;
    NCCL when trainer and generation are both on CUDA), formed at the first sync and again after a
    worker restarts; if a group cannot be formed the worker gets the object-store path, and the log
    says so. See docs/performance.md for the measured cost of each."""
    weight_bucket_mb: Positive = 4.0
    """Weight snapshots are published as flat buckets of at most this many MiB (one larger tensor gets
    its own bucket); generation workers stream them into the engine one bucket at a time."""


@dataclass(frozen=True)
class TimeoutConfig:
    generate_s: Positive = 120.0
    """Deadline of one generation request's own work (sampling, scoring, storing its rows): the time it
    queues in its worker, or is held there for newer weights, does not count. A request past it fails
    alone (`generation_timeout`, retried per `rollout.max_retries`); its worker is taken for hung only
    if it does not answer a liveness call (`liveness_s`)."""
    liveness_s: Positive = 30.0
    """Deadline of a liveness call to a generation worker, made when one of its requests reaches its
    deadline: a worker that does not answer it is hung (killed and restarted, its requests re-dispatched
    uncharged)."""
    train_call_s: Positive = 120.0
    """Deadline of each split-API call (begin / microbatch / finish / abort)."""
    weight_sync_s: Positive = 120.0
    """Deadline of publishing and applying one weight snapshot."""
    storage_s: Positive = 60.0
    """Deadline of one row-storage call."""
    setup_s: Positive = 180.0
    """Deadline of starting workers and storage."""
    checkpoint_s: Positive = 600.0
    """Deadline of writing (staging, then committing) one checkpoint and of loading one at resume,
    plus `checkpoint_s_per_gib` for each GiB the newest checkpoint took (a real model's state takes
    minutes to write: not the split-API calls' deadline)."""
    checkpoint_s_per_gib: NonNegative = 60.0
    """Seconds added to `checkpoint_s` per GiB of the newest checkpoint written (or loaded); before a
    run has written or loaded one, per GiB of 8 times its published weights (a guess of its state's size)."""


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: Count = 20
    """Write a checkpoint every this many optimizer steps (0: never by step count)."""
    every_s: NonNegative = 0.0
    """Also write one when this many seconds passed since the last (0: never by time)."""
    keep: Count = 2
    """Checkpoints kept in `<run dir>/checkpoints/` (the newest ones; 0 keeps all)."""
    at_exit: bool = True
    """Write one when the run ends: finished, stopped by SIGTERM/SIGINT, or failed with a live trainer."""


@dataclass(frozen=True)
class BackendConfig:
    generation: Literal["torch", "vllm", "sim"] = "torch"
    """Generation backend: `torch` (the embedded torch sampler, Ray actors), `vllm` (the vLLM engine,
    Ray actors; needs the `vllm-cpu` extra on a CPU, `vllm` on a GPU), or `sim` (latency-scripted
    fakes, in-process; only with `trainer: sim`)."""
    trainer: Literal["torch", "fsdp", "megatron", "sim"] = "torch"
    """Trainer backend: `torch` (torch ranks with DDP, each holding the whole model and optimizer; Ray
    actors), `fsdp` (the same model and split step sharded with FSDP2 over the ranks: each holds 1/N of
    the parameters, gradients and optimizer state; any Hugging Face causal LM or the embedded model;
    `fsdp.*`), `megatron` (Megatron-core ranks with tensor parallelism; needs the `megatron` extra), or
    `sim` (a latency-scripted fake, in-process; only with `generation: sim`). docs/fsdp.md compares them."""
    num_generation_workers: PositiveInt = 1
    """Generation worker actors."""
    num_trainer_ranks: PositiveInt = 1
    """Trainer ranks: data-parallel (DDP) for `torch`, sharded data-parallel for `fsdp` (gloo on the
    CPU, NCCL on CUDA)."""
    trainer_placement: Literal["pack", "spread"] = "pack"
    """Where the trainer ranks go on the Ray cluster: `pack` (no constraint: Ray's default, the ranks
    share a node while it has room) or `spread` (a STRICT_SPREAD placement group: every rank on its
    own node; refused, naming the nodes, when the cluster cannot do that). Either way the ranks meet
    at rank 0's node IP and a port free there."""
    trainer_device: Literal["cpu", "cuda"] = "cpu"
    """`torch` and `fsdp` trainers: `cpu`, or `cuda` (each rank asks Ray for one GPU and trains there)."""
    colocate: bool = False
    """Generation and training on the same device (a node's cores, or one GPU) instead of each role its
    own; `colocate_form` says how they share it. false (disaggregated): each process its own share
    (on GPUs, a GPU per generation worker and per trainer rank), generation overlapping training."""
    colocate_form: Literal["shared", "turns"] = "shared"
    """`colocate` only. `shared`: both roles stay resident and the pipeline overlaps them: on the CPU
    every process gets all the node's cores and a node-local lock lets one role compute at a time, a
    sampling batch / engine step against a trainer microbatch or finish
    (`backends/common/colocation.py`); on a GPU each role takes its own memory share
    (`vllm.gpu_memory_utilization`, `train.gpu_memory_fraction`) and both run at once. Use it when
    the model fits twice (weights, KV cache, optimizer state). `turns`: the device alternates by
    whole phases (`single_controller/device_turns.py`): before a train step every generation worker
    is shrunk to sleep at `rollout.sleep_level` (vLLM frees its KV cache and weights) and the trainer
    takes back what `train.offload` moved to host memory; after the step's weights are published the
    trainer offloads again and the workers wake with the new weights. Use it when the model does not
    fit twice, or to give each phase the whole device; each switch costs a sleep and a wake. The
    exactly-once ledger, the staleness bound and the weight-sync policy hold in both."""
    torch_threads: PositiveInt | None = None
    """torch threads per worker process; null: 1 (disaggregated: more would oversubscribe the cores and
    slow every step), or all the node's cores with `colocate`."""
    sim_generate_s: NonNegative = 0.01
    """`sim` only: seconds per generation batch."""
    sim_train_s: NonNegative = 0.01
    """`sim` only: seconds of training per step (spread over its microbatches)."""


@dataclass(frozen=True)
class VllmConfig:
    device: Literal["cpu", "cuda"] = "cpu"
    """`cpu`: the vLLM CPU engine (the `vllm-cpu` extra), in the worker's process; `cuda`: one GPU per
    generation worker (the `vllm` extra)."""
    kv_cache_gib: Positive = 1.0
    """GiB of KV cache per engine: on `cpu` always (VLLM_CPU_KVCACHE_SPACE); on `cuda` in a pool
    (`pool.enabled`), where the engine starts with this KV cache instead of measuring the memory
    left (another run's engine sleeping or waking meanwhile would upset that measure)."""
    gpu_memory_utilization: Fraction = 0.5
    """`cuda` only: fraction of the GPU's memory the engine may take (weights + KV cache); in a pool,
    also the share of a GPU its worker asks Ray for (the runs of a pool share GPUs)."""
    max_num_seqs: PositiveInt = 256
    """Sequences the engine schedules at once (a group of G completions is G sequences)."""
    enforce_eager: bool = True
    """Run the model eagerly (no CUDA graphs / torch.compile): fast start, fine for small models."""


@dataclass(frozen=True)
class MegatronConfig:
    tensor_parallel_size: PositiveInt = 1
    """`backend.trainer: megatron` only: tensor-parallel degree; must divide the model's attention
    heads, key/value heads and intermediate size."""
    data_parallel_size: PositiveInt = 1
    """Data-parallel degree; tensor_parallel_size * data_parallel_size must equal
    backend.num_trainer_ranks (one rank actor per GPU, or per process on CPU)."""
    distributed_optimizer: bool = False
    """Shard the optimizer state over the data-parallel ranks (Megatron's distributed optimizer)."""
    cpu_emulation: bool = False
    """Run megatron-core on CPU over gloo (tests and CPU-only demos; see
    `backends/megatron/cpu_emulation.py`). Refused where CUDA is available; false: NCCL, one GPU per rank."""


@dataclass(frozen=True)
class FsdpConfig:
    reduce: Literal["microbatch", "finish"] = "microbatch"
    """`backend.trainer: fsdp` only: when gradients are reduce-scattered (raw sums either way: the step
    divides by its global count once, at finish; same step). `microbatch`: after each microbatch's
    backward, so every rank keeps only its 1/N shard of the gradient; `finish`: once per step, in
    `finish_train_step` (fewer collectives, but every rank holds a whole unsharded gradient until then)."""
    safetensors_shard_mb: PositiveInt = 5120
    """The policy it saves (`checkpoint`s' `policy/`, the run's final policy) as Hugging Face
    safetensors files of at most this many MiB each, with a `model.safetensors.index.json` past one
    file; rank 0 holds at most one file's tensors while writing."""


@dataclass(frozen=True)
class StorageConfig:
    kind: Literal["tq", "memory"] = "tq"
    """`tq`: TransferQueue on the local (or attached) Ray; `memory`: in-process (sim backend only)."""
    partition: str = "rollout"
    """Prefix of the run's TransferQueue partition: its rows go to `<partition>-<run id>` (the run id is
    the run directory's name plus a random suffix, kept across resumes), so runs sharing one
    TransferQueue never see or clear each other's keys."""
    attach: bool = False
    """Attach to a TransferQueue already running on the Ray cluster (`sc-grpo storage serve`)
    instead of starting one; the run leaves every other partition alone and drops its own when it
    ends empty."""
    num_storage_units: PositiveInt = 1
    """TransferQueue storage units started (each needs one logical Ray CPU)."""
    tq_one_process: bool = True
    """With one storage unit, run TransferQueue's controller and the unit in one actor process
    (`replay/transferqueue/host.py`) instead of one each: one Python process fewer importing torch and
    TransferQueue at start-up (docs/performance.md). More storage units always get a process each, as
    TransferQueue starts them."""
    pack_groups: bool = True
    """One TransferQueue key per prompt group, its rows packed together, instead of one key per row:
    TransferQueue's cost is per key, so a step's data plane costs far less CPU. Rows are still read
    by their own keys; groups are written and cleared whole (as every backend does)."""


@dataclass(frozen=True)
class RayConfig:
    address: str | None = None
    """Attach to this Ray cluster (e.g. `auto`, `HEAD_IP:6379` or `ray://host:10001`); null starts a
    local one. Each run gets its own Ray namespace, `sc-grpo-<run id>`, so runs sharing a cluster
    never collide on actor names."""
    num_cpus: PositiveInt | None = None
    """Logical CPUs of a local Ray (null: enough for TQ + workers + controller, whatever the core count)."""
    ray_observability: bool = False
    """A local Ray's own task events (its state API's task list, `ray.timeline()`), its own metrics and
    its event-loop statistics (its debug-state dumps). Off by default: sc-grpo's metrics and status
    do not use them, and they cost CPU every step in the raylet, the GCS and Ray's metrics agent
    (docs/performance.md). An attached cluster keeps its own settings."""


@dataclass(frozen=True)
class MetricsConfig:
    enabled: bool = True
    """Serve Prometheus metrics from the controller."""
    host: str = "127.0.0.1"
    """Bind address of the metrics endpoint (loopback unless you choose otherwise)."""
    port: Port = 9464
    """Port of the metrics endpoint; when it is taken (e.g. by another run on this host) the next free
    one up to port + 15, then any free port (0: any free port). The run prints the URL it bound."""
    mismatch_kl_bound: Positive = 0.001
    """Bound on the training-inference mismatch (`train/mismatch_kl`, the KL between the generation
    engine's and the trainer's token distributions on tokens both computed with the same weights),
    exported as a gauge; the shipped Prometheus alert fires while the mismatch exceeds it."""


@dataclass(frozen=True)
class EvalConfig:
    enabled: bool = False
    """Evaluate the policy on held-out prompts while training goes on (the eval pump; no drain)."""
    every_steps: PositiveInt = 10
    """Evaluate every this many policy versions (optimizer steps), plus at the start and the end of the run."""
    dataset: str | None = None
    """Held-out prompts: null is the task's held-out split (`<task>.held_out` for the built-in digit
    tasks, never used for training); or a registered name (`reverse_digits.held_out`,
    `copy_digits.held_out`) or `module:function` returning `Prompt`s for (num_prompts, num_digits, seed)."""
    num_prompts: PositiveInt = 64
    """Held-out prompts per evaluation (fewer if the dataset has fewer)."""
    num_samples: PositiveInt = 1
    """Completions per eval prompt: `eval/accuracy` averages them, `eval/pass@k` (k = this) counts a
    prompt solved if any of them succeeds."""
    temperature: NonNegative = 0.0
    """Eval sampling temperature; 0 is greedy (argmax). Must be > 0 when num_samples > 1."""
    top_p: Fraction = 1.0
    """Eval nucleus sampling mass (1.0 = full vocabulary; ignored when greedy)."""
    max_new_tokens: PositiveInt | None = None
    """Tokens generated per eval completion at most (null: rollout.max_new_tokens)."""
    max_retries: Count = 2
    """Re-issues of one eval request after generation failures before that eval point is abandoned
    (counted in `eval/failed`; training goes on). Re-issues after a weight update do not count."""


@dataclass(frozen=True)
class EnvConfig:
    """Multi-turn rollouts against an environment (docs/environments.md); off while `fn` and `url` are null."""

    fn: str | None = None
    """The environment in-process: a built-in name (`lookup`: a tool-use task; `guess`: a digit-guessing
    game) or `module:Class`, instantiated once per episode as Class(**env.args) with async `reset(item)
    -> str` and `step(action) -> StepOutcome` (`single_controller/envs/contract.py`)."""
    url: str | None = None
    """The environment over HTTP (`sc-grpo env serve` or any server of the documented JSON protocol),
    e.g. `http://127.0.0.1:8765`; exclusive with `fn`. Checked reachable before start-up."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment class (`fn`); sent with each reset over HTTP (`url`)."""
    tools: list[dict[str, Any]] = field(default_factory=list)
    """JSON tool schemas (e.g. `{type: function, function: {name, description, parameters}}`) handed to the
    chat template as `tools=` when prompts of chat messages (or templated strings) are rendered, so the
    policy sees the tools the way its template shows them. Empty: none."""
    max_turns: PositiveInt = 4
    """Policy turns per episode at most; an episode still running after them ends with
    `truncated_reward` (an outcome of the policy, not an error)."""
    max_tokens_per_turn: PositiveInt | None = None
    """Tokens the policy generates in one turn at most (null: rollout.max_new_tokens); a turn also
    ends at a stop token (`rollout.stop_at_eos`, the chat template's end of turn)."""
    truncated_reward: AnyFloat = 0.0
    """Reward of an episode that used `max_turns` without finishing."""
    timeout_s: Positive = 10.0
    """Deadline of one environment call (reset, step, tool call, close); a call past it fails its episode."""
    max_attempts: PositiveInt = 2
    """Attempts of an episode whose environment failed (error or deadline) before its whole group is
    dropped with reason `env_failed` (counted; never a zero reward in the baseline)."""
    retry_backoff_s: NonNegative = 0.5
    """Pause before an episode's next attempt, doubled after each (0.5, 1, 2 s...): an environment
    server that restarts gets that long to come back before the group is given up."""
    max_failures_in_a_row: PositiveInt = 64
    """Groups dropped as `env_failed` in a row, none scored between, before the run stops with
    `EnvironmentFailing` (a dead environment would drop every prompt)."""
    tool_call: Literal["auto", "none", "regex", "hermes"] = "auto"
    """How an action becomes a tool call: `hermes` (`<tool_call>{"name": .., "arguments": {..}}</tool_call>`,
    the format of Qwen's and Hermes' chat templates), `regex` (`tool_call_pattern`), `none` (actions are
    plain text), or `auto`: `hermes` when the chat template mentions `<tool_call>`, else `regex`."""
    tool_call_pattern: str = r"^\?(?P<arguments>[0-9]*)$"
    """For `regex`: a pattern matched against the whole action, with a named group `arguments` and
    optionally `name` (else the tool is `default_tool`). The default suits the character tokenizer
    of the built-in tasks: `?47` calls the tool with `47`."""
    default_tool: str = "lookup"
    """The tool's name when `tool_call_pattern` has no `name` group."""


@dataclass(frozen=True)
class PoolConfig:
    enabled: bool = False
    """Run in a pool of slots time-shared with other runs (RLix-style; `sc-grpo pool run POOL.yaml`
    sets it, see docs/pool.md): the run's generation workers start asleep, the pool expands them onto
    slots by demand and shrinks them (abort for a train grant, drain for a rebalance, then sleep at
    `rollout.sleep_level`); the train pump asks for the train slots before each step and gives them
    back once the step's weights are on the run's routable workers. The run's name (`run.name`) is
    its name in the pool."""
    attach: bool = False
    """Attach to a pool served on the Ray cluster at `ray.address` (`sc-grpo pool serve`) instead of
    the one `sc-grpo pool run` starts."""
    name: str = "sc-grpo-pool"
    """The pool actor's name (its Ray namespace: `sc-grpo-pool`)."""
    gen_slots: tuple[Count, ...] = ()
    """The pool slots of the run's generation workers, one worker per slot (their number is
    `backend.num_generation_workers`)."""
    train_slots: tuple[Count, ...] = ()
    """The pool slots the run's trainer takes while it trains a step (granted before generation,
    never preempted)."""
    overlap: Literal["partial", "none"] = "partial"
    """`partial`: the train slots are among the run's generation slots (their workers sleep while it
    trains; RLix's partial overlap); `none`: they are none of them."""
    grant_timeout_s: Positive = 600.0
    """Deadline of one wait for the train slots (other runs may train on them meanwhile)."""
    call_timeout_s: Positive = 60.0
    """Deadline of every other call between the run and the pool."""


@dataclass(frozen=True)
class Config:
    seed: Count = 0
    """Seed of the model init, the prompt order and sampling."""
    run: RunConfig = field(default_factory=RunConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)


# Keys a config may no longer use, each with what replaced it (the loader names it instead of "unknown key").
RETIRED_KEYS: dict[str, str] = {
    "train.loss_level": "replaced by train.loss_agg: token -> token_mean, sequence -> seq_mean_token_mean",
    "train.is_truncation": (
        "replaced by train.is_correction and train.is_threshold: is_truncation=C > 0 -> is_correction=token_truncate "
        "is_threshold=C; is_truncation=0 -> is_correction=none recompute_old_logprobs=false"
    ),
}


def env_enabled(env: EnvConfig) -> bool:
    """Rollouts are multi-turn episodes against an environment (`env.fn` or `env.url` set)."""
    return env.fn is not None or env.url is not None


def required_capacity(cfg: Config) -> int:
    """Groups the lookahead can have resident at once: every live group targets one of the steps
    v .. v+L, each holding at most groups_per_step, so fewer slots can deadlock a refill."""
    return (cfg.sampler.max_lookahead_versions + 1) * cfg.train.groups_per_step


def run_reward(cfg: Config) -> RewardConfig:
    """The reward section a run scores with: `reward.functions`, or, when that is empty and the prompts
    come from a reasoning-gym task, that task's own scorer (the `reasoning_gym` built-in)."""
    if cfg.reward.functions or cfg.data.reasoning_gym.task is None:
        return cfg.reward
    return dataclasses.replace(cfg.reward, functions=(RewardFunctionConfig(fn="reasoning_gym"),))


def prompts_from_data(cfg: Config) -> bool:
    """The training prompts come from `data` (files or a reasoning-gym task), rendered with the
    model's tokenizer, not from `task.name`'s generator."""
    return bool(cfg.data.train_files) or cfg.data.reasoning_gym.task is not None


def eval_max_new_tokens(cfg: Config) -> int:
    """Tokens per eval completion: `eval.max_new_tokens`, or the rollouts' when null."""
    return cfg.eval.max_new_tokens if cfg.eval.max_new_tokens is not None else rollout_max_new_tokens(cfg)


def rollout_max_new_tokens(cfg: Config) -> int:
    """Tokens per rollout completion: `rollout.max_new_tokens`, or the digit tasks' answer length when
    null (config rule `data_prompts_set_their_new_tokens` refuses null for prompts from data)."""
    return cfg.rollout.max_new_tokens if cfg.rollout.max_new_tokens is not None else cfg.task.num_digits


def resolved_capacity(cfg: Config) -> int:
    return cfg.buffer.capacity_groups if cfg.buffer.capacity_groups is not None else required_capacity(cfg)


class CapacityConfigError(ValueError):
    """The buffer capacity cannot hold what the lookahead admits: the run would deadlock."""


def check_capacity(cfg: Config) -> None:
    need, have = required_capacity(cfg), resolved_capacity(cfg)
    if have < need:
        raise CapacityConfigError(
            f"buffer.capacity_groups={have} cannot satisfy sampler.max_lookahead_versions="
            f"{cfg.sampler.max_lookahead_versions} with train.groups_per_step={cfg.train.groups_per_step}: "
            f"(L + 1) * groups_per_step = {need} slots are needed, or a refill for the oldest step "
            f"could wait forever behind groups of later steps"
        )
