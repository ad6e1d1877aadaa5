"""An HTTP environment server that hangs, then dies, under a real `sc-grpo run` (issue 36, acceptance 4).

The run (`configs/env_lookup_http.yaml`) plays `lookup` over `env.url` against `sc-grpo env serve` in
its own process. Mid-run the
server is frozen (SIGSTOP: it accepts connections and answers nothing) for longer than
`env.timeout_s`, then thawed; later it is killed (SIGKILL) and started again on the same port. The run
must go on to its last step without a hang: episodes retried, or their groups dropped as
`env_failed`, and the prompt ledger exactly-once (each prompt one fate; every step trained exactly its
prompts, none twice).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.ray]
STEPS, PROMPTS_PER_STEP = 24, 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(port: int, tmp_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "single_controller", "env", "serve", "lookup", "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    assert f":{port}" in line, line
    return proc


def _steps_done(tmp_path: Path) -> int:
    found = list(tmp_path.glob("env_lookup-*/metrics.jsonl"))
    return len(found[0].read_text().splitlines()) if found else 0


def _wait_for_step(run: subprocess.Popen, tmp_path: Path, step: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while _steps_done(tmp_path) < step:
        assert run.poll() is None, "the run ended early"
        assert time.monotonic() < deadline, f"no step {step} within {timeout}s"
        time.sleep(0.2)  # test code, not the controller


def test_a_hanging_then_killed_http_environment_costs_deadlines_never_a_hang_or_a_prompt(tmp_path):
    port = _free_port()
    server = _serve(port, tmp_path)
    run_cmd = [
        sys.executable,
        "-m",
        "single_controller",
        "run",
        str(ROOT / "configs/env_lookup_http.yaml"),
        f"env.url=http://127.0.0.1:{port}",
        "env.timeout_s=1",
        "env.max_attempts=4",
        "env.retry_backoff_s=0.5",
        f"run.max_steps={STEPS}",
        "run.stop_at_success_rate=null",
        f"run.output_dir={tmp_path}",
        "run.progress_bar=false",
        "metrics.port=0",
    ]
    run = subprocess.Popen(run_cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_step(run, tmp_path, 4)
        os.kill(server.pid, signal.SIGSTOP)  # hangs: connections accepted, nothing answered
        time.sleep(3.0)
        os.kill(server.pid, signal.SIGCONT)
        _wait_for_step(run, tmp_path, 12)
        server.kill()  # dies with every episode it held
        server.wait()
        time.sleep(1.0)
        server = _serve(port, tmp_path)  # back on the same port
        out, err = run.communicate(timeout=300)
    finally:
        for proc in (run, server):
            if proc.poll() is None:
                proc.kill()
    assert run.returncode == 0, out[-3000:] + err[-3000:]
    (run_dir,) = list(tmp_path.glob("env_lookup-*"))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS))
    ledger = json.loads((run_dir / "prompt_ledger.json").read_text())["prompts"]
    assert len({p["prompt_id"] for p in ledger}) == len(ledger), "a prompt appears twice in the ledger"
    assert all(p["fate"] in ("trained", "dropped", "evicted") for p in ledger), "a prompt has no fate (lost)"
    trained = Counter(p["step"] for p in ledger if p["fate"] == "trained")
    assert trained == {s: PROMPTS_PER_STEP for s in range(STEPS)}, trained
    # The outages cost retries (episodes started over) or whole groups dropped as env_failed, never a row.
    retries = [r.get("env/retries", 0) for r in records]  # episodes of trained groups started over
    env_failed = [p for p in ledger if p["fate"] == "dropped" and p.get("reason") == "env_failed"]
    # each outage reached the run: retried episodes in the steps after it, or groups dropped
    assert env_failed or (any(retries[4:12]) and any(retries[12:])), (retries, len(env_failed))
    assert records[-1]["env/failed_groups"] == len(env_failed)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["storage_keys_left"] == 0
