"""`sc-grpo pool run POOL.yaml` (single_controller/runtime/pool_run.py) as a user runs it, on the embedded
backend under Ray (its sim runs and refusals in this process: tests/unit/test_pool_run_sim.py): kill -9 of the
pool actor (every run stops with a named error and a resumable checkpoint) and of one run's
controller (the other run goes on and takes its slots)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers.runs import actor_pids, check_exactly_once, check_one_run_per_slot, pool_file

ROOT = Path(__file__).resolve().parents[2]


# -- under Ray, on the embedded backend ------------------------------------------------------------
EMBEDDED = [
    "run.progress_bar=false",
    "metrics.port=0",
    "run.stop_at_success_rate=null",
    "run.plot=false",
    "run.max_steps=100000",
    "checkpoint.every_steps=3",
    "backend.num_generation_workers=2",
    "rollout.max_in_flight_per_worker=8",
    "rollout.sleep_level=1",
    "pool.gen_slots=[0,1]",
]


def _embedded_pool(tmp_path: Path) -> Path:
    runs = [
        {
            "config": str(ROOT / "configs/embedded.yaml"),
            "overrides": [
                *EMBEDDED,
                f"run.output_dir={tmp_path / 'runs'}",
                f"run.name={name}",
                f"pool.train_slots=[{i}]",
            ],
        }
        for i, name in enumerate(("left", "right"))
    ]
    return pool_file(tmp_path, runs, slots=2)


def _start_pool(path: Path, cwd: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "single_controller", "pool", "run", str(path)]
    return subprocess.Popen(
        cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _wait_for_steps(proc: subprocess.Popen, steps: dict[str, int]) -> list[str]:
    seen: list[str] = []
    reached: dict[str, int] = {}
    for line in proc.stdout:  # type: ignore[union-attr]
        seen.append(line)
        m = re.match(r"\[(\w+)\] step\s+(\d+)/", line)
        if m:
            reached[m.group(1)] = int(m.group(2))
        if all(reached.get(n, -1) >= s for n, s in steps.items()):
            return seen
    raise AssertionError(f"the pool ended before the steps {steps}:\n{''.join(seen[-40:])}")


def _sc_grpo_to_the_end(cwd: Path, *args: str) -> None:
    """`sc-grpo ARGS...` in `cwd`, to its end: it must exit 0."""
    done = subprocess.run(
        [sys.executable, "-m", "single_controller", *args], cwd=cwd, capture_output=True, text=True, timeout=400
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]


def _actor_pid(session: int, cls: str, name: str | None = None) -> int:
    import psutil

    pids = actor_pids(session, cls)
    if name is not None:  # a controller: the one whose run directory it logs to
        pids = [p for p in pids if any(name in f.path for f in psutil.Process(p).open_files())]
    assert len(pids) == 1, f"{cls} {name or ''}: processes {pids}"
    return pids[0]


@pytest.mark.slow
@pytest.mark.ray
def test_kill_9_of_the_pool_actor_stops_every_run_with_a_named_error_and_a_resumable_checkpoint(tmp_path):
    proc = _start_pool(_embedded_pool(tmp_path), tmp_path)
    try:
        _wait_for_steps(proc, {"left": 4, "right": 4})
        os.kill(_actor_pid(proc.pid, "PoolActor"), signal.SIGKILL)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, out[-3000:]
    assert re.search(r"run failed in the \w+ pump after \d+ steps: .*pool sc-grpo-pool", out), out[-3000:]
    for name in ("left", "right"):
        (run_dir,) = (tmp_path / "runs").glob(f"{name}-*")
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["failure"] is not None and "pool sc-grpo-pool" in summary["failure"]["error"], summary
        assert summary["checkpoint"]["step"] >= 3, summary
        assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{summary['checkpoint']['step']:06d}"
    # one of them resumes alone, out of any pool (both checkpoints were written by the same code)
    k = summary["checkpoint"]["step"]
    _sc_grpo_to_the_end(tmp_path, "run", "--resume", str(run_dir), "pool.enabled=false", f"run.max_steps={k + 2}")
    check_exactly_once(run_dir, k + 2, 16)


@pytest.mark.slow
@pytest.mark.ray
def test_kill_9_of_one_runs_controller_leaves_the_other_run_going_on_both_slots(tmp_path):
    pool = _embedded_pool(tmp_path)
    cfg = yaml.safe_load(pool.read_text())
    cfg["runs"][1]["overrides"][cfg["runs"][1]["overrides"].index("run.max_steps=100000")] = "run.max_steps=30"
    pool.write_text(yaml.safe_dump(cfg))
    proc = _start_pool(pool, tmp_path)
    try:
        _wait_for_steps(proc, {"left": 3, "right": 3})
        os.kill(_actor_pid(proc.pid, "ControllerHost", "left-"), signal.SIGKILL)
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, out[-3000:]  # one run failed
    (summary_path,) = (tmp_path / "pools").glob("pool-*/pool_summary.json")
    summary = json.loads(summary_path.read_text())
    assert summary["runs"]["left"]["exit_code"] == 1 and summary["runs"]["right"]["exit_code"] == 0, summary["runs"]
    assert summary["dropped_runs"] == ["left"], summary["dropped_runs"]
    check_one_run_per_slot(summary["timeline"])
    # after left is gone, right generates on both slots (left's train slot 0 included; a slot goes
    # back to generation between left's steps, so right may be there already as left goes)
    timeline = summary["timeline"]
    gone = max(t for t, _, state, run in timeline if run == "left")
    at_gone = {int(slot): (state, run) for t, slot, state, run in timeline if t <= gone}  # each slot's last state
    later = {s for s, (state, run) in at_gone.items() if (state, run) == ("gen", "right")}
    later |= {int(slot) for t, slot, state, run in timeline if t > gone and state == "gen" and run == "right"}
    assert later == {0, 1}, later
    (right_dir,) = (tmp_path / "runs").glob("right-*")
    check_exactly_once(right_dir, 30, 16)


def _last_resize(run_dir: Path, worker: str) -> str | None:
    """The last resize of `worker` in the run's controller log: `shrunk`, `expanded` or None."""
    events = _resizes(run_dir, worker)
    return events[-1] if events else None


