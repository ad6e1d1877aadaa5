"""The single controller: setup, the pumps in one TaskGroup (eval too when `eval.enabled`), teardown.

`Controller` runs in-process (tests, the simulated backend, benchmarks) or in a CPU-only Ray actor
(`runtime.actor_host.ControllerHost`); it moves keys, lengths, rewards and advantages, never bulk
tensors. A failing pump cancels its siblings and `run()` raises `RunFailed` naming it. Teardown always
runs: an open step is aborted, resident rows are cleared, unsettled prompts are settled `dropped`.
Checkpoints are written between steps (`checkpoint.every_steps` / `every_s`) and at the end, unless
the trainer stands elsewhere than the controller; `resume=` continues from a checkpoint's cut,
clearing whatever rows its storage still holds first.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import math
import statistics as pystats
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pumps.advantage import RewardKlPass, advantage_pump, shaped_rewards
from pumps.eval import EvalPoint, EvalStatistics, EvalTracker, eval_pump, reward_part_means
from pumps.rollout import rollout_pump
from pumps.train import StepReport, prefetch_pump, record_landed_finish, train_pump
from pumps.weight_sync import update_worker, weight_sync_pump
from replay.ledger import TERMINAL, GroupRecord, GroupState, LedgerStatistics, PromptLedger, PromptLedgerStatistics
from replay.storage import RowStorage, StorageStatistics, row_keys
from samplers.staleness import SamplerStatistics
from single_controller import elastic
from single_controller.channels import Channel
from single_controller.checkpoint import (
    CheckpointInfo,
    commit_checkpoint,
    config_fingerprint,
    latest_checkpoint,
    stage_checkpoint,
    tree_bytes,
)
from single_controller.config.schema import CapacityConfigError, Config, check_capacity  # noqa: F401  (re-exported)
from single_controller.deadlines import within
from single_controller.device_turns import DeviceTurns
from single_controller.errors import error_text
from single_controller.protocols import Checkpointable
from single_controller.state import ElasticStatistics, PumpStatistics, RunState, SyncRecord, Workers
from single_controller.types import Prompt, WeightsHandle


class RunFailed(RuntimeError):
    """A pump failed; `pump` names it and `__cause__` is its error. `also`: other pumps that failed
    together with it (not cancelled by it), each with its error. Every error is named in the message,
    exception groups as each of their errors (`errors.error_text`)."""

    def __init__(
        self,
        pump: str,
        cause: BaseException,
        checkpoint: CheckpointInfo | None = None,
        also: Sequence[tuple[str, BaseException]] = (),
    ):
        super().__init__(f"{pump} pump failed: {failure_text(cause, also)}")
        self.pump = pump
        self.checkpoint = checkpoint  # the newest checkpoint to resume from, if any
        self.also = tuple(also)


def failure_text(cause: BaseException, also: Sequence[tuple[str, BaseException]] = ()) -> str:
    """A failed run's errors in one paragraph: the failing pump's, then those of the pumps that
    failed together with it."""
    return error_text(cause) + "".join(f"; the {pump} pump failed too: {error_text(e)}" for pump, e in also)


@dataclass(frozen=True)
class ControllerStatistics:
    t: float  # controller clock when taken
    policy_version: int
    trainer_version: int
    admission_open: bool
    stopping: bool
    pumps: dict[str, PumpStatistics]
    ledger: LedgerStatistics
    prompts: PromptLedgerStatistics
    sampler: SamplerStatistics
    storage: StorageStatistics
    sync: SyncRecord
    zero_variance_groups: int
    aborted_steps: int
    step_retries: int
    steps: int
    tokens_generated: int
    tokens_trained: int
    last_step_s: float
    last_reward_mean: float
    last_success_rate: float
    generation_workers: int = 0
    generation_workers_down: int = 0  # dead or restarting: out of routing
    generation_workers_active: int = 0  # routable: neither down nor shrunk
    elastic: ElasticStatistics = field(default_factory=lambda: ElasticStatistics(0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0, 0, 0))
    worker_deaths: int = 0
    worker_restarts: int = 0
    reward_failed: int = 0  # groups dropped because their reward function failed
    env_failed: int = 0  # groups dropped because their environment failed (multi-turn)
    context_full: int = 0  # groups dropped because an episode had no room for a policy token (multi-turn)
    env_totals: dict[str, float] = field(default_factory=dict)  # sums of the trained episodes' `episode_stats`
    late_finishes: int = 0
    storage_retries: int = 0
    checkpoints_written: int = 0
    last_checkpoint_s: float = 0.0
    # Latest measured training-inference mismatch (`train/mismatch_*` of the last step that had
    # tokens sampled with its own weights; empty before the first) and its configured bound.
    mismatch: dict[str, float] = field(default_factory=dict)
    mismatch_kl_bound: float = 0.0
    # The last step's loss and completion statistics (`ALGORITHM_METRICS` of its record; empty before the first).
    algorithm: dict[str, float] = field(default_factory=dict)
    eval: EvalStatistics | None = None  # None when eval is off


@dataclass(frozen=True)
class RunSummary:
    steps: int
    stop_reason: str
    wall_s: float
    history: list[dict]
    checkpoint: CheckpointInfo | None = None  # the newest checkpoint written, if any


HISTORY_KEPT = 1000
# Before a run has written or loaded a checkpoint, its size is guessed from the published weights':
# parameters, a master copy and two optimizer moments, each up to twice as wide as the snapshot's
# dtype. A generous guess: the deadline only has to catch a write that hangs, never a big model's.
CHECKPOINT_BYTES_PER_WEIGHT_BYTE = 8


# What an operator watches of the algorithm, the last step's value of each (Prometheus gauges, the dashboard).
ALGORITHM_METRICS = {
    "rollout/completion_len_mean": "Mean completion length (tokens) of the last step's rows.",
    "rollout/completion_len_max": "Longest completion (tokens) of the last step's rows.",
    "rollout/truncated_rate": "Share of the last step's completions cut at max_new_tokens (or env.max_turns).",
    "rollout/advantage_std": "Std of the last step's advantages (0: no learning signal).",
    "train/entropy": "Mean policy entropy over the last step's trained tokens (nats).",
    "train/clip_frac_low": "Share of the last step's tokens where the lower clip bound bound the objective.",
    "train/clip_frac_high": "Share of the last step's tokens where the upper clip bound bound the objective.",
    "train/is_weight_max": "Largest importance ratio pi_old / pi_gen of the last step (before truncation or mask).",
    "train/is_truncated_frac": "Share of the last step's tokens whose importance weight was truncated.",
    "train/is_masked_frac": "Share of the last step's valid tokens a mask correction dropped.",
    "train/kl": "Mean KL to the reference policy of the last step (the penalty's estimator; with train.kl_coef).",
}


def completion_records(groups: Sequence[GroupRecord]) -> dict[str, float]:
    """A step's completions: their lengths (mean, min, max; tokens generated, the stop token
    included), the share cut short (`GenerationResult.truncated`), and their advantages' mean and std."""
    lengths = [n for g in groups for n in g.response_lengths]
    advantages = [a for g in groups for a in g.advantages]
    if not lengths:
        return {}
    n_adv = max(len(advantages), 1)
    mean_adv = math.fsum(advantages) / n_adv
    return {
        "rollout/completion_len_mean": sum(lengths) / len(lengths),
        "rollout/completion_len_min": float(min(lengths)),
        "rollout/completion_len_max": float(max(lengths)),
        "rollout/truncated_rate": sum(t for g in groups for t in g.truncated) / len(lengths),
        "rollout/advantage_mean": mean_adv,
        "rollout/advantage_std": math.sqrt(
            math.fsum((a - mean_adv) ** 2 for a in advantages) / max(len(advantages), 1)
        ),
    }


