"""`backend.trainer: fsdp` end to end, as a user runs it (issue #52):

* 2 FSDP2 ranks learn the embedded task (the same split-step math as the torch trainer: the same steps
  to the target) and leave the final policy as a loadable model directory;
* kill -9 of one rank with `run.auto_resume` heals the run; then SIGTERM, a resume on 1 rank, SIGTERM
  again, a resume on 2 ranks to the end: the lr of every step is the schedule's (warmup + cosine, as
  an uninterrupted run's) and the ledger is exactly-once.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal

import pytest

from single_controller.backends.common.split_step import lr_at, lr_schedule
from single_controller.backends.torch.model import load_tinygpt
from single_controller.preflight.loader import load_config
from tests.e2e.test_durable_runs import (
    ROOT,
    _check_exactly_once,
    _cmd,
    _interrupted_cleanly,
    _lrs,
    _run_to_end,
    _sigterm_in_step,
    _start,
    _wait_for_step,
)
from tests.helpers.runs import actor_pids

pytestmark = [pytest.mark.slow, pytest.mark.ray]
FSDP = ("backend.trainer=fsdp", "backend.num_trainer_ranks=2")


def test_two_fsdp_ranks_learn_the_embedded_task_and_save_a_loadable_policy(tmp_path):
    cmd = [c for c in _cmd(tmp_path, *FSDP) if c != "run.stop_at_success_rate=null"]
    out = _run_to_end(cmd, tmp_path, timeout=900)
    assert "success rate >= 0.9" in out, out[-2000:]
    (run_dir,) = tmp_path.glob("embedded-*")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] <= 200, summary["steps"]  # the torch trainer: 130 (seed 0)
    model = load_tinygpt(run_dir / "checkpoint")
    assert sum(p.numel() for p in model.parameters()) > 0
    print(f"fsdp, 2 ranks: success >= 0.9 after {summary['steps']} steps")


def test_kill_9_of_an_fsdp_rank_heals_and_resumes_on_1_then_2_ranks_keep_the_lr_schedule_and_the_ledger(tmp_path):
    steps = 24
    schedule = ("train.lr_schedule=cosine", "train.warmup_steps=2", f"run.max_steps={steps}")
    rng = random.Random(0)
    proc = _start(_cmd(tmp_path, *FSDP, *schedule, "checkpoint.every_steps=3", "run.auto_resume=2"), tmp_path)
    try:
        _wait_for_step(proc, 5)
        ranks = sorted(actor_pids(proc.pid, "FsdpRankActor"))
        assert len(ranks) == 2, ranks
        os.kill(ranks[-1], signal.SIGKILL)
        seen = _wait_for_step(proc, 9)
        assert any(re.search(r"auto-resume 1/2: TrainerRankDied: trainer rank \d died", line) for line in seen), seen
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    _sigterm_in_step(proc, 10, rng)
    (run_dir,) = tmp_path.glob("embedded-*")
    cut = _interrupted_cleanly(run_dir)["checkpoint"]["step"]
    one = _start(_cmd(tmp_path, "backend.num_trainer_ranks=1", resume=run_dir), tmp_path)
    _sigterm_in_step(one, cut + 4, rng)
    cut2 = _interrupted_cleanly(run_dir)["checkpoint"]["step"]
    assert cut2 > cut
    out = _run_to_end(_cmd(tmp_path, "backend.num_trainer_ranks=2", resume=run_dir), tmp_path)
    assert f"from the checkpoint of step {cut2}" in out
    _check_exactly_once(run_dir, steps)
    cfg = load_config(str(ROOT / "configs/embedded.yaml"), list(schedule))
    want = [lr_at(s, lr_schedule(cfg.train, steps)) for s in range(steps)]
    assert _lrs(run_dir) == pytest.approx(want, rel=1e-12), (_lrs(run_dir), want)
    print(f"healed after kill -9; SIGTERM at {cut}, 1 rank to {cut2}, 2 ranks to {steps}")
