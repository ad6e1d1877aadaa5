"""The single controller: setup, the pumps in one TaskGroup (eval too when `eval.enabled`), teardown.

`Controller` is constructible in-process (tests, the simulated backend, benchmarks) and is also
what the CPU-only Ray actor `ControllerActor` (see `single_controller.launch`) runs. It never
touches bulk tensors: it moves keys, lengths, rewards and advantages; workers read and write rows.

A failing pump cancels its siblings and `run()` raises `RunFailed` naming the pump and its cause.
Teardown always runs: an open train step is aborted, resident rows are cleared (no key is left in
storage), and every prompt taken from the dataloader without a fate is settled `dropped`.
"""

from __future__ import annotations

import asyncio
import collections
import statistics as pystats
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from pumps.advantage import advantage_pump
from pumps.eval import EvalPoint, EvalStatistics, EvalTracker, eval_pump
from pumps.rollout import rollout_pump
from pumps.train import StepReport, prefetch_pump, train_pump
from pumps.weight_sync import weight_sync_pump
from replay.ledger import TERMINAL, GroupState, LedgerStatistics, PromptLedgerStatistics
from replay.storage import RowStorage, StorageStatistics, row_keys
from samplers.staleness import SamplerStatistics
from single_controller.channels import Channel
from single_controller.config import Config, required_capacity, resolved_capacity
from single_controller.deadlines import within
from single_controller.state import PumpStatistics, RunState, SyncRecord, Workers
from single_controller.types import Prompt, WeightsHandle


class CapacityConfigError(ValueError):
    """The buffer capacity cannot hold what the lookahead admits: the run would deadlock."""


class RunFailed(RuntimeError):
    """A pump failed; `pump` names it and `__cause__` is its error."""

    def __init__(self, pump: str, cause: BaseException):
        super().__init__(f"{pump} pump failed: {type(cause).__name__}: {cause}")
        self.pump = pump


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
    eval: EvalStatistics | None = None  # None when eval is off


@dataclass(frozen=True)
class RunSummary:
    steps: int
    stop_reason: str
    wall_s: float
    history: list[dict]


def check_capacity(cfg: Config) -> None:
    need, have = required_capacity(cfg), resolved_capacity(cfg)
    if have < need:
        raise CapacityConfigError(
            f"buffer.capacity_groups={have} cannot satisfy sampler.max_lookahead_versions="
            f"{cfg.sampler.max_lookahead_versions} with train.groups_per_step={cfg.train.groups_per_step}: "
            f"(L + 1) * groups_per_step = {need} slots are needed, or a refill for the oldest step "
            f"could wait forever behind groups of later steps"
        )


