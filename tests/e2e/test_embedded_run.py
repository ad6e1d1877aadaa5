"""Layer (d): real `sc-grpo run` of the embedded config, as a user runs it (a subprocess).

Asserts the reward rises above its starting level, the run directory is complete, every prompt has
exactly one fate, and no Ray process outlives the run — also when it is interrupted with Ctrl-C.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from single_controller.backends.common.colocation import turns_path

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.ray]


def _ray_pids() -> set[int]:
    out = set()
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if (
                (p.info["name"] or "").startswith("ray::")
                or "raylet" in cmd
                or "gcs_server" in cmd
                or cmd.startswith("ray::")
            ):
                out.add(p.info["pid"])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def _wait_gone(pids: set[int], timeout: float) -> set[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = {p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE}
        if not alive:
            return set()
        time.sleep(0.2)  # test code, not the controller
    return alive


def _cmd(tmp_path: Path, *overrides: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "single_controller",
        "run",
        str(ROOT / "configs/embedded.yaml"),
        f"run.output_dir={tmp_path}",
        "run.progress_bar=false",
        "metrics.port=0",
        *overrides,
    ]


MODES = {
    "disaggregated": ["backend.colocate=false"],
    "colocated": ["backend.colocate=true"],
    "turns": ["backend.colocate=true", "backend.colocate_form=turns", "train.offload=all", "rollout.sleep_level=1"],
}


@pytest.mark.parametrize("mode", list(MODES))
def test_embedded_run_learns_and_shuts_down_cleanly(tmp_path, mode):
    """Every mode: colocated (`backend.colocate`), generation and training share the cores (a lock
    per compute call); in turns the device alternates by phase (the workers asleep, the trainer's
    state in a second host buffer between steps)."""
    colocate = mode != "disaggregated"
    before = _ray_pids()
    proc = subprocess.run(
        _cmd(tmp_path, "run.max_steps=60", "run.stop_at_success_rate=null", *MODES[mode]),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    (run_dir,) = list(tmp_path.glob("embedded-*"))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(60))
    first = sum(r["rollout/reward_mean"] for r in records[:5]) / 5
    last = sum(r["rollout/reward_mean"] for r in records[-5:]) / 5
    # random policy: ~1/13 per position; 60 steps of GRPO at lr 1e-3 measured ~0.2 here
    assert last > first + 0.05, (first, last)
    assert max(r["train/staleness_max"] for r in records) <= 1
    # colocated: every step's finish (and its microbatches) took turns; disaggregated: no turns
    assert all((r.get("train/turns", 0) >= 2) == colocate for r in records), [r.get("train/turns") for r in records]
    if mode == "turns":  # each step ended with every worker asleep; the trainer offloaded between turns
        assert all(r["rollout/workers_routable"] == 0 and r["turns/to_train"] >= 1 for r in records)
        last = records[-1]
        assert last["turns/to_train"] + last["turns/kept_for_training"] >= 59
        assert last["elastic/shrinks"] == last["turns/to_train"] and last["turns/offloaded_bytes"] > 0
    run_id = (run_dir / "run_id").read_text().strip()
    assert not Path(turns_path(run_id)).exists(), "the turns' lock file was left behind"
    for name in (
        "config.yaml",
        "summary.json",
        "prompt_ledger.json",
        "checkpoint/model.safetensors",
        "checkpoint/config.json",
    ):
        assert (run_dir / name).exists(), name
    ledger = json.loads((run_dir / "prompt_ledger.json").read_text())["prompts"]
    assert all(p["fate"] in ("trained", "dropped", "evicted") for p in ledger)
    assert sum(p["fate"] == "trained" for p in ledger) == 60 * 16
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["storage"]["resident_rows"] == 0, "rows left in TransferQueue"
    # The controller's own TransferQueue client never read or wrote a row: trainers fetch theirs, and
    # the advantages travel in the train chunks; it only clears the trained rows.
    ctl = summary["storage"]
    assert ctl["gets"] == 0 and ctl["rows_read"] == 0 and ctl["bytes_read"] == 0, ctl
    assert ctl["puts"] == 0 and ctl["rows_put"] == 0 and ctl["bytes_put"] == 0, ctl
    assert ctl["clears"] >= 60, ctl
    ratios = [r["replay/controller_bytes_ratio"] for r in records if "replay/controller_bytes_ratio" in r]
    assert ratios and max(ratios) < 0.1
    leaked = _wait_gone(_ray_pids() - before, 15)
    assert not leaked, f"ray processes left behind: {leaked}"


def test_ctrl_c_exits_within_30s_and_leaves_no_ray_processes(tmp_path):
    before = _ray_pids()
    proc = subprocess.Popen(
        _cmd(tmp_path, "run.max_steps=100000", "run.stop_at_success_rate=null"),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        for line in proc.stdout:  # wait until it is training for real
            if re.match(r"step\s+2/", line):
                break
            assert time.monotonic() < deadline, "run did not start training"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert took < 30, f"Ctrl-C took {took:.1f}s"
    assert proc.returncode == 130, out[-2000:]
    assert "Traceback" not in out
    leaked = _wait_gone(_ray_pids() - before, 15)
    assert not leaked, f"ray processes left behind after Ctrl-C: {leaked}"
