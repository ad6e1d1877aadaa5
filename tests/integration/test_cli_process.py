"""The `sc-grpo` command in a process of its own (`python -m single_controller`): it prints the resolved config,
and a bad config (a Megatron layout, a pooled run with no pool) is refused before anything starts: no run
directory, no Ray."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EMBEDDED = str(ROOT / "configs/embedded.yaml")
CPU_CFG = str(ROOT / "configs/megatron_cpu.yaml")


def test_python_dash_m_single_controller():
    ok = subprocess.run(
        [sys.executable, "-m", "single_controller", "config", EMBEDDED],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    assert "name: embedded" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "single_controller", "config", EMBEDDED, "train.lrr=1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert bad.returncode == 2
    assert "did you mean 'train.lr'?" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_sc_grpo_run_reports_a_bad_layout_before_starting_anything(tmp_path):
    t0 = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "single_controller",
            "run",
            CPU_CFG,
            "megatron.data_parallel_size=3",
            f"run.output_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert out.returncode != 0
    assert "must equal backend.num_trainer_ranks = 2" in " ".join((out.stderr + out.stdout).split())  # (wrapped)
    assert not list(tmp_path.iterdir())  # no run directory: nothing started
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        ([], r"pool.enabled=true: a run joins a pool that `sc-grpo pool run POOL.yaml` starts"),
        (["pool.attach=true"], r"pool.attach=true joins the pool `sc-grpo pool serve` serves"),
    ],
)
def test_sc_grpo_run_refuses_a_pooled_config_with_no_pool_to_join(tmp_path, overrides, problem):
    cmd = [
        sys.executable,
        "-m",
        "single_controller",
        "run",
        str(ROOT / "configs/sim.yaml"),
        f"run.output_dir={tmp_path}",
    ]
    pooled = ["pool.enabled=true", "pool.gen_slots=[0]", "pool.train_slots=[0]", *overrides]
    out = subprocess.run([*cmd, *pooled], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert re.search(problem, " ".join((out.stdout + out.stderr).split())), out.stderr
    assert not any(tmp_path.iterdir()), "a refused run created its directory"
