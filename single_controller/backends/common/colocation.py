"""Colocated mode (`backend.colocate: true`): the generation workers and trainer ranks of a node take
turns at its compute instead of splitting it.

Every process gets every core (`threads_per_process`) and a node-local `flock` (`TURNS_ENV`) decides
who computes: trainer ranks hold it shared around each microbatch, finish and export (ranks meet in
collectives, so they take the turn together); a generation worker holds it exclusive around each
sampling batch or engine step. The pipeline and its staleness bounds are unchanged, nothing waits on
a remote process while holding the lock, and it dies with its holder. That is the CPU's `shared`
form; colocated on one GPU (`colocated_on_gpu`) there is no lock: `shared` runs both roles at once
in their memory shares (`gpu_shares`), and `turns` (`single_controller/device_turns.py`, either
device) hands the device over by whole phases, the engine asleep while the trainer steps.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from single_controller.config.schema import BackendConfig, Config

TURNS_ENV = "SC_GRPO_TURNS"

Role = Literal["generate", "train"]


class ComputeTurns:
    """This process's end of the node's turn lock (`path` None: disaggregated, `hold` is free)."""

    def __init__(self, path: str | None, role: Role):
        self.path, self.role = path, role
        self._fd: int | None = None
        self._lock = threading.Lock()  # one holder per process (a sync thread may compute too)
        self.waited_s = 0.0  # total time spent waiting for a turn
        self.turns = 0
        self._reported = (0.0, 0)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Compute inside this: blocks until it is this role's turn on the node."""
        if self.path is None:
            yield
            return
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            t0 = time.perf_counter()
            fcntl.flock(self._fd, fcntl.LOCK_SH if self.role == "train" else fcntl.LOCK_EX)
            self.waited_s += time.perf_counter() - t0
            self.turns += 1
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def take_step_figures(self) -> dict[str, float]:
        """`train/turn_wait_s` and `train/turns` since the last call (a trainer rank's, per step)."""
        waited, turns = self.waited_s - self._reported[0], self.turns - self._reported[1]
        self._reported = (self.waited_s, self.turns)
        return {"train/turn_wait_s": waited, "train/turns": float(turns)}

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def threads_per_process(backend: BackendConfig) -> int:
    """`backend.torch_threads`, or its default: 1 per process, every core of this node when colocated."""
    if backend.torch_threads is not None:
        return int(backend.torch_threads)
    return (os.cpu_count() or 1) if backend.colocate else 1


def turns_from_env(role: Role) -> ComputeTurns:
    """The turns of a worker process started by the driver (none when the run is not colocated)."""
    return ComputeTurns(os.environ.get(TURNS_ENV) or None, role)


def turns_path(run_id: str) -> str:
    """The lock file of run `run_id` on every node (node-local temporary directory)."""
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"sc-grpo-turns-{run_id}")


def generation_on_gpu(cfg: Config) -> bool:
    return cfg.backend.generation == "vllm" and cfg.vllm.device == "cuda"


def training_on_gpu(cfg: Config) -> bool:
    if cfg.backend.trainer == "megatron":
        return not cfg.megatron.cpu_emulation
    return cfg.backend.trainer in ("torch", "fsdp") and cfg.backend.trainer_device == "cuda"


def colocated_on_gpu(cfg: Config) -> bool:
    """Colocated with both roles on one GPU (the node-local CPU turn lock is then not used)."""
    return cfg.backend.colocate and generation_on_gpu(cfg) and training_on_gpu(cfg)


def gpu_shares(cfg: Config) -> tuple[float, float]:
    """The GPU a generation worker and a trainer rank ask Ray for: a whole one each; colocated on one
    GPU, the engine's memory share and the rest (Ray's bookkeeping: the memory itself is what
    vLLM's `gpu_memory_utilization` and the trainer's `gpu_memory_fraction` hold each to)."""
    if not colocated_on_gpu(cfg):
        return (cfg.vllm.gpu_memory_utilization if cfg.pool.enabled else 1.0), 1.0
    engine = cfg.vllm.gpu_memory_utilization
    return engine, round(1.0 - engine, 6)
