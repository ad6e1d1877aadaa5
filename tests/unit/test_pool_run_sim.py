"""`sc-grpo pool run POOL.yaml` (single_controller/runtime/pool_run.py) in this process: what it refuses before anything
starts, every shipped pool file loads, and two sim runs in one pool end to end (each with its own records, exactly
once, the slot timeline never holding two runs on a slot), a pooled run resumed into a pool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from single_controller.config.problems import ConfigError
from single_controller.runtime.pool_run import load_pool, main_run
from tests.helpers.runs import check_exactly_once, check_one_run_per_slot, pool_file

ROOT = Path(__file__).resolve().parents[2]


def _sim_run(name: str, gen: str, train: str, *more: str) -> dict:
    workers = len(yaml.safe_load(gen))
    return {
        "config": str(ROOT / "configs/sim.yaml"),
        "overrides": [
            f"run.name={name}",
            f"backend.num_generation_workers={workers}",
            f"pool.gen_slots={gen}",
            f"pool.train_slots={train}",
            *more,
        ],
    }


@pytest.mark.parametrize(
    ("top", "runs", "problem"),
    [
        (  # the slots a CPU machine has are its cores
            {"slots": 4096},
            [
                {
                    "config": str(ROOT / "configs/embedded.yaml"),
                    "overrides": ["pool.gen_slots=[0]", "pool.train_slots=[0]"],
                }
            ],
            r"4096 slots do not fit this machine: it has \d+ CPU core\(s\)",
        ),
        (  # partial overlap trains on slots whose workers sleep meanwhile: a subset
            {"slots": 4},
            [_sim_run("a", "[0,1]", "[2]")],
            r"pool.overlap=partial: the train slots \[2\] are not among the run's generation slots \[0, 1\]",
        ),
        (
            {"slots": 4},
            [_sim_run("a", "[0,1]", "[0]"), _sim_run("a", "[2,3]", "[2]")],
            r"two runs are named 'a'",
        ),
        (
            {"slots": 2},
            [_sim_run("a", "[0,1,2]", "[0]")],
            r"run a: slots \[2\] are outside the pool's 0..1",
        ),
        (  # vLLM's sleep mode is CUDA/ROCm only
            {"slots": 1},
            [
                {
                    "config": str(ROOT / "configs/vllm_cpu.yaml"),
                    "overrides": ["pool.gen_slots=[0]", "pool.train_slots=[0]", "rollout.sleep_level=2"],
                }
            ],
            r"rollout.sleep_level=2 with vLLM on the CPU",
        ),
        (  # a Hub repo id its run would load: resolved from the local cache as `sc-grpo run` does
            {"slots": 1},
            [
                {
                    "config": str(ROOT / "configs/embedded.yaml"),
                    "overrides": ["pool.gen_slots=[0]", "pool.train_slots=[0]", "model.path=no-org/not-cached"],
                }
            ],
            r"huggingface-cli download no-org/not-cached",
        ),
    ],
)
def test_a_pool_that_cannot_run_is_refused_before_anything_starts(tmp_path, top, runs, problem):
    path = pool_file(tmp_path, runs, **top)
    with pytest.raises(ConfigError, match=problem):
        load_pool(path)
    assert main_run([str(path)]) == 2
    assert not (tmp_path / "pools").exists(), "a refused pool created its directory"


def test_two_sim_runs_share_a_pool_each_with_its_own_records_exactly_once(tmp_path):
    out = tmp_path / "runs"
    more = (f"run.output_dir={out}", "run.max_steps=8", "rollout.sleep_level=1", "rollout.max_in_flight_per_worker=2")
    path = pool_file(
        tmp_path,
        [_sim_run("gen-heavy", "[0,1,2,3]", "[0]", *more), _sim_run("train-heavy", "[0,1,2,3]", "[2,3]", *more)],
        slots=4,
    )
    assert main_run([str(path)]) == 0
    (summary_path,) = (tmp_path / "pools").glob("pool-*/pool_summary.json")
    summary = json.loads(summary_path.read_text())
    assert {r["exit_code"] for r in summary["runs"].values()} == {0}
    check_one_run_per_slot(summary["timeline"])
    stats = summary["statistics"]
    assert stats["expands"] >= 4 and stats["shrinks"] >= 2 and stats["train_grants"] >= 2, stats
    for name, run in summary["runs"].items():
        run_dir = Path(run["run_dir"])
        assert run_dir.parent == out and run_dir.name.startswith(name)
        check_exactly_once(run_dir, 8, 16)
        last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
        assert last["elastic/expands"] >= 1, last  # the pool brought its workers in
    trained_on = {run for _, _, state, run in summary["timeline"] if state == "train"}
    assert trained_on == {"gen-heavy", "train-heavy"}


def test_a_pooled_run_resumes_into_a_pool_at_sleep_level_1_from_its_run_directory(tmp_path):
    # (R2: the resume pushed its weights to workers asleep out of the pool, and the run died before a rollout)
    out = tmp_path / "runs"
    more = (f"run.output_dir={out}", "run.max_steps=4", "rollout.sleep_level=1", "checkpoint.every_steps=2")
    first = pool_file(tmp_path, [_sim_run("a", "[0,1]", "[0]", *more), _sim_run("b", "[0,1]", "[1]", *more)], slots=2)
    assert main_run([str(first)]) == 0
    (run_dir,) = out.glob("a-*")
    resumed = pool_file(tmp_path, [{"resume": str(run_dir), "overrides": ["run.max_steps=6"]}], slots=2)
    assert main_run([str(resumed)]) == 0
    check_exactly_once(run_dir, 6, 16)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"]["step"] == 4 and summary["steps"] == 6, summary


@pytest.mark.parametrize("path", sorted((ROOT / "configs/pools").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_pool_file_loads(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # its runs' config paths are relative to the repository
    spec = load_pool(path)
    assert spec.runs and all(c.pool.enabled for c in spec.runs)