def _resizes(run_dir: Path, worker: str) -> list[str]:
    text = (run_dir / "logs" / "controller.log").read_text(errors="replace")
    return re.findall(rf"generation worker {worker} (shrunk|expanded)", text)


def _kill_9_once(run_dir: Path, worker: str, last_resize: str, timeout_s: float = 120.0) -> int:
    """kill -9 of the run's `worker` process the moment its last resize is `last_resize`; returns how
    many resizes of it the log held then."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # (a test polling a log file, not the product's code)
        if _last_resize(run_dir, worker) == last_resize:
            seen = len(_resizes(run_dir, worker))
            log = (run_dir / "logs" / f"{worker}.log").read_text(errors="replace")
            os.kill(int(re.findall(rf"==== {worker} \(pid (\d+)\) started", log)[-1]), signal.SIGKILL)
            return seen
        time.sleep(0.02)
    raise AssertionError(f"{worker} of {run_dir.name} was never {last_resize} in {timeout_s:g}s")


@pytest.mark.slow
@pytest.mark.ray
def test_kill_9_of_a_shrunk_worker_and_of_one_on_a_train_slot_then_a_resume_into_a_pool_at_sleep_level_1(tmp_path):
    """Both runs finish exactly once, none dropped (R6); the one resumed into a pool at sleep level 1
    trains (R2)."""
    steps = 40  # (~10 s of training in the pool: room for both kills and the restarts)
    pool = _embedded_pool(tmp_path)
    cfg = yaml.safe_load(pool.read_text())
    for run in cfg["runs"]:
        run["overrides"][run["overrides"].index("run.max_steps=100000")] = f"run.max_steps={steps}"
    pool.write_text(yaml.safe_dump(cfg))
    proc = _start_pool(pool, tmp_path)
    try:
        _wait_for_steps(proc, {"left": 1, "right": 1})
        left, right = (next((tmp_path / "runs").glob(f"{n}-*")) for n in ("left", "right"))
        # right's worker on slot 0 (left's train slot): shrunk, it gets no call until its next expand
        killed_at = _kill_9_once(right, "gen0", "shrunk")
        # left's worker on its own train slot: resident, shrunk (drained) at left's next train grant
        _kill_9_once(left, "gen0", "expanded")
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    (summary_path,) = (tmp_path / "pools").glob("pool-*/pool_summary.json")
    summary = json.loads(summary_path.read_text())
    assert summary["dropped_runs"] == [], summary["dropped_runs"]
    check_one_run_per_slot(summary["timeline"])
    # A shrunk worker gets no call until its next expand: if the pool expanded it again, its death was
    # found then; if right's run ended first (the pool gave right's generation to gen1), nothing asked it.
    if "expanded" in _resizes(right, "gen0")[killed_at:] or "died" in (right / "logs" / "controller.log").read_text():
        assert "generation worker gen0 died while shrunk" in (right / "logs" / "controller.log").read_text()
    for run_dir in (left, right):
        check_exactly_once(run_dir, steps, 16)
        last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
        # the death is taken at once; its restart (a model load) may still be under way at the last step
        assert last["rollout/worker_deaths"] == 1 and last["rollout/worker_restarts"] <= 1, last
    resume = pool_file(tmp_path, [{"resume": str(left), "overrides": [f"run.max_steps={steps + 2}"]}], slots=2)
    _sc_grpo_to_the_end(tmp_path, "pool", "run", str(resume))
    check_exactly_once(left, steps + 2, 16)
    assert json.loads((left / "summary.json").read_text())["resumed_from"]["step"] == steps


@pytest.mark.slow
@pytest.mark.ray
def test_with_lookahead_0_a_run_samples_and_scores_the_same_alone_and_in_a_pool(tmp_path):
    # Sampling is seeded per prompt and charged attempt, not per worker (`torch/sampling.row_uniforms`),
    # and a step is the same prompts alone or shared: the per-step rewards match (to the float
    # rounding of their mean, whose summation order follows the commits).
    same = [
        *EMBEDDED[:4],
        "run.max_steps=4",
        "sampler.max_lookahead_versions=0",
        "sampler.max_staleness_versions=0",
        "train.min_groups_per_chunk=16",  # a pooled run trains a step whole: the same sums alone
        f"run.output_dir={tmp_path / 'runs'}",
    ]
    alone = [
        sys.executable,
        "-m",
        "single_controller",
        "run",
        str(ROOT / "configs/embedded.yaml"),
        *same,
        "run.name=alone",
    ]
    done = subprocess.run(alone, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    pooled = [*same, *EMBEDDED[5:], "run.name=pooled"]
    other = [*EMBEDDED, f"run.output_dir={tmp_path / 'runs'}", "run.max_steps=6", "run.name=other"]
    runs = [
        {"config": str(ROOT / "configs/embedded.yaml"), "overrides": [*pooled, "pool.train_slots=[0]"]},
        {
            "config": str(ROOT / "configs/embedded.yaml"),
            "overrides": [*other, "task.name=copy_digits", "pool.train_slots=[1]"],
        },
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "single_controller", "pool", "run", str(pool_file(tmp_path, runs, slots=2))],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]

    def rewards(name: str) -> list[float]:
        (run_dir,) = (tmp_path / "runs").glob(f"{name}-*")
        return [
            json.loads(line)["rollout/reward_mean"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        ]

    a, p = rewards("alone"), rewards("pooled")
    assert len(a) == len(p) == 4
    assert a == pytest.approx(p, rel=0, abs=1e-9), (a, p)
