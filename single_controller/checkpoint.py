"""Run checkpoints: atomic on disk, everything a resume needs, refused when the config differs.

`<run dir>/checkpoints/step_N/` holds `controller.json` (versions, the prompt ledger rolled back to
the cut, the dataloader position, the success window, the config) and `trainer/` (the backend's
policy, optimizer and RNG, `protocols.Checkpointable`); `latest` names the newest complete one.
Written aside, fsynced and renamed, so a crash leaves `latest` valid. `stage_checkpoint` saves the
cut between steps; `commit` (fsyncs, rename, rotation) may run while training goes on. Groups not
yet trained are not saved: their prompts stay unsettled, so a resume re-dispatches them.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from single_controller.config.schema import Config

FORMAT = 1
LATEST = "latest"

# Config keys a resume may change: how long to run, deadlines, where to report, how often to
# checkpoint, the cluster and workers to run on, how a trainer cuts its microbatches. Everything else
# shapes the data or the math and must match the checkpoint (run.max_steps too, under a decaying lr
# schedule: it is the schedule's horizon).
RESUMABLE_CHANGES = (
    "run.max_steps",
    "run.stop_at_success_rate",
    "run.progress_bar",
    "run.plot",
    "run.output_dir",
    "run.sample_every_steps",
    "reward.timeout_s",
    "reward.max_workers",
    "timeouts.",
    "metrics.",
    "checkpoint.",
    "ray.",
    "storage.attach",
    "storage.num_storage_units",
    "backend.num_generation_workers",
    # the torch trainer's state is whole on every rank, the fsdp trainer's checkpoint reshards on load;
    # Megatron's shards are its layout's (pinned below)
    "backend.num_trainer_ranks",
    "backend.torch_threads",
    "sync.drain_timeout_s",
    "rollout.max_in_flight_groups",
    "rollout.max_batch_groups",
    "rollout.max_in_flight_per_worker",
    # where and with whom it runs: a pooled run resumes alone, or in another pool (the same data and math)
    "rollout.sleep_level",
    "rollout.shrink",
    "rollout.shrink_drain_timeout_s",
    "pool.",
    "train.pipeline_steps",
    "train.micro_batch_tokens",  # how a microbatch is cut into passes: the same sums
    "train.gradient_checkpointing",  # recomputes activations: the same gradients
)


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that does not fit this run."""


@dataclass(frozen=True)
class CheckpointInfo:
    path: str
    step: int
    write_s: float
    num_bytes: int


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _fsync_tree(path: Path) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(root))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@dataclass(frozen=True)
class StagedCheckpoint:
    """A checkpoint whose cut is saved (`stage_checkpoint`) but that is not durable or current yet:
    `commit` (blocking; run it on a thread) finishes it and returns its size in bytes."""

    step: int
    path: str  # where it will be once committed
    started: float  # clock() when staging began
    commit: Callable[[], int]


async def stage_checkpoint(
    run_dir: str | Path,
    step: int,
    controller_state: dict[str, Any],
    save_trainer: Callable[[str], Awaitable[Any]],
    *,
    keep: int,
    clock: Callable[[], float],
) -> StagedCheckpoint:
    """The part of checkpoint `step` that needs the cut: the trainer saves its state into
    `step_N.tmp` and the controller's state is serialized now. Training may go on once this returns;
    the returned `commit` writes the controller's part, fsyncs everything, renames the folder into
    place, points `latest` at it and drops the oldest beyond `keep` (0: keeps all). Until `commit`
    has returned, `latest` names the previous checkpoint."""
    t0 = clock()
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)  # a crash mid-write of this very checkpoint
    tmp.mkdir()
    await save_trainer(str(tmp / "trainer"))
    text = json.dumps({"format": FORMAT, **controller_state}) + "\n"  # now: the state moves on

    def commit() -> int:
        (tmp / "controller.json").write_text(text, encoding="utf-8")
        _fsync_tree(tmp)
        if final.exists():  # re-taken after a resume from an earlier checkpoint
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        _write_atomic(root / LATEST, final.name + "\n")
        if keep > 0:
            done = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
            for old in done[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
        return tree_bytes(final)

    return StagedCheckpoint(step, str(final), t0, commit)


async def commit_checkpoint(staged: StagedCheckpoint, clock: Callable[[], float]) -> CheckpointInfo:
    """Run `staged.commit` off the event loop (its fsyncs can take long on a slow disk)."""
    import asyncio

    num_bytes = await asyncio.to_thread(staged.commit)
    return CheckpointInfo(staged.path, staged.step, clock() - staged.started, num_bytes)


def latest_checkpoint(run_dir: str | Path) -> Path:
    """The newest complete checkpoint of a run directory, or `CheckpointError` saying what is missing."""
    root = checkpoints_dir(run_dir)
    pointer = root / LATEST
    if not pointer.is_file():
        raise CheckpointError(
            f"{run_dir} has no checkpoint to resume from ({pointer} is missing): the run stopped before "
            "its first checkpoint (checkpoint.every_steps / checkpoint.every_s)"
        )
    path = root / pointer.read_text(encoding="utf-8").strip()
    if not (path / "controller.json").is_file():
        raise CheckpointError(f"{pointer} names {path.name}, which is incomplete or missing")
    return path


def read_controller_state(path: Path) -> dict[str, Any]:
    state = json.loads((path / "controller.json").read_text(encoding="utf-8"))
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {state.get('format')!r}, this sc-grpo reads {FORMAT}")
    return state


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = list(v) if isinstance(v, tuple) else v
    return out


def config_fingerprint(cfg: Config) -> dict[str, Any]:
    return _flatten(asdict(cfg))


def incompatible_keys(saved: dict[str, Any], cfg: Config) -> list[tuple[str, Any, Any]]:
    """(key, checkpoint value, this config's value) for every key that differs and may not."""
    now = config_fingerprint(cfg)
    default = config_fingerprint(Config())  # a key newer than the checkpoint had its default then
    # a decaying lr schedule's horizon is run.max_steps: another one would change the lr of every later step
    pinned = {"run.max_steps"} if cfg.train.lr_schedule != "constant" else set()
    if cfg.backend.trainer == "megatron":  # each rank's shard file is its tensor/data-parallel layout's
        pinned.add("backend.num_trainer_ranks")
    out = []
    for key in sorted(set(saved) | set(now)):
        if key not in pinned and any(key == r or (r.endswith(".") and key.startswith(r)) for r in RESUMABLE_CHANGES):
            continue
        then = saved.get(key, default.get(key))
        if then != now.get(key):
            out.append((key, then, now.get(key)))
    return out


def check_compatible(state: dict[str, Any], cfg: Config, path: Path) -> None:
    diff = incompatible_keys(state["config"], cfg)
    if diff:
        lines = "; ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, a, b in diff[:10])
        if any(k == "run.max_steps" for k, _, _ in diff):
            lines += f" (run.max_steps is the horizon of train.lr_schedule={cfg.train.lr_schedule})"
        more = f" (and {len(diff) - 10} more)" if len(diff) > 10 else ""
        raise CheckpointError(
            f"checkpoint {path} was taken with a different config, so it cannot be resumed: {lines}{more}. "
            f"Keys a resume may change: {', '.join(RESUMABLE_CHANGES)}"
        )
