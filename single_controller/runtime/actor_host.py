"""The controller's host: builds storage, workers and the dataloader from a config, runs the
`Controller`, serves its Prometheus metrics, and streams one record per step to whoever drives it.

`ControllerHost` is a plain class with async methods, run by the driver as a CPU-only Ray actor (Ray
backends) or in-process (`sim`, tests): `setup()` -> `run()` (while the driver calls `next_records`)
-> `close()`, always. Workers are built per role through `backends.registry`; as a Ray actor its
output goes to `<run dir>/logs/controller.log`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import random
import threading
import time
import traceback
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from single_controller import startup_trace
from single_controller.config.schema import Config
from single_controller.deadlines import DeadlineExceeded, within
from single_controller.runtime.records import is_eval_record
from single_controller.types import Prompt

if TYPE_CHECKING:
    from replay.transferqueue.storage import TQRowStorage
    from single_controller.controller import Controller
    from single_controller.runtime.metrics import MetricsServer

log = logging.getLogger(__name__)

# Heavy modules (torch, TransferQueue, the backends) are imported inside methods, which run in the
# controller's own process: the driver that only starts the actor stays light and starts fast.


class PromptStream:
    """The task's prompt pool, cycled in epochs and reshuffled each epoch (seeded). Prompt ids are
    unique over the run (`e{epoch}-{id}`), which the exactly-once prompt ledger relies on: a pool
    that repeats an id is refused as it is loaded, naming the ids. Its
    position (epoch, cursor) is part of a checkpoint; `seek(taken)` restores it exactly.
    With eval on, no training prompt has the token ids and answer of an eval prompt (the built-in
    tasks never draw their held-out split anyway; this also keeps a custom `eval.dataset` out of
    training; the answer counts because an environment's task may hide behind one prompt text, as
    `lookup`'s secret values do)."""

    def __init__(self, cfg: Config):
        from single_controller.data.sources import eval_prompts, train_prompts

        loaded = train_prompts(cfg)
        self.pool, self.too_long = loaded.prompts, loaded.too_long
        if cfg.eval.enabled:
            held_out = {(p.token_ids, p.answer) for p in eval_prompts(cfg)}
            self.pool = [p for p in self.pool if (p.token_ids, p.answer) not in held_out]
            if not self.pool:
                what = "data.train_files" if cfg.data.train_files else f"task {cfg.task.name!r}"
                raise ValueError(f"every prompt of {what} is also an eval prompt: nothing left to train on")
        self._rng = random.Random(cfg.seed)
        self.epoch = -1
        self.cursor = 0
        self._order: list[int] = []
        self._new_epoch()

    def _new_epoch(self) -> None:
        self.epoch += 1
        self.cursor = 0
        self._order = list(range(len(self.pool)))
        self._rng.shuffle(self._order)

    def __iter__(self) -> PromptStream:
        return self

    def __next__(self) -> Prompt:
        if self.cursor == len(self._order):
            self._new_epoch()
        p = self.pool[self._order[self.cursor]]
        self.cursor += 1
        return Prompt(f"e{self.epoch}-{p.prompt_id}", p.token_ids, p.answer, p.raw_prompt, p.columns)

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def resolve(self, saved: Mapping[str, tuple[tuple[int, ...], str]]) -> dict[str, Prompt]:
        """The whole prompts of a checkpoint's unsettled records (`replay.ledger.unsettled_prompt_ids`:
        id -> token ids, answer), found in the pool by id: the raw prompt and dataset columns a
        checkpoint does not keep come back as they were. A prompt the pool lacks, or holds with other
        token ids or answer (the dataset, its rendering or the tokenizer changed since), refuses the
        resume, naming the prompts (`CheckpointError`)."""
        from single_controller.checkpoint import CheckpointError

        by_id = {p.prompt_id: p for p in self.pool}
        found: dict[str, Prompt] = {}
        missing, changed = [], []
        for pid, (token_ids, answer) in saved.items():
            p = by_id.get(pid.partition("-")[2])  # `e{epoch}-{id in the pool}`, as `__next__` names it
            if p is None:
                missing.append(pid)
            elif p.token_ids != token_ids or p.answer != answer:
                changed.append(pid)
            else:
                found[pid] = Prompt(pid, p.token_ids, p.answer, p.raw_prompt, p.columns)
        if missing or changed:
            parts = [
                f"{what} ({len(ids)}: {', '.join(ids[:5])}{', ...' if len(ids) > 5 else ''})"
                for what, ids in (("not in the prompt source", missing), ("changed in it", changed))
                if ids
            ]
            raise CheckpointError(
                f"cannot resume: the checkpoint's unsettled prompts must come back whole (raw prompt and "
                f"columns) from the prompt source, but some are {' and some '.join(parts)}; resume with the "
                "dataset (and tokenizer, chat template) the run started with"
            )
        return found

    def seek(self, taken: int) -> None:
        """Position after `taken` prompts from the start (replays the epoch shuffles, nothing else)."""
        epochs, cursor = divmod(taken, len(self.pool))
        for _ in range(epochs):
            self._new_epoch()
        self.cursor = cursor


def make_dataloader(cfg: Config) -> Iterator[Prompt]:
    return PromptStream(cfg)


def run_id_of(run_dir: str | None) -> str:
    """The run id kept in the run directory (`RunDirectory`), else a fresh random one."""

    from single_controller.runtime.run_dir import RUN_ID_FILE

    if run_dir is not None and (Path(run_dir) / RUN_ID_FILE).exists():
        return (Path(run_dir) / RUN_ID_FILE).read_text(encoding="utf-8").strip()
    return f"run-{uuid.uuid4().hex[:8]}"


class ControllerHost:
    """`run_id` names this run's TransferQueue partition (`<storage.partition>-<run id>`): runs
    sharing one TQ never touch each other's keys (default: the run directory's, else a fresh one)."""

    def __init__(
        self,
        cfg: Config,
        run_dir: str | None = None,
        resume: bool = False,
        run_id: str | None = None,
        wall_offset_s: float = 0.0,
        pool: Any = None,
    ):
        from single_controller.backends.common.worker_logs import redirect_output
        from single_controller.config.schema import check_capacity

        redirect_output("controller")
        check_capacity(cfg)
        self.cfg = cfg
        self.run_dir = run_dir  # checkpoints go to <run_dir>/checkpoints (None: no checkpoints)
        self.run_id = run_id or run_id_of(run_dir)
        self.partition = f"{cfg.storage.partition}-{self.run_id}"
        self.resume = resume
        self.wall_offset_s = wall_offset_s  # the run's wall clock as this part starts (`RunDirectory`)
        self.resumed_from: dict | None = None
        self.controller: Controller | None = None
        self.records: list[dict] = []  # step and eval records from index `_records_base` of the run on
        self._records_base = 0  # records before it were read by the driver (`next_records`) and dropped
        self._changed = asyncio.Event()
        self._finished = asyncio.Event()  # set once the run has ended, however it ended
        self._metrics_server: MetricsServer | None = None
        self._workers: tuple[Any, Any] | None = None
        self.metrics_port: int | None = None
        self.metrics_url: str | None = None
        self._storage: TQRowStorage | None = None
        self._started_tq = False
        self.setup_times: dict[str, float] = {}
        self.data_prompts_too_long = 0  # dataset prompts over data.max_prompt_tokens, dropped at load
        # cfg.pool.enabled: the pool (`PoolApi`; in-process for the sim backend, else the pool
        # actor's client, made at `run`) and the run's link to it
        self.pool = pool
        self._link: Any = None

    async def setup(self) -> dict:
        cfg = self.cfg
        startup_trace.mark("controller", "setup")
        prompts = PromptStream(cfg)  # a dataset it refuses (e.g. a repeated prompt id) stops the run before any worker
        self.data_prompts_too_long = prompts.too_long
        if prompts.too_long:
            log.warning("dropped %d dataset prompt(s) longer than data.max_prompt_tokens", prompts.too_long)
        # a checkpoint this run cannot resume from is refused before any worker starts
        checkpoint = self._read_checkpoint(prompts) if self.resume else None
        if cfg.backend.generation == "sim":  # config validation: then the trainer is sim too
            storage, gens, trainer = self._sim_workers()
        else:
            storage, gens, trainer = await self._ray_workers()
        # Imported only now (torch, via the ledger's row schema): the worker processes were started
        # first, so their own imports run beside this one.
        from single_controller.controller import Controller
        from single_controller.data.sources import eval_prompts
        from single_controller.data.tokenizer import load_tokenizer
        from single_controller.state import Workers

        stop = load_tokenizer(cfg.model.path).eos_ids if cfg.rollout.stop_at_eos else ()
        saved = await self._load_checkpoint(trainer, prompts, *checkpoint[:2]) if checkpoint else None
        self.controller = Controller(
            cfg,
            prompts,
            storage,
            Workers(gens, trainer),
            stop_token_ids=stop,
            on_step=self._on_step,
            run_dir=self.run_dir,
            resume=saved,
            resumed_prompts=checkpoint[2] if checkpoint else None,
            dataloader_state=prompts.state,
            eval_prompts=eval_prompts(cfg) if cfg.eval.enabled else (),
            on_eval=self._on_step,
            wall_offset_s=self.wall_offset_s,
            # settled prompts stream to disk: memory holds the ones in flight, checkpoints stay small
            prompt_history=os.path.join(self.run_dir, "prompt_history.jsonl") if self.run_dir else None,
        )
        # the driver writes the records from here on (`next_records` confirms what it wrote)
        self.controller.records_written(saved["step"] if saved else 0)
        if cfg.metrics.enabled:
            from single_controller.runtime.metrics import serve_from_config

            server = serve_from_config(cfg.metrics, self.controller.statistics)
            assert server is not None  # None only with metrics disabled
            self._metrics_server = server
            self.metrics_port, self.metrics_url = server.port, server.url
        b = cfg.backend
        gens = f"{b.num_generation_workers} {b.generation} generation worker(s)"
        ranks = f"{b.num_trainer_ranks} {b.trainer} trainer rank(s)"
        resumed = f", resumed from step {saved['step']}" if saved else ""
        times = ", ".join(f"{k} {v:.1f}s" for k, v in self.setup_times.items()) or "no timed parts"
        storage = f"{cfg.storage.kind} storage (partition {self.partition})"
        log.info("set up %s, %s, %s%s; %s", gens, ranks, storage, resumed, times)
        startup_trace.mark("controller", "set up")
        return {"metrics_port": self.metrics_port, "metrics_url": self.metrics_url, **self.setup_times}

    def _read_checkpoint(self, prompts: PromptStream) -> tuple[Path, dict, dict[str, Prompt]]:
        """The newest checkpoint of the run directory: its path, its controller state (checked
        against the config) and its unsettled prompts whole, from the prompt source (`resolve`)."""
        from replay.ledger import unsettled_prompt_ids
        from single_controller.checkpoint import check_compatible, latest_checkpoint, read_controller_state

        assert self.run_dir is not None  # a resume continues a run directory (the driver opened it)
        path = latest_checkpoint(self.run_dir)
        saved = read_controller_state(path)
        check_compatible(saved, self.cfg, path)
        return path, saved, prompts.resolve(unsettled_prompt_ids(saved["prompts"]))

    async def _load_checkpoint(self, trainer, prompts: PromptStream, path: Path, saved: dict) -> dict:
        """The checkpoint (`_read_checkpoint`) into the trainer and the dataloader position; returns
        the controller state (the resumed `Controller` clears the rows a storage that outlived the
        crash still holds)."""
        t0 = time.perf_counter()
        step = await within(
            trainer.load_state(str(path / "trainer")), _load_deadline(self.cfg, path), f"trainer.load_state({path})"
        )
        if step != saved["step"]:
            raise RuntimeError(f"{path}: the trainer state is at step {step}, the controller state at {saved['step']}")
        prompts.seek(saved["dataloader"]["taken"])
        self.setup_times["resume_s"] = time.perf_counter() - t0
        self.resumed_from = {"path": str(path), "step": saved["step"]}
        return saved

    async def request_stop(self, reason: str) -> None:
        """An interrupt: stop on the last finished step (the open one is aborted) and checkpoint it."""
        if self.controller is not None:
            self.controller.state.request_stop(reason, abandon_open_step=True)

    def _sim_workers(self):
        from replay.storage import InMemoryRowStorage
        from single_controller.backends.sim import sim_workers

        b, P = self.cfg.backend, self.cfg.train.groups_per_step
        storage = InMemoryRowStorage()
        gens, trainer = sim_workers(
            storage,
            num_generators=b.num_generation_workers,
            gen_group_s=b.sim_generate_s / P,
            train_group_s=b.sim_train_s / P,
        )
        return storage, gens, trainer

    async def _ray_workers(self):
        """Start (or attach to) TransferQueue here, while the worker processes start beside it."""
        # TQ itself is imported on the storage thread: the worker processes start first
        from replay.transferqueue.factory import attach_tq_storage, import_storage_modules, open_tq_storage
        from single_controller.backends.registry import load_starters, start_workers

        cfg = self.cfg
        t0 = time.perf_counter()

        loop, spawned = asyncio.get_running_loop(), asyncio.Event()
        # Python's imports are not safe on two threads at once: a module another thread is importing
        # can be reported missing (CPython bpo-38884; here `No module named
        # 'single_controller.backends.common.weight_broadcast'` once in a suite). So the storage thread
        # waits, once TQ's processes were asked for, until this thread has imported what both need.
        imported = threading.Event()

        def asked_for() -> None:  # on the storage thread
            loop.call_soon_threadsafe(spawned.set)
            if not imported.wait(cfg.timeouts.setup_s):
                raise DeadlineExceeded("the controller's imports of the worker starters", cfg.timeouts.setup_s)

        def storage_up():  # blocking Ray lookups and tq.init: run off the event loop
            # starts TQ, or attaches to one
            storage = open_tq_storage(cfg.storage, cfg.timeouts, self.partition, on_spawned=asked_for)
            self._started_tq = not cfg.storage.attach
            self._storage = storage
            self.setup_times["transferqueue_s"] = time.perf_counter() - t0
            startup_trace.mark("controller", "transferqueue up")
            return storage

        storage = asyncio.ensure_future(asyncio.to_thread(storage_up))
        # TQ's processes are asked for before the worker starters are imported here (torch, seconds of
        # CPU that would hold up the storage thread's Ray calls): all of them start side by side.
        asked = asyncio.ensure_future(spawned.wait())
        await asyncio.wait([storage, asked], return_when=asyncio.FIRST_COMPLETED)
        asked.cancel()
        try:
            starters = load_starters(cfg)
            import_storage_modules()
        finally:
            imported.set()
        factory = functools.partial(attach_tq_storage, self.partition, cfg.timeouts.storage_s, cfg.storage.pack_groups)
        b = cfg.backend
        what = f"starting TransferQueue, the {b.generation} generation workers and the {b.trainer} trainer"
        started = start_workers(cfg, factory, storage_ready=storage, starters=starters)
        gens, trainer = await within(started, cfg.timeouts.setup_s, what)
        self._workers = (gens, trainer)
        self.setup_times["workers_s"] = time.perf_counter() - t0
        startup_trace.mark("controller", "workers up, weights v0 synced")
        return await storage, gens, trainer

    def _on_step(self, record: dict) -> None:
        self.records.append(record)
        self._changed.set()

    async def run(self) -> dict:
        """Run to the end; a failed run returns its cause (pump, error, traceback) instead of raising,
        so the driver can write every record and one readable paragraph."""
        from single_controller.controller import RunFailed, failure_text

        controller = self.controller
        assert controller is not None, "run() before setup()"
        t0 = time.perf_counter()
        failure: dict | None = None
        try:
            summary = await (self._pool_link().run() if self.cfg.pool.enabled else controller.run())
            steps, reason, checkpoint = summary.steps, summary.stop_reason, summary.checkpoint
        except RunFailed as e:
            cause = e.__cause__ or e
            failure = {
                "pump": e.pump,
                "type": type(cause).__name__,
                "error": failure_text(cause, e.also),
                "traceback": "".join(traceback.format_exception(cause))
                + "".join(f"\nThe {p} pump failed too:\n" + "".join(traceback.format_exception(x)) for p, x in e.also),
            }
            steps, reason, checkpoint = controller.state.versions.trained, f"failed: {e}", e.checkpoint
        finally:
            self._finished.set()
            self._changed.set()
        st = controller.statistics()
        try:  # every key in the partition, whoever wrote it: a clean run leaves none
            left = sorted(
                await within(
                    controller.state.storage.resident_keys(),
                    self.cfg.timeouts.storage_s,
                    "storage listing after the run",
                )
            )
        except Exception as e:
            left = [f"<listing failed: {type(e).__name__}: {e}>"]
        return {
            "steps": steps,
            "run_id": self.run_id,
            "storage_partition": self.partition if self.cfg.storage.kind == "tq" else None,
            "metrics_url": self.metrics_url,
            "placement": self._placement(),
            "storage_keys_left": len(left),
            "storage_keys_left_sample": left[:10],
            "stop_reason": reason,
            "wall_s": time.perf_counter() - t0,
            "failure": failure,
            "checkpoint": asdict(checkpoint) if checkpoint is not None else None,
            "resumed_from": self.resumed_from,
            "prompts": asdict(st.prompts),
            "data_prompts_too_long": self.data_prompts_too_long,
            "storage": asdict(st.storage),
            "teardown_errors": list(controller.state.teardown_errors),
            "eval": controller.eval_history[-1] if controller.eval_history else None,
        }

    # -- in a pool (`single_controller/pool/`) -------------------------------------------------
    def _pool_link(self):
        from single_controller.pool.link import PoolLink
        from single_controller.pool.planner import RunSlots

        cfg, controller = self.cfg, self.controller
        assert controller is not None, "run() before setup()"
        if self.pool is None:  # a Ray actor: the pool actor, by name
            import ray

            from single_controller.pool.actor import RayPoolClient

            self.pool = RayPoolClient(cfg.pool, ray.get_runtime_context().current_actor)
        spec = RunSlots(cfg.run.name, cfg.pool.gen_slots, cfg.pool.train_slots)
        self._link = PoolLink(controller, self.pool, spec, cfg.rollout.sleep_level)
        return self._link

    async def pool_shrink_slot(self, slot: int, preempt: bool) -> None:
        assert self._link is not None, "a pool call before the run joined its pool"
        await self._link.shrink_slot(slot, preempt)

    async def pool_expand_slot(self, slot: int) -> None:
        assert self._link is not None, "a pool call before the run joined its pool"
        await self._link.expand_slot(slot)

    async def pool_wait_ended(self) -> None:
        """Returns when the run has ended (the pool watches its runs with it: a call that fails
        instead tells the pool that this controller died)."""
        await self._finished.wait()

    def _placement(self) -> dict:
        """Where this run's processes ran: its Ray namespace, the controller's node and each trainer
        rank's (Ray node ids)."""
        out: dict[str, Any] = {
            "ray_namespace": None,
            "controller_node": None,
            "trainer_nodes": [],
            "trainer_node_ips": [],
        }
        if self.cfg.backend.generation == "sim":
            return out
        import ray

        from single_controller.backends.common.rank_calls import node_info

        try:
            out["controller_node"] = node_info()["node_id"]
            out["ray_namespace"] = ray.get_runtime_context().namespace
        except Exception:  # Ray is not initialized here (tests driving the host in-process)
            pass
        trainer = self._workers[1] if self._workers is not None else None
        out["trainer_nodes"] = [n["node_id"] for n in getattr(trainer, "rank_nodes", [])]
        out["trainer_node_ips"] = [n["node_ip"] for n in getattr(trainer, "rank_nodes", [])]
        return out

    async def next_records(self, cursor: int, linger_s: float = 0.0) -> tuple[list[dict], bool]:
        """Records from `cursor` (an index over the run) on, waiting until there is one or the run
        has finished; then, with `linger_s`, up to that long more for the records behind it (never
        past the run's end). Asking from `cursor` acknowledges every record before it: those are
        dropped, so the controller's memory stays flat however long the run."""
        if cursor > self._records_base:
            written = self.records[: cursor - self._records_base]
            del self.records[: cursor - self._records_base]
            self._records_base = cursor
            steps = [r["step"] for r in written if not is_eval_record(r)]
            if steps and self.controller is not None:
                self.controller.records_written(max(steps) + 1)
        while self._records_base + len(self.records) <= cursor and not self._finished.is_set():
            self._changed.clear()
            await self._changed.wait()
        if linger_s > 0 and not self._finished.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._finished.wait(), linger_s)
        if cursor < self._records_base:
            raise ValueError(f"records before {self._records_base} were already read and dropped (asked from {cursor})")
        return self.records[cursor - self._records_base :], self._finished.is_set() and self._records_base + len(
            self.records
        ) <= cursor

    async def save_checkpoint(self, directory: str) -> str:
        if self._workers is None:
            return ""
        _, trainer = self._workers
        return await within(
            trainer.save_checkpoint(directory), self.cfg.timeouts.train_call_s, "trainer checkpoint save"
        )

    async def write_prompt_ledger(self, path: str) -> int | None:
        """The whole prompt ledger to `path` (streamed, off the event loop); the prompts written."""
        if self.controller is None:
            return None
        return await asyncio.to_thread(self.controller.state.prompts.write_json, path)

    async def close(self) -> None:
        if self.controller is not None:
            self.controller.state.prompts.close()
        stopping_metrics = None
        if self._metrics_server is not None:
            server, self._metrics_server = self._metrics_server, None
            # blocks up to 0.5 s: beside the rest
            stopping_metrics = asyncio.ensure_future(asyncio.to_thread(server.stop))
        try:
            if self._workers is not None:
                from single_controller.backends.registry import shutdown_workers

                gens, trainer = self._workers
                self._workers = None
                await within(shutdown_workers(gens, trainer), 60, "shutting down the workers")
            if self._started_tq:
                from replay.transferqueue.runtime import stop_tq

                self._started_tq = False
                await asyncio.to_thread(stop_tq)  # only the process that started TQ may close it
            elif self._storage is not None and self.cfg.storage.attach:
                storage, self._storage = self._storage, None
                # a TQ that outlives the run keeps no empty partition of it (a failed run's rows stay, for --resume)
                try:
                    await storage.drop_partition_if_empty()
                except Exception as e:
                    log.warning("could not drop the empty partition %r: %s", self.partition, e)
        finally:
            if stopping_metrics is not None:
                await stopping_metrics


def _load_deadline(cfg: Config, checkpoint: Path) -> float:
    """`timeouts.checkpoint_s`, plus `checkpoint_s_per_gib` per GiB of the checkpoint to load."""
    size = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())
    return cfg.timeouts.checkpoint_s + cfg.timeouts.checkpoint_s_per_gib * size / 2**30