class Controller:
    def __init__(
        self,
        cfg: Config,
        dataloader: Iterator[Prompt],
        storage: RowStorage,
        workers: Workers,
        *,
        stop_token_id: int | None = None,
        on_step: Callable[[dict], None] | None = None,
        clock: Callable[[], float] | None = None,
        eval_prompts: Sequence[Prompt] = (),
        on_eval: Callable[[dict], None] | None = None,
    ):
        check_capacity(cfg)
        if cfg.eval.enabled and not eval_prompts:
            raise ValueError("eval.enabled is true but no eval prompts were given")
        kwargs = {"clock": clock} if clock is not None else {}
        self.cfg = cfg
        self.state = RunState(cfg, dataloader, storage, workers, **kwargs)
        self.stop_token_id = stop_token_id
        self.on_step = on_step
        self.history: list[dict] = []
        self._success = collections.deque(maxlen=cfg.run.success_window)
        self._tokens_trained = 0
        self._last_controller_bytes = 0
        self._t0 = self.state.clock()
        self._last_wait: dict[str, float] = {}
        self._last_step_end = self._t0
        self.eval_prompts = tuple(eval_prompts)
        self.on_eval = on_eval
        self.eval_history: list[dict] = []
        self.eval_tracker = EvalTracker(cfg.eval.num_samples) if cfg.eval.enabled else None

    async def run(self) -> RunSummary:
        """Setup, the pumps, teardown."""
        st = self.state
        self._t0 = self._last_step_end = st.clock()
        weights: Channel[WeightsHandle] = Channel(capacity=1)
        tasks: dict[str, asyncio.Task] = {}
        try:
            async with asyncio.TaskGroup() as pumps:
                tasks["rollout"] = pumps.create_task(rollout_pump(st, stop_token_id=self.stop_token_id))
                tasks["advantage"] = pumps.create_task(advantage_pump(st))
                tasks["train"] = pumps.create_task(train_pump(st, weights, self._record_step))
                tasks["weight_sync"] = pumps.create_task(weight_sync_pump(st, weights))
                tasks["prefetch"] = pumps.create_task(prefetch_pump(st))
                if self.eval_tracker is not None:
                    tasks["eval"] = pumps.create_task(
                        eval_pump(st, self.eval_prompts, self.eval_tracker, self._record_eval, stop_token_id=self.stop_token_id)
                    )
        except BaseException as e:
            await self._teardown(failed=True)
            if isinstance(e, BaseExceptionGroup) and e.subgroup(Exception) is not None:
                pump, cause = _first_pump_error(e, tasks)
                raise RunFailed(pump, cause) from cause
            raise
        await self._teardown(failed=False)
        return RunSummary(st.trainer_version, st.stop_reason or "finished", st.clock() - self._t0, self.history)

    # -- per-step record ---------------------------------------------------------------------
    def _record_step(self, report: StepReport) -> None:
        st, cfg = self.state, self.cfg
        rewards = [r for g in report.groups for r in g.rewards]
        success = sum(r >= cfg.task.success_reward for r in rewards) / max(1, len(rewards))
        stale = [st.sampler.staleness(g, report.step) for g in report.groups]
        gen_tokens = sum(n for g in report.groups for n in g.response_lengths)
        seq_tokens = sum(n for g in report.groups for n in g.seq_lengths())
        self._tokens_trained += seq_tokens
        step_s = report.t_end - self._last_step_end
        self._last_step_end = report.t_end
        self._success.append(success)
        rec = {
            "step": report.step,
            "time/wall_s": report.t_end - self._t0,
            "time/step_s": step_s,
            "rollout/reward_mean": sum(rewards) / max(1, len(rewards)),
            "rollout/success_rate": success,
            "rollout/groups": len(report.groups),
            "train/staleness_mean": sum(stale) / max(1, len(stale)),
            "train/staleness_max": max(stale, default=0),
            "train/chunks": report.chunks,
            "train/retries": report.retries,
            "throughput/train_tokens_per_s": seq_tokens / step_s if step_s > 0 else 0.0,
            "throughput/gen_tokens_per_s": gen_tokens / step_s if step_s > 0 else 0.0,
            "replay/resident_groups": st.ledger.resident(),
            "sync/policy_version": st.policy_version,
            "sync/last_s": st.sync.last_s,
        }
        rec.update({k: float(v) for k, v in report.result.metrics.items()})
        # bytes the controller moved through storage this step vs bytes the trainers read
        moved = st.storage.statistics()
        moved_bytes = moved.bytes_put + moved.bytes_read
        rec["replay/controller_bytes"] = moved_bytes - self._last_controller_bytes
        self._last_controller_bytes = moved_bytes
        if rec.get("train/bytes_read"):
            rec["replay/controller_bytes_ratio"] = rec["replay/controller_bytes"] / rec["train/bytes_read"]
        now = st.clock()
        for name, clk in st.pumps.items():
            total = sum(clk.statistics(now).wait_s_by_reason.values())
            rec[f"pump/{name}_wait_s"] = total - self._last_wait.get(name, 0.0)
            self._last_wait[name] = total
        self.history.append(rec)
        if self.on_step is not None:
            self.on_step(rec)
        target = cfg.run.stop_at_success_rate
        if target is not None and len(self._success) == self._success.maxlen and sum(self._success) / len(self._success) >= target:
            st.request_stop(f"success rate >= {target} over {len(self._success)} steps")

    def _record_eval(self, point: EvalPoint) -> None:
        rec = {
            "eval/policy_version": point.version,
            **point.metrics,
            "eval/seconds": point.seconds,
            "eval/reissued": point.reissued,
            "eval/failures": point.failures,
            "eval/trainer_version": self.state.trainer_version,
            "time/wall_s": point.t_end - self._t0,
        }
        self.eval_history.append(rec)
        if self.on_eval is not None:
            self.on_eval(rec)

    # -- teardown ----------------------------------------------------------------------------
    async def _teardown(self, *, failed: bool) -> None:
        st = self.state
        reason = "run_failed" if failed else "run_ended"
        if failed and any(g.state is GroupState.SELECTED for g in st.ledger.all_records()):
            try:  # the step is open on the trainer: leave its state as it was before begin
                await within(st.workers.trainer.abort_train_step(), self.cfg.timeouts.train_call_s, "trainer.abort_train_step (teardown)")
            except Exception as e:  # the run already failed; keep its cause, note this one
                st.teardown_errors.append(f"abort_train_step: {e}")
        active = [g for g in st.ledger.all_records() if g.resident]
        if active:
            keys = [k for g in active for k in row_keys(g.group_id, self.cfg.rollout.group_size)]
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
        for pid in st.prompts.unsettled():
            st.prompts.settle(pid, "dropped", reason=reason)

    # -- statistics --------------------------------------------------------------------------
    def statistics(self) -> ControllerStatistics:
        st = self.state
        now = st.clock()
        last = self.history[-1] if self.history else {}
        return ControllerStatistics(
            t=now,
            policy_version=st.policy_version,
            trainer_version=st.trainer_version,
            admission_open=st.admission_open,
            stopping=st.stopping,
            pumps={n: c.statistics(now) for n, c in st.pumps.items()},
            ledger=st.ledger.statistics(),
            prompts=st.prompts.statistics(),
            sampler=st.sampler.statistics(),
            storage=st.storage.statistics(),
            sync=SyncRecord(**vars(st.sync)),
            zero_variance_groups=st.zero_variance_groups,
            aborted_steps=st.aborted_steps,
            step_retries=st.step_retries,
            steps=st.trainer_version,
            tokens_generated=st.tokens_generated,
            tokens_trained=self._tokens_trained,
            last_step_s=last.get("time/step_s", 0.0),
            last_reward_mean=last.get("rollout/reward_mean", 0.0),
            last_success_rate=last.get("rollout/success_rate", 0.0),
            eval=self.eval_tracker.statistics() if self.eval_tracker is not None else None,
        )

    def select_latency_percentiles(self) -> tuple[float, float]:
        lat = sorted(self.state.select_latency_s)
        if not lat:
            return float("nan"), float("nan")
        return pystats.median(lat), lat[min(len(lat) - 1, int(0.99 * len(lat)))]


def _first_pump_error(group: BaseExceptionGroup, tasks: dict[str, asyncio.Task]) -> tuple[str, BaseException]:
    """The pump whose own error stopped the run (the others were cancelled by the TaskGroup)."""
    for name, task in tasks.items():
        if task.done() and not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
                exc = exc.exceptions[0]  # a pump's own child TaskGroup wraps its child's error
            return name, exc
    return "unknown", group.exceptions[0]
