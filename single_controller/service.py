"""The controller's host: builds storage, workers and the dataloader from a config, runs the
Controller, serves its Prometheus metrics, and streams one record per step to whoever drives it.

`ControllerService` is a plain class with async methods. `launch` runs it as a CPU-only Ray actor
(`ray.remote(num_cpus=0, num_gpus=0)`) for the `cpu` backend, or in-process for the `sim` backend
and tests. Its own lifecycle: `setup()` -> `run()` (while the driver calls `next_records`) ->
`close()` (always, also after a failure).
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
from dataclasses import asdict
from typing import Any, Iterator

from single_controller.config import Config
from single_controller.deadlines import within
from single_controller.types import Prompt

# Heavy modules (torch, TransferQueue, the backends) are imported inside methods, which run in the
# controller's own process: the driver that only starts the actor stays light and starts fast.


def make_dataloader(cfg: Config) -> Iterator[Prompt]:
    """The task's prompt pool, cycled in epochs and reshuffled each epoch (seeded). Prompt ids are
    unique over the run (`e{epoch}-{id}`), which the exactly-once prompt ledger relies on.
    With eval on, no training prompt has the token ids of an eval prompt (the built-in tasks never
    draw their held-out split anyway; this also keeps a custom `eval.dataset` out of training)."""
    from single_controller.tasks import load_eval_prompts, load_task

    pool = load_task(cfg.task.name)(cfg.task.num_prompts, cfg.task.num_digits, cfg.seed)
    if cfg.eval.enabled:
        held_out = {p.token_ids for p in load_eval_prompts(cfg)}
        pool = [p for p in pool if p.token_ids not in held_out]
        if not pool:
            raise ValueError(f"every prompt of task {cfg.task.name!r} is also an eval prompt: nothing left to train on")
    rng = random.Random(cfg.seed)
    epoch = 0
    while True:
        order = list(range(len(pool)))
        rng.shuffle(order)
        for i in order:
            p = pool[i]
            yield Prompt(f"e{epoch}-{p.prompt_id}", p.token_ids, p.answer)
        epoch += 1


class ControllerService:
    def __init__(self, cfg: Config):
        from single_controller.controller import check_capacity

        check_capacity(cfg)
        self.cfg = cfg
        self.controller = None
        self.records: list[dict] = []
        self._changed = asyncio.Event()
        self._finished = False
        self._metrics_server = None
        self._workers: tuple[Any, Any] | None = None
        self.metrics_port: int | None = None
        self._started_tq = False
        self.setup_times: dict[str, float] = {}

    async def setup(self) -> dict:
        from single_controller.controller import Controller
        from single_controller.state import Workers

        cfg = self.cfg
        if cfg.backend.kind == "sim":
            storage, gens, trainer = self._sim_workers()
        else:
            storage, gens, trainer = await self._cpu_workers()
        from single_controller.tasks import TOKENIZER, load_eval_prompts

        stop = TOKENIZER.eos_id if cfg.rollout.stop_at_eos else None
        self.controller = Controller(
            cfg, make_dataloader(cfg), storage, Workers(gens, trainer), stop_token_id=stop, on_step=self._on_step,
            eval_prompts=load_eval_prompts(cfg) if cfg.eval.enabled else (), on_eval=self._on_step,
        )
        if cfg.metrics.enabled:
            from single_controller.metrics import start_metrics_server

            self._metrics_server, self.metrics_port = start_metrics_server(
                self.controller.statistics, host=cfg.metrics.host, port=cfg.metrics.port
            )
        return {"metrics_port": self.metrics_port, **self.setup_times}

    def _sim_workers(self):
        from replay.storage import InMemoryRowStorage
        from single_controller.backends.sim import sim_workers

        b, P = self.cfg.backend, self.cfg.train.groups_per_step
        storage = InMemoryRowStorage()
        gens, trainer = sim_workers(
            storage, num_generators=b.num_generation_workers, gen_group_s=b.sim_generate_s / P, train_group_s=b.sim_train_s / P
        )
        return storage, gens, trainer

    async def _cpu_workers(self):
        """Start (or attach to) TransferQueue here, while the worker processes start beside it."""
        from replay.tq_runtime import open_tq_storage
        from replay.tq_storage import TQRowStorage
        from single_controller.backends.cpu.ray_workers import create_cpu_workers

        cfg = self.cfg
        t0 = time.perf_counter()

        def storage_up():  # blocking Ray lookups and tq.init: run off the event loop
            storage = open_tq_storage(cfg.storage, cfg.timeouts)  # starts TQ, or attaches per storage.attach
            self._started_tq = not cfg.storage.attach
            self.setup_times["transferqueue_s"] = time.perf_counter() - t0
            return storage

        storage = asyncio.ensure_future(asyncio.to_thread(storage_up))
        factory = functools.partial(TQRowStorage.attach, cfg.storage.partition, timeout_s=cfg.timeouts.storage_s)
        gens, trainer = await within(
            create_cpu_workers(cfg, factory, storage_ready=storage), cfg.timeouts.setup_s, "starting TransferQueue and the CPU workers"
        )
        self._workers = (gens, trainer)
        self.setup_times["workers_s"] = time.perf_counter() - t0
        return await storage, gens, trainer

    def _on_step(self, record: dict) -> None:
        self.records.append(record)
        self._changed.set()

    async def run(self) -> dict:
        try:
            summary = await self.controller.run()
        finally:
            self._finished = True
            self._changed.set()
        st = self.controller.statistics()
        return {
            "steps": summary.steps,
            "stop_reason": summary.stop_reason,
            "wall_s": summary.wall_s,
            "prompts": asdict(st.prompts),
            "storage": asdict(st.storage),
            "eval": self.controller.eval_history[-1] if self.controller.eval_history else None,
        }

    async def next_records(self, cursor: int) -> tuple[list[dict], bool]:
        """Records from `cursor` on, waiting until there is one or the run has finished."""
        while len(self.records) <= cursor and not self._finished:
            self._changed.clear()
            await self._changed.wait()
        return self.records[cursor:], self._finished and len(self.records) <= cursor

    async def save_checkpoint(self, directory: str) -> str:
        if self._workers is None:
            return ""
        _, trainer = self._workers
        return await within(trainer.save_checkpoint(directory), self.cfg.timeouts.train_call_s, "trainer checkpoint save")

    async def prompt_ledger(self) -> dict:
        return self.controller.state.prompts.to_dict()

    async def close(self) -> None:
        if self._metrics_server is not None:
            server, self._metrics_server = self._metrics_server, None
            await asyncio.to_thread(server.stop)  # blocks up to 0.5 s
        if self._workers is not None:
            from single_controller.backends.cpu.ray_workers import shutdown_cpu_workers

            gens, trainer = self._workers
            self._workers = None
            await within(shutdown_cpu_workers(gens, trainer), 30, "shutting down the CPU workers")
        if self._started_tq:
            from replay.tq_runtime import stop_tq

            self._started_tq = False
            await asyncio.to_thread(stop_tq)  # only the process that started TQ may close it