def _latency_max(groups: Sequence[GroupRecord]) -> float:
    """Dispatch to commit of the slowest of `groups`: its queue in the worker and its own work."""
    return max(((g.t_committed or g.t_reserved) - g.t_reserved for g in groups), default=0.0)


def _prompt_ledger(resume: dict | None, history: str | None, whole: Mapping[str, Prompt] | None) -> PromptLedger:
    """A new prompt ledger, or a resume's: the saved one (its history file cut back to the checkpoint)."""
    if resume is None:
        return PromptLedger(history)
    return PromptLedger.from_dict(resume["prompts"], history, prompts=whole)


class Controller:
    _rolled_back: tuple[str, ...] = ()  # a resumed run: the attempts live at its checkpoint's cut
    _loaded_bytes: int | None = None  # a resumed run: the size of the checkpoint it loaded (`run`)

    def __init__(
        self,
        cfg: Config,
        dataloader: Iterator[Prompt],
        storage: RowStorage,
        workers: Workers,
        *,
        stop_token_ids: tuple[int, ...] = (),
        on_step: Callable[[dict], None] | None = None,
        clock: Callable[[], float] | None = None,
        run_dir: str | None = None,
        resume: dict | None = None,
        dataloader_state: Callable[[], dict] | None = None,
        eval_prompts: Sequence[Prompt] = (),
        on_eval: Callable[[dict], None] | None = None,
        prompt_history: str | None = None,
        resumed_prompts: Mapping[str, Prompt] | None = None,  # the unsettled prompts whole (`PromptStream.resolve`)
        wall_offset_s: float = 0.0,  # the run's `time/wall_s` as it starts (a resume goes on from it)
    ):
        check_capacity(cfg)
        if cfg.eval.enabled and not eval_prompts:
            raise ValueError("eval.enabled is true but no eval prompts were given")
        kwargs = {"clock": clock} if clock is not None else {}
        first_step = resume["step"] if resume is not None else 0
        self.cfg = cfg
        prompts = _prompt_ledger(resume, prompt_history, resumed_prompts)
        self.state = RunState(cfg, dataloader, storage, workers, first_step=first_step, prompts=prompts, **kwargs)
        self.stop_token_ids = stop_token_ids
        self.on_step = on_step
        # The last HISTORY_KEPT step records (every record also goes to `on_step`, which streams it
        # to metrics.jsonl): the controller's memory stays flat over a long run.
        self.history: collections.deque[dict] = collections.deque(maxlen=HISTORY_KEPT)
        self._mismatch: dict[str, float] = {}
        self._algorithm: dict[str, float] = {}
        self._success: collections.deque[float] = collections.deque(maxlen=cfg.run.success_window)
        self._tokens_trained = 0
        self._env_totals: dict[str, float] = {}  # multi-turn: sums of the trained episodes' stats
        self._last_controller_bytes = 0
        self._t0 = self._last_step_end = self.state.clock()
        self._wall_offset_s = wall_offset_s
        self._last_wait: dict[str, float] = {}
        self.run_dir = run_dir
        self._dataloader_state = dataloader_state
        self.last_checkpoint: CheckpointInfo | None = None  # the newest durable one
        self._committing: asyncio.Task[CheckpointInfo] | None = None  # a periodic one, being committed
        self._last_checkpoint_t = self._t0
        self._last_checkpoint_step = first_step if resume is not None else None
        self._records_unwritten_from: int | None = None  # `records_written`; None: nobody confirms
        self._hook_checkpoints()
        self._resumed = resume is not None
        if resume is not None:
            self._restore(resume)
        self.turns = DeviceTurns.of_run(self.state)  # colocated in turns: the device to training and back
        # Beside the pumps, in their TaskGroup (a failure ends the run as a pump's does): name -> a coroutine
        # function of the run state, returning once training is done (a pool member's: `pool/link.py`).
        self.companions: dict[str, Callable[[RunState], Coroutine[Any, Any, None]]] = {}
        self.eval_prompts = tuple(eval_prompts)
        self.on_eval = on_eval
        self.eval_history: list[dict] = []
        self.eval_tracker = EvalTracker(cfg.eval.num_samples) if cfg.eval.enabled else None

    def _hook_checkpoints(self) -> None:
        """Periodic checkpoints, where the run has a directory and its trainer can write one."""
        if self.run_dir is not None and isinstance(self.state.workers.trainer, Checkpointable):
            self.state.hooks.after_step = self._periodic_checkpoint
            self.state.hooks.checkpoint_due = self._checkpoint_due

    async def run(self) -> RunSummary:
        """Setup, the pumps, teardown."""
        st = self.state
        self._t0 = self._last_step_end = self._last_checkpoint_t = st.clock()
        weights: Channel[WeightsHandle] = Channel(capacity=1)
        tasks: dict[str, asyncio.Task] = {}
        if self._resumed:
            run_dir = self.run_dir
            assert run_dir is not None  # a resume continues a run directory
            self._loaded_bytes = await asyncio.to_thread(lambda: tree_bytes(latest_checkpoint(run_dir)))
            await self._clear_rows_left()
            await self._sync_resumed_weights()
        else:  # the workers hold the trainer's initial weights (their backend loaded them at setup)
            v = st.versions.trained
            st.versions.latest_weights = await within(
                st.workers.trainer.export_weights(v), self.cfg.timeouts.weight_sync_s, f"trainer.export_weights(v{v})"
            )
        st.versions.published = st.versions.latest_weights
        st.notify()  # (a pool member registers once there are weights to expand workers with)
        # Everything alive now (imported modules, torch's above all) is set aside from the cyclic
        # collector for the run: each full collection would walk it again (docs/performance.md).
        # Given back at the end, so nothing is kept alive for good.
        gc.freeze()
        try:
            async with asyncio.TaskGroup() as pumps:
                tasks["rollout"] = pumps.create_task(rollout_pump(st, stop_token_ids=self.stop_token_ids))
                passes = [RewardKlPass(st)] if self.cfg.reward.kl_coef > 0 else []
                tasks["advantage"] = pumps.create_task(advantage_pump(st, passes))
                tasks["train"] = pumps.create_task(train_pump(st, weights, self._record_step))
                tasks["weight_sync"] = pumps.create_task(weight_sync_pump(st, weights))
                tasks["prefetch"] = pumps.create_task(prefetch_pump(st))
                for name, companion in self.companions.items():
                    tasks[name] = pumps.create_task(companion(st))
                if self.eval_tracker is not None:
                    tasks["eval"] = pumps.create_task(
                        eval_pump(
                            st,
                            self.eval_prompts,
                            self.eval_tracker,
                            self._record_eval,
                            stop_token_ids=self.stop_token_ids,
                        )
                    )
        except BaseException as e:
            gc.unfreeze()
            await self._end(failed=True)
            if isinstance(e, BaseExceptionGroup) and e.subgroup(Exception) is not None:
                (pump, cause), *also = _pump_errors(e, tasks)
                raise RunFailed(pump, cause, self.last_checkpoint, also) from cause
            raise
        gc.unfreeze()
        await self._end(failed=False)
        return RunSummary(
            st.versions.trained,
            st.stop.reason or "finished",
            st.clock() - self._t0,
            list(self.history),
            self.last_checkpoint,
        )

    # -- elastic generation ------------------------------------------------------------------
    async def shrink_generation(self, name: str, level: int | None = None, mode: str | None = None) -> None:
        """Take generation worker `name` out of the run (out of routing, its groups in flight aborted or
        drained (`mode`, by default `rollout.shrink`), then asleep at `level`, by default
        `rollout.sleep_level`); see `single_controller/elastic.py`. Call it on the controller's loop
        while the run goes on; idempotent."""
        await elastic.shrink(self.state, name, self.cfg.rollout.sleep_level if level is None else level, mode)

    async def expand_generation(self, name: str) -> None:
        """Bring a shrunk generation worker back: woken, the published weights applied and checked,
        then routed to again; `elastic.ExpandFailed` leaves it out. Idempotent."""
        await elastic.expand(self.state, name)

    # -- checkpoints ---------------------------------------------------------------------------
    def checkpoint_state(self) -> dict:
        """The controller's side of a checkpoint at the cut `versions.trained` (between steps).
        Attempts not trained by the cut are rolled back: their prompts will be re-dispatched."""
        st = self.state
        live = {g.group_id for g in st.ledger.active_records() if g.state not in TERMINAL}
        prompts = st.prompts.checkpoint_dict()
        rolled_back: list[str] = []
        for p in prompts["prompts"]:
            if p["fate"] is None:
                rolled_back += [a for a in p["attempts"] if a in live]
                p["attempts"] = [a for a in p["attempts"] if a not in live]
        return {
            "step": st.versions.trained,
            "prompts": prompts,
            "rolled_back": rolled_back,
            "dataloader": {"taken": len(st.prompts), **(self._dataloader_state() if self._dataloader_state else {})},
            # the step records the driver may not have written yet: it writes metrics.jsonl behind the
            # controller, so a crash can lose the last ones, which a resume does not train again
            "records": [dict(r) for r in self.history if r["step"] >= self._records_kept_from()],
            "success_window": list(self._success),
            "counters": {
                "zero_variance_groups": st.counters.zero_variance_groups,
                "tokens_generated": st.counters.tokens_generated,
                "tokens_trained": self._tokens_trained,
                "aborted_steps": st.counters.aborted_steps,
                "step_retries": st.counters.step_retries,
                "reward_failed": st.counters.reward_failed,
                "env_failed": st.counters.env_failed,
                "context_full": st.counters.context_full,
                "env_totals": dict(self._env_totals),
            },
            "config": config_fingerprint(self.cfg),
        }

    def _restore(self, saved: dict) -> None:
        st = self.state
        unsettled = sorted((r for r in st.prompts.records() if r.fate is None), key=lambda r: r.order)
        st.pending_prompts.extend(r.prompt for r in unsettled)  # re-dispatched before fresh prompts
        self._rolled_back = tuple(saved["rolled_back"])
        self._success.extend(saved["success_window"])
        c = saved["counters"]
        st.counters.zero_variance_groups, st.counters.tokens_generated = (
            c["zero_variance_groups"],
            c["tokens_generated"],
        )
        st.counters.aborted_steps, st.counters.step_retries = c["aborted_steps"], c["step_retries"]
        st.counters.reward_failed = c.get("reward_failed", 0)  # absent from checkpoints older than it
        st.counters.env_failed = c.get("env_failed", 0)
        st.counters.context_full = c.get("context_full", 0)
        self._env_totals = dict(c.get("env_totals", {}))
        self._tokens_trained = c["tokens_trained"]

    async def _clear_rows_left(self) -> None:
        """Before a resumed run's first rollout: clear every row in its storage. At the cut no group
        is resident, so each one is the crashed run's: an attempt rolled back at the cut, or one made
        after it (a retry, a prompt taken after the cut, a step the resume does not reach). The
        rolled-back attempts' keys are cleared even when the listing lacks them (a put the crash cut
        short may be registered without the tags a listing reads)."""
        st, cfg = self.state, self.cfg
        listed = await within(st.storage.resident_keys(), cfg.timeouts.storage_s, "storage listing at resume")
        keys = sorted(listed.union(*(row_keys(g, cfg.rollout.group_size) for g in self._rolled_back)))
        if keys:
            await within(
                st.storage.clear_rows(keys),
                cfg.timeouts.storage_s,
                f"storage clear at resume ({len(keys)} rows left by the run before it)",
            )

    async def _sync_resumed_weights(self) -> None:
        """A resumed run starts from the checkpoint's policy: every routable generation worker gets the
        trainer's weights (version = the cut) before the first rollout, as in a weight sync (one that
        fails it is down, and restarted with them). A shrunk one (asleep, in a pool) gets them at its
        expand: they are the published weights from now on."""
        st, cfg = self.state, self.cfg
        v = st.versions.trained
        handle = await within(
            st.workers.trainer.export_weights(v), cfg.timeouts.weight_sync_s, f"trainer.export_weights(v{v}) (resume)"
        )
        st.versions.latest_weights = handle  # what a worker restarted from now on applies
        async with asyncio.TaskGroup() as fanout:
            for w in st.routable():
                fanout.create_task(update_worker(st, w, handle, " (resume)"))

    def records_written(self, before_step: int) -> None:
        """The consumer of `on_step` (the driver, writing metrics.jsonl) has durably written the
        records of every step before `before_step`: a checkpoint keeps the step records from the first
        one it has not, however many checkpoints ago that was (at most the last HISTORY_KEPT). Never
        called: a checkpoint keeps the records since the previous one."""
        self._records_unwritten_from = max(self._records_unwritten_from or 0, before_step)

    def _records_kept_from(self) -> int:
        since_checkpoint = self._last_checkpoint_step or 0
        if self._records_unwritten_from is None:
            return since_checkpoint
        return min(since_checkpoint, self._records_unwritten_from)

    def _checkpoint_due(self, version: int) -> bool:
        c, st = self.cfg.checkpoint, self.state
        by_step = c.every_steps > 0 and version % c.every_steps == 0
        by_time = c.every_s > 0 and st.clock() - self._last_checkpoint_t >= c.every_s
        return (by_step or by_time) and version != self._last_checkpoint_step

    async def _periodic_checkpoint(self) -> None:
        st = self.state
        # A next step already open (sent behind the finish, when no checkpoint was due then; the
        # time-based one may have come due since): the checkpoint waits for the next step boundary.
        if self._checkpoint_due(st.versions.trained) and not st.ledger.count(GroupState.SELECTED):
            await self.checkpoint(durable=False)

    async def checkpoint(self, *, durable: bool = True) -> CheckpointInfo | None:
        """Write a checkpoint now (between steps) and return it once it is durable and `latest`.
        `durable=False` (the periodic ones) returns once its cut is saved (`stage_checkpoint`): the
        fsyncs, the rename and `latest` run in the background while training goes on (on a slow
        disk they stalled the step), and the next checkpoint or the run's end waits
        for them and raises their error, if any."""
        st = self.state
        trainer = st.workers.trainer
        # (only called with both: `__init__` sets the checkpoint hook only then)
        assert self.run_dir is not None and isinstance(trainer, Checkpointable), "no run directory or trainer state"
        await self._checkpoint_committed()
        step = st.versions.trained
        staged = await within(
            stage_checkpoint(
                self.run_dir,
                step,
                self.checkpoint_state(),
                trainer.save_state,
                keep=self.cfg.checkpoint.keep,
                clock=st.clock,
            ),
            self._checkpoint_deadline(),
            f"checkpoint of step {step}",
        )
        self._last_checkpoint_t, self._last_checkpoint_step = st.clock(), step
        self._committing = asyncio.ensure_future(commit_checkpoint(staged, st.clock))
        return await self._checkpoint_committed() if durable else None

    def _checkpoint_deadline(self) -> float:
        """`timeouts.checkpoint_s`, plus `checkpoint_s_per_gib` per GiB of the newest checkpoint
        written, else of the one a resume loaded, else of the guess from the published weights
        (`CHECKPOINT_BYTES_PER_WEIGHT_BYTE`): the first checkpoint of a big model is no quicker."""
        t = self.cfg.timeouts
        weights = self.state.versions.latest_weights
        if self.last_checkpoint is not None:
            size = self.last_checkpoint.num_bytes
        elif self._loaded_bytes is not None:
            size = self._loaded_bytes
        else:
            size = CHECKPOINT_BYTES_PER_WEIGHT_BYTE * weights.num_bytes if weights is not None else 0
        return t.checkpoint_s + t.checkpoint_s_per_gib * size / 2**30

    async def _checkpoint_committed(self) -> CheckpointInfo | None:
        """Wait for the checkpoint being committed in the background, if any (None: there is none)."""
        task = self._committing
        if task is None:
            return None
        try:
            info = await within(
                asyncio.shield(task), self._checkpoint_deadline(), "checkpoint commit (fsync, rename, latest)"
            )
        finally:
            if task.done():
                self._committing = None
        st = self.state
        self.last_checkpoint = info
        st.counters.checkpoints_written += 1
        st.counters.last_checkpoint_s = info.write_s
        return info

    async def _end(self, *, failed: bool) -> None:
        """The run's end, whatever ended it: where the trainer stands, the final checkpoint, teardown."""
        in_step = await self._settle_open_step(failed=failed)
        await self._final_checkpoint(failed=failed, in_step=in_step)
        await self._teardown(failed=failed)

    async def _settle_open_step(self, *, failed: bool) -> bool:
        """With a step's groups still selected at the run's end, ask the trainer where it stands (a
        remote call outlives the pump that stopped waiting for it): a finish that landed is the step
        trained (`record_landed_finish`: its groups, its prompts, its step record); a step still
        open is aborted. Returns whether the trainer stands at the controller's step with none open
        (a checkpoint of the cut is consistent); with no step's groups selected it is not asked."""
        st, t = self.state, self.cfg.timeouts.train_call_s
        if not st.ledger.count(GroupState.SELECTED):
            return True
        trainer, step = st.workers.trainer, st.versions.trained
        try:
            status = await within(trainer.train_status(), t, f"trainer.train_status (the run ends in step {step})")
            if status.open_step is not None:
                what = f"trainer.abort_train_step({status.open_step}) (the run ends)"
                await within(trainer.abort_train_step(status.open_step), t, what)
            if status.last_finished == step and status.next_step == step + 1:
                what = f"trainer.finish_train_step({step}) (its recorded result: it landed as the run ended)"
                result = await within(trainer.finish_train_step(step), t, what)
                self._record_step(record_landed_finish(st, step, result))
                st.counters.late_finishes += 1
        except Exception as e:
            if not failed:
                raise
            st.teardown_errors.append(f"where the trainer stands at the end: {type(e).__name__}: {e}")
            return False
        if status.next_step != st.versions.trained:
            where = (
                f"at the run's end the trainer is at step {status.next_step}, the controller at {st.versions.trained}"
            )
            if not failed:
                raise RuntimeError(where)
            st.teardown_errors.append(f"{where}: no final checkpoint")
            return False
        return True

    async def _final_checkpoint(self, *, failed: bool, in_step: bool) -> None:
        """At the end of the run, before teardown settles anything: checkpoint the cut, when the
        trainer stands `in_step` with the controller (`_settle_open_step`). Otherwise, or with a
        trainer that no longer answers, the newest checkpoint stays the last one written."""
        st = self.state
        try:
            await self._checkpoint_committed()  # a periodic one still being committed
        except Exception as e:
            if not failed:
                raise
            st.teardown_errors.append(f"checkpoint of step {self._last_checkpoint_step}: {type(e).__name__}: {e}")
        if self.state.hooks.after_step is None or not self.cfg.checkpoint.at_exit or not in_step:
            return
        if st.versions.trained == self._last_checkpoint_step:
            return
        try:
            await self.checkpoint()
        except Exception as e:
            if not failed:
                raise
            st.teardown_errors.append(f"final checkpoint: {type(e).__name__}: {e}")

    # -- per-step record ---------------------------------------------------------------------
    def _record_step(self, report: StepReport) -> None:
        st, cfg = self.state, self.cfg
        rewards = [r for g in report.groups for r in g.rewards]
        success = sum(r >= cfg.task.success_reward for r in rewards) / max(1, len(rewards))
        stale = [st.sampler.staleness(g, report.step) for g in report.groups]
        gen_tokens = sum(sum(g.response_lengths) for g in report.groups)
        seq_tokens = sum(sum(g.seq_lengths) for g in report.groups)
        self._tokens_trained += seq_tokens
        step_s = report.t_end - self._last_step_end
        self._last_step_end = report.t_end
        self._success.append(success)
        rec = {
            "step": report.step,
            # the run's clock, also in the records a checkpoint keeps for a later resume to recover
            "time/wall_s": self._wall_offset_s + report.t_end - self._t0,
            "time/step_s": step_s,
            "rollout/reward_mean": sum(rewards) / max(1, len(rewards)),
            "rollout/success_rate": success,
            "rollout/groups": len(report.groups),
            "rollout/group_latency_max_s": _latency_max(report.groups),
            "train/staleness_mean": sum(stale) / max(1, len(stale)),
            "train/staleness_max": max(stale, default=0),
            "train/chunks": report.chunks,
            "train/retries": report.retries,
            "throughput/train_tokens_per_s": seq_tokens / step_s if step_s > 0 else 0.0,
            "throughput/gen_tokens_per_s": gen_tokens / step_s if step_s > 0 else 0.0,
            "replay/resident_groups": st.ledger.resident(),
            "sync/policy_version": st.versions.served,
            "sync/last_s": st.sync.last_s,
            "sync/admission_closed_s": st.sync.last_closed_s,
            "rollout/worker_deaths": st.counters.worker_deaths,
            "rollout/worker_restarts": st.counters.worker_restarts,
            "rollout/reward_failed": st.counters.reward_failed,
        }
        rec.update(elastic.step_record(st))
        if self.turns is not None:
            rec.update(self.turns.record.step_record())
        rec.update({k: float(v) for k, v in report.result.metrics.items()})
        rec.update(completion_records(report.groups))
        self._add_rewards(rec, report)
        self._add_moved_bytes(rec)
        now = st.clock()
        for name, clk in st.pumps.items():
            total = clk.total_wait_s(now)
            rec[f"pump/{name}_wait_s"] = total - self._last_wait.get(name, 0.0)
            self._last_wait[name] = total
        self.history.append(rec)
        if "train/mismatch_kl" in rec:
            self._mismatch = {k: rec[k] for k in ("train/mismatch_kl", "train/mismatch_abs_logprob") if k in rec}
        self._algorithm = {k: float(rec[k]) for k in ALGORITHM_METRICS if k in rec}
        if self.on_step is not None:
            self.on_step(rec)
        target = cfg.run.stop_at_success_rate
        if (
            target is not None
            and len(self._success) == self._success.maxlen
            and sum(self._success) / len(self._success) >= target
        ):
            st.request_stop(f"success rate >= {target} over {len(self._success)} steps")

    def _add_moved_bytes(self, rec: dict) -> None:
        """The bytes the controller moved through storage this step, and their share of what the
        trainers read."""
        moved = self.state.storage.statistics()
        moved_bytes = moved.bytes_put + moved.bytes_read
        rec["replay/controller_bytes"] = moved_bytes - self._last_controller_bytes
        self._last_controller_bytes = moved_bytes
        if rec.get("train/bytes_read"):
            rec["replay/controller_bytes_ratio"] = rec["replay/controller_bytes"] / rec["train/bytes_read"]

    def _add_rewards(self, rec: dict, report: StepReport) -> None:
        """Each reward function's mean over the step's groups (`reward/<name>/mean`, with
        `reward.functions`); every `run.sample_every_steps` steps one trained completion as text
        (`sample`: prompt, completion, reward), for the loggers."""
        rec.update(reward_part_means((g.reward_parts for g in report.groups), ""))
        rec.update(self._shaping_records(report))
        rec.update(self._episode_records(report))
        every = self.cfg.run.sample_every_steps
        if every and report.step % every == 0:
            sample = next((g.sample for g in report.groups if g.sample is not None), None)
            if sample is not None:
                prompt, completion, reward = sample
                rec["sample"] = {"prompt": prompt, "completion": completion, "reward": reward}

    def _shaping_records(self, report: StepReport) -> dict[str, float]:
        """What shaped the step's rewards before advantages: DAPO's overlong punishment
        (`reward/overlong_penalty_mean`) and the KL penalty (`reward/kl_mean`, per row, and
        `reward/kl_penalty_mean`); nothing when neither is on."""
        r, groups, out = self.cfg.reward, report.groups, {}
        n = max(sum(len(g.rewards) for g in groups), 1)
        if r.kl_coef:
            out["reward/kl_mean"] = math.fsum(kl for g in groups for kl in g.reward_kl) / n
            out["reward/kl_penalty_mean"] = -r.kl_coef * out["reward/kl_mean"]
        if r.overlong_buffer:
            shaping = math.fsum(s - x for g in groups for s, x in zip(shaped_rewards(g, self.cfg), g.rewards))
            out["reward/overlong_penalty_mean"] = shaping / n - out.get("reward/kl_penalty_mean", 0.0)
        return out

    def _episode_records(self, report: StepReport) -> dict[str, float]:
        """Multi-turn (`env`): the step's episodes, per episode (turns, tool calls, tokens), per
        environment step (latency), and the run's `env_failed` and `context_full` groups; nothing for
        single-turn runs."""
        sums: dict[str, float] = {}
        for g in report.groups:
            for k, v in g.episode_stats.items():
                sums[k] = sums.get(k, 0.0) + v
        if not sums.get("episodes"):
            return {}
        for k, v in sums.items():
            self._env_totals[k] = self._env_totals.get(k, 0.0) + v
        n, turns = sums["episodes"], sums.get("turns", 0.0)
        return {
            "env/turns_per_episode": turns / n,
            "env/tool_calls_per_episode": sums.get("tool_calls", 0.0) / n,
            "env/step_latency_s": sums.get("env_s", 0.0) / max(turns, 1.0),
            "env/policy_tokens_per_episode": sums.get("policy_tokens", 0.0) / n,
            "env/observation_tokens_per_episode": sums.get("observation_tokens", 0.0) / n,
            "env/truncated_rate": sums.get("truncated", 0.0) / n,
            "env/retries": sums.get("retries", 0.0),
            "env/failed_groups": float(self.state.counters.env_failed),
            "env/context_full_groups": float(self.state.counters.context_full),
        }

    def _record_eval(self, point: EvalPoint) -> None:
        rec = {
            "eval/policy_version": point.version,
            **point.metrics,
            "eval/seconds": point.seconds,
            "eval/reissued": point.reissued,
            "eval/failures": point.failures,
            "eval/trainer_version": self.state.versions.trained,
            "time/wall_s": self._wall_offset_s + point.t_end - self._t0,
        }
        self.eval_history.append(rec)
        if self.on_eval is not None:
            self.on_eval(rec)

    # -- teardown ----------------------------------------------------------------------------
    async def _teardown(self, *, failed: bool) -> None:
        st = self.state
        reason = "run_failed" if failed else "run_ended"
        if failed and st.ledger.count(GroupState.SELECTED):
            try:  # the step is open on the trainer: leave its state as it was before begin
                step = st.versions.trained  # the open step is always the next one
                await within(
                    st.workers.trainer.abort_train_step(step),
                    self.cfg.timeouts.train_call_s,
                    f"trainer.abort_train_step({step}) (teardown)",
                )
            except Exception as e:  # the run already failed; keep its cause, note this one
                st.teardown_errors.append(f"abort_train_step: {e}")
        active = list(st.ledger.active_records())
        if active:
            keys = [k for g in active for k in g.keys]
            try:
                await within(st.storage.clear_rows(keys), self.cfg.timeouts.storage_s, "storage clear at teardown")
            except Exception as e:
                st.teardown_errors.append(f"clear_rows: {e}")
                if not failed:
                    raise
            else:
                for g in active:
                    if g.state not in TERMINAL:
                        st.ledger.drop(g.group_id, reason)
                    st.ledger.release(g.group_id)
        if st.stop.abandon_open_step and not failed and self.last_checkpoint is not None:
            return  # an interrupt: what was not trained is the checkpoint's, for the resume (not run_ended)
        for pid in st.prompts.unsettled():
            st.prompts.settle(pid, "dropped", reason=reason)

    # -- statistics --------------------------------------------------------------------------
    def statistics(self) -> ControllerStatistics:
        st = self.state
        now = st.clock()
        last = self.history[-1] if self.history else {}
        return ControllerStatistics(
            t=now,
            policy_version=st.versions.served,
            trainer_version=st.versions.trained,
            admission_open=st.admission_open,
            stopping=st.stop.requested,
            pumps={n: c.statistics(now) for n, c in st.pumps.items()},
            ledger=st.ledger.statistics(),
            prompts=st.prompts.statistics(),
            sampler=st.sampler.statistics(),
            storage=st.storage.statistics(),
            sync=SyncRecord(**vars(st.sync)),
            zero_variance_groups=st.counters.zero_variance_groups,
            aborted_steps=st.counters.aborted_steps,
            step_retries=st.counters.step_retries,
            steps=st.versions.trained,
            tokens_generated=st.counters.tokens_generated,
            tokens_trained=self._tokens_trained,
            last_step_s=last.get("time/step_s", 0.0),
            last_reward_mean=last.get("rollout/reward_mean", 0.0),
            last_success_rate=last.get("rollout/success_rate", 0.0),
            generation_workers=len(st.workers.generators),
            generation_workers_down=len(st.health.down),
            generation_workers_active=st.routable_count(),
            elastic=st.elastic.statistics(),
            worker_deaths=st.counters.worker_deaths,
            worker_restarts=st.counters.worker_restarts,
            reward_failed=st.counters.reward_failed,
            env_failed=st.counters.env_failed,
            context_full=st.counters.context_full,
            env_totals=dict(self._env_totals),
            late_finishes=st.counters.late_finishes,
            storage_retries=st.counters.storage_retries,
            checkpoints_written=st.counters.checkpoints_written,
            last_checkpoint_s=st.counters.last_checkpoint_s,
            mismatch=dict(self._mismatch),
            algorithm=dict(self._algorithm),
            mismatch_kl_bound=self.cfg.metrics.mismatch_kl_bound,
            eval=self.eval_tracker.statistics() if self.eval_tracker is not None else None,
        )

    def select_latency_percentiles(self) -> tuple[float, float]:
        lat = sorted(self.state.counters.select_latency_s)
        if not lat:
            return float("nan"), float("nan")
        return pystats.median(lat), lat[min(len(lat) - 1, int(0.99 * len(lat)))]


def _pump_errors(group: BaseExceptionGroup, tasks: dict[str, asyncio.Task]) -> list[tuple[str, BaseException]]:
    """The pumps whose own error stopped the run (the others were cancelled by the TaskGroup), in
    the order they were started, each with its error; never empty."""
    failed = []
    for name, task in tasks.items():
        if task.done() and not task.cancelled() and (exc := task.exception()) is not None:
            while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
                exc = exc.exceptions[0]  # a pump's own child TaskGroup wraps its child's error
            failed.append((name, exc))
    return failed or [("unknown", group.exceptions[0])]
